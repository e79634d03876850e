"""Token sampling from one row of logits, in llama.cpp's default order.

penalties -> top-k -> top-p -> min-p -> temperature -> draw. Temperature <= 0 is greedy (argmax
after penalties). Works on the single logits row it is given; never copies more than that row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = SamplingParams(temperature=0.0)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log(softmax(logits)) along the last axis, in float64 (perplexity, KL divergence)."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


class Sampler:
    """Draws tokens; one random generator per sampler so a seed reproduces a whole generation."""

    def __init__(self, params: SamplingParams = GREEDY):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def penalized(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        """Logits after the repetition penalty (llama.cpp: divide positive, multiply negative)."""
        p = self.params
        if p.repeat_penalty == 1.0 or not history or p.repeat_last_n == 0:
            return logits
        recent = history[-p.repeat_last_n:] if p.repeat_last_n > 0 else history
        ids = np.unique(np.asarray(recent, dtype=np.int64))
        out = np.array(logits, dtype=np.float32, copy=True)
        vals = out[ids]
        out[ids] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        return out

    def distribution(self, logits: np.ndarray, history: list[int] | None = None) -> np.ndarray:
        """The probabilities the sampler draws from (one-hot when greedy); used by speculative sampling."""
        p = self.params
        x = self.penalized(np.asarray(logits, dtype=np.float32), history or [])
        probs = np.zeros(x.shape[0], dtype=np.float64)
        if p.greedy:
            probs[int(np.argmax(x))] = 1.0
            return probs
        order = np.argsort(-x, kind="stable")
        if 0 < p.top_k < order.size:
            order = order[: p.top_k]
        kept = x[order].astype(np.float64)
        w = np.exp(kept - kept[0])
        w /= w.sum()
        if p.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(w), p.top_p) + 1)
            order, kept = order[:cut], kept[:cut]
        if p.min_p > 0.0:
            keep = np.exp(kept - kept[0]) >= p.min_p
            order, kept = order[keep], kept[keep]
        w = np.exp((kept - kept[0]) / p.temperature)
        probs[order] = w / w.sum()
        return probs

    def sample(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        if self.params.greedy:
            return int(np.argmax(self.penalized(np.asarray(logits), history or [])))
        probs = self.distribution(logits, history)
        return int(self.rng.choice(probs.size, p=probs))


def sample_rows(samplers: Sequence[Sampler], logits: np.ndarray, histories: Sequence[list[int]],
                draw: Callable[[Sampler, np.ndarray, list[int]], int] | None = None) -> list[int]:
    """The next token of several sequences at once: row i of `logits` [n, vocab] with samplers[i]
    and histories[i], the same tokens as `samplers[i].sample(logits[i], histories[i])` row by row.

    A server step decodes one token for every running sequence; the greedy rows (the usual load)
    get their repetition penalty (when they have one) and then one argmax over all of them, instead
    of a Python call chain and an argmax per row. The other rows are drawn in row order, each with
    its own sampler's generator (so a seed gives the same tokens as sampling that sequence alone),
    by `draw` (default `Sampler.sample`; the server passes its top-k-by-partition variant).
    """
    x = np.asarray(logits, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] != len(samplers) or len(histories) != len(samplers):
        raise ValueError(f"sample_rows: {len(samplers)} samplers and {len(histories)} histories for logits "
                         f"of shape {x.shape}")
    out = [0] * len(samplers)
    greedy = [i for i, s in enumerate(samplers) if s.params.greedy]
    if greedy:
        rows = x[greedy]                                     # a copy: penalties go into it
        for k, i in enumerate(greedy):
            p = samplers[i].params
            if p.repeat_penalty != 1.0 and histories[i] and p.repeat_last_n != 0:
                rows[k] = samplers[i].penalized(rows[k], histories[i])
        for i, t in zip(greedy, rows.argmax(axis=1).tolist()):
            out[i] = t
    one = draw or Sampler.sample
    for i, s in enumerate(samplers):
        if not s.params.greedy:
            out[i] = int(one(s, x[i], histories[i]))
    return out
