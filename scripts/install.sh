#!/usr/bin/env bash
# Install deltarun (editable, with the test tools) on ggml-python 0.0.45's bindings built on ggml
# 0.25.3 (a pinned, checksummed source: see scripts/ggml-wheel.sh) the way llama.cpp builds ggml for
# the CPU, with deltarun's kernel patches (scripts/ggml-patches).
#
#   scripts/install.sh [--venv DIR]
#
# --venv DIR   create (if needed) and install into this virtual environment; default: the
#              current `python`'s environment.
#
# Besides the newer ggml and the patches, the difference from a plain `pip install -e '.[test]'`
# (ggml-python's own ggml 0.15.3) is GGML_LLAMAFILE=ON: llamafile's
# tinyBLAS matrix kernels, which llama.cpp enables and ggml's own CMake default leaves off. Prompt
# processing (batched matrix products) is 1.3-1.5x faster with them (bench/RESULTS.md); decoding
# is unchanged. It is also built with GGML_RPC=ON: ggml's RPC backend, which `deltarun rpc-server`
# and `--rpc HOST:PORT` use to split a model's layers across machines. The wheel is built once (about 2 minutes on 2 cores) and kept in
# DELTARUN_WHEEL_CACHE (default ~/.cache/deltarun-wheels), outside the clone, per CPU.
# An environment whose ggml-python already has llamafile and RPC is left as it is.
set -euo pipefail

VENV=""
REPO=$(cd "$(dirname "$0")/.." && pwd)
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) VENV=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
log() { echo "[install] $*" >&2; }
. "$REPO/scripts/ggml-wheel.sh"
pick_python "$VENV"

has_llamafile() {
  "$PY" -c "import ggml, sys; sys.exit(0 if ggml.ggml_cpu_has_llamafile() and ggml.GGML_USE_RPC else 1)" 2>/dev/null
}
# ggml-python first, so that installing deltarun finds the pinned version there and builds nothing.
if has_llamafile && "$PY" -m pip show ggml-python 2>/dev/null | grep -qx "Version: $GGML_PYTHON_BUILD"; then
  log "ggml-python $GGML_PYTHON_BUILD with llamafile and RPC is already installed"
else
  install_ggml_wheel cpu-llamafile-rpc "-DGGML_LLAMAFILE=ON;-DGGML_RPC=ON"
fi
"$PY" -m pip install -q -e "$REPO[test]"
has_llamafile || { log "ggml-python was replaced by a build without llamafile or RPC"; exit 1; }
log "done: $("$PY" -m deltarun --version 2>/dev/null || echo deltarun)"
