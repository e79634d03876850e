"""A model's logits against a float64 reference's over the same tokens, one way for every family.

The Qwen3.5, Kimi-Linear and qwen4exp tests (test_qwen35_forward, test_kimi_linear,
test_qwen4exp) each run the graph and their family's numpy reference (reference_qwen35,
reference_kimi, reference_qwen4exp) on one prompt and bound the difference. The bounds and the
way they are applied live here, so that a family's test cannot drift into a weaker comparison:
F32 weights must match every row to `F32_TOL` and decode the same greedy tokens; quantised
weights or a rounded cache must stay within per-position bounds measured for each case. The
same tests hold the recurrent state to the same bound against the model's own recomputation
(a rollback, a restored capture), also here.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

#: relative logit error of an F32 file against the float64 reference: measured 2.8e-7 .. 7.1e-7
#: (the Qwen3.5 presets, fused and primitive delta nets), of the same order for Kimi-Linear and qwen4exp
F32_TOL = 1e-5


class Reference(Protocol):
    """What the families' float64 references have in common."""

    def forward(self, tokens: list[int]) -> np.ndarray: ...

    def reset(self) -> None: ...


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """The largest absolute difference relative to the largest magnitude of `b` (the reference)."""
    return float(np.abs(a - b).max() / np.abs(b).max())


def prompt(n: int, seed: int = 0) -> list[int]:
    """`n` random token ids inside every family's tiny vocabulary."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, 2300, n)]


def greedy(step: Callable[[int], np.ndarray], first_logits: np.ndarray, n: int) -> list[int]:
    """`n` greedy tokens: the argmax of `first_logits`, then of what `step` returns for each token."""
    out, logits = [], first_logits
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = step(out[-1])
    return out


def assert_f32_matches(model, ref: Reference, toks: list[int], n_first: int, label: str,
                       n_greedy: int = 12) -> None:
    """An F32 model (an open `Model`, fresh) against its reference (fresh): the logits of every
    position of `toks` within `F32_TOL` with the same argmax, then (both reset) the same `n_greedy`
    greedy tokens after `toks[:n_first]`, one decoding step at a time."""
    expected = ref.forward(toks)
    got = model.logits_for(toks)
    print(f"{label}: {rel_err(got, expected):.2e}")
    assert got.shape == expected.shape
    assert rel_err(got, expected) < F32_TOL
    assert (got.argmax(1) == expected.argmax(1)).all()
    model.reset()
    mine = greedy(lambda t: model.eval([t]), model.eval(toks[:n_first]), n_greedy)
    ref.reset()
    theirs = greedy(lambda t: ref.forward([t])[-1], ref.forward(toks[:n_first])[-1], n_greedy)
    assert mine == theirs


def assert_one_ubatch_matches(model, prompts: list[list[int]], last_logits: Callable[[list[int]], np.ndarray]
                              ) -> None:
    """The prompts as sequences 0, 1, ... of one ubatch (`model` has as many cells): each
    sequence's last row within `F32_TOL` of `last_logits(prompt)`, the reference's for it alone."""
    want = [last_logits(p) for p in prompts]
    got = model.eval_batch(dict(enumerate(prompts)))
    for seq, w in enumerate(want):
        assert rel_err(got[seq], w) < F32_TOL, seq


def assert_rollback_equals_recomputation(model, first: list[int], block: list[int], cont: list[int],
                                         n_back: int) -> None:
    """`first`, then `block` with its last `n_back` tokens rolled back, then `cont`: the logits of
    `cont` within `F32_TOL` of the kept tokens evaluated afresh (`model` needs n_back < rs_slots)."""
    model.eval(first)
    model.eval(block)
    model.rollback(n_back)
    after = model.eval(cont, all_logits=True)
    fresh = model.logits_for(first + block[:len(block) - n_back] + cont)[-len(cont):]
    assert rel_err(after, fresh) < F32_TOL


def assert_capture_resumes(model, toks: list[int], n_first: int, captures: list[int], at: int) -> None:
    """The prompt cache's pieces: `toks[:n_first]` evaluated in sequence 0 with state captures at
    `captures`; capture `at` restored into sequence 1 with the K/V rows and tokens before it; the
    rest of `toks` from there within `F32_TOL` of the unbroken sequence's logits (`model` needs 2
    cells and len(captures) capture slots)."""
    model.eval(toks[:n_first], seq=0, captures=captures)
    model.memory.write_recurrent(1, model.last_captures[at])
    model.memory.write_kv(1, model.memory.read_kv(0, at), at)
    model.memory.set_tokens(1, toks[:at])
    resumed = model.eval(toks[at:], seq=1, all_logits=True)
    model.reset()
    unbroken = model.eval(toks, seq=0, all_logits=True)[at:]
    assert rel_err(resumed, unbroken) < F32_TOL


def per_position_error(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Each position's largest logit difference, relative to the reference's largest logit."""
    assert got.shape == expected.shape
    return np.abs(got - expected).max(axis=1) / np.abs(expected).max()


def assert_quantised_close(got: np.ndarray, expected: np.ndarray, bound: float, label: str) -> None:
    """A quantised file against the reference on its dequantised weights: the median position
    within `bound`, 90% within 2x (a near-tie of two experts may switch expert under activation
    rounding, so a few positions go further), and the argmax kept where the reference's top two
    logits are clearly apart (some such position must exist)."""
    per_pos = per_position_error(got, expected)
    print(f"{label}: max {per_pos.max():.2e} median {np.median(per_pos):.2e}")
    assert np.median(per_pos) < bound
    assert (per_pos < 2 * bound).mean() >= 0.9
    top2 = np.sort(expected, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) / np.abs(expected).max() > 0.1
    assert clear.any()
    assert (got.argmax(1) == expected.argmax(1))[clear].all()


def assert_close_everywhere(got: np.ndarray, expected: np.ndarray, median: float, maximum: float,
                            label: str) -> None:
    """A rounding with no outliers (an F16 cache): median and worst position within their bounds,
    every argmax kept."""
    per_pos = per_position_error(got, expected)
    print(f"{label}: max {per_pos.max():.2e} median {np.median(per_pos):.2e}")
    assert np.median(per_pos) < median and per_pos.max() < maximum
    assert (got.argmax(1) == expected.argmax(1)).all()
