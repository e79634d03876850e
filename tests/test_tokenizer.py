"""Tokenizer tests: llama.cpp's qwen2 test vectors, round trips, streaming, errors, tiny vocab."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarun.base.errors import TokenizerError
from deltarun.base.tokenizer import (
    BYTE_TO_UNICODE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_USER_DEFINED,
    StreamDecoder,
    Tokenizer,
)
from deltarun.model_files import make_tiny_vocab
from deltarun.model_files.vocab import tiny_vocab

from shipped_data import VOCAB_INPUTS, VOCAB_OUTPUTS, qwen2_vocab_gguf

TEST_SEPARATOR = "\n__ggml_vocab_test__\n"


def load_vectors() -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 cases: each input block ends with "\\n" + separator line."""
    inputs = VOCAB_INPUTS.read_bytes().decode("utf-8")
    outputs = VOCAB_OUTPUTS.read_bytes().decode("utf-8")
    texts = inputs.split(TEST_SEPARATOR)
    lines = outputs.split("\n")
    # Both files end with a terminator, leaving one empty trailing piece each.
    assert texts[-1] == "" and lines[-1] == ""
    texts, lines = texts[:-1], lines[:-1]
    assert len(texts) == len(lines), "inputs and expected outputs disagree in count"
    return [(t, [int(v) for v in line.split()]) for t, line in zip(texts, lines)]


VECTORS = load_vectors()


@pytest.fixture(scope="module")
def real_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(qwen2_vocab_gguf())


@pytest.fixture(scope="module")
def real(real_reader: gguf.GGUFReader) -> Tokenizer:
    return Tokenizer.from_gguf(real_reader)


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return tiny_vocab().tokenizer()


def byte_tokens() -> list[str]:
    return [BYTE_TO_UNICODE[b] for b in range(256)]


def mini_tokenizer(specials: dict[str, int] | None = None, **kwargs: Any) -> Tokenizer:
    """256 byte tokens, a few merges and the given specials: small enough to build by hand."""
    tokens = byte_tokens() + ["he", "ll", "hell", "hello"]
    merges = ["h e", "l l", "he ll", "hell o"]
    types = [TOKEN_TYPE_NORMAL] * len(tokens)
    for text, token_type in (specials or {}).items():
        tokens.append(text)
        types.append(token_type)
    kwargs.setdefault("bos_id", 0)
    kwargs.setdefault("eos_id", 0)
    return Tokenizer(tokens, types, merges, **kwargs)


# ------------------------------------------------------------------ llama.cpp test vectors


def test_vector_files_parse_to_matching_counts() -> None:
    assert len(VECTORS) == 46
    assert VECTORS[2] == ("", [])  # the empty input block


def vector_params() -> list[Any]:
    return [pytest.param(t, ids, id=f"case{i:02d}") for i, (t, ids) in enumerate(VECTORS)]


@pytest.mark.parametrize(("text", "expected"), vector_params())
def test_llama_cpp_vectors(real: Tokenizer, text: str, expected: list[int]) -> None:
    # test-tokenizer-0 tokenizes with add_special=false, parse_special=false.
    assert real.encode(text, add_special=False, parse_special=False) == expected
    assert real.encode(text) == expected  # no special-token texts in the inputs
    assert real.decode(expected) == text


def test_long_fragments_tokenize_the_same_again_and_after_the_memory_fills(real: Tokenizer, monkeypatch) -> None:
    """Texts between special tokens of 256+ characters are remembered (`Tokenizer._fragments`):
    again, among others, and after the memory was dropped when full, each gives the ids it gave
    the first time (llama.cpp's for its one long vector), also between special tokens."""
    from deltarun.base import tokenizer as tokenizer_module

    texts = ["".join(t for t, _ in VECTORS[i::5]) * 5 for i in range(5)]     # 295-2,090 characters
    assert all(len(t) >= 256 for t in texts)
    want = []
    for t in texts:                                    # the word-by-word path, nothing remembered
        ids: list[int] = []
        real._encode_ordinary(t, ids)
        want.append(ids)
    (vector, vector_ids), = [(t, ids) for t, ids in VECTORS if len(t) >= 256]
    monkeypatch.setattr(real, "_fragments", {})
    monkeypatch.setattr(real, "_fragment_chars", 0)
    monkeypatch.setattr(tokenizer_module, "_FRAGMENT_CACHE_CHARS", 2 * max(map(len, texts)))
    start, end = real.token_id("<|im_start|>"), real.token_id("<|im_end|>")
    for _ in range(3):
        assert real.encode(vector) == vector_ids
        for text, ids in zip(texts, want):
            assert real.encode(text) == ids
            assert real.encode("<|im_start|>" + text + "<|im_end|>") == [start, *ids, end]
    kept = real._fragments                            # dropped when full: not all 6 texts are held
    assert sum(map(len, kept)) == real._fragment_chars <= tokenizer_module._FRAGMENT_CACHE_CHARS and len(kept) < 6


def test_real_metadata(real: Tokenizer) -> None:
    assert real.n_vocab == 151936
    assert real.bos_id == real.eos_id == real.pad_id == 151643
    assert real.eot_id is None
    assert real.add_bos is False
    assert real.pre == "qwen2"
    assert real.token_id("<|im_end|>") == 151645
    assert real.token_id("Hello") == 9707
    assert real.token_id("no such token") is None


def test_real_special_tokens(real: Tokenizer) -> None:
    text = "<|im_start|>user\nhello<|im_end|>"
    ids = real.encode(text)
    assert ids == [151644, 872, 198, 14990, 151645]
    assert real.decode(ids) == text
    literal = real.encode(text, parse_special=False)
    assert 151644 not in literal and 151645 not in literal
    assert real.decode(literal) == text


def test_real_eog(real: Tokenizer) -> None:
    assert real.is_eog(151643)  # <|endoftext|> = eos
    assert real.is_eog(151645)  # <|im_end|>
    assert not real.is_eog(151644)
    assert not real.is_eog(9707)


TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=120)


NO_FIXTURE_CHECK = [HealthCheck.function_scoped_fixture]
PIECES = st.sampled_from(["<|im_start|>", "<|im_end|>", " \n\t", "é🦙"])


@settings(max_examples=150, deadline=None, suppress_health_check=NO_FIXTURE_CHECK)
@given(pieces=st.lists(st.one_of(TEXT, PIECES)))
def test_real_round_trip(real: Tokenizer, pieces: list[str]) -> None:
    text = "".join(pieces)
    assert real.decode(real.encode(text)) == text
    assert real.decode(real.encode(text, parse_special=False)) == text


# ------------------------------------------------------------------ encode options and lookups


def test_add_special_prepends_bos_only_when_vocab_asks() -> None:
    assert mini_tokenizer(bos_id=7, add_bos=True).encode("hello", add_special=True) == [7, 259]
    assert mini_tokenizer(bos_id=7, add_bos=True).encode("hello") == [259]
    assert mini_tokenizer(bos_id=7, add_bos=False).encode("hello", add_special=True) == [259]


def test_longest_special_token_wins() -> None:
    tok = mini_tokenizer({"<a>": TOKEN_TYPE_CONTROL, "<a><b>": TOKEN_TYPE_USER_DEFINED})
    short_id, long_id = tok.token_id("<a>"), tok.token_id("<a><b>")
    assert tok.encode("x<a><b>y<a>") == [tok.token_id("x"), long_id, tok.token_id("y"), short_id]
    assert short_id not in tok.encode("<a>", parse_special=False)


def test_special_token_wins_over_same_normal_text() -> None:
    tok = mini_tokenizer({"he": TOKEN_TYPE_CONTROL})
    assert tok.token_id("he") == 256  # plain lookup: the first (normal) entry
    assert tok.encode("he") == [tok.n_vocab - 1]
    assert tok.encode("he", parse_special=False) == [256]


def test_lone_surrogates_become_replacement_characters() -> None:
    tok = mini_tokenizer()
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"


def test_a_merge_listed_twice_keeps_its_first_rank() -> None:
    """llama.cpp ranks a pair by its first line (later repeats add nothing). "a b" is rank 0 and
    again rank 2, "b c" rank 1: "abc" merges a+b first, and no merge joins "ab" and "c"; with
    "a b" at rank 2, b+c would go first instead."""
    tokens = byte_tokens() + ["ab", "bc"]
    for merges in (["a b", "b c", "a b"], ["a b", "b c", "a b", "a b"]):
        tok = Tokenizer(tokens, [TOKEN_TYPE_NORMAL] * len(tokens), merges, bos_id=0, eos_id=0)
        assert tok.encode("abc") == [256, tokens.index("c")]
        assert tok.encode("bcab") == [257, 256]
    # without the repeat, the same ranks
    tok = Tokenizer(tokens, [TOKEN_TYPE_NORMAL] * len(tokens), ["a b", "b c"], bos_id=0, eos_id=0)
    assert tok.encode("abc") == [256, tokens.index("c")]


def test_long_word_is_not_quadratic() -> None:
    tok = mini_tokenizer()
    assert tok.encode("hello" * 20000) == [259] * 20000


def test_token_bytes_renders_specials_as_text() -> None:
    tok = mini_tokenizer({"<|im_end|>": TOKEN_TYPE_CONTROL})
    assert tok.token_bytes(tok.token_id("<|im_end|>")) == b"<|im_end|>"
    assert tok.token_bytes(tok.token_id("Ġ")) == b" "
    assert tok.is_eog(tok.token_id("<|im_end|>"))


# ------------------------------------------------------------------ streaming


def test_stream_decoder_holds_back_split_character() -> None:
    tok = mini_tokenizer()
    e_acute = "é".encode()  # two bytes, two byte-level tokens
    stream = StreamDecoder(tok)
    assert stream.push(tok.token_id(BYTE_TO_UNICODE[e_acute[0]])) == ""
    assert stream.push(tok.token_id(BYTE_TO_UNICODE[e_acute[1]])) == "é"
    assert stream.flush() == ""


def test_stream_decoder_flush_replaces_incomplete_tail() -> None:
    tok = mini_tokenizer()
    stream = StreamDecoder(tok)
    assert stream.push(tok.token_id("h")) == "h"
    assert stream.push(tok.token_id(BYTE_TO_UNICODE[0xF0])) == ""
    assert stream.flush() == "\ufffd"
    assert stream.push(tok.token_id("h")) == "h"  # usable again after flush


def test_stream_decoder_matches_decode_on_real_emoji(real: Tokenizer) -> None:
    text = " this is 🦙.cpp, Äpfel, 🚀 (normal) 😶‍🌫️"
    ids = real.encode(text)
    assert ids[2:5] == [11162, 99, 247]  # the llama emoji is split over three tokens
    stream = StreamDecoder(real)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


# ------------------------------------------------------------------ validation errors


@dataclass
class FakeField:
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass
class FakeReader:
    fields: dict[str, FakeField]


def fake_reader(**overrides: Any) -> FakeReader:
    tokens = byte_tokens() + ["he"]
    values: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [TOKEN_TYPE_NORMAL] * len(tokens),
        "tokenizer.ggml.merges": ["h e"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    values.update(overrides)
    return FakeReader({k: FakeField(v) for k, v in values.items() if v is not None})


def test_from_gguf_fake_reader_ok() -> None:
    tok = Tokenizer.from_gguf(fake_reader())
    assert tok.encode("he") == [256]
    assert (tok.bos_id, tok.eos_id, tok.eot_id, tok.pad_id) == (0, 1, None, None)
    assert tok.add_bos is False


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tokenizer.ggml.model": "llama"}, "only 'gpt2'"),
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "257 tokens but 2 token types"),
        ({"tokenizer.ggml.merges": ["h x1"]}, "'x1', which is not in the vocabulary"),
        ({"tokenizer.ggml.merges": ["h e", "e h"]}, "'eh', which is not in the vocabulary"),
        ({"tokenizer.ggml.merges": ["he"]}, "not two tokens"),
        ({"tokenizer.ggml.bos_token_id": 999}, "bos token id 999 is outside"),
        ({"tokenizer.ggml.pre": "llama3"}, "unsupported pre-tokenizer 'llama3'"),
        ({"tokenizer.ggml.tokens": ["a"] * 257}, "lacks byte-level tokens"),
    ],
)
def test_from_gguf_rejects_bad_metadata(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(TokenizerError, match=message.replace("(", r"\(")):
        Tokenizer.from_gguf(fake_reader(**overrides))


def test_constructor_rejects_empty_vocab() -> None:
    with pytest.raises(TokenizerError, match="empty"):
        Tokenizer([], [], [], bos_id=None, eos_id=None)


def test_unknown_id_is_a_tokenizer_error() -> None:
    tok = mini_tokenizer()
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.n_vocab])
    with pytest.raises(TokenizerError):
        tok.token_bytes(-1)


# ------------------------------------------------------------------ tiny vocabulary


def test_tiny_vocab_shape() -> None:
    vocab = tiny_vocab()
    assert 2000 < vocab.n_vocab < 2500
    assert len(vocab.tokens) == len(vocab.token_types)
    # the 256 byte tokens first, in the real vocabulary's order (GPT-2 table order)
    assert list(vocab.tokens[:256]) == list(BYTE_TO_UNICODE.values())
    endoftext = vocab.tokens.index("<|endoftext|>")
    assert vocab.bos_id == vocab.eos_id == vocab.pad_id == endoftext
    assert vocab.add_bos is False and vocab.pre == "qwen2"
    types = dict(zip(vocab.tokens, vocab.token_types))
    assert types["<|im_start|>"] == types["<|im_end|>"] == TOKEN_TYPE_CONTROL
    assert types["<think>"] == types["</think>"] == TOKEN_TYPE_USER_DEFINED
    # specials are appended after every normal token
    first_special = min(i for i, t in enumerate(vocab.token_types) if t != TOKEN_TYPE_NORMAL)
    assert all(t != TOKEN_TYPE_NORMAL for t in vocab.token_types[first_special:])


def test_tiny_vocab_chat_markup(tiny: Tokenizer) -> None:
    text = "<|im_start|>user\nhello<|im_end|>"
    ids = tiny.encode(text)
    assert ids[0] == tiny.token_id("<|im_start|>")
    assert ids[-1] == tiny.token_id("<|im_end|>")
    assert sum(1 for i in ids if tiny.token_type(i) != TOKEN_TYPE_NORMAL) == 2
    assert tiny.decode(ids) == text
    think = tiny.encode("<think>\n\n</think>")
    assert think[0] == tiny.token_id("<think>") and think[-1] == tiny.token_id("</think>")
    assert tiny.is_eog(tiny.token_id("<|im_end|>")) and tiny.is_eog(tiny.eos_id)


@settings(max_examples=100, deadline=None, suppress_health_check=NO_FIXTURE_CHECK)
@given(text=TEXT)
def test_tiny_vocab_round_trip(tiny: Tokenizer, text: str) -> None:
    assert tiny.decode(tiny.encode(text)) == text


ASCII_SAMPLES = [
    "Hello, world! This is a plain ASCII sentence with numbers 12345 and symbols #$%.",
    "def main(argv):\n    return sum(x * 2 for x in argv)  # comment\n\n",
    "   leading spaces, trailing tabs\t\t\nI've been 'told he's there, 'RE you sure?",
]


@pytest.mark.parametrize("text", ASCII_SAMPLES)
def test_tiny_vocab_refines_real_tokenization(real: Tokenizer, tiny: Tokenizer, text: str) -> None:
    """A merge-prefix vocabulary stops BPE early: real tokens are runs of tiny tokens."""
    real_ids, tiny_ids = real.encode(text), tiny.encode(text)
    real_pieces = [real.token_bytes(i) for i in real_ids]
    tiny_pieces = [tiny.token_bytes(i) for i in tiny_ids]
    assert b"".join(tiny_pieces) == b"".join(real_pieces) == text.encode()
    assert boundaries(real_pieces) <= boundaries(tiny_pieces)
    for i in tiny_ids:  # every tiny normal token is the same string in the real vocab
        assert real.token_id(tiny.token_text(i)) is not None


def boundaries(pieces: list[bytes]) -> set[int]:
    offsets, total = set(), 0
    for piece in pieces:
        total += len(piece)
        offsets.add(total)
    return offsets


def test_tiny_vocab_json_is_up_to_date(real_reader: gguf.GGUFReader) -> None:
    """The shipped JSON equals what make_tiny_vocab.py derives from the real vocabulary."""
    fields = real_reader.fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    merges = fields["tokenizer.ggml.merges"].contents()
    vocab = tiny_vocab()
    normal, kept_merges = make_tiny_vocab.cut_normal_tokens(tokens, merges, len(vocab.merges))
    specials = make_tiny_vocab.added_tokens(tokens, types)
    assert list(vocab.tokens) == normal + [t for t, _ in specials]
    assert list(vocab.merges) == kept_merges == merges[: len(kept_merges)]


def test_tiny_vocab_through_a_gguf_file(tmp_path: Path) -> None:
    """Written with gguf.GGUFWriter and read back, the tiny vocab builds the same tokenizer."""
    vocab = tiny_vocab()
    path = tmp_path / "tiny-vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3next")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.token_types))
    writer.add_token_merges(list(vocab.merges))
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_pad_token_id(vocab.pad_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    text = "<|im_start|>assistant\n<think>\nok</think>\n\nDone. 🦙<|im_end|>"
    assert tok.encode(text) == vocab.tokenizer().encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (
        vocab.bos_id, vocab.eos_id, vocab.pad_id, False
    )


def test_tiny_vocab_json_is_small() -> None:
    path = Path(make_tiny_vocab.__file__).parent / "data" / "tiny-vocab.json"
    assert path.stat().st_size < 300_000
    assert json.loads(path.read_text("utf-8"))["tokens"][-1] == "</think>"
