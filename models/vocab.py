"""The small vocabulary synthetic test models carry.

It is a consistent cut of the real Qwen2/Qwen3 BPE vocabulary (see ``make_tiny_vocab.py``), so
synthetic models tokenize prompts the way real Qwen3-Next files do while keeping the embedding at
a couple of thousand rows. The data ships inside the package (``data/tiny-vocab.json``) so that
installed copies never need the shared reference folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from deltarun.runner.tokenizer import Tokenizer

VOCAB_RESOURCE = "tiny-vocab.json"


@dataclass(frozen=True)
class TinyVocab:
    """What a GGUF writer needs for ``tokenizer.ggml.*`` metadata (immutable: it is shared)."""

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: int
    eos_id: int
    pad_id: int
    eot_id: int | None = None
    add_bos: bool = False
    pre: str = "qwen2"

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def tokenizer(self) -> Tokenizer:
        """A tokenizer over this vocabulary, as a model file carrying it would get."""
        return Tokenizer(
            tokens=self.tokens,
            token_types=self.token_types,
            merges=self.merges,
            bos_id=self.bos_id,
            eos_id=self.eos_id,
            eot_id=self.eot_id,
            pad_id=self.pad_id,
            add_bos=self.add_bos,
            pre=self.pre,
        )


@lru_cache(maxsize=1)
def tiny_vocab() -> TinyVocab:
    """Load the packaged tiny vocabulary (read once, then shared)."""
    resource = resources.files("deltarun.model_files").joinpath("data").joinpath(VOCAB_RESOURCE)
    text = resource.read_text("utf-8")
    doc = json.loads(text)
    return TinyVocab(
        tokens=tuple(doc["tokens"]),
        token_types=tuple(int(t) for t in doc["token_types"]),
        merges=tuple(doc["merges"]),
        bos_id=int(doc["bos_id"]),
        eos_id=int(doc["eos_id"]),
        pad_id=int(doc["pad_id"]),
        eot_id=doc.get("eot_id"),
        add_bos=bool(doc.get("add_bos", False)),
        pre=doc.get("pre", "qwen2"),
    )
