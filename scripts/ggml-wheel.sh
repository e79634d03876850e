# Sourced by the install scripts: build ggml-python once per variant and CPU, keep the wheel.
#
# ggml-python builds ggml from source with -march=native, so a wheel is only good for the CPU it
# was built on; the cache folder is named after the variant and a hash of the CPU's flags, so a
# home folder restored onto another machine rebuilds instead of dying with SIGILL. The variant name
# must change whenever the cmake flags do (e.g. cpu-llamafile -> cpu-llamafile-rpc when GGML_RPC
# was added): pip's own wheel cache ignores config settings, this cache only knows the name.
#
#   GGML_PYTHON_VERSION   the pinned version (from pyproject.toml)
#   GGML_VERSION          the ggml the bindings are built on (see "The ggml underneath" below)
#   CACHE                 DELTARUN_WHEEL_CACHE or ~/.cache/deltarun-wheels
#   pick_python VENV      sets PY: VENV's python (created if needed) or the current `python`
#   install_ggml_wheel VARIANT CMAKE_ARGS
#                         installs the cached wheel into $PY, building it first when missing
#                         (scikit-build-core splits CMAKE_ARGS on ';'); NICE and JOBS apply.
#   GGML_PYTHON_BUILD     the version the built wheel reports: the pin plus a local label
#                         naming the source, e.g. 0.0.45+deltarun.1a2b3c4d (still == the pin).
# The caller defines `log`.
#
# The ggml underneath: ggml-python 0.0.45 vendors ggml 0.15.3; deltarun builds its ctypes
# bindings (ggml/*.py, unchanged) on ggml 0.25.3 instead: the `vendor/llama.cpp/ggml` tree of the
# llama-cpp-python 0.3.36 sdist from PyPI replaces the sdist's `vendor/ggml`. Both sdists are
# pinned by sha256 and kept in $CACHE/sources. Every declaration and enum value deltarun uses is
# checked against the installed headers and library by tests/test_ggml_abi.py.
#
# The tree is then patched with every scripts/ggml-patches/*.patch, in name order (ggml kernel
# fixes that keep deltarun's graphs as they are; each patch says why at its top). SOURCE_KEY, a
# hash of the two sdists' checksums and the patches, is in the local version label and in the
# cache folder's name, so a changed source or patch rebuilds.

GGML_PYTHON_VERSION=$(sed -n 's/.*"ggml-python==\([0-9.]*\)".*/\1/p' "$(dirname "${BASH_SOURCE[0]}")/../pyproject.toml")
[ -n "$GGML_PYTHON_VERSION" ] || { echo "ggml-wheel.sh: no ggml-python pin in pyproject.toml" >&2; exit 1; }
CACHE=${DELTARUN_WHEEL_CACHE:-$HOME/.cache/deltarun-wheels}
GGML_PYTHON_SHA256=10aac52075cf3c7ef2b00d6c35b1c23f7b018dbeff8ae8df67339b4be1166f05
GGML_VERSION=0.25.3
GGML_SOURCE_PKG=llama-cpp-python==0.3.36
GGML_SOURCE_FILE=llama_cpp_python-0.3.36.tar.gz
GGML_SOURCE_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
GGML_SOURCE_TREE=llama_cpp_python-0.3.36/vendor/llama.cpp/ggml
PATCHES=$(cd "$(dirname "${BASH_SOURCE[0]}")/ggml-patches" && pwd)
SOURCE_KEY=$( { echo "$GGML_PYTHON_SHA256 $GGML_SOURCE_SHA256"; cat "$PATCHES"/*.patch; } | sha1sum | cut -c1-8)
GGML_PYTHON_BUILD=$GGML_PYTHON_VERSION+deltarun.$SOURCE_KEY
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

# fetch_sdist SPEC FILE SHA256: $CACHE/sources/FILE, downloaded with pip from the package index
# when missing, and checked against SHA256 (a mismatch is removed and fails the install).
fetch_sdist() {
  local spec=$1 file=$2 sum=$3 dir=$CACHE/sources
  mkdir -p "$dir"
  if [ ! -f "$dir/$file" ]; then
    log "downloading $spec (sdist)"
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$dir" "$spec" >&2
  fi
  if ! echo "$sum  $dir/$file" | sha256sum -c --status; then
    log "$file does not have the pinned sha256 $sum: removed"
    rm -f "$dir/$file"
    exit 1
  fi
  echo "$dir/$file"
}

# ggml_source DEST: ggml-python's sdist unpacked into DEST, its vendor/ggml replaced by ggml
# $GGML_VERSION and patched; DEST/.. must be writable. Prints the source folder.
ggml_source() {
  local dest=$1 bindings ggml src
  # (run inside $(...), where bash does not apply `set -e`: every step checks for itself)
  bindings=$(fetch_sdist "ggml-python==$GGML_PYTHON_VERSION" "ggml_python-$GGML_PYTHON_VERSION.tar.gz" "$GGML_PYTHON_SHA256") || exit 1
  ggml=$(fetch_sdist "$GGML_SOURCE_PKG" "$GGML_SOURCE_FILE" "$GGML_SOURCE_SHA256") || exit 1
  src=$dest/ggml_python-$GGML_PYTHON_VERSION
  tar -xzf "$bindings" -C "$dest" && tar -xzf "$ggml" -C "$dest" "$GGML_SOURCE_TREE" && rm -rf "$src/vendor/ggml" \
    && mv "$dest/$GGML_SOURCE_TREE" "$src/vendor/ggml" || { log "could not unpack the sources into $dest"; exit 1; }
  local v
  v=$(sed -n 's/^set(GGML_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))/\2/p' "$src/vendor/ggml/CMakeLists.txt" | paste -sd.)
  [ "$v" = "$GGML_VERSION" ] || { log "$GGML_SOURCE_FILE holds ggml $v, not $GGML_VERSION"; exit 1; }
  local p
  for p in "$PATCHES"/*.patch; do
    log "applying $(basename "$p")"
    git -C "$src" apply -p1 "$p" >&2 || { log "$(basename "$p") does not apply to ggml $GGML_VERSION"; exit 1; }
  done
  # the headers go into the wheel (ggml/include): tests/test_ggml_abi.py checks the bindings against them
  mkdir -p "$src/ggml/include" && cp "$src"/vendor/ggml/include/*.h "$src/ggml/include/" || exit 1
  sed -i "s/^__version__ = \"$GGML_PYTHON_VERSION\"/__version__ = \"$GGML_PYTHON_BUILD\"/" "$src/ggml/__init__.py"
  grep -q "\"$GGML_PYTHON_BUILD\"" "$src/ggml/__init__.py" || { log "could not set the version in $src/ggml/__init__.py"; exit 1; }
  echo "$src"
}

install_ggml_wheel() {
  local variant=$1 cmake_args=$2
  local wheels=$CACHE/$variant-$(cpu_key)-$SOURCE_KEY
  mkdir -p "$wheels"
  local wheel
  wheel=$(ls "$wheels"/ggml_python-$GGML_PYTHON_BUILD-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    log "building ggml-python $GGML_PYTHON_BUILD on ggml $GGML_VERSION ($variant, $JOBS jobs) -> $wheels"
    log "cmake args: $cmake_args"
    local build src
    build=$(mktemp -d)
    src=$(ggml_source "$build") || exit 1
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
