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
- TRANSFORMERS: torch and Hugging Face transformers (5.24 has Kimi-Linear), for the tests that run
  a synthetic checkpoint through transformers itself (tests/transformers_ref.py). About 5 GB with
  torch's CUDA libraries (PyPI's only build); a few minutes from the package index.
- llama-server: the `llama-server` binary of the same sdist's vendored llama.cpp (`tools/server`),
  CPU only, with the same ggml options as LLAMACPP, for `bench/serve_load.py`. Only that target is
  built (about 200 compile steps rather than the whole tree's), out of the source tree, without the
  web UI (no npm, no download: the server then embeds no UI assets, its API is unchanged).

    python bench/bench_envs.py llamacpp|ggml-stock|transformers   # build (if needed) and print the python
    python bench/bench_envs.py llama-server [--source SDIST/vendor/llama.cpp] [--build-dir DIR] [--jobs N]
                                                       # build (if needed) and print the binary
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import tarfile
import sys
import venv
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


LLAMA_CPP_PYTHON_VERSION = "0.3.36"   # the sdist whose vendored llama.cpp both LLAMACPP and llama-server use
LLAMA_CPP_PYTHON_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"  # as scripts/ggml-wheel.sh


def cached_sdist() -> Path | None:
    """The llama-cpp-python sdist scripts/ggml-wheel.sh keeps in its cache (same pinned sha256), if there.

    The ggml wheel is built from this very sdist, so building from it needs no download (and no
    network: the package index is not always reachable) and keeps all three builds on one source."""
    cache = Path(os.environ.get("DELTARUN_WHEEL_CACHE", Path.home() / ".cache" / "deltarun-wheels"))
    sdist = cache / "sources" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if sdist.is_file() and hashlib.sha256(sdist.read_bytes()).hexdigest() == LLAMA_CPP_PYTHON_SDIST_SHA256:
        return sdist
    return None


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
        packages = [str(sdist) if p == f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}" and (sdist := cached_sdist())
                    else p for p in self.packages]
        print(f"[bench_envs] building {' '.join(packages)} with CMAKE_ARGS={self.cmake_args} "
              "(minutes; llama-cpp-python ~20-40 min on two cores)", file=log, flush=True)
        subprocess.run([str(self.python()), "-m", "pip", "install", "--no-cache-dir", *packages],
                       env=env, check=True)
        if not self.is_ready():
            raise RuntimeError(f"the {self.name} environment is not usable after installing")
        return self.python()


LLAMACPP = BuildEnv(
    name="llamacpp",
    check="import llama_cpp, numpy",
    packages=["--no-binary", "llama-cpp-python", "llama-cpp-python==0.3.36", "numpy", "psutil"],  # see cached_sdist
    cmake_args=" ".join([
        "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON", "-DGGML_BLAS=OFF", "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF",
        "-DGGML_METAL=OFF", "-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DCMAKE_BUILD_TYPE=Release",
    ]),
    extra_env={"FORCE_CMAKE": "1"},
)

GGML_STOCK = BuildEnv(
    name="ggml-stock",
    check=("import ggml, deltarun; from deltarun.base.ggml_util import ggml as g; "
           "assert not g.ggml_cpu_has_llamafile() and 'venv-ggml-stock' in ggml.__file__"),
    packages=["--no-deps", "--force-reinstall", "--no-binary", "ggml-python", "ggml-python==0.0.45"],
    cmake_args="-DGGML_LLAMAFILE=OFF",
    system_site_packages=True,
)

TRANSFORMERS = BuildEnv(
    name="transformers",
    check="import torch, transformers, safetensors, numpy, PIL",
    packages=["torch", "transformers>=5.24", "safetensors", "numpy", "pillow"],
    cmake_args="",
)

ENVS = {"llamacpp": LLAMACPP, "ggml-stock": GGML_STOCK, "transformers": TRANSFORMERS}

LLAMA_SERVER_CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON",
    "-DGGML_BLAS=OFF", "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF", "-DGGML_METAL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",    # no npm build, no download of the web UI
]


def llama_cpp_source(work: Path, log=sys.stderr) -> Path:
    """The vendored llama.cpp of the llama-cpp-python sdist, fetched with pip into work/ on first use."""
    root = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    if not (root / "vendor" / "llama.cpp" / "tools" / "server").is_dir():
        sdist = cached_sdist()
        if sdist is None:
            print(f"[bench_envs] pip download llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} (sdist)", file=log, flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(work)], check=True)
            (sdist,) = work.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
    return root / "vendor" / "llama.cpp"


def build_llama_server(build_dir: Path, source: Path | None = None, jobs: int = 2, log=sys.stderr) -> Path:
    """Configure and build only the `llama-server` target (if not built yet); the binary's path."""
    binary = build_dir / "bin" / "llama-server"
    if binary.exists():
        return binary
    source = source or llama_cpp_source(build_dir.parent / "llama-cpp-python-sdist", log)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    print(f"[bench_envs] building llama-server from {source} in {build_dir} (minutes)", file=log, flush=True)
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *generator, *LLAMA_SERVER_CMAKE_ARGS], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)], check=True)
    return binary


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Build a bench environment (if needed) and print its python or binary.")
    ap.add_argument("what", choices=[*ENVS, "llama-server"])
    ap.add_argument("--source", type=Path, help="llama-server: a vendored llama.cpp tree [default: the cached sdist (cached_sdist), else pip download it]")
    ap.add_argument("--build-dir", type=Path, default=HERE.parent / "build" / "llama-server",
                    help="llama-server: out-of-tree build folder [default: build/llama-server, git-ignored]")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="llama-server: compile jobs")
    a = ap.parse_args()
    if a.what == "llama-server":
        print(build_llama_server(a.build_dir.resolve(), a.source, a.jobs))
    else:
        print(ENVS[a.what].ensure())
