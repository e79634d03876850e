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


#: The vocabulary size of the published Kimi-Linear models (config.json `vocab_size`).
KIMI_LINEAR_VOCAB_SIZE = 163_840


@lru_cache(maxsize=1)
def qwen2_vocab_kimi_linear_size() -> TinyVocab:
    """llama.cpp's Qwen2 vocabulary padded to Kimi-Linear's 163,840 rows: the embedding and LM head
    of the published model (whose tiktoken ranks are not available here) for benchmarks."""
    return padded(qwen2_vocab(), KIMI_LINEAR_VOCAB_SIZE)


#: Kimi-K2's named special tokens (tokenization_kimi.py / tokenizer_config.json
#: `added_tokens_decoder`), as offsets from the first special id (163,584 in the real vocabulary);
#: the rest of its 256 reserved ids are `<|reserved_token_{id}|>`.
KIMI_K2_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
                    13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
                    17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
                    21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]"}
KIMI_K2_RESERVED = 256


def tiktoken_bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's BPE of `token` with only the ranks below `max_rank` (llama.cpp's converter,
    `QwenModel.bpe`): a token whose parts end as two is that pair's merge."""
    parts = [bytes([b]) for b in token]
    while True:
        pairs = [(ranks.get(a + b), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(((r, i) for r, i in pairs if r is not None), default=(None, None))
        if rank is None or rank >= max_rank:
            return parts
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def kimi_k2_vocab(ranks: dict[bytes, int]) -> TinyVocab:
    """A `kimi-k2` vocabulary as llama.cpp's converter writes one (conversion/kimi_linear.py
    `set_vocab`) from tiktoken ranks (bytes -> rank, ranks 0..n-1): token i is rank i's bytes in
    the byte-level alphabet, a merge for every multi-byte token whose BPE below its own rank ends
    in two parts (in rank order), then the 256 special ids as CONTROL tokens; bos [BOS], eos [EOS]
    (the tiktoken eos the converter writes), padding [PAD]."""
    from deltarun.base.tokenizer import BYTE_TO_UNICODE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL

    def spell(b: bytes) -> str:
        return "".join(BYTE_TO_UNICODE[x] for x in b)

    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    if [r for _, r in by_rank] != list(range(len(by_rank))):
        raise ValueError("tiktoken ranks must be 0..n-1")
    merges = []
    for token, rank in by_rank:
        if len(token) > 1 and len(parts := tiktoken_bpe(ranks, token, rank)) == 2:
            merges.append(" ".join(map(spell, parts)))
    base = len(by_rank)
    specials = [KIMI_K2_SPECIALS.get(i, f"<|reserved_token_{base + i}|>") for i in range(KIMI_K2_RESERVED)]
    by_name = {name: base + i for i, name in enumerate(specials)}
    return TinyVocab(tokens=tuple(spell(t) for t, _ in by_rank) + tuple(specials),
                     token_types=(TOKEN_TYPE_NORMAL,) * base + (TOKEN_TYPE_CONTROL,) * KIMI_K2_RESERVED,
                     merges=tuple(merges), bos_id=by_name["[BOS]"], eos_id=by_name["[EOS]"],
                     pad_id=by_name["[PAD]"], pre="kimi-k2")


@lru_cache(maxsize=1)
def tiny_kimi_k2_vocab() -> TinyVocab:
    """A small `kimi-k2` vocabulary in the converter's layout (`kimi_k2_vocab`): its tiktoken ranks
    are the packaged tiny vocabulary's normal tokens (a consistent BPE cut, in merge order), so it
    has 2,304 ordinary tokens and Kimi-K2's 256 special ids after them."""
    from deltarun.base.tokenizer import TOKEN_TYPE_NORMAL, _from_byte_level

    tiny = tiny_vocab()
    return kimi_k2_vocab({_from_byte_level(t): i for i, (t, kind) in enumerate(zip(tiny.tokens, tiny.token_types))
                          if kind == TOKEN_TYPE_NORMAL})


#: Vocabularies a generator preset can name (ModelConfig.vocab, Qwen35Config.vocab).
VOCABS = {"tiny": tiny_vocab, "qwen2": qwen2_vocab, "qwen2-248k": qwen2_vocab_qwen35_size,
          "tiny-kimi-k2": tiny_kimi_k2_vocab, "qwen2-164k": qwen2_vocab_kimi_linear_size}


def vocab_named(name: str) -> TinyVocab:
    """The vocabulary a generator config names (`VOCABS`), or a ValueError listing the names."""
    if name not in VOCABS:
        raise ValueError(f"unknown vocabulary {name!r}; choose from {', '.join(VOCABS)}")
    return VOCABS[name]()
