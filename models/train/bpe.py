"""The byte-level BPE vocabulary of the built-in model, trained with HF `tokenizers`.

Same scheme as Qwen2/Qwen3: the qwen2 pre-tokenizer regex (deltarun's own copy, so the two can
not drift), GPT-2 byte-to-unicode alphabet, merges by rank, then Qwen3's added tokens appended
after the normal ones with the GGUF types a converter gives them. The result is a `TinyVocab`
(what the GGUF writer takes) and the HF tokenizer itself (what the training and tests encode
with); `tests/test_trained_model.py` checks that deltarun's tokenizer encodes like it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from deltarun.base.tokenizer import PRE_TOKENIZER_PATTERNS
from deltarun.model_files.make_tiny_vocab import QWEN3_ADDED_TOKENS, converter_token_type
from deltarun.model_files.vocab import TinyVocab

ENDOFTEXT = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], n_vocab: int) -> Tokenizer:
    """A byte-level BPE tokenizer of `n_vocab` tokens in all (normal ones plus Qwen3's added ones).

    The trainer is deterministic for a given input (counts, then pair order, break ties)."""
    n_normal = n_vocab - len(QWEN3_ADDED_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERNS["qwen2"]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_normal, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(list(texts), trainer)
    if tok.get_vocab_size() != n_normal:
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} tokens, not {n_normal}")
    tok.add_tokens([AddedToken(text, special=special, normalized=False) for text, special in QWEN3_ADDED_TOKENS])
    return tok


def to_vocab(tok: Tokenizer) -> TinyVocab:
    """The GGUF `tokenizer.ggml.*` view of a tokenizer made by `train_tokenizer`."""
    doc = json.loads(tok.to_str())
    vocab: dict[str, int] = doc["model"]["vocab"]
    added = {a["content"]: a for a in doc["added_tokens"]}
    n = len(vocab) + len(added)
    tokens = [""] * n
    types = [1] * n
    for text, i in vocab.items():
        tokens[i] = text
    for text, a in added.items():
        tokens[a["id"]] = text
        types[a["id"]] = converter_token_type(text, a["special"])
    if "" in tokens:
        raise RuntimeError("token ids are not dense")
    merges = [m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]]
    eos = tokens.index(ENDOFTEXT)
    return TinyVocab(tokens=tuple(tokens), token_types=tuple(types), merges=tuple(merges),
                     bos_id=eos, eos_id=eos, pad_id=eos, eot_id=None, add_bos=False, pre="qwen2")
