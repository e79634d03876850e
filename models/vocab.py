"""The small vocabulary synthetic test models carry.

It is a consistent cut of the real Qwen2/Qwen3 BPE vocabulary (see ``make_tiny_vocab.py``), so
synthetic models tokenize prompts the way real Qwen3-Next files do while keeping the embedding at
a couple of thousand rows. The data ships inside the package (``data/tiny-vocab.json``) so that
installed copies never need the shared reference folder.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import gguf

from deltarun.base.tokenizer import Tokenizer

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


#: llama.cpp's Qwen2 vocabulary file (151,936 tokens, 151,387 merges): the real vocabulary of
#: Qwen2 and Qwen3-Next, in the shared reference folder beside the checkout (as make_tiny_vocab.py
#: reads it). Set DELTARUN_QWEN2_VOCAB to use a copy elsewhere.
QWEN2_VOCAB_FILE = str(Path(__file__).resolve().parents[1].parent / "shared" / "data" / "vocab"
                       / "ggml-vocab-qwen2.gguf")
QWEN2_VOCAB_ENV = "DELTARUN_QWEN2_VOCAB"


def qwen2_vocab_path() -> str:
    import os

    return os.environ.get(QWEN2_VOCAB_ENV) or QWEN2_VOCAB_FILE


@lru_cache(maxsize=1)
def qwen2_vocab() -> TinyVocab:
    """The real Qwen2 vocabulary, read from llama.cpp's vocabulary GGUF (`qwen2_vocab_path`).

    Benchmark presets use it so that the embedding and LM head have a real model's size (the tiny
    vocabulary's 2,330 rows hide the cost that dominates decoding small real models)."""
    import os

    from deltarun.base.errors import DeltarunError
    from deltarun.base.fast_gguf import FastGGUFReader, array_values

    path = qwen2_vocab_path()
    if not os.path.exists(path):
        raise DeltarunError(f"the real Qwen2 vocabulary file {path} does not exist (llama.cpp's "
                            f"models/ggml-vocab-qwen2.gguf; point {QWEN2_VOCAB_ENV} at a copy)")
    f = FastGGUFReader(path).fields
    eos = int(array_values(f["tokenizer.ggml.eos_token_id"]))
    return TinyVocab(tokens=tuple(array_values(f["tokenizer.ggml.tokens"])),
                     token_types=tuple(int(t) for t in array_values(f["tokenizer.ggml.token_type"])),
                     merges=tuple(array_values(f["tokenizer.ggml.merges"])),
                     bos_id=int(array_values(f["tokenizer.ggml.bos_token_id"])), eos_id=eos, pad_id=eos)


#: The vocabulary size of the published Qwen3.5 models (config.json `vocab_size`).
QWEN35_VOCAB_SIZE = 248_320


def padded(vocab: TinyVocab, n_vocab: int) -> TinyVocab:
    """`vocab` padded to `n_vocab` entries as convert_hf_to_gguf.py pads a tokenizer smaller than
    the model's `vocab_size`: `[PAD{i}]` tokens of type UNUSED."""
    extra = range(vocab.n_vocab, n_vocab)
    return dataclasses.replace(vocab, tokens=vocab.tokens + tuple(f"[PAD{i}]" for i in extra),
                               token_types=vocab.token_types + (gguf.TokenType.UNUSED,) * len(extra))


@lru_cache(maxsize=1)
def qwen2_vocab_qwen35_size() -> TinyVocab:
    """llama.cpp's Qwen2 vocabulary padded to Qwen3.5's 248,320 rows: the embedding and LM head of
    a published Qwen3.5 (whose own 248k-token vocabulary is not available here) for benchmarks."""
    return padded(qwen2_vocab(), QWEN35_VOCAB_SIZE)


#: Vocabularies a generator preset can name (ModelConfig.vocab, Qwen35Config.vocab).
VOCABS = {"tiny": tiny_vocab, "qwen2": qwen2_vocab, "qwen2-248k": qwen2_vocab_qwen35_size}


def vocab_named(name: str) -> TinyVocab:
    """The vocabulary a generator config names (`VOCABS`), or a ValueError listing the names."""
    if name not in VOCABS:
        raise ValueError(f"unknown vocabulary {name!r}; choose from {', '.join(VOCABS)}")
    return VOCABS[name]()
