"""The `qwen35` pre-tokenizer against llama.cpp's test vectors, and Qwen3.5-sized vocabularies.

`tests/data/vocab/ggml-vocab-qwen35.gguf.{inp,out}` are llama.cpp's test-tokenizer-0 files for
`models/ggml-vocab-qwen35.gguf` (MIT, unchanged; see tests/data/vocab/NOTICE.md). That GGUF is
llama.cpp's Qwen2 vocabulary GGUF with `tokenizer.ggml.pre = qwen35` (same tokens, types and
merges: checked when this file was written), so the tests build it from the Qwen2 vocabulary
shipped in tests/data, with the qwen35 pre-tokenizer.
"""

from __future__ import annotations

import time
import unicodedata
from pathlib import Path

import gguf
import pytest
import regex

from deltarun.base.errors import TokenizerError
from shipped_data import qwen2_vocab_gguf
from deltarun.base.tokenizer import (
    BYTE_TO_UNICODE,
    PRE_TOKENIZER_PATTERNS,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNUSED,
    Tokenizer,
)

HERE = Path(__file__).resolve().parent
VECTORS_BASE = HERE / "data" / "vocab" / "ggml-vocab-qwen35.gguf"
SEPARATOR = "\n__ggml_vocab_test__\n"


def load_vectors() -> list[tuple[str, list[int]]]:
    texts = VECTORS_BASE.with_name(VECTORS_BASE.name + ".inp").read_bytes().decode("utf-8").split(SEPARATOR)
    lines = VECTORS_BASE.with_name(VECTORS_BASE.name + ".out").read_bytes().decode("utf-8").split("\n")
    assert texts[-1] == "" and lines[-1] == ""
    texts, lines = texts[:-1], lines[:-1]
    assert len(texts) == len(lines)
    return [(t, [int(v) for v in line.split()]) for t, line in zip(texts, lines)]


VECTORS = load_vectors()


@pytest.fixture(scope="module")
def qwen35() -> Tokenizer:
    """llama.cpp's qwen35 vocabulary test file: the Qwen2 vocabulary with pre-tokenizer qwen35."""
    from deltarun.base.fast_gguf import array_values

    fields = gguf.GGUFReader(qwen2_vocab_gguf()).fields
    value = {k: array_values(fields[f"tokenizer.ggml.{k}"]) for k in ("tokens", "token_type", "merges",
                                                                      "bos_token_id", "eos_token_id")}
    return Tokenizer(value["tokens"], value["token_type"], value["merges"], bos_id=value["bos_token_id"],
                     eos_id=value["eos_token_id"], pre="qwen35")


def split(pre: str, text: str) -> list[str]:
    return regex.compile(PRE_TOKENIZER_PATTERNS[pre]).findall(text)


def test_vector_files_parse():
    assert len(VECTORS) == 50
    assert any(unicodedata.combining(c) for text, _ in VECTORS for c in text)   # decomposed accents are covered


@pytest.mark.parametrize(("text", "expected"), [pytest.param(t, e, id=f"case{i:02d}") for i, (t, e) in enumerate(VECTORS)])
def test_llama_cpp_qwen35_vectors(qwen35: Tokenizer, text: str, expected: list[int]):
    assert qwen35.encode(text, add_special=False, parse_special=False) == expected
    assert qwen35.decode(expected) == text


def test_combining_marks_stay_in_their_word_unlike_qwen2(qwen35: Tokenizer):
    """Decomposed 'é' (e + U+0301): qwen35 keeps the mark with its letters; qwen2 ends the letter
    run at the mark (which may start the next word as its optional prefix);
    neither normalises to NFC (the composed word tokenizes differently again)."""
    decomposed = "re\u0301sume\u0301 cafe\u0301"
    assert unicodedata.normalize("NFC", decomposed) != decomposed
    assert split("qwen35", decomposed) == ["re\u0301sume\u0301", " cafe\u0301"]
    assert split("qwen2", decomposed) == ["re", "\u0301sume", "\u0301", " cafe", "\u0301"]
    assert qwen35.encode(decomposed) != qwen35.encode(unicodedata.normalize("NFC", decomposed))
    # the vectors exercise the rule: some of their texts split differently under qwen2 (with this
    # vocabulary the ids happen to coincide, since no merge joins a letter with a following mark)
    assert any(split("qwen35", t) != split("qwen2", t) for t, _ in VECTORS)


def test_unknown_pre_tokenizer_is_refused_with_the_known_ones():
    tokens = [BYTE_TO_UNICODE[b] for b in range(256)]
    with pytest.raises(TokenizerError, match=r"unsupported pre-tokenizer 'qwen9'.*qwen2, qwen35"):
        Tokenizer(tokens, [TOKEN_TYPE_NORMAL] * 256, [], bos_id=None, eos_id=None, pre="qwen9")


def test_a_qwen35_sized_vocabulary():
    """248,320 entries laid out like the published one (BPE tokens, 33 specials from 248,044,
    then [PAD] entries of type UNUSED): ids at the top of the range encode and decode."""
    n_bpe, n_special, n_total = 248_044, 33, 248_320
    tokens = [BYTE_TO_UNICODE[b] for b in range(256)] + ["he", "ll", "hell", "hello"]
    tokens += [f"w{i}" for i in range(n_bpe - len(tokens))]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|special_{i}|>" for i in range(n_special - 5)] \
        + ["<think>", "</think>"]
    types = [TOKEN_TYPE_NORMAL] * n_bpe + [TOKEN_TYPE_CONTROL] * n_special
    tokens += specials
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_total)]
    types += [TOKEN_TYPE_UNUSED] * (n_total - len(types))
    t0 = time.perf_counter()
    tok = Tokenizer(tokens, types, ["h e", "l l", "he ll", "hell o"], bos_id=None, eos_id=248_046,
                    pad_id=248_044, pre="qwen35")
    assert time.perf_counter() - t0 < 60   # generous bound: a hang, not a speed measurement
    assert tok.n_vocab == n_total
    assert tok.token_id("<think>") == 248_075 and tok.token_id("</think>") == 248_076
    ids = tok.encode("<|im_start|>hello<think>")
    assert ids == [248_045, tokens.index("hello"), 248_075]
    assert tok.decode(ids) == "<|im_start|>hello<think>"
    assert tok.decode([n_total - 1]) == ""            # an unused padding entry decodes to nothing
    assert tok.is_eog(248_046)
    with pytest.raises(TokenizerError):
        tok.decode([n_total])
