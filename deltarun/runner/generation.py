"""The decode loop: the one loop that `generate`, `chat`, speculative decoding and the Python API use.

    logits = model.eval(prompt)
    for token in decode_tokens(model, logits, 64, sampler, on_token=print):
        ...

`decode_tokens` owns the stopping rules (the -n limit, an end-of-generation token, a full
context, the caller's `on_token` callback asking to stop) and the counters; where the next tokens
come from is a `Step`: `PlainStep` evaluates the last token and samples one more, the speculative
step (`deltarun.runner.speculative.SpeculativeStep`) verifies several drafted tokens in one ubatch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import numpy as np

from deltarun.runner.model import Model
from deltarun.runner.sampling import Sampler


@dataclass
class GenerationStats:
    n_prompt: int = 0
    prompt_seconds: float = 0.0
    n_generated: int = 0
    generate_seconds: float = 0.0
    stop_reason: str = ""          # eog, length, context, stop (on_token asked), interrupted
    tokens: list[int] = field(default_factory=list)

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generate_tps(self) -> float:
        return self.n_generated / self.generate_seconds if self.generate_seconds else 0.0


class Step(Protocol):
    """Where the decode loop's tokens come from."""

    def first(self, logits: np.ndarray, history: list[int]) -> list[int]:
        """The first token(s), from the logits of the prompt's last token."""

    def next(self, history: list[int], budget: int) -> list[int] | None:
        """The token(s) following `history`, whose last token the model has not evaluated yet; at
        most `budget` are used. None when the context has no room for that token."""


class PlainStep:
    """One token per step: evaluate the last token, sample the next."""

    def __init__(self, model: Model, sampler: Sampler, seq: int = 0,
                 evaluate: Callable[[int], np.ndarray | None] | None = None):
        self.model, self.sampler, self.seq = model, sampler, seq
        self.evaluate = evaluate or self._evaluate

    def _evaluate(self, token: int) -> np.ndarray | None:
        if self.model.n_past(self.seq) >= self.model.n_ctx:
            return None
        return self.model.eval([token], self.seq)

    def first(self, logits: np.ndarray, history: list[int]) -> list[int]:
        return [self.sampler.sample(logits, history)]

    def next(self, history: list[int], budget: int) -> list[int] | None:
        logits = self.evaluate(history[-1])
        return None if logits is None else [self.sampler.sample(logits, history)]


def decode_tokens(model: Model, logits: np.ndarray, n_predict: int, sampler: Sampler, *, seq: int = 0,
                  stats: GenerationStats | None = None, stop_at_eog: bool = True, step: Step | None = None,
                  on_token: Callable[[int], bool | None] | None = None) -> Iterator[int]:
    """Yield up to n_predict tokens (-1: no limit) following a sequence whose prompt is evaluated.

    `logits` are the prompt's last row. The end-of-generation token is not yielded. The last
    token yielded is never evaluated (the sequence holds every token but that one), so a caller
    can append more text and evaluate it together with it. `on_token(token)` runs once the
    consumer has taken a token; returning True ends the loop with stop_reason "stop".
    """
    stats = stats if stats is not None else GenerationStats()
    step = step if step is not None else PlainStep(model, sampler, seq)
    limit = n_predict if n_predict >= 0 else None
    history = model.tokens(seq)
    stats.stop_reason = "length"
    t0 = time.perf_counter()
    try:
        if limit == 0:
            return
        pending: list[int] | None = step.first(logits, history)
        while pending is not None:
            for token in pending:
                if stop_at_eog and model.tokenizer.is_eog(token):
                    stats.stop_reason = "eog"
                    return
                stats.n_generated += 1
                stats.tokens.append(token)
                history.append(token)
                yield token
                if on_token is not None and on_token(token):
                    stats.stop_reason = "stop"
                    return
                if limit is not None and stats.n_generated >= limit:
                    return
            budget = limit - stats.n_generated if limit is not None else model.n_ctx
            pending = step.next(history, budget)
        stats.stop_reason = "context"
    except (KeyboardInterrupt, GeneratorExit):
        stats.stop_reason = "interrupted"
        raise
    finally:
        stats.generate_seconds += time.perf_counter() - t0


def generate_tokens(model: Model, prompt: list[int], n_predict: int, sampler: Sampler, seq: int = 0,
                    stats: GenerationStats | None = None, stop_at_eog: bool = True,
                    on_token: Callable[[int], bool | None] | None = None) -> Iterator[int]:
    """Evaluate `prompt` (appended to what the sequence holds) and yield up to n_predict new tokens.

    The end-of-generation token is not yielded; `stats.stop_reason` says why the loop ended.
    """
    stats = stats if stats is not None else GenerationStats()
    t0 = time.perf_counter()
    logits = model.eval(prompt, seq)
    stats.n_prompt += len(prompt)
    stats.prompt_seconds += time.perf_counter() - t0
    yield from decode_tokens(model, logits, n_predict, sampler, seq=seq, stats=stats, stop_at_eog=stop_at_eog,
                             on_token=on_token)
