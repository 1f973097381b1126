# Sourced by .ci/flake-check and .ci/flake-check-vllm: start_burners runs
# one busy loop per core; the traps end exactly these processes, by id.
cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
burners=""
stop_burners() {
	for pid in $burners; do kill "$pid" 2>/dev/null || true; done
}
trap stop_burners EXIT
trap 'stop_burners; exit 130' INT
trap 'stop_burners; exit 143' TERM
start_burners() {
	i=0
	while [ "$i" -lt "$cores" ]; do
		yes >/dev/null &
		burners="$burners $!"
		i=$((i + 1))
	done
}
