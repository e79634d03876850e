"""Private virtual environment holding llama-cpp-python, for bench/compare_llamacpp.py.

llama-cpp-python is built from source (the sdist vendors llama.cpp) with the
CPU backend only, -march=native and OpenMP, the same way the ggml inside
ggml-python 0.0.45 is built here (a single native libggml-cpu.so linked with
libgomp), so that kernels are comparable.  The first build takes a long time on
two cores (~20-40 min); later runs reuse the environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV_DIR = HERE / ".venv-llamacpp"
# 0.3.36 is the first release we checked whose vendored llama.cpp has
# src/models/qwen3next.cpp (the `qwen3next` architecture).
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
CMAKE_ARGS = " ".join([
    "-DGGML_NATIVE=ON",
    "-DGGML_OPENMP=ON",
    "-DGGML_BLAS=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_METAL=OFF",
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
])


def venv_python() -> Path:
    return VENV_DIR / "bin" / "python"


def is_ready() -> bool:
    py = venv_python()
    if not py.exists():
        return False
    r = subprocess.run([str(py), "-c", "import llama_cpp, numpy"], capture_output=True)
    return r.returncode == 0


def ensure(log=sys.stderr) -> Path:
    """Create the environment and build llama-cpp-python on first use."""
    if is_ready():
        return venv_python()
    if not venv_python().exists():
        print(f"[llamacpp_env] creating {VENV_DIR}", file=log, flush=True)
        venv.EnvBuilder(with_pip=True, clear=False).create(VENV_DIR)
    env = dict(os.environ)
    env["CMAKE_ARGS"] = CMAKE_ARGS
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    env["FORCE_CMAKE"] = "1"
    cmd = [str(venv_python()), "-m", "pip", "install", "--no-binary", "llama-cpp-python",
           "--no-cache-dir", "-v", LLAMA_CPP_PYTHON, "numpy", "psutil"]
    print(f"[llamacpp_env] building {LLAMA_CPP_PYTHON} from source "
          f"(CMAKE_ARGS={CMAKE_ARGS}); this takes a while", file=log, flush=True)
    subprocess.run(cmd, env=env, check=True)
    if not is_ready():
        raise RuntimeError("llama-cpp-python did not import after installation")
    return venv_python()


if __name__ == "__main__":
    print(ensure())
