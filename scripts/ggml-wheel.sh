# Sourced by the install scripts: build ggml-python once per variant and CPU, keep the wheel.
#
# ggml-python builds ggml from source with -march=native, so a wheel is only good for the CPU it
# was built on; the cache folder is named after the variant and a hash of the CPU's flags, so a
# home folder restored onto another machine rebuilds instead of dying with SIGILL. The variant name
# must change whenever the cmake flags do (e.g. cpu-llamafile -> cpu-llamafile-rpc when GGML_RPC
# was added): pip's own wheel cache ignores config settings, this cache only knows the name.
#
#   GGML_PYTHON_VERSION   the pinned version (from pyproject.toml)
#   CACHE                 DELTARUN_WHEEL_CACHE or ~/.cache/deltarun-wheels
#   pick_python VENV      sets PY: VENV's python (created if needed) or the current `python`
#   install_ggml_wheel VARIANT CMAKE_ARGS
#                         installs the cached wheel into $PY, building it first when missing
#                         (scikit-build-core splits CMAKE_ARGS on ';'); NICE and JOBS apply.
# The caller defines `log`.

GGML_PYTHON_VERSION=$(sed -n 's/.*"ggml-python==\([0-9.]*\)".*/\1/p' "$(dirname "${BASH_SOURCE[0]}")/../pyproject.toml")
[ -n "$GGML_PYTHON_VERSION" ] || { echo "ggml-wheel.sh: no ggml-python pin in pyproject.toml" >&2; exit 1; }
CACHE=${DELTARUN_WHEEL_CACHE:-$HOME/.cache/deltarun-wheels}
NICE=${NICE:-10}
JOBS=${JOBS:-$(nproc)}

pick_python() {
  if [ -n "$1" ]; then
    [ -x "$1/bin/python" ] || python3 -m venv "$1"
    PY=$1/bin/python
  else
    PY=$(command -v python)
  fi
}

cpu_key() {
  grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null | sha1sum | cut -c1-10
}

install_ggml_wheel() {
  local variant=$1 cmake_args=$2
  local wheels=$CACHE/$variant-$(cpu_key)
  mkdir -p "$wheels"
  local wheel
  wheel=$(ls "$wheels"/ggml_python-$GGML_PYTHON_VERSION-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    log "building ggml-python $GGML_PYTHON_VERSION ($variant, $JOBS jobs) -> $wheels"
    log "cmake args: $cmake_args"
    local build
    build=$(mktemp -d)
    CMAKE_BUILD_PARALLEL_LEVEL=$JOBS nice -n "$NICE" "$PY" -m pip wheel -q --no-deps --no-binary ggml-python \
      --no-cache-dir -w "$build" --config-settings=cmake.args="$cmake_args" "ggml-python==$GGML_PYTHON_VERSION"
    mv "$build"/ggml_python-*.whl "$wheels"/
    rm -rf "$build"
    wheel=$(ls "$wheels"/ggml_python-$GGML_PYTHON_VERSION-*.whl | head -1)
  fi
  log "installing $wheel"
  "$PY" -m pip install -q --force-reinstall --no-deps "$wheel"
  "$PY" -m pip install -q numpy typing_extensions
}
