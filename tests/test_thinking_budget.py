"""The thinking budget (`runner.reasoning.ThinkingBudget`, llama.cpp's reasoning budget): after N
tokens inside the think block the end-of-thinking marker is forced, then the model answers.

The state machine is checked on scripted tokens; the decode engine on the tiny model against the
float64 reference (`test_engine._reference_greedy`): with a budget of N the tokens are the reference's first N thinking tokens, the
template's marker, and the reference's greedy continuation of everything before (drafted or not);
without a budget the reference's tokens unchanged.
"""

from __future__ import annotations

import codecs

import numpy as np
import pytest
from test_engine import _reference_greedy

from deltarun.base.chat_template import ChatTemplate
from deltarun.runner.engine import Engine, Running
from deltarun.runner.model import Model
from deltarun.runner.reasoning import ThinkingBudget, ThinkingTags, ends_inside_a_character
from deltarun.runner.sampling import GREEDY, LogitsProcessors, Sampler
from deltarun.runner.speculative import Draft, DraftLength

OPEN, CLOSE, MARK = (90,), (91,), (7, 91, 8)      # scripted tags: the marker is "\n</think>\n\n"
TAGS = ThinkingTags(OPEN, CLOSE, MARK)
VOCAB = 100


def _ascii(token: int) -> bytes:
    return b"a"


def _only(row: np.ndarray) -> int | None:
    """The one finite token of a forced row (None: the row is left as it was)."""
    finite = np.flatnonzero(np.isfinite(row))
    return int(finite[0]) if finite.size == 1 else None


def _run(budget: ThinkingBudget, script: list[int]) -> list[int]:
    """Each step: the token the budget forces, else the next scripted one; the kept tokens."""
    out, it = [], iter(script)
    x = np.zeros(VOCAB, dtype=np.float32)
    while True:
        forced = _only(budget.force(x))
        t = forced if forced is not None else next(it, None)
        if t is None:
            return out
        budget.accept(t)
        out.append(t)


def test_budget_forces_the_marker_after_n_tokens_inside_the_block():
    """Opened by the prompt: N tokens, the marker, then the script goes on unforced; a block the
    model opens itself later gets a fresh budget; tokens before any block are not counted."""
    free = [10, 11, 12, 13, 14, 15]
    assert _run(ThinkingBudget(TAGS, 3, True, _ascii), free) == [10, 11, 12, *MARK, 13, 14, 15]
    assert _run(ThinkingBudget(TAGS, 0, True, _ascii), free) == [*MARK, *free]
    # not opened by the prompt: text, then the model's own <think> starts the count
    assert _run(ThinkingBudget(TAGS, 2, False, _ascii), [20, 21, *OPEN, 30, 31, 32, 33]) == \
        [20, 21, *OPEN, 30, 31, *MARK, 32, 33]
    # a second block: a fresh budget
    script = [30, 31, 32, *OPEN, 40, 41, 42]
    assert _run(ThinkingBudget(TAGS, 2, True, _ascii), script) == [30, 31, *MARK, 32, *OPEN, 40, 41, *MARK, 42]


def test_a_block_closed_in_time_is_left_alone_and_the_count_is_of_thinking_tokens():
    b = ThinkingBudget(TAGS, 3, True, _ascii)
    script = [10, 11, *CLOSE, 12, 13, 14, 15]
    assert _run(b, script) == script and b.n_thinking == 2
    b = ThinkingBudget(TAGS, 4, True, _ascii)
    _run(b, [10, 11, 12, 13, 14])
    assert b.n_thinking == 4                           # the marker's tokens are not thinking tokens


def test_the_marker_waits_for_a_whole_character():
    """A budget spent on a token that ends inside a UTF-8 character forces the marker after the
    token that completes it (the reasoning text never ends in half a character)."""
    pieces = {10: b"a", 11: "é".encode()[:1], 12: b"\xa9", 13: "€".encode()[:1], 14: "€".encode()[1:2],
              15: "€".encode()[2:], 16: b"b"}
    b = ThinkingBudget(TAGS, 2, True, pieces.__getitem__)
    assert _run(b, [10, 11, 12, 16]) == [10, 11, 12, *MARK, 16]
    b = ThinkingBudget(TAGS, 1, True, pieces.__getitem__)
    assert _run(b, [13, 14, 15, 16]) == [13, 14, 15, *MARK, 16]
    assert not ends_inside_a_character("é€".encode()) and ends_inside_a_character("€".encode()[:2])
    assert ends_inside_a_character(b"\xf0\x9f\x98") and not ends_inside_a_character(b"\x80")


def test_forced_rows_and_forks():
    """A forced row keeps only the marker's token (with its own logit, 0 where that was -inf); a
    fork (what verifies drafts) counts and forces on its own."""
    b = ThinkingBudget(TAGS, 3, True, _ascii)
    x = np.arange(VOCAB, dtype=np.float32)
    assert b.force(x) is x
    walk = b.fork()
    for t in (10, 11, 12):
        walk.accept(t)
    assert _only(walk.force(x)) == MARK[0] and b.force(x) is x and b.remaining == 3    # the original waits
    b.accept(10)
    b.accept(11)
    b.accept(12)
    row = b.force(x)
    assert _only(row) == MARK[0] and row[MARK[0]] == x[MARK[0]]
    forbidden = x.copy()
    forbidden[MARK[0]] = -np.inf                          # e.g. a grammar's mask: not forced
    assert b.force(forbidden) is forbidden
    for t in MARK:
        b.accept(t)
    assert b.forcing is None and not b.state.inside and walk.forcing == 0
    with pytest.raises(ValueError):
        ThinkingBudget(TAGS, -1, True, _ascii)
    with pytest.raises(ValueError):
        ThinkingTags((), CLOSE, MARK)


def test_a_refused_marker_stands_the_budget_down():
    """A marker token the processors before forbid (a grammar) is not forced; the token drawn instead
    turns the budget off for the rest of the answer."""
    b = ThinkingBudget(TAGS, 1, True, _ascii)
    b.accept(10)
    x = np.zeros(VOCAB, dtype=np.float32)
    x[MARK[0]] = -np.inf
    assert b.force(x) is x
    b.accept(11)
    assert b.off and b.forcing is None
    assert _run(b, [12, 13, *OPEN, 14, 15]) == [12, 13, *OPEN, 14, 15]


def test_tags_from_the_template():
    """The marker is what the template writes between reasoning and content."""
    sep = ChatTemplate.builtin().reasoning_separator()
    assert sep == "\n</think>\n\n"
    encode = {"<think>": [1], "</think>": [2], "\n</think>\n\n": [3, 2, 4]}.__getitem__
    assert ThinkingTags.of(encode, sep) == ThinkingTags((1,), (2,), (3, 2, 4))
    assert ThinkingTags.of(encode, None).forced == (2,)       # no reasoning rendered: the closing tag
    assert ThinkingTags.of(encode, "\n\n").forced == (2,)


# --------------------------------------------------------------------------------------- the tiny model
N_AFTER = 6


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    path = tiny_model_path("tiny", "f32")
    with Model(path, n_ctx=256, kv_type="f32", n_seq_max=1, rs_slots=4) as m:
        tok = m.tokenizer
        encode = lambda s: tok.encode(s, add_special=False, parse_special=True)  # noqa: E731
        tags = ThinkingTags.of(encode, ChatTemplate.builtin().reasoning_separator())
        prompt = encode("<|im_start|>user\nThink about it<|im_end|>\n<|im_start|>assistant\n<think>\n")
        yield m, tags, prompt, path


class _Oracle:
    """Drafts what the model writes without a budget (`free` after the prompt): every draft is
    accepted up to the budget's end, so verification rows reach past it whenever allowed to."""

    needs_hidden = False

    def __init__(self, prompt: list[int], free: list[int]):
        self.prompt, self.free = prompt, free

    def propose(self, history: list[int], n: int, sampler: Sampler) -> Draft:
        j = len(history) - len(self.prompt)
        if history[:len(self.prompt)] != self.prompt or history[len(self.prompt):] != self.free[:j]:
            return Draft([], [])
        tokens = self.free[j:j + n]
        return Draft(tokens, [None] * len(tokens))

    def commit(self, next_tokens, hiddens, start) -> None:
        pass


def _decode(m: Model, prompt: list[int], n: int, processors: LogitsProcessors | None,
            draft: _Oracle | None, stats: dict | None = None) -> list[int]:
    """n greedy tokens after `prompt` by the engine (drafted by `draft`); `stats` gets n_drafted."""
    m.memory.clear_seq(0)
    engine = Engine(m, max_rows=64)
    s = Running(0, Sampler(GREEDY), list(prompt), processors, draft=draft,
                length=DraftLength(4) if draft is not None else None)
    engine.first(s, m.eval(prompt, 0))
    while len(s.history) - len(prompt) < n:
        s.budget = n - (len(s.history) - len(prompt))
        engine.step([s])
    if stats is not None:
        stats["n_drafted"] = s.n_drafted
    return s.history[len(prompt):len(prompt) + n]


def _thinking_length(tok, tokens: list[int], n: int) -> int:
    """Tokens the budget lets through: n, or more until the text does not end inside a character
    (what Python's incremental UTF-8 decoder holds back, not the budget's own byte check)."""
    for k in range(n, len(tokens) + 1):
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoder.decode(b"".join(tok.token_bytes(t) for t in tokens[:k]))
        if not decoder.getstate()[0]:
            return k
    raise AssertionError("no whole character in sight")


@pytest.mark.parametrize("n", [1, 5, 9])
@pytest.mark.parametrize("drafts", [False, True], ids=["plain", "drafted"])
def test_engine_thinks_n_tokens_then_writes_the_marker(tiny, n, drafts):
    m, tags, prompt, path = tiny
    free = _reference_greedy(path, prompt, n + 8 + len(tags.forced) + N_AFTER)
    oracle = _Oracle(prompt, free) if drafts else None
    k = _thinking_length(m.tokenizer, free, n)
    assert not set(tags.end) & set(free[:k]), "the model closed its block on its own: no budget to test"
    want = free[:k] + list(tags.forced)
    want += _reference_greedy(path, prompt + want, N_AFTER)
    budget = ThinkingBudget(tags, n, True, m.tokenizer.token_bytes)
    got = _decode(m, prompt, len(want), LogitsProcessors(budget=budget), oracle)
    assert got == want
    assert budget.n_thinking == k and budget.forcing is None
    # without a budget: the reference's tokens
    assert _decode(m, prompt, len(want), None, oracle) == free[:len(want)]
