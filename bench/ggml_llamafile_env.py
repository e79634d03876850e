"""A virtual environment where deltarun runs on ggml-python 0.0.45 built with GGML_LLAMAFILE=ON.

ggml-python's build of ggml leaves GGML_LLAMAFILE at ggml's default, OFF; llama.cpp turns it on.
Those are llamafile's tinyBLAS matmul kernels, which ggml's CPU backend uses for batched
multiplications (prompt processing) of F32/F16/BF16/Q8_0/Q4_0... weights. Without them,
prompt processing runs on ggml's generic vec_dot path and is 1.3-1.5x slower than llama.cpp on
the same GGUF; the Python side has nothing to do with it (see bench/RESULTS.md).

The environment inherits the system site-packages (deltarun, numpy, gguf, ...) and shadows only
`ggml`. Same sdist, same compiler, same -march=native and OpenMP as the stock install, only
-DGGML_LLAMAFILE=ON added. The same command installs it for good:

    CMAKE_ARGS="-DGGML_LLAMAFILE=ON" pip install --force-reinstall --no-deps \
        --no-binary ggml-python ggml-python==0.0.45
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV_DIR = HERE / ".venv-ggml-llamafile"
GGML_PYTHON = "ggml-python==0.0.45"
CMAKE_ARGS = "-DGGML_LLAMAFILE=ON -DGGML_NATIVE=ON -DGGML_OPENMP=ON"


def venv_python() -> Path:
    return VENV_DIR / "bin" / "python"


def is_ready() -> bool:
    py = venv_python()
    if not py.exists():
        return False
    code = ("import ggml, deltarun; from deltarun.runner.ggml_util import ggml as g; "
            "assert g.ggml_cpu_has_llamafile() and 'venv-ggml-llamafile' in ggml.__file__")
    return subprocess.run([str(py), "-c", code], capture_output=True).returncode == 0


def ensure(log=sys.stderr) -> Path:
    if is_ready():
        return venv_python()
    if not venv_python().exists():
        print(f"[ggml_llamafile_env] creating {VENV_DIR}", file=log, flush=True)
        venv.EnvBuilder(with_pip=True, system_site_packages=True).create(VENV_DIR)
    env = dict(os.environ, CMAKE_ARGS=CMAKE_ARGS)
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    print(f"[ggml_llamafile_env] building {GGML_PYTHON} with {CMAKE_ARGS} (a few minutes)", file=log, flush=True)
    subprocess.run([str(venv_python()), "-m", "pip", "install", "--no-deps", "--force-reinstall",
                    "--no-binary", "ggml-python", "--no-cache-dir", GGML_PYTHON], env=env, check=True)
    if not is_ready():
        raise RuntimeError("the llamafile build of ggml-python is not usable from the environment")
    return venv_python()


if __name__ == "__main__":
    print(ensure())
