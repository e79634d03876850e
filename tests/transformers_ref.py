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

# argv: checkpoint folder, prompt ids (comma-separated), torch dtype, greedy tokens to generate,
# out.npz. Every token's logits in one forward pass, no cache; then greedy tokens one at a time, each
# the argmax of a whole forward pass over the ids so far; the experts in eager loops (the grouped
# product takes no float64).
# (both model scripts) a checkpoint folder loaded with `from_pretrained`, every weight as it is
LOAD = """
import json, sys, numpy as np, torch
from safetensors.numpy import save_file

def load(cls, folder, dtype, **kw):
    with np.load(folder + "/weights.npz") as w:
        save_file({k: np.ascontiguousarray(w[k]) for k in w.files}, folder + "/model.safetensors")
    model, info = cls.from_pretrained(folder, dtype=dtype, output_loading_info=True, **kw)
    left = {k: sorted(v) for k, v in info.items() if v}
    assert not left, f"weights not loaded as they are: {left}"
    return model.eval()
"""

LOGITS_SCRIPT = LOAD + """
from transformers import AutoModelForCausalLM
folder, ids, dtype = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], sys.argv[3]
n_gen, out = int(sys.argv[4]), sys.argv[5]
model = load(AutoModelForCausalLM, folder, getattr(torch, dtype), experts_implementation="eager")
with torch.no_grad():
    logits = model(torch.tensor([ids]), use_cache=False).logits[0].double().numpy()
    greedy = []
    for _ in range(n_gen):
        row = model(torch.tensor([ids + greedy]), use_cache=False).logits[0, -1]
        greedy.append(int(torch.argmax(row)))
np.savez(out, logits=logits, greedy=np.asarray(greedy, dtype=np.int64))
"""


def transformers_python() -> Path | None:
    """The Python with transformers the tests use, or None."""
    candidates = [os.environ.get("DELTARUN_TRANSFORMERS_PYTHON"),
                  str(Path(__file__).resolve().parents[1] / "bench" / ".venv-transformers" / "bin" / "python")]
    for c in candidates:
        if c and Path(c).is_file():
            if subprocess.run([c, "-c", "import torch, transformers, safetensors, PIL"], capture_output=True).returncode == 0:
                return Path(c)
    return None


PYTHON = transformers_python()
needs_transformers = pytest.mark.skipif(PYTHON is None, reason="no Python with transformers "
                                        "(python bench/bench_envs.py transformers, or set DELTARUN_TRANSFORMERS_PYTHON)")


def run(script: str, *args: object) -> None:
    """Run one of the scripts here in transformers' Python; a failure shows its stderr."""
    p = subprocess.run([str(PYTHON), "-c", script, *map(str, args)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert p.returncode == 0, f"transformers exited with {p.returncode}: {p.stderr[-2000:]}"


def write_checkpoint(folder: Path, config: dict, weights: dict[str, np.ndarray]) -> Path:
    """A checkpoint folder for `logits`: config.json and weights.npz."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    np.savez(folder / "weights.npz", **weights)
    return folder


def logits_and_greedy(folder: Path, toks: list[int], n_gen: int, dtype: str = "float64") -> tuple[np.ndarray, list[int]]:
    """transformers' logits for `toks` (one row per token, as float64) from a `write_checkpoint`
    folder, and its next `n_gen` greedy tokens."""
    out = folder / f"logits-{dtype}.npz"
    run(LOGITS_SCRIPT, folder, ",".join(map(str, toks)), dtype, n_gen, out)
    with np.load(out) as z:
        return z["logits"], z["greedy"].tolist()


# argv: checkpoint folder (a Qwen3_5ForConditionalGeneration), image file, processor settings
# (JSON: patch_size, temporal_patch_size, merge_size, min_pixels, max_pixels, image_mean,
# image_std), prompt ids with the image's pad tokens, greedy tokens to generate, out.npz. The
# image goes through transformers' own processor (the PIL one: Qwen2VLImageProcessorPil); its
# pixel_values and image_grid_thw come back with the logits of every position and the greedy
# tokens (each from a whole forward pass, the image included).
VLM_SCRIPT = LOAD + """
from PIL import Image
from transformers import Qwen3_5ForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
folder, image, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
ids, n_gen, out = [int(t) for t in sys.argv[4].split(",")], int(sys.argv[5]), sys.argv[6]
model = load(Qwen3_5ForConditionalGeneration, folder, torch.float64)
processor = Qwen2VLImageProcessorPil(**settings)
features = processor(images=[Image.open(image).convert("RGB")], return_tensors="pt")
pixels, grid = features["pixel_values"].to(torch.float64), features["image_grid_thw"]
with torch.no_grad():
    image_id = model.config.image_token_id              # the processor's token types: text 0, image 1
    run = lambda toks: model(input_ids=torch.tensor([toks]), pixel_values=pixels, image_grid_thw=grid,
                             mm_token_type_ids=torch.tensor([[int(t == image_id) for t in toks]]),
                             use_cache=False).logits[0]
    logits = run(ids).double().numpy()
    greedy = []
    for _ in range(n_gen):
        greedy.append(int(torch.argmax(run(ids + greedy)[-1])))
np.savez(out, logits=logits, greedy=np.asarray(greedy, dtype=np.int64), pixel_values=pixels.numpy(),
         grid=grid.numpy())
"""


def vlm_logits_and_greedy(folder: Path, image: Path, settings: dict, toks: list[int], n_gen: int) -> dict[str, np.ndarray]:
    """transformers' processor and model on one image and prompt (see VLM_SCRIPT): a dict with
    `logits` (float64, every position), `greedy`, `pixel_values` and `grid`."""
    out = folder / "vlm.npz"
    run(VLM_SCRIPT, folder, image, json.dumps(settings), ",".join(map(str, toks)), n_gen, out)
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


# argv: cases.json ([{"template", "messages", "tools", "kwargs", "add_generation_prompt"}]),
# out.json: each case's prompt text as transformers renders it (render_jinja_template, what
# apply_chat_template calls), or "error: <class>" where the template raised.
TEMPLATE_SCRIPT = """
import json, sys
from transformers.utils.chat_template_utils import render_jinja_template
out = []
for c in json.load(open(sys.argv[1], encoding="utf-8")):
    try:
        text, _ = render_jinja_template([c["messages"]], tools=c["tools"], chat_template=c["template"],
                                        add_generation_prompt=c["add_generation_prompt"], **c["kwargs"])
        out.append(text[0])
    except Exception as e:
        out.append("error: " + type(e).__name__)
json.dump(out, open(sys.argv[2], "w", encoding="utf-8"))
"""


def render_templates(cases: list[dict], tmp: Path) -> list[str]:
    """transformers' rendering of each case (see TEMPLATE_SCRIPT)."""
    src, out = tmp / "template-cases.json", tmp / "template-renders.json"
    src.write_text(json.dumps(cases), encoding="utf-8")
    run(TEMPLATE_SCRIPT, src, out)
    return json.loads(out.read_text(encoding="utf-8"))
