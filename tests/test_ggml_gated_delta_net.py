"""ggml's CPU gated delta rule (`ggml_gated_delta_net`) against the recurrence in float64 numpy.

The model tests compare whole graphs (fused op against the primitive-op graph, float64 forward
passes) at the tiny models' head sizes; this one checks the op alone at the head sizes the
patched AVX-512 kernels take (S_v a multiple of 16 up to 128, Qwen3.5's 128 included), with the
rollback snapshots: scripts/ggml-patches/gated-delta-net-rows.patch keeps each state row in
registers (one token a ubatch), gated-delta-net-tiles.patch takes 16 rows at a time from two
tokens on (two tiles in step from S_v = 32), with the row kernel's operations in its order. The
shapes cover token counts below, at and above K (the snapshot slots), more tokens than the
kernel's 64-token chunk (65, 130), q/k heads shared by several value heads, two sequences, thread
counts that split the heads unevenly, and decays from none (0) to near-total (-30). A
per-channel gate (Kimi's KDA) takes ggml's generic loop.
"""

from __future__ import annotations

import numpy as np
import pytest

from ggml_delta_net import ggml_gated_delta_net


def _unit(rng: np.random.Generator, *shape: int) -> np.ndarray:
    a = rng.standard_normal(shape)
    return (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)


def _reference(q, k, v, g, beta, state, K):
    """The recurrence in float64, state kept as the kernel keeps it (m[j] = column j of S):
    S <- exp(g) S;  d = beta (v - S^T k);  S <- S + k d^T;  o = S^T q / sqrt(S_v)."""
    N, T, H, S = v.shape
    rep = H // q.shape[2]
    out = np.zeros((N, T, H, S))
    snaps = np.zeros((min(T, K), N, H, S, S))
    for n in range(N):
        for h in range(H):
            m = state[n, h].astype(np.float64)                           # [j, i] = S[i][j]
            qh, kh = q[n, :, h % q.shape[2]].astype(np.float64), k[n, :, h % k.shape[2]].astype(np.float64)
            assert rep >= 1
            for t in range(T):
                decay = np.exp(g[n, t, h].astype(np.float64))         # [1] or [S] (per key channel)
                m = m * decay[None, :]
                d = (v[n, t, h] - m @ kh[t]) * beta[n, t, h, 0]
                m = m + d[:, None] * kh[t][None, :]
                out[n, t, h] = m @ qh[t] / np.sqrt(S)
                if T - 1 - t < K:
                    snaps[T - 1 - t, n, h] = m
    return out, snaps


def _inputs(rng, N, T, H, H_k, S, gate, kda=False):
    q, k = _unit(rng, N, T, H_k, S), _unit(rng, N, T, H_k, S)
    v = rng.standard_normal((N, T, H, S)).astype(np.float32)
    gate_shape = (N, T, H, S if kda else 1)
    if gate == "mixed":
        g = -rng.uniform(0.0, 0.5, gate_shape)
    else:
        g = np.full(gate_shape, float(gate))
    beta = rng.uniform(0.1, 1.0, (N, T, H, 1))
    state = (0.3 * rng.standard_normal((N, H, S, S))).astype(np.float32)
    return q, k, v, g.astype(np.float32), beta.astype(np.float32), state


@pytest.mark.parametrize("S,H,H_k,N,T,K,threads,gate", [
    (128, 4, 4, 1, 1, 1, 1, "mixed"),
    (128, 4, 4, 1, 2, 4, 2, "mixed"),
    (128, 4, 2, 1, 3, 4, 2, "mixed"),
    (128, 4, 4, 2, 4, 4, 3, "mixed"),
    (128, 2, 2, 1, 5, 4, 1, "mixed"),
    (128, 3, 3, 1, 8, 1, 2, "mixed"),
    (128, 2, 1, 2, 17, 4, 3, "mixed"),
    (128, 2, 2, 1, 65, 4, 2, "-0.5"),
    (128, 2, 2, 1, 130, 2, 2, "mixed"),
    (128, 2, 2, 1, 6, 4, 1, "-30"),
    (128, 2, 2, 1, 6, 4, 1, "0"),
    (64, 4, 4, 1, 9, 4, 2, "mixed"),
    (32, 4, 2, 2, 7, 3, 2, "-0.5"),
    (16, 4, 4, 1, 70, 4, 3, "mixed"),
    (16, 2, 2, 1, 1, 4, 1, "mixed"),
])
def test_gated_delta_net_matches_numpy(S, H, H_k, N, T, K, threads, gate) -> None:
    rng = np.random.default_rng(S + 7 * T + 31 * K + N)
    q, k, v, g, beta, state = _inputs(rng, N, T, H, H_k, S, gate)
    out, snaps = ggml_gated_delta_net(q, k, v, g, beta, state, K, threads)
    want_out, want_snaps = _reference(q, k, v, g, beta, state, K)
    # float32 state updates of S products a token, over up to 130 tokens (|state| ~ 1): ~1e-6
    # relative each, a few 1e-5 at the end; an error in one row, lane or snapshot is O(0.1)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=2e-5 * np.sqrt(T))
    np.testing.assert_allclose(snaps, want_snaps, rtol=1e-4, atol=2e-5 * np.sqrt(T))


@pytest.mark.parametrize("T", [1, 5])
def test_per_channel_gate_matches_numpy(T: int) -> None:
    """Kimi's KDA gate (one decay per key channel): ggml's generic loop."""
    rng = np.random.default_rng(T)
    q, k, v, g, beta, state = _inputs(rng, 1, T, 2, 2, 32, "mixed", kda=True)
    out, snaps = ggml_gated_delta_net(q, k, v, g, beta, state, 4, 2)
    want_out, want_snaps = _reference(q, k, v, g, beta, state, 4)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(snaps, want_snaps, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("S", [128, 32])
def test_results_do_not_depend_on_the_ubatch_split(S: int) -> None:
    """The same tokens in one call and in calls of 1, 2, 1 and 5 tokens (each starting from the
    state the last one left): bit for bit the same outputs and state. A prompt read in chunks, a
    resume from the prompt cache and a verification step of drafts then give exactly what one
    evaluation gives (the row kernel takes single tokens, the tile kernel the others)."""
    rng = np.random.default_rng(S)
    q, k, v, g, beta, state = _inputs(rng, 1, 9, 2, 2, S, "mixed")
    whole, whole_snaps = ggml_gated_delta_net(q, k, v, g, beta, state, 1, 2)
    outs, s = [], state
    for a, b in ((0, 1), (1, 3), (3, 4), (4, 9)):
        out, snaps = ggml_gated_delta_net(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], s, 1, 2)
        outs.append(out)
        s = snaps[0]
    np.testing.assert_array_equal(np.concatenate(outs, axis=1), whole)
    np.testing.assert_array_equal(s, whole_snaps[0])
