"""The decode loop shared by `generate`, `chat` and the Python API."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

from deltarun.runner.model import Model
from deltarun.runner.sampling import Sampler


@dataclass
class GenerationStats:
    n_prompt: int = 0
    prompt_seconds: float = 0.0
    n_generated: int = 0
    generate_seconds: float = 0.0
    stop_reason: str = ""
    tokens: list[int] = field(default_factory=list)

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generate_tps(self) -> float:
        return self.n_generated / self.generate_seconds if self.generate_seconds else 0.0


def generate_tokens(model: Model, prompt: list[int], n_predict: int, sampler: Sampler, seq: int = 0,
                    stats: GenerationStats | None = None, stop_at_eog: bool = True) -> Iterator[int]:
    """Evaluate `prompt` (appended to what the sequence holds) and yield up to n_predict new tokens.

    The end-of-generation token is not yielded; `stats.stop_reason` says why the loop ended.
    """
    stats = stats if stats is not None else GenerationStats()
    t0 = time.perf_counter()
    logits = model.eval(prompt, seq)
    stats.n_prompt += len(prompt)
    stats.prompt_seconds += time.perf_counter() - t0
    history = model.tokens(seq)
    stats.stop_reason = "length"
    t1 = time.perf_counter()
    try:
        for _ in range(n_predict):
            tok = sampler.sample(logits, history)
            if stop_at_eog and model.tokenizer.is_eog(tok):
                stats.stop_reason = "eog"
                return
            stats.n_generated += 1
            stats.tokens.append(tok)
            history.append(tok)
            yield tok
            if model.n_past(seq) >= model.n_ctx:
                stats.stop_reason = "context"
                return
            logits = model.eval([tok], seq)
    finally:
        stats.generate_seconds += time.perf_counter() - t1
