"""Private virtual environments the bench scripts build once and reuse (bench/.venv-<name>).

- LLAMACPP: llama-cpp-python built from source (the sdist vendors llama.cpp) with the CPU backend
  only, -march=native and OpenMP, the way the ggml inside ggml-python 0.0.45 is built here (one
  native libggml-cpu.so linked with libgomp), so that kernels are comparable. 0.3.36 is the first
  release we checked whose llama.cpp has src/models/qwen3next.cpp. The first build takes
  ~20-40 min on two cores.
- GGML_STOCK: ggml-python 0.0.45 as a plain `pip install` builds it, GGML_LLAMAFILE=OFF (ggml's
  default; scripts/install.sh turns it on, as llama.cpp does). It inherits the system
  site-packages (deltarun, numpy, gguf, ...) and shadows only `ggml`, so that
  `compare_llamacpp.py --ggml-builds installed,stock` shows what llamafile's kernels are worth.

    python bench/bench_envs.py llamacpp|ggml-stock     # build (if needed) and print the python
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class BuildEnv:
    name: str                 # the folder is bench/.venv-<name>
    check: str                # Python code that exits 0 once the environment is usable
    packages: list[str]       # pip install arguments
    cmake_args: str           # CMAKE_ARGS of the source build
    system_site_packages: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def dir(self) -> Path:
        return HERE / f".venv-{self.name}"

    def python(self) -> Path:
        return self.dir / "bin" / "python"

    def is_ready(self) -> bool:
        py = self.python()
        return py.exists() and subprocess.run([str(py), "-c", self.check], capture_output=True).returncode == 0

    def ensure(self, log=sys.stderr) -> Path:
        """Create the environment and build its packages on first use; its python."""
        if self.is_ready():
            return self.python()
        if not self.python().exists():
            print(f"[bench_envs] creating {self.dir}", file=log, flush=True)
            venv.EnvBuilder(with_pip=True, system_site_packages=self.system_site_packages).create(self.dir)
        env = dict(os.environ, CMAKE_ARGS=self.cmake_args, **self.extra_env)
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        print(f"[bench_envs] building {' '.join(self.packages)} with CMAKE_ARGS={self.cmake_args} "
              "(minutes; llama-cpp-python ~20-40 min on two cores)", file=log, flush=True)
        subprocess.run([str(self.python()), "-m", "pip", "install", "--no-cache-dir", *self.packages],
                       env=env, check=True)
        if not self.is_ready():
            raise RuntimeError(f"the {self.name} environment is not usable after installing")
        return self.python()


LLAMACPP = BuildEnv(
    name="llamacpp",
    check="import llama_cpp, numpy",
    packages=["--no-binary", "llama-cpp-python", "llama-cpp-python==0.3.36", "numpy", "psutil"],
    cmake_args=" ".join([
        "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON", "-DGGML_BLAS=OFF", "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF",
        "-DGGML_METAL=OFF", "-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DCMAKE_BUILD_TYPE=Release",
    ]),
    extra_env={"FORCE_CMAKE": "1"},
)

GGML_STOCK = BuildEnv(
    name="ggml-stock",
    check=("import ggml, deltarun; from deltarun.runner.ggml_util import ggml as g; "
           "assert not g.ggml_cpu_has_llamafile() and 'venv-ggml-stock' in ggml.__file__"),
    packages=["--no-deps", "--force-reinstall", "--no-binary", "ggml-python", "ggml-python==0.0.45"],
    cmake_args="-DGGML_LLAMAFILE=OFF",
    system_site_packages=True,
)

ENVS = {"llamacpp": LLAMACPP, "ggml-stock": GGML_STOCK}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ENVS:
        raise SystemExit(f"usage: {sys.argv[0]} {'|'.join(ENVS)}")
    print(ENVS[sys.argv[1]].ensure())
