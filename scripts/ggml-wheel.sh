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
#   GGML_PYTHON_BUILD     the version the built wheel reports: the pin plus a local label
#                         naming the patches, e.g. 0.0.45+deltarun.1a2b3c4d (still == the pin).
# The caller defines `log`.
#
# The sdist is patched before it is built with every scripts/ggml-patches/*.patch (ggml kernel
# fixes that keep deltarun's graphs as they are; each patch says why at its top). The patches'
# hash is in the local version label and in the cache folder's name, so a changed patch rebuilds.

GGML_PYTHON_VERSION=$(sed -n 's/.*"ggml-python==\([0-9.]*\)".*/\1/p' "$(dirname "${BASH_SOURCE[0]}")/../pyproject.toml")
[ -n "$GGML_PYTHON_VERSION" ] || { echo "ggml-wheel.sh: no ggml-python pin in pyproject.toml" >&2; exit 1; }
CACHE=${DELTARUN_WHEEL_CACHE:-$HOME/.cache/deltarun-wheels}
PATCHES=$(cd "$(dirname "${BASH_SOURCE[0]}")/ggml-patches" && pwd)
PATCH_KEY=$(cat "$PATCHES"/*.patch | sha1sum | cut -c1-8)
GGML_PYTHON_BUILD=$GGML_PYTHON_VERSION+deltarun.$PATCH_KEY
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
  local wheels=$CACHE/$variant-$(cpu_key)-$PATCH_KEY
  mkdir -p "$wheels"
  local wheel
  wheel=$(ls "$wheels"/ggml_python-$GGML_PYTHON_BUILD-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    log "building ggml-python $GGML_PYTHON_BUILD ($variant, $JOBS jobs) -> $wheels"
    log "cmake args: $cmake_args"
    local build src
    build=$(mktemp -d)
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$build" "ggml-python==$GGML_PYTHON_VERSION"
    tar -xzf "$build"/ggml_python-$GGML_PYTHON_VERSION.tar.gz -C "$build"
    src=$build/ggml_python-$GGML_PYTHON_VERSION
    for p in "$PATCHES"/*.patch; do
      log "applying $(basename "$p")"
      git -C "$src" apply -p1 "$p"
    done
    sed -i "s/^__version__ = \"$GGML_PYTHON_VERSION\"/__version__ = \"$GGML_PYTHON_BUILD\"/" "$src/ggml/__init__.py"
    grep -q "\"$GGML_PYTHON_BUILD\"" "$src/ggml/__init__.py" || { log "could not set the version in $src/ggml/__init__.py"; exit 1; }
    CMAKE_BUILD_PARALLEL_LEVEL=$JOBS nice -n "$NICE" "$PY" -m pip wheel -q --no-deps --no-cache-dir \
      -w "$build/out" --config-settings=cmake.args="$cmake_args" "$src"
    mv "$build"/out/ggml_python-*.whl "$wheels"/
    rm -rf "$build"
    wheel=$(ls "$wheels"/ggml_python-$GGML_PYTHON_BUILD-*.whl | head -1)
  fi
  log "installing $wheel"
  "$PY" -m pip install -q --force-reinstall --no-deps "$wheel"
  "$PY" -m pip install -q numpy typing_extensions
}
