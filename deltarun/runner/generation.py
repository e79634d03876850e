"""The decode loop: the one loop that `generate`, `chat`, speculative decoding and the Python API use.

    logits = model.eval(prompt)
    for token in decode_tokens(model, logits, 64, sampler, on_token=print):
        ...

`decode_tokens` owns the stopping rules (the -n limit, an end-of-generation token, a full
context, the caller's `on_token` callback asking to stop) and the counters; each step is the
engine's (`runner.engine`) for one sequence: the last token evaluated, and with a draft source
(`draft`) the drafted tokens verified in the same ubatch. `processors` change the logits before
the sampler (`sampling.LogitsProcessors`: `--reasoning-budget`'s thinking budget).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from deltarun.runner.engine import NO_LIMIT, Engine, Running
from deltarun.runner.model import Model
from deltarun.runner.sampling import LogitsProcessors, Sampler
from deltarun.runner.speculative import DraftLength, DraftSource, MtpFeed, draft_limit


@dataclass
class GenerationStats:
    n_prompt: int = 0
    prompt_seconds: float = 0.0
    n_generated: int = 0
    generate_seconds: float = 0.0
    stop_reason: str = ""          # eog, length, context, stop (on_token asked), interrupted
    tokens: list[int] = field(default_factory=list)
    n_steps: int = 0               # decode ubatches (with drafts: verification ubatches)
    n_drafted: int = 0
    n_accepted: int = 0

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generate_tps(self) -> float:
        return self.n_generated / self.generate_seconds if self.generate_seconds else 0.0

    @property
    def acceptance(self) -> float:
        """The fraction of drafted tokens kept."""
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.n_generated / self.n_steps if self.n_steps else 0.0


def decode_tokens(model: Model, logits: np.ndarray, n_predict: int, sampler: Sampler, *, seq: int = 0,
                  stats: GenerationStats | None = None, stop_at_eog: bool = True,
                  draft: DraftSource | None = None, draft_max: int = 0,
                  context: tuple[list[int], np.ndarray | None, int] | None = None,
                  on_full: Callable[[], np.ndarray | None] | None = None,
                  on_token: Callable[[int], bool | None] | None = None,
                  processors: LogitsProcessors | None = None, undoable: bool = True) -> Iterator[int]:
    """Yield up to n_predict tokens (-1: no limit) following a sequence whose prompt is evaluated.

    `logits` are the prompt's last row. The end-of-generation token is not yielded. The last
    token yielded is never evaluated (the sequence holds every token but that one), so a caller
    can append more text and evaluate it together with it. `on_token(token)` runs once the
    consumer has taken a token; returning True ends the loop with stop_reason "stop".

    `draft` (with `draft_max` >= 1): speculative decoding, up to draft_max drafted tokens verified
    per ubatch; `context` = what the draft source has not seen of the prompt (see `Engine.first`;
    default for a source that needs hidden rows: the prompt's last row). `on_full()`, called when
    the context has no room for the next token, may make room (chat's context shift, which
    evaluates the tokens so far) and return the logits that follow them; None ends the loop.
    `undoable=False`: the caller never rolls the sequence back after a step (`Running.undoable`).
    """
    stats = stats if stats is not None else GenerationStats()
    engine = Engine(model)
    length = DraftLength(draft_limit(model, draft_max)) if draft is not None else None
    s = Running(seq, sampler, model.tokens(seq), processors, draft=draft, length=length, undoable=undoable)
    if draft is not None and draft.needs_hidden and context is None and model.last_hidden is not None:
        context = ([], model.last_hidden[0][-1:], model.n_past(seq) - 1)
    limit = n_predict if n_predict >= 0 else None
    stats.stop_reason = "length"
    t0 = time.perf_counter()
    try:
        if limit == 0:
            return
        pending: list[int] = [engine.first(s, logits, context)]
        while True:
            for token in pending:
                if stop_at_eog and model.tokenizer.is_eog(token):
                    stats.stop_reason = "eog"
                    return
                stats.n_generated += 1
                stats.tokens.append(token)
                yield token
                if on_token is not None and on_token(token):
                    stats.stop_reason = "stop"
                    return
                if limit is not None and stats.n_generated >= limit:
                    return
            s.budget = limit - stats.n_generated if limit is not None else NO_LIMIT
            outcome, = engine.step([s])
            if outcome.error is not None:
                raise outcome.error
            if outcome.full:
                logits = on_full() if on_full is not None else None
                if logits is None:
                    break
                pending = [engine.first(s, logits)]
                continue
            stats.n_steps += 1
            stats.n_drafted += outcome.n_drafted
            stats.n_accepted += outcome.n_accepted
            pending = outcome.tokens
        stats.stop_reason = "context"
    except (KeyboardInterrupt, GeneratorExit):
        stats.stop_reason = "interrupted"
        raise
    finally:
        stats.generate_seconds += time.perf_counter() - t0


def generate_tokens(model: Model, prompt: list[int], n_predict: int, sampler: Sampler, seq: int = 0,
                    stats: GenerationStats | None = None, stop_at_eog: bool = True,
                    on_token: Callable[[int], bool | None] | None = None,
                    draft: DraftSource | None = None, draft_max: int = 0,
                    processors: LogitsProcessors | None = None, feed: MtpFeed | None = None,
                    undoable: bool = True) -> Iterator[int]:
    """Evaluate `prompt` (appended to what the sequence holds) and yield up to n_predict new tokens.

    The end-of-generation token is not yielded; `stats.stop_reason` says why the loop ended. With
    `draft`, up to `draft_max` drafted tokens are verified per ubatch (`decode_tokens`).
    `feed`: for a draft source that reads hidden rows, the `MtpFeed` that was handed the rows
    evaluated before `prompt` (images and the text before them, `multimodal.prefill_with_images`).
    """
    stats = stats if stats is not None else GenerationStats()
    if draft is not None:
        draft_limit(model, draft_max)          # before the prompt: a model without rollback slots fails at once
    wants_hidden = draft is not None and draft.needs_hidden
    t0 = time.perf_counter()
    start = model.n_past(seq)
    logits = model.eval(prompt, seq, all_hidden=wants_hidden)
    context = None
    if wants_hidden:                           # the MTP block's rows for every prompt position
        feed = feed if feed is not None else MtpFeed(draft)
        feed.feed(model.tokens(seq), model.last_hidden[0], start)
        context = feed.context(model.n_past(seq))
    stats.n_prompt += len(prompt)
    stats.prompt_seconds += time.perf_counter() - t0
    if draft is not None:
        draft.start(prompt)
    yield from decode_tokens(model, logits, n_predict, sampler, seq=seq, stats=stats, stop_at_eog=stop_at_eog,
                             draft=draft, draft_max=draft_max, context=context, on_token=on_token,
                             processors=processors, undoable=undoable)
