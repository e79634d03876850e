#!/usr/bin/env python3
"""Encoding one image: deltarun's vision tower against llama.cpp's mtmd, same mmproj file, CPU, N threads.

    python bench/mtmd_encode.py                          # tiny and Qwen3.5-0.8B shapes, 10 rounds, 2 threads
    python bench/mtmd_encode.py --shapes 0.8b --rounds 21 --size 768x512 --json /tmp/mtmd.json

What it does
------------
1. Writes, per shape, a random-weights text model and mmproj (models/qwen35_vision.py: the tiny
   test tower `tiny-vision`, or `bench-vision`, the vision shapes of Qwen/Qwen3.5-0.8B: 12 blocks
   of 768, projection to 1024) as the converter writes them (--mmproj-type, default f16 as Hugging
   Face publishes `mmproj-F16.gguf`), and one random RGB PNG of --size pixels (a multiple of 32 on
   each side inside both engines' pixel bounds, so neither preprocessor resizes it: both encode the
   same patches; checked by comparing the token counts). The text model exists because mtmd needs
   one (it checks the projection width); its layers are the tiny preset's, hidden size widened.
2. deltarun: `VisionEncoder(mmproj, n_threads=N)` in this process, the image prepared once
   (`images.load_image`); one timed unit = `encode(image)` (graph build, allocation, compute, the
   embeddings read back).
3. llama.cpp: bench/_mtmd_worker.py in bench/.venv-llamacpp, on llama-cpp-python 0.3.36's mtmd
   bindings and a shared-library build of the same sdist's llama.cpp (build/llama-mtmd/bin; built
   on first use with build/llama-server's flags: Release, GGML_NATIVE, OpenMP; `nice`, -j2). The
   image is tokenized once (mtmd's preprocessing); one timed unit = `mtmd_encode_chunk` on it
   (graph build, allocation, compute; mtmd's flash-attention choice left at its default, auto).
   On AMX CPUs llama.cpp's extra buffer types are off (bench/_worker_protocol.cpu_has_amx); mtmd's
   tower never uses them.
4. One untimed warm-up encode per side, the embeddings of both compared (max |a-b| / max |a|:
   a check that both run the same tower; mtmd's merger uses the tanh GELU, deltarun the erf one
   of transformers, so they differ at about 1e-3), then --rounds rounds, each one encode per
   side, the order alternating (deltarun first in even rounds). Reported per shape: min and
   median ms per image for each engine, and llama.cpp / deltarun (> 1: deltarun is faster) on the
   medians and on the minima (the figure least moved by other work on the machine).

Run it on a quiet machine: two threads on two cores collapse when anything else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_envs import LLAMACPP  # noqa: E402
from compare_llamacpp import Worker  # noqa: E402

DEFAULT_DIR = Path("/tmp/drmtmd")
MTMD_BUILD = ROOT / "build" / "llama-mtmd"
SDIST_TREE = ROOT / "build" / "llama-cpp-python-sdist" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
#: --shapes name -> vision preset (models/qwen35_vision.py)
SHAPES = {"tiny": "tiny-vision", "0.8b": "bench-vision"}
#: build/llama-server's configuration (its CMakeCache.txt), with shared libraries and mtmd
CMAKE_FLAGS = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON",
               "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_MTMD=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF"]


def mtmd_libs() -> Path:
    """The folder of libmtmd and its libllama / libggml, built from the sdist's tree on first use."""
    lib = MTMD_BUILD / "bin"
    if (lib / "libmtmd.so").exists() and (lib / "libllama.so").exists():
        return lib
    if not SDIST_TREE.is_dir():
        sys.exit(f"no llama.cpp tree at {SDIST_TREE} (the llama-cpp-python 0.3.36 sdist, unpacked)")
    print(f"building libmtmd into {MTMD_BUILD} (nice, -j2; tens of minutes on two cores)", file=sys.stderr, flush=True)
    subprocess.run(["nice", "-n", "10", "cmake", "-S", str(SDIST_TREE), "-B", str(MTMD_BUILD), *CMAKE_FLAGS], check=True)
    subprocess.run(["nice", "-n", "10", "cmake", "--build", str(MTMD_BUILD), "-j", "2", "--target", "mtmd",
                    "llama-mtmd-cli"], check=True)
    return lib


def write_files(folder: Path, shape: str, mmproj_type: str, size: tuple[int, int]) -> tuple[Path, Path, Path]:
    """(text model, mmproj, image) for one shape, written once into `folder`."""
    import numpy as np
    from PIL import Image

    from deltarun.model_files import qwen35, qwen35_vision as qv

    preset = SHAPES[shape]
    folder.mkdir(parents=True, exist_ok=True)
    width = qv.VISION_PRESETS[preset].out_hidden_size
    text_cfg = qwen35.config_with("tiny-qwen35", hidden_size=width)
    text = folder / f"text-{shape}.gguf"
    mmproj = folder / f"mmproj-{shape}-{mmproj_type}.gguf"
    h, w = size
    image = folder / f"image-{h}x{w}.png"
    if not text.exists():
        qwen35.write_model(text, text_cfg, "f32")
    if not mmproj.exists():
        print(f"writing {mmproj} ({preset}, {mmproj_type})", file=sys.stderr, flush=True)
        qv.write_mmproj(mmproj, qv.vision_for(text_cfg, preset), mmproj_type)
    if not image.exists():
        Image.fromarray(np.random.default_rng(31).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(image)
    return text, mmproj, image


def bench_shape(shape: str, args: argparse.Namespace, libs: Path, python: Path) -> dict:
    import numpy as np

    from deltarun.runner.images import load_image
    from deltarun.runner.vision import VisionEncoder

    text, mmproj, image = write_files(args.dir, shape, args.mmproj_type, args.size)
    env_lib = {"LLAMA_CPP_LIB_PATH": str(libs), "MTMD_CPP_LIB": str(libs)}
    os.environ.update(env_lib)        # read by llama_cpp and llama_cpp.mtmd_cpp in the worker
    log = open(args.dir / f"mtmd-worker-{shape}.log", "w")
    rgb = args.dir / f"{image.stem}.npy"
    from PIL import Image

    np.save(rgb, np.asarray(Image.open(image).convert("RGB"), dtype=np.uint8))   # the worker has no Pillow
    worker = Worker([str(python), str(HERE / "_mtmd_worker.py"), "--model", str(text), "--mmproj", str(mmproj),
                     "--rgb", str(rgb), "--threads", str(args.threads)], stderr=log)
    try:
        with VisionEncoder(mmproj, n_threads=args.threads) as enc:
            prep = load_image(image, enc.hp)
            if list(prep.pixels.shape[1:]) != list(args.size) or worker.info["n_tokens"] != prep.n_tokens:
                sys.exit(f"{shape}: the engines prepare the image differently (deltarun {list(prep.pixels.shape[1:])} "
                         f"pixels, {prep.n_tokens} tokens; mtmd {worker.info['n_tokens']} tokens): pick another --size")
            ours = enc.encode(prep)                                     # warm-up
            warm = worker.ask(cmd="encode")
            if "error" in warm:
                sys.exit(f"{shape}: {warm['error']}")
            npy = args.dir / f"mtmd-embd-{shape}.npy"
            worker.ask(cmd="embd", path=str(npy))
            theirs = np.load(npy)
            agree = float(np.abs(ours - theirs).max() / np.abs(ours).max()) if theirs.shape == ours.shape else None
            times: dict[str, list[float]] = {"deltarun": [], "llama.cpp": []}

            def ours_once() -> None:
                t0 = time.perf_counter()
                enc.encode(prep)
                times["deltarun"].append((time.perf_counter() - t0) * 1e3)

            def theirs_once() -> None:
                got = worker.ask(cmd="encode")
                if "error" in got:
                    sys.exit(f"{shape}: {got['error']}")
                times["llama.cpp"].append(got["ms"])

            for r in range(args.rounds):
                for step in ((ours_once, theirs_once) if r % 2 == 0 else (theirs_once, ours_once)):
                    step()
                if not args.quiet_progress:
                    print(f"{shape} round {r + 1}/{args.rounds}: deltarun {times['deltarun'][-1]:.1f} ms, "
                          f"llama.cpp {times['llama.cpp'][-1]:.1f} ms", file=sys.stderr, flush=True)
    finally:
        worker.close()
        log.close()
    _, gh, gw = prep.grid
    row = {"shape": shape, "preset": SHAPES[shape], "mmproj": str(mmproj), "mmproj_type": args.mmproj_type,
           "image": list(args.size), "patches": gh * gw, "n_tokens": prep.n_tokens, "threads": args.threads,
           "rounds": args.rounds, "embeddings_max_rel_diff": agree,
           "llamacpp_extra_bufts": worker.info.get("extra_bufts"), "llamacpp_libs": worker.info.get("libs"),
           "ms": times}
    for eng, ts in times.items():
        row[eng] = {"min": min(ts), "median": statistics.median(ts)}
    row["speedup_median"] = row["llama.cpp"]["median"] / row["deltarun"]["median"]
    row["speedup_min"] = row["llama.cpp"]["min"] / row["deltarun"]["min"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="tiny,0.8b", help=f"comma-separated of {', '.join(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", default="512x512", help="image HEIGHTxWIDTH in pixels, multiples of 32")
    ap.add_argument("--mmproj-type", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where the files are written")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--quiet-progress", action="store_true", help="no line per round on stderr")
    args = ap.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        ap.error(f"--shapes: unknown {bad}; choose from {', '.join(SHAPES)}")
    try:
        h, w = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        ap.error("--size is HEIGHTxWIDTH, e.g. 512x512")
    if h % 32 or w % 32 or h <= 0 or w <= 0:
        ap.error("--size: both sides must be positive multiples of 32 (patch 16 x merge 2), so neither engine resizes")
    if args.rounds < 1 or args.threads < 1:
        ap.error("--rounds and --threads must be at least 1")
    args.size = (h, w)
    if shutil.which("cmake") is None:
        sys.exit("cmake is needed to build libmtmd")
    python = LLAMACPP.ensure()
    libs = mtmd_libs()
    rows = [bench_shape(s, args, libs, python) for s in shapes]
    print(f"image encode, ms per image, {args.threads} threads, {args.rounds} rounds (alternated), "
          f"mmproj {args.mmproj_type}, image {h} x {w}")
    print(f"{'shape':6} {'tokens':>6} {'deltarun min':>12} {'median':>8} {'llama.cpp min':>13} {'median':>8} "
          f"{'x (median)':>10} {'x (min)':>8}  embd diff")
    for r in rows:
        d, lc = r["deltarun"], r["llama.cpp"]
        diff = "-" if r["embeddings_max_rel_diff"] is None else f"{r['embeddings_max_rel_diff']:.2g}"
        print(f"{r['shape']:6} {r['n_tokens']:6d} {d['min']:12.1f} {d['median']:8.1f} {lc['min']:13.1f} "
              f"{lc['median']:8.1f} {r['speedup_median']:10.2f} {r['speedup_min']:8.2f}  {diff}")
    print("x = llama.cpp ms / deltarun ms (> 1: deltarun encodes faster)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))


if __name__ == "__main__":
    main()
