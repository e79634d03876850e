#!/usr/bin/env bash
# Build ggml-python 0.0.45's bindings on ggml 0.25.3 (scripts/ggml-wheel.sh: the same pinned source
# and kernel patches as scripts/install.sh) with ggml's CUDA backend, and install them into a Python
# environment.
#
#   scripts/install-cuda.sh [--venv DIR] [--arch SM]
#
# --venv DIR   create (if needed) and install into this virtual environment, with deltarun
#              installed editable into it too; default: the current `python`'s environment.
# --arch SM    CUDA architecture, e.g. 90 for H100/H200 [default: the first GPU's compute
#              capability from nvidia-smi, else 90]. The wheel is cached per architecture.
#
# Needs nvcc (CUDA 12 or 13). cuBLAS comes from the CUDA toolkit when it has it, else from the
# nvidia-cublas pip package (its library folder is then preloaded by `import ggml`, see below).
# Without a driver library (libcuda, e.g. a build machine without GPU) VMM is switched off.
# Environment: DELTARUN_WHEEL_CACHE (default ~/.cache/deltarun-wheels) keeps the built wheel
# outside the clone, per CPU (scripts/ggml-wheel.sh); the build takes minutes on 16 cores, about an
# hour on 2. NICE (default 10); JOBS (default: all cores). The CPU side is built with
# GGML_LLAMAFILE=ON, as scripts/install.sh does.
#
# After installing, two fixes are applied to the installed package (idempotent):
# - ggml-python 0.0.45 binds ggml_backend_cuda_allreduce_tensor for every CUDA build, but ggml
#   (0.15.3, and 0.25.3 still) declares it without defining it, so `import ggml` fails with
#   AttributeError; the binding is made conditional on the symbol being there.
# - when cuBLAS comes from pip, ggml/__init__.py preloads it (RTLD_GLOBAL) so libggml-cuda.so
#   finds it without LD_LIBRARY_PATH.
set -euo pipefail

VENV=""
ARCH=""
REPO=$(cd "$(dirname "$0")/.." && pwd)
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) VENV=$2; shift 2 ;;
    --arch) ARCH=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
log() { echo "[install-cuda] $*" >&2; }
. "$REPO/scripts/ggml-wheel.sh"

# 1. nvcc and the architecture
NVCC=$(command -v nvcc || true)
for d in "${CUDA_HOME:-}" /usr/local/cuda /opt/cuda; do
  [ -z "$NVCC" ] && [ -n "$d" ] && [ -x "$d/bin/nvcc" ] && NVCC=$d/bin/nvcc
done
[ -n "$NVCC" ] || { log "nvcc not found: install the CUDA toolkit (or set CUDA_HOME)"; exit 1; }
export PATH=$(dirname "$NVCC"):$PATH
CUDA_ROOT=$(cd "$(dirname "$NVCC")/.." && pwd)
CUDA_MAJOR=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
if [ -z "$ARCH" ]; then
  ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
  ARCH=${ARCH:-90}
fi
log "nvcc $NVCC (CUDA $CUDA_MAJOR), architecture sm_$ARCH"

# 2. The environment to install into
pick_python "$VENV"

# 3. cuBLAS: the toolkit's, or the nvidia-cublas wheel's
CMAKE_ARGS="-DGGML_CUDA=ON;-DCMAKE_CUDA_ARCHITECTURES=$ARCH;-DGGML_LLAMAFILE=ON;-DGGML_RPC=ON"
PRELOAD_DIR=""
if ls "$CUDA_ROOT"/lib64/libcublas.so* "$CUDA_ROOT"/targets/*/lib/libcublas.so* >/dev/null 2>&1; then
  log "cuBLAS from the toolkit ($CUDA_ROOT)"
else
  if [ "$CUDA_MAJOR" -ge 13 ]; then PKG="nvidia-cublas==13.1.1.3"; else PKG="nvidia-cublas-cu$CUDA_MAJOR"; fi
  log "the toolkit has no cuBLAS: installing $PKG"
  "$PY" -m pip install -q "$PKG"
  CU=$("$PY" - <<'PY'
import glob, os, nvidia
roots = [p for base in nvidia.__path__ for p in glob.glob(os.path.join(base, "*"))]
for r in roots:
    if glob.glob(os.path.join(r, "lib", "libcublas.so*")):
        print(r); break
PY
)
  [ -n "$CU" ] || { log "could not find libcublas in the nvidia-cublas package"; exit 1; }
  LIB=$(ls "$CU"/lib/libcublas.so.* | head -1)
  LIBLT=$(ls "$CU"/lib/libcublasLt.so.* | head -1)
  CMAKE_ARGS="$CMAKE_ARGS;-DCUDA_cublas_LIBRARY=$LIB;-DCUDA_cublasLt_LIBRARY=$LIBLT;-DCMAKE_CUDA_FLAGS=-I$CU/include"
  PRELOAD_DIR=$CU/lib
fi
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so'; then
  log "no libcuda (no driver here): building with -DGGML_CUDA_NO_VMM=ON"
  CMAKE_ARGS="$CMAKE_ARGS;-DGGML_CUDA_NO_VMM=ON"
fi

# 4. The wheel: cached (per architecture and CPU), or built once
install_ggml_wheel cuda-sm$ARCH-rpc "$CMAKE_ARGS"
if [ -n "$VENV" ]; then
  "$PY" -m pip install -q -e "$REPO[test]"
fi

# 5. The two fixes to the installed package
PRELOAD_DIR="$PRELOAD_DIR" "$PY" - <<'PY'
import importlib.util, os, pathlib, re
pkg = pathlib.Path(importlib.util.find_spec("ggml").submodule_search_locations[0])
src = pkg / "ggml.py"
text = src.read_text()
pat = re.compile(r'("ggml_backend_cuda_allreduce_tensor",.*?enabled=)GGML_USE_CUDA,', re.S)
if 'hasattr(lib, "ggml_backend_cuda_allreduce_tensor")' not in text:
    text, n = pat.subn(r'\1GGML_USE_CUDA and hasattr(lib, "ggml_backend_cuda_allreduce_tensor"),', text, count=1)
    if n:
        src.write_text(text)
        print("[install-cuda] patched the ggml_backend_cuda_allreduce_tensor binding")
init = pkg / "__init__.py"
marker = "# deltarun install-cuda.sh: preload cuBLAS\n"
body = init.read_text()
preload = os.environ.get("PRELOAD_DIR")
if preload and marker not in body:
    libs = sorted(pathlib.Path(preload).glob("libcublasLt.so.*")) + sorted(pathlib.Path(preload).glob("libcublas.so.*"))
    block = marker + "import ctypes as _ctypes\n" + "".join(
        f"_ctypes.CDLL({str(p)!r}, mode=_ctypes.RTLD_GLOBAL)\n" for p in libs) + "\n"
    init.write_text(block + body)
    print(f"[install-cuda] ggml now preloads {len(libs)} cuBLAS libraries from {preload}")
PY

# 6. Check
"$PY" - <<'PY'
import ggml
print(f"[install-cuda] ggml-python with CUDA: {bool(ggml.GGML_USE_CUDA)}, "
      f"{ggml.ggml_backend_cuda_get_device_count() if ggml.GGML_USE_CUDA else 0} device(s)")
PY
