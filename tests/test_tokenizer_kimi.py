"""The `kimi-k2` pre-tokenizer and vocabulary layout (Kimi-K2, Kimi-Linear; issue 32).

llama.cpp splits kimi-k2 text with a hand-written function (unicode.cpp,
`unicode_regex_split_custom_kimi_k2`, llama-cpp-python 0.3.36); deltarun with one regex
(`PRE_TOKENIZER_PATTERNS["kimi-k2"]`). `llamacpp_kimi_k2_split` below is that C++ function
transcribed line by line onto Python's unicodedata (is_letter = category L*, is_number = N*,
llama.cpp's whitespace set, its Han ranges), so the regex is checked against the algorithm
itself here, without llama.cpp; tests/test_llamacpp.py checks it against llama.cpp's build.
"""

from __future__ import annotations

import unicodedata

import gguf
import pytest
import regex

from deltarun.base.tokenizer import PRE_TOKENIZER_PATTERNS, TOKEN_TYPE_CONTROL, Tokenizer
from deltarun.model_files import kimi_linear as kl
from deltarun.model_files.vocab import KIMI_K2_SPECIALS, kimi_k2_vocab, tiny_kimi_k2_vocab, tiny_vocab
from llamacpp import random_texts

# unicode-data.cpp unicode_set_whitespace
LLAMA_WHITESPACE = {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                    0x202F, 0x205F, 0x3000}
HAN_RANGES = [(0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
              (0x2B820, 0x2CEAF), (0x2CEB0, 0x2EBEF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)]   # unicode_cpt_is_han


def is_han(c: int | None) -> bool:
    return c is not None and any(a <= c <= b for a, b in HAN_RANGES)


def llamacpp_kimi_k2_split(text: str) -> list[str]:
    """unicode_regex_split_custom_kimi_k2 for one offset span (the whole text)."""
    cpts = [ord(ch) for ch in text]
    end = len(cpts)

    def cpt(pos):
        return cpts[pos] if 0 <= pos < end else None

    def cat(pos):
        return unicodedata.category(chr(cpts[pos]))[0] if 0 <= pos < end else ""

    def letter(pos):
        return cat(pos) == "L"

    def number(pos):
        return cat(pos) == "N"

    def space(pos):
        return cpt(pos) in LLAMA_WHITESPACE

    words, prev = [], 0

    def add(upto):
        nonlocal prev
        if upto > prev:
            words.append(text[prev:upto])
        prev = upto

    pos = 0
    while pos < end:
        c = cpt(pos)
        if is_han(c):                                                              # Pattern 1
            while is_han(cpt(pos)):
                pos += 1
            add(pos)
            continue
        lead = not (c in (13, 10) or letter(pos) or number(pos))
        if (letter(pos) and not is_han(c)) or (lead and letter(pos + 1) and not is_han(cpt(pos + 1))):   # 2 & 3
            if lead:
                pos += 1
            while letter(pos) and not is_han(cpt(pos)):
                pos += 1
            if cpt(pos) == ord("'") and pos + 1 < end:
                nxt = chr(cpt(pos + 1)).lower()
                if nxt in "stmd":
                    pos += 2
                elif pos + 2 < end and nxt + chr(cpt(pos + 2)).lower() in ("re", "ve", "ll"):
                    pos += 3
            add(pos)
            continue
        if number(pos):                                                            # Pattern 4
            start = pos
            while number(pos):
                pos += 1
                if pos - start >= 3:
                    add(pos)
                    start = pos
            add(pos)
            continue
        p2 = pos + 1 if c == 0x20 else pos                                          # Pattern 5
        if p2 < end and not (space(p2) or letter(p2) or number(p2)):
            pos = p2
            while pos < end and not (space(pos) or letter(pos) or number(pos)):
                pos += 1
            while cpt(pos) in (13, 10):
                pos += 1
            add(pos)
            continue
        n_space, last_nl = 0, 0
        while space(pos + n_space):
            if cpt(pos + n_space) in (13, 10):
                last_nl = pos + n_space + 1
            n_space += 1
        if last_nl > 0:                                                            # Pattern 6
            pos = last_nl
        elif n_space > 1 and cpt(pos + n_space) is not None:                       # Pattern 7
            pos += n_space - 1
        elif n_space > 0:                                                          # Pattern 8
            pos += n_space
        else:
            pos += 1
        add(pos)
    return words


KIMI_K2 = regex.compile(PRE_TOKENIZER_PATTERNS["kimi-k2"])


def split(text: str) -> list[str]:
    return KIMI_K2.findall(text)


@pytest.mark.parametrize("text, words", [
    ("Hello World's", ["Hello", " World's"]),
    ("HelloWorld", ["HelloWorld"]),                       # the tiktoken regex splits Hello|World
    ("abc我想def", ["abc", "我想", "def"]),                # Han runs apart from other letters
    (" 我想", [" ", "我想"]),                             # no leading space for a Han run
    ("々々x", ["々々x"]),                                  # 々 is a letter outside llama.cpp's Han ranges
    ("DON'T we'LL 'sup", ["DON'T", " we'LL", " '", "sup"]),
    ("1234567", ["123", "456", "7"]),
    ("e\u0301t\u00e9", ["e", "\u0301t\u00e9"]),           # a combining mark leads the next word
    ("x  \n\n  y", ["x", "  \n\n", " ", " y"]),
    ("((x ", ["((", "x", " "]),
])
def test_kimi_k2_split_examples(text, words):
    assert split(text) == words
    assert llamacpp_kimi_k2_split(text) == words


def test_kimi_k2_regex_equals_llamacpp_algorithm_on_random_text():
    texts = random_texts(3000, seed=7)
    bad = [t for t in texts if split(t) != llamacpp_kimi_k2_split(t)]
    assert not bad, [(t, split(t), llamacpp_kimi_k2_split(t)) for t in bad[:3]]


def test_converter_layout_from_tiktoken_ranks():
    """Token i is rank i's bytes; a merge for each multi-byte token whose BPE below its rank ends in
    two parts, in rank order; the 256 specials (CONTROL) after the ranks at Kimi-K2's offsets."""
    ranks = {bytes([b]): b for b in range(256)}
    for word in (b"ab", b"abc", b"cd", b"abcd", b"xyz"):   # xyz: no two-part split below its rank
        ranks[word] = len(ranks)
    v = kimi_k2_vocab(ranks)
    assert v.n_vocab == 261 + 256 and v.tokens[256:261] == ("ab", "abc", "cd", "abcd", "xyz")
    assert v.merges == ("a b", "ab c", "c d", "abc d")
    assert v.tokens[261 + 9] == "[EOT]" and v.tokens[261 + 100] == f"<|reserved_token_{261 + 100}|>"
    assert set(v.token_types[261:]) == {TOKEN_TYPE_CONTROL}
    assert (v.tokens[v.bos_id], v.tokens[v.eos_id], v.tokens[v.pad_id]) == ("[BOS]", "[EOS]", "[PAD]")
    tok = v.tokenizer()
    assert tok.encode("abcd abc") == [259, 0x20, 257]
    assert tok.encode("<|im_end|>[EOS]") == [261 + 2, 261 + 1]
    assert tok.is_eog(261 + 1) and tok.is_eog(261 + 9) and tok.is_eog(261 + 2)


def test_tiny_vocabulary_is_the_tiny_bpe_cut_relabelled():
    """The packaged tiny vocabulary is a consistent BPE cut, so the converter's rule recovers its
    merges exactly from the ranks alone."""
    v, tiny = tiny_kimi_k2_vocab(), tiny_vocab()
    assert v.merges == tiny.merges
    assert v.tokens[:2304] == tiny.tokens[:2304]
    assert {v.tokens[2304 + i] for i in KIMI_K2_SPECIALS} == set(KIMI_K2_SPECIALS.values())


def test_a_kimi_linear_file_carries_the_vocabulary(tmp_path):
    path = kl.write_model(tmp_path / "k2.gguf", "tiny-kimi-linear-k2vocab")
    tok = Tokenizer.from_gguf(gguf.GGUFReader(str(path)))
    assert tok.pre == "kimi-k2" and tok.n_vocab == 2560
    assert tok.encode("Hello World<|im_end|>") == tiny_kimi_k2_vocab().tokenizer().encode("Hello World<|im_end|>")


def test_kimi_k2_file_without_merges_tokenizes_to_bytes(tmp_path):
    """llama.cpp loads a kimi-k2 vocabulary without merges (other pre-tokenizers need them)."""
    from test_loader_errors import rewrite

    path = kl.write_model(tmp_path / "k2.gguf", "tiny-kimi-linear-k2vocab")
    bare = tmp_path / "bare.gguf"
    rewrite(path, bare, drop_keys=("tokenizer.ggml.merges",))
    tok = Tokenizer.from_gguf(gguf.GGUFReader(str(bare)))
    assert tok.decode(tok.encode("Hello")) == "Hello" and len(tok.encode("Hello")) == 5
