"""Hugging Face transformers itself, run from the tests: the logits of a synthetic checkpoint.

The float64 references in tests/ are written from transformers' modelling code; this runs that
code. It needs a Python with torch and transformers >= 5.24 (which has Kimi-Linear):
`$DELTARUN_TRANSFORMERS_PYTHON`, else the bench environment `bench/.venv-transformers` (`python
bench/bench_envs.py transformers` builds it from the package index: torch with its CUDA libraries,
about 5 GB). Without one the tests skip (CI has none).

The checkpoint is a folder with config.json and the weights as weights.npz (numpy's format: the
tests' Python has no safetensors); the script writes model.safetensors from them in transformers'
Python and loads the folder with `from_pretrained`, so transformers' own renaming of checkpoint
weights (its conversion mapping) applies as it does to a published checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

# argv: checkpoint folder, prompt ids (comma-separated), torch dtype, out.npy. Every token's logits
# in one forward pass, no cache; the experts in eager loops (the grouped product takes no float64).
LOGITS_SCRIPT = """
import json, sys, numpy as np, torch
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM
folder, ids, dtype, out = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], sys.argv[3], sys.argv[4]
with np.load(folder + "/weights.npz") as w:
    save_file({k: np.ascontiguousarray(w[k]) for k in w.files}, folder + "/model.safetensors")
model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), experts_implementation="eager",
                                                   output_loading_info=True)
left = {k: sorted(v) for k, v in info.items() if v}
assert not left, f"weights not loaded as they are: {left}"
with torch.no_grad():
    logits = model.eval()(torch.tensor([ids]), use_cache=False).logits[0]
np.save(out, logits.double().numpy())
"""


def transformers_python() -> Path | None:
    """The Python with transformers the tests use, or None."""
    candidates = [os.environ.get("DELTARUN_TRANSFORMERS_PYTHON"),
                  str(Path(__file__).resolve().parents[1] / "bench" / ".venv-transformers" / "bin" / "python")]
    for c in candidates:
        if c and Path(c).is_file():
            if subprocess.run([c, "-c", "import torch, transformers, safetensors"], capture_output=True).returncode == 0:
                return Path(c)
    return None


PYTHON = transformers_python()
needs_transformers = pytest.mark.skipif(PYTHON is None, reason="no Python with transformers "
                                        "(python bench/bench_envs.py transformers, or set DELTARUN_TRANSFORMERS_PYTHON)")


def write_checkpoint(folder: Path, config: dict, weights: dict[str, np.ndarray]) -> Path:
    """A checkpoint folder for `logits`: config.json and weights.npz."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    np.savez(folder / "weights.npz", **weights)
    return folder


def logits(folder: Path, toks: list[int], dtype: str = "float64") -> np.ndarray:
    """transformers' logits for `toks` (one row per token, as float64) from a `write_checkpoint` folder."""
    out = folder / f"logits-{dtype}.npy"
    p = subprocess.run([str(PYTHON), "-c", LOGITS_SCRIPT, str(folder), ",".join(map(str, toks)), dtype, str(out)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert p.returncode == 0, f"transformers exited with {p.returncode}: {p.stderr[-2000:]}"
    return np.load(out)
