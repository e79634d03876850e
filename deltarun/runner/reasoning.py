"""Where a generation stands in its think block, and a budget on the tokens spent there.

A thinking model writes `<think> ... </think>` before its answer (or the prompt already opened
the block: Qwen3.5's generation prompt ends with `<think>\\n`). Two things follow the kept tokens
through it: `ThinkingState` (inside the block or not: a lazy tool-call grammar stays off while the
model thinks, since a `<tool_call>` written there is reasoning, not a call) and `ThinkingBudget`,
llama.cpp's reasoning budget (common/reasoning-budget.cpp): after `budget` tokens inside the
block it forces the end-of-thinking marker, one token per step, then lets the model answer.

As in llama.cpp, the budget counts the tokens after the block opened, the closing tag not
included; it runs out after the token that spends it unless the text then ends inside a UTF-8
character (the marker waits for the character to complete, so the reasoning text never ends in
half a character; llama.cpp looks at the last token's bytes alone); a block the model closes itself ends the count; a new block gets a fresh
budget. The marker is the template's: what it writes between an answer's reasoning and its
content (`"\\n</think>\\n\\n"` for Qwen3 and Qwen3.5), so a forced end renders back as the
template renders the turn.

`thinking_budget` is the one way from llama.cpp's `--reasoning-budget N` (-1 no limit, 0 the
marker at once, N a budget) to a processor: `deltarun generate`, `chat` and `serve` take it.
"""

from __future__ import annotations

import copy

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkingTags:
    """The token sequences of a think block: its opening and closing tags, and the marker a budget
    forces (the closing tag as the template surrounds it)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    forced: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.start or not self.end or not self.forced:
            raise ValueError("thinking tags: the start, end and forced sequences must not be empty")

    @classmethod
    def of(cls, encode: Callable[[str], list[int]], separator: str | None) -> "ThinkingTags":
        """The tags in tokens (`encode`: text -> tokens, special tokens parsed); the marker is the
        template's `separator` between reasoning and content when it holds the closing tag
        (`ChatTemplate.reasoning_separator`), else the closing tag alone."""
        marker = separator if separator is not None and THINK_CLOSE in separator else THINK_CLOSE
        return cls(tuple(encode(THINK_OPEN)), tuple(encode(THINK_CLOSE)), tuple(encode(marker)))

    @classmethod
    def of_tokenizer(cls, tokenizer: Any, separator: str | None) -> "ThinkingTags":
        """`of` with a `base.tokenizer.Tokenizer`'s encoding (special tokens parsed, no BOS)."""
        return cls.of(lambda s: tokenizer.encode(s, add_special=False, parse_special=True), separator)


class TokenSequence:
    """Recognises one token sequence in a stream of tokens (a restart on a mismatch, as llama.cpp's
    token_matcher)."""

    def __init__(self, tokens: Sequence[int]):
        self.tokens = tuple(tokens)
        self.pos = 0

    def advance(self, token: int) -> bool:
        """True when `token` completes the sequence."""
        if token == self.tokens[self.pos]:
            self.pos += 1
            if self.pos == len(self.tokens):
                self.pos = 0
                return True
            return False
        self.pos = 1 if token == self.tokens[0] else 0
        return False

    def reset(self) -> None:
        self.pos = 0

    def fork(self) -> "TokenSequence":
        """A copy that follows tokens on its own (a speculative walk: `LogitsProcessors.fork`)."""
        return copy.copy(self)


class ThinkingState:
    """Inside the think block or not, following the kept tokens (`accept`)."""

    def __init__(self, tags: ThinkingTags, inside: bool):
        self.inside = inside
        self._start, self._end = TokenSequence(tags.start), TokenSequence(tags.end)

    def fork(self) -> "ThinkingState":
        """A copy that follows tokens on its own."""
        twin = copy.copy(self)
        twin._start, twin._end = self._start.fork(), self._end.fork()
        return twin

    def accept(self, token: int) -> bool:
        """Follow `token`; True when it opened or closed the block."""
        if self.inside and self._end.advance(token):
            self.inside = False
            self._start.reset()
            return True
        if not self.inside and self._start.advance(token):
            self.inside = True
            self._end.reset()
            return True
        return False


def ends_inside_a_character(piece: bytes) -> bool:
    """Whether `piece` ends with the first bytes of a UTF-8 character whose last bytes are missing."""
    for back in range(1, min(4, len(piece)) + 1):
        b = piece[-back]
        if b & 0xC0 == 0x80:             # a continuation byte: look further back for the lead byte
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return need > back
    return False


class ThinkingBudget:
    """At most `budget` tokens inside a think block, then the forced end marker (see the module).

    A logits processor (`sampling.LogitsProcessors.budget`): `force` leaves the logits alone
    except while the marker is being forced, when only the marker's next token remains;
    `accept` follows each kept token. `piece` gives a token's bytes (the UTF-8 check). What the
    processors before it forbid (a grammar's mask, banned ids: -inf) stays forbidden: a marker
    token they forbid is not forced, and the budget stands down for the rest of the answer.
    """

    def __init__(self, tags: ThinkingTags, budget: int, inside: bool, piece: Callable[[int], bytes]):
        if budget < 0:
            raise ValueError(f"a thinking budget of {budget} tokens; expected 0 or more")
        self.tags, self.budget, self._piece = tags, budget, piece
        self.state = ThinkingState(tags, inside)
        self.remaining = budget
        self.forcing: int | None = None       # the position in tags.forced of the next forced token
        self.n_thinking = 0                   # tokens counted inside blocks so far
        self._waiting = False                 # the budget is spent; the marker waits for a whole character
        self._tail = b""                      # the thinking text's last bytes (a character split over tokens)
        self.off = False                      # a forced token was refused: nothing more is forced
        if inside:
            self._open()

    def _open(self) -> None:
        self.remaining = self.budget
        if self.budget == 0:
            self.forcing = 0

    def force(self, logits: np.ndarray) -> np.ndarray:
        """The logits, or while forcing a row where only the marker's next token is finite (unless
        that token is forbidden already: see the class)."""
        if self.forcing is None or self.off:
            return logits
        token = self.tags.forced[self.forcing]
        value = float(logits[token])
        if not np.isfinite(value):
            return logits
        x = np.full(np.shape(logits), -np.inf, dtype=np.float32)
        x[token] = value
        return x

    def accept(self, token: int) -> None:
        """A kept token: counted inside a block, the marker moved on, a block opened or closed."""
        if self.off:
            return
        if self.forcing is not None:
            if token != self.tags.forced[self.forcing]:      # refused (see the class)
                self.off, self.forcing = True, None
                return
            self.forcing += 1
            if self.forcing == len(self.tags.forced):
                self.forcing = None
                self.state = ThinkingState(self.tags, inside=False)
            return
        was_inside = self.state.inside
        if self.state.accept(token):
            self._waiting = False
            if self.state.inside:
                self._open()
            return
        if not was_inside:
            return
        self.n_thinking += 1
        self._tail = (self._tail + self._piece(token))[-4:]
        if not self._waiting:
            self.remaining -= 1
            self._waiting = self.remaining <= 0
        if self._waiting and not ends_inside_a_character(self._tail):
            self._waiting = False
            self.forcing = 0

    def fork(self) -> "ThinkingBudget":
        """A copy that counts and forces on its own: drafted tokens are verified on one
        (`LogitsProcessors.fork`), so each verification row is forced as it would be after the
        drafts before it."""
        twin = copy.copy(self)
        twin.state = self.state.fork()
        return twin


#: llama.cpp's `--reasoning-budget` value for no limit
NO_BUDGET = -1


def check_budget(budget: int) -> int:
    """`budget` when it is a `--reasoning-budget` value (-1, 0 or more), else a ValueError."""
    if budget < NO_BUDGET:
        raise ValueError(f"a reasoning budget of {budget}; expected -1 (no limit), 0 or more tokens")
    return budget


def thinking_budget(budget: int, tags: ThinkingTags, inside: bool,
                    piece: Callable[[int], bytes]) -> ThinkingBudget | None:
    """The processor of llama.cpp's `--reasoning-budget N`: None for -1 (no limit), else a
    `ThinkingBudget` of N tokens (0: the marker as soon as a block is open); `inside`: the prompt
    opened the block."""
    return None if check_budget(budget) == NO_BUDGET else ThinkingBudget(tags, budget, inside, piece)
