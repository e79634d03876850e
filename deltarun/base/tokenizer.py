"""GPT-2 style byte-level BPE tokenizer built from GGUF tokenizer metadata.

Qwen3-Next GGUF files carry a ``gpt2`` vocabulary with the ``qwen2`` pre-tokenizer, Qwen3.5 files
one with the ``qwen35`` pre-tokenizer (up to 248,320 entries), Kimi-Linear files Kimi-K2's
tiktoken ranks converted to merges with the ``kimi-k2`` pre-tokenizer. This module
reproduces llama.cpp's tokenization of such a vocabulary in pure Python so that prompts encode to
exactly the ids the model was trained on (checked against llama.cpp's own test vectors).

Pipeline of :meth:`Tokenizer.encode`:

1. split out special tokens (CONTROL / USER_DEFINED types) so they map to single ids;
2. split the remaining text with the file's pre-tokenizer regex (qwen2, qwen35, kimi-k2) into "words";
3. map each word's UTF-8 bytes to the printable byte-level alphabet and apply BPE merges by rank.
"""

from __future__ import annotations

import codecs
import gc
import heapq
from collections.abc import Iterable, Sequence
from typing import Any

import regex

from deltarun.base.errors import TokenizerError

# GGUF token types (gguf.TokenType), spelled out so this module does not depend on their enum.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Types matched as whole tokens in the input text (never split by BPE).
SPECIAL_TOKEN_TYPES = frozenset({TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED})
# Types whose vocabulary text is the literal text, not byte-level encoded bytes.
LITERAL_TOKEN_TYPES = frozenset({TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED})

# The code points llama.cpp's kimi-k2 splitter treats as Han (unicode.cpp, unicode_cpt_is_han):
# CJK Unified Ideographs and Extensions A-F, the Compatibility Ideographs and their Supplement, as
# whole blocks (unassigned code points included), a regex character-class body.
KIMI_K2_HAN = (
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
    "\U00020000-\U0002a6df\U0002a700-\U0002ebef\U0002f800-\U0002fa1f"
)

# Pre-tokenizer regexes, copied from llama.cpp (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_QWEN2 / _QWEN35).
PRE_TOKENIZER_PATTERNS: dict[str, str] = {
    "qwen2": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
        r"|[^\r\n\p{L}\p{N}]?\p{L}+"
        r"|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+"
        r"|\s+(?!\S)"
        r"|\s+"
    ),
    # LLAMA_VOCAB_PRE_TYPE_QWEN35 (Qwen3.5): letter runs also take combining marks (\p{M}), so a
    # decomposed accent stays in its word. Like llama.cpp, no NFC normalisation first.
    "qwen35": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
        r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
        r"|\p{N}"
        r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+"
        r"|\s+(?!\S)"
        r"|\s+"
    ),
    # LLAMA_VOCAB_PRE_TYPE_KIMI_K2 (Kimi-K2, Kimi-Linear): what llama.cpp's hand-written splitter
    # (unicode.cpp, unicode_regex_split_custom_kimi_k2) does, which is not quite the tiktoken pattern
    # it cites: Han runs (llama.cpp's own code point ranges, KIMI_K2_HAN) first; then any other
    # letters as one run with one optional leading non-letter/non-digit and an optional contraction
    # ('s 't 'm 'd 're 've 'll, either case) -- no split at a lower->upper case change and no \p{M}
    # in the run, where the tiktoken regex has both; digits in threes; the rest as qwen2.
    "kimi-k2": (
        rf"[{KIMI_K2_HAN}]+"
        rf"|[^\r\n\p{{L}}\p{{N}}]?[^\P{{L}}{KIMI_K2_HAN}]+(?:'[sStTmMdD]|'[rR][eE]|'[vV][eE]|'[lL][lL])?"
        r"|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+"
        r"|\s+(?!\S)"
        r"|\s+"
    ),
}

# Texts of end-of-generation tokens that chat models emit even when metadata omits them, as
# llama.cpp's vocabulary loader lists them (Qwen's, and Kimi-K2's [EOT] / [EOS]), with Qwen's FIM
# pad, repo and file-separator tokens (a fill-in-the-middle answer ends with one when the model
# moves past the hole; llama.cpp ends generation there too).
EOG_TOKEN_TEXTS = ("<|im_end|>", "<|endoftext|>", "[EOT]", "[EOS]", "<|fim_pad|>", "<|repo_name|>", "<|fim_repo|>",
                   "<|file_sep|>")

# Cap on cached BPE results so pathological inputs (many unique words) cannot grow memory forever.
_BPE_CACHE_LIMIT = 200_000
# Texts between special tokens at least this long keep their ids (`Tokenizer._fragments`), up to
# _FRAGMENT_CACHE_CHARS characters in all: a chat server renders and tokenizes each conversation's
# whole history again every turn (an 8,300-token agent prompt: 3.2 ms a request in pre-tokenizing
# and word lookups), and all but the last messages come back unchanged.
_FRAGMENT_CACHE_MIN = 256
_FRAGMENT_CACHE_CHARS = 8_000_000

_SURROGATES = regex.compile(r"[\ud800-\udfff]")


def bytes_to_unicode() -> dict[int, str]:
    """Return GPT-2's byte -> printable character table.

    Byte-level BPE vocabularies store tokens as strings over this 256-character alphabet so that
    every byte sequence (not only valid UTF-8) is representable and no token contains whitespace
    or control characters.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE: dict[int, str] = bytes_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_UNICODE.items()}


def _to_byte_level(word: str) -> str:
    """Spell a text word in the byte-level alphabet the vocabulary uses.

    Decoding as latin-1 maps each byte to the code point of the same value, so one C-level
    ``str.translate`` does the whole byte -> character mapping.
    """
    return word.encode("utf-8").decode("latin-1").translate(BYTE_TO_UNICODE)


def _from_byte_level(text: str) -> bytes:
    """Invert :func:`_to_byte_level`; characters outside the alphabet fall back to their UTF-8."""
    out = bytearray()
    for ch in text:
        b = UNICODE_TO_BYTE.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


class Tokenizer:
    """Byte-level BPE tokenizer equivalent to llama.cpp's for ``gpt2``/``qwen2`` vocabularies.

    Construct it with :meth:`from_gguf` for a model file, or directly from lists when no file
    exists (tests, the synthetic model generator).
    """

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int],
        merges: Sequence[str],
        bos_id: int | None,
        eos_id: int | None,
        eot_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
        pre: str = "qwen2",
    ) -> None:
        """Build lookup tables and validate them: a broken vocabulary fails here, not mid-prompt."""
        self._tokens: list[str] = list(tokens)
        self._types: list[int] = [int(t) for t in token_types]
        _check_token_lists(self._tokens, self._types)
        self._token_to_id: dict[str, int] = _index_tokens(self._tokens)
        _check_byte_tokens(self._token_to_id)
        self._merge_ranks: dict[tuple[str, str], int] = _rank_merges(merges, self._token_to_id)
        self._pre_regex = _compile_pre_tokenizer(pre)
        self.pre = pre
        self.bos_id = self._check_id(bos_id, "bos")
        self.eos_id = self._check_id(eos_id, "eos")
        self.eot_id = self._check_id(eot_id, "eot")
        self.pad_id = self._check_id(pad_id, "padding")
        self.add_bos = bool(add_bos)
        self._special_ids: dict[str, int] = _index_specials(self._tokens, self._types)
        self._special_regex = self._compile_special_regex()
        self._eog_ids: frozenset[int] = self._collect_eog_ids()
        self._bpe_cache: dict[str, tuple[int, ...]] = {}
        self._fragments: dict[str, tuple[int, ...]] = {}
        self._fragment_chars = 0

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_gguf(cls, reader: Any) -> Tokenizer:
        """Build the tokenizer from a ``gguf.GGUFReader``'s ``tokenizer.ggml.*`` metadata.

        Only ``gpt2`` (byte-level BPE) vocabularies are supported because that is what Qwen3-Next
        files carry; anything else raises :class:`TokenizerError` rather than mis-tokenizing.
        """
        # ~450k small objects for a 151k vocabulary: pause the cyclic GC, which would otherwise
        # rescan them over and over while they are being created (none of them form cycles)
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return cls._from_gguf_fields(reader.fields)
        finally:
            if gc_was_enabled:
                gc.enable()

    @classmethod
    def _from_gguf_fields(cls, fields: Any) -> Tokenizer:
        model = _field_value(fields, "tokenizer.ggml.model", required=True)
        if model != "gpt2":
            raise TokenizerError(
                f"unsupported tokenizer model {model!r}: only 'gpt2' (byte-level BPE) is supported"
            )
        tokens = _field_value(fields, "tokenizer.ggml.tokens", required=True)
        pre = _field_value(fields, "tokenizer.ggml.pre") or "qwen2"
        # llama.cpp loads a kimi-k2 vocabulary without merges (then BPE never merges: bytes only)
        merges = _field_value(fields, "tokenizer.ggml.merges", required=pre != "kimi-k2") or []
        types = _field_value(fields, "tokenizer.ggml.token_type")
        if types is None:  # llama.cpp treats a missing type array as all-normal tokens
            types = [TOKEN_TYPE_NORMAL] * len(tokens)
        return cls(
            tokens=tokens,
            token_types=types,
            merges=merges,
            bos_id=_field_value(fields, "tokenizer.ggml.bos_token_id"),
            eos_id=_field_value(fields, "tokenizer.ggml.eos_token_id"),
            eot_id=_field_value(fields, "tokenizer.ggml.eot_token_id"),
            pad_id=_field_value(fields, "tokenizer.ggml.padding_token_id"),
            add_bos=bool(_field_value(fields, "tokenizer.ggml.add_bos_token") or False),
            pre=pre,
        )

    def _check_id(self, token_id: int | None, what: str) -> int | None:
        """Reject special ids outside the vocabulary: they would crash decoding much later."""
        if token_id is None:
            return None
        token_id = int(token_id)
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(
                f"{what} token id {token_id} is outside the vocabulary (size {len(self._tokens)})"
            )
        return token_id

    def _compile_special_regex(self) -> regex.Pattern[str] | None:
        """One alternation of all special token texts, longest first, so the longest one wins."""
        if not self._special_ids:
            return None
        specials = sorted(self._special_ids, key=lambda t: (-len(t), t))
        return regex.compile("(" + "|".join(regex.escape(t) for t in specials) + ")")

    def _collect_eog_ids(self) -> frozenset[int]:
        """End-of-generation ids: eos, eot and the Qwen end markers when the vocab has them."""
        ids = {i for i in (self.eos_id, self.eot_id) if i is not None}
        ids.update(i for i in map(self._token_to_id.get, EOG_TOKEN_TEXTS) if i is not None)
        return frozenset(ids)

    # ----------------------------------------------------------------- properties / lookups

    @property
    def n_vocab(self) -> int:
        """Number of token ids (the model's embedding rows)."""
        return len(self._tokens)

    def token_id(self, text: str) -> int | None:
        """Id of the vocabulary entry spelled ``text`` (normal tokens use byte-level spelling)."""
        return self._token_to_id.get(text)

    def token_text(self, token_id: int) -> str:
        """The raw vocabulary string of ``token_id`` (as stored in the GGUF)."""
        return self._tokens[self._valid_id(token_id)]

    def token_type(self, token_id: int) -> int:
        """The GGUF token type of ``token_id``."""
        return self._types[self._valid_id(token_id)]

    @property
    def eog_ids(self) -> frozenset[int]:
        """The ids of the tokens that end generation (see `is_eog`)."""
        return self._eog_ids

    def is_eog(self, token_id: int) -> bool:
        """True for tokens that end generation (eos, eot, ``<|im_end|>``, ``<|endoftext|>``)."""
        return token_id in self._eog_ids

    def _valid_id(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(
                f"token id {token_id} is outside the vocabulary (size {self.n_vocab})"
            )
        return token_id

    # ----------------------------------------------------------------- encoding

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Tokenize ``text``.

        ``add_special`` prepends bos when the vocabulary asks for it (Qwen files do not).
        ``parse_special`` turns special-token texts such as ``<|im_start|>`` into their single ids;
        switch it off for untrusted text that must never inject control tokens.
        """
        text = _replace_surrogates(text)
        ids: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            ids.append(self.bos_id)
        for fragment, is_special in self._split_special(text, parse_special):
            if is_special:
                ids.append(self._special_ids[fragment])
            elif len(fragment) < _FRAGMENT_CACHE_MIN:
                self._encode_ordinary(fragment, ids)
            else:
                ids.extend(self._encode_fragment(fragment))
        return ids

    def _encode_fragment(self, text: str) -> tuple[int, ...]:
        """The ids of a long text between special tokens, remembered (a text always tokenizes
        alike); the memory is dropped whole when full, as the BPE word cache is."""
        ids = self._fragments.get(text)
        if ids is None:
            out: list[int] = []
            self._encode_ordinary(text, out)
            ids = tuple(out)
            if self._fragment_chars + len(text) > _FRAGMENT_CACHE_CHARS:
                self._fragments.clear()
                self._fragment_chars = 0
            self._fragments[text] = ids
            self._fragment_chars += len(text)
        return ids

    def _split_special(self, text: str, parse_special: bool) -> Iterable[tuple[str, bool]]:
        """Yield (fragment, is_special) pieces; the capture group keeps specials in the split."""
        if not parse_special or self._special_regex is None:
            yield text, False
            return
        for index, piece in enumerate(self._special_regex.split(text)):
            if piece:
                yield piece, index % 2 == 1

    def _encode_ordinary(self, text: str, out: list[int]) -> None:
        """Pre-tokenize plain text and append the BPE ids of each word to ``out``."""
        cache = self._bpe_cache
        for word in self._pre_regex.findall(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe_word(word)
                if len(cache) >= _BPE_CACHE_LIMIT:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        """BPE-merge one pre-tokenized word; pieces missing from the vocab fall back to bytes."""
        ids: list[int] = []
        for piece in self._bpe_merge(_to_byte_level(word)):
            token_id = self._token_to_id.get(piece)
            if token_id is None:
                ids.extend(self._token_to_id[ch] for ch in piece)
            else:
                ids.append(token_id)
        return tuple(ids)

    def _bpe_merge(self, word: str) -> list[str]:
        """Apply merges like llama.cpp: always the lowest-ranked adjacent pair, leftmost on ties.

        Uses a heap of candidate pairs over a linked list of symbols, O(n log n) per word, so a
        long word without spaces (base64, minified code) does not take quadratic time.
        """
        symbols = list(word)
        n = len(symbols)
        if n < 2:
            return symbols
        ranks = self._merge_ranks
        next_of = list(range(1, n + 1))
        next_of[-1] = -1
        prev_of = list(range(-1, n - 1))
        heap: list[tuple[int, int, str, str]] = []

        def push(left: int, right: int) -> None:
            rank = ranks.get((symbols[left], symbols[right]))
            if rank is not None:
                heapq.heappush(heap, (rank, left, symbols[left], symbols[right]))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, left_text, right_text = heapq.heappop(heap)
            right = next_of[left]
            # Symbols only ever grow, so unchanged texts mean the pair is still current.
            if right == -1 or symbols[left] != left_text or symbols[right] != right_text:
                continue
            symbols[left] = left_text + right_text
            symbols[right] = ""
            after = next_of[right]
            next_of[left] = after
            if after != -1:
                prev_of[after] = left
                push(left, after)
            if prev_of[left] != -1:
                push(prev_of[left], left)
        return [s for s in symbols if s]

    # ----------------------------------------------------------------- decoding

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for; special tokens render as their literal text."""
        token_type = self._types[self._valid_id(token_id)]
        text = self._tokens[token_id]
        if token_type in LITERAL_TOKEN_TYPES:
            return text.encode("utf-8")
        if token_type == TOKEN_TYPE_UNUSED:
            return b""
        return _from_byte_level(text)

    def decode(self, ids: Iterable[int]) -> str:
        """Join the tokens' bytes and decode them as UTF-8, replacing invalid sequences."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


class StreamDecoder:
    """Turn a stream of token ids into text, holding back characters split across tokens.

    A byte-level token can end in the middle of a multi-byte UTF-8 character; printing it at once
    would show a replacement character, so incomplete trailing bytes wait for the next token.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the characters it completed that were not returned yet."""
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Return what is still held back (an incomplete sequence becomes U+FFFD) and reset."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


# --------------------------------------------------------------------- helpers


def _replace_surrogates(text: str) -> str:
    """Lone surrogates cannot be UTF-8 encoded; map them to U+FFFD like llama.cpp does bad input."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATES.sub("\ufffd", text)
    return text


def _check_token_lists(tokens: list[str], types: list[int]) -> None:
    if not tokens:
        raise TokenizerError("the vocabulary is empty")
    if len(tokens) != len(types):
        raise TokenizerError(
            f"vocabulary has {len(tokens)} tokens but {len(types)} token types; they must match"
        )


def _index_tokens(tokens: list[str]) -> dict[str, int]:
    """Map token text -> id; on duplicates the first id wins (as in llama.cpp's token_to_id)."""
    index = dict(zip(tokens, range(len(tokens))))   # fast path, right when no text repeats
    if len(index) == len(tokens):
        return index
    index = {}
    for token_id, text in enumerate(tokens):
        index.setdefault(text, token_id)
    return index


def _index_specials(tokens: list[str], types: list[int]) -> dict[str, int]:
    """Map the text of each CONTROL / USER_DEFINED token to its id (first id on duplicates)."""
    index: dict[str, int] = {}
    for token_id, (text, token_type) in enumerate(zip(tokens, types)):
        if token_type in SPECIAL_TOKEN_TYPES and text:
            index.setdefault(text, token_id)
    return index


def _check_byte_tokens(token_to_id: dict[str, int]) -> None:
    """Byte-level BPE needs one token per byte: the fallback for pieces missing from the vocab."""
    missing = [b for b, ch in BYTE_TO_UNICODE.items() if ch not in token_to_id]
    if missing:
        shown = ", ".join(f"0x{b:02x}" for b in missing[:8])
        raise TokenizerError(
            f"vocabulary lacks byte-level tokens for {len(missing)} byte values ({shown}...); "
            "it is not a byte-level BPE vocabulary"
        )


def _rank_merges(merges: Sequence[str], token_to_id: dict[str, int]) -> dict[tuple[str, str], int]:
    """Parse ``"left right"`` merge lines into a pair -> rank table, checking every name exists."""
    # Fast path (a 151k-merge vocabulary in a fraction of the loop's time): bulk checks with sets;
    # anything unusual (a bad line, an unknown name, a repeated pair) takes the loop below, which
    # gives the same table and the precise error.
    lines: list[str] = []
    flat: list[str] = []
    try:
        lines = list(merges)
        flat = "\n".join(lines).replace("\n", " ").split(" ")
    except TypeError:   # not all strings: the loop reports it
        pass
    if lines and len(flat) == 2 * len(lines):
        lefts, rights = flat[0::2], flat[1::2]
        # every line is exactly `left right` (neither part holds a space or a newline) ...
        if list(map(" ".join, zip(lefts, rights))) == lines:
            names = set(lefts)
            names.update(rights)
            names.update(map(str.__add__, lefts, rights))
            # ... no part is empty, every name is a token, and no pair repeats
            if "" not in names and not names.difference(token_to_id):
                fast = dict(zip(zip(lefts, rights), range(len(lines))))
                if len(fast) == len(lines):
                    return fast
    return _rank_merges_loop(merges, token_to_id)


def _rank_merges_loop(merges: Sequence[str], token_to_id: dict[str, int]) -> dict[tuple[str, str], int]:
    """The line-by-line parse: the reference for the bulk path, and the one that names a bad line."""
    ranks: dict[tuple[str, str], int] = {}
    for rank, line in enumerate(merges):
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise TokenizerError(f"merge #{rank} {line!r} is not two tokens separated by one space")
        left, right = parts
        for name in (left, right, left + right):
            if name not in token_to_id:
                raise TokenizerError(
                    f"merge #{rank} {line!r} refers to token {name!r}, "
                    "which is not in the vocabulary"
                )
        ranks.setdefault((left, right), rank)
    return ranks


def _compile_pre_tokenizer(pre: str) -> regex.Pattern[str]:
    pattern = PRE_TOKENIZER_PATTERNS.get(pre)
    if pattern is None:
        known = ", ".join(sorted(PRE_TOKENIZER_PATTERNS))
        raise TokenizerError(f"unsupported pre-tokenizer {pre!r} (supported: {known})")
    return regex.compile(pattern)


def _field_value(fields: dict[str, Any], key: str, required: bool = False) -> Any:
    """Read one GGUF metadata value (scalar, string or array) as plain Python data."""
    field = fields.get(key)
    if field is None:
        if required:
            raise TokenizerError(
                f"the model file has no {key!r} metadata; cannot build the tokenizer"
            )
        return None
    from deltarun.base.fast_gguf import array_values  # contents(), without per-item arrays

    try:
        return array_values(field)
    except Exception as exc:  # a malformed field must surface as a tokenizer problem
        raise TokenizerError(f"cannot read metadata {key!r}: {exc}") from exc
