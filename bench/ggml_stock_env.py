"""A virtual environment where deltarun runs on ggml-python 0.0.45 as PyPI's sdist builds it.

scripts/install.sh builds ggml-python with -DGGML_LLAMAFILE=ON (llamafile's tinyBLAS matrix
kernels, as llama.cpp builds ggml); ggml's own default, and so a plain `pip install ggml-python`,
leaves them off. This environment holds that plain build, so that bench/compare_llamacpp.py
(`--ggml-builds installed,stock`) can show what the kernels are worth: prompt processing runs on
ggml's generic vec_dot path without them.

The environment inherits the system site-packages (deltarun, numpy, gguf, ...) and shadows only
`ggml`. Same sdist, same compiler, same -march=native and OpenMP, only GGML_LLAMAFILE=OFF.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV_DIR = HERE / ".venv-ggml-stock"
GGML_PYTHON = "ggml-python==0.0.45"
CMAKE_ARGS = "-DGGML_LLAMAFILE=OFF"


def venv_python() -> Path:
    return VENV_DIR / "bin" / "python"


def is_ready() -> bool:
    py = venv_python()
    if not py.exists():
        return False
    code = ("import ggml, deltarun; from deltarun.runner.ggml_util import ggml as g; "
            "assert not g.ggml_cpu_has_llamafile() and 'venv-ggml-stock' in ggml.__file__")
    return subprocess.run([str(py), "-c", code], capture_output=True).returncode == 0


def ensure(log=sys.stderr) -> Path:
    if is_ready():
        return venv_python()
    if not venv_python().exists():
        print(f"[ggml_stock_env] creating {VENV_DIR}", file=log, flush=True)
        venv.EnvBuilder(with_pip=True, system_site_packages=True).create(VENV_DIR)
    env = dict(os.environ)
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    print(f"[ggml_stock_env] building {GGML_PYTHON} with {CMAKE_ARGS} (a few minutes)", file=log, flush=True)
    subprocess.run([str(venv_python()), "-m", "pip", "install", "--no-deps", "--force-reinstall",
                    "--no-binary", "ggml-python", "--no-cache-dir",
                    f"--config-settings=cmake.args={CMAKE_ARGS}", GGML_PYTHON], env=env, check=True)
    if not is_ready():
        raise RuntimeError("the stock build of ggml-python is not usable from the environment")
    return venv_python()


if __name__ == "__main__":
    print(ensure())
