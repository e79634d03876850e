"""Plain-numpy float64 reference of Qwen3.8-Flash-Next (`qwen4exp`) from Hugging Face-order weights.

Written from the math of transformers 5.24's `modeling_qwen4_exp.py` (docs/qwen4exp-gguf.md), never
from the GGUF layout or llama.cpp's graph: it takes the dict `models/qwen4exp.hf_weights()` makes.
What Qwen4 shares with Qwen3.5 is `Qwen35Reference`'s (Gated DeltaNet with the configured output
gate, gated attention and its rope, the MoE, the per-layer state and clone); what is its own, here:

* hyper-connections (`Qwen4ExpTextGatedResidual`): H residual streams, a grouped zero-centred
  RMSNorm, a low-rank sigmoid mixer that makes the block input, 2 * sigmoid injection weights;
* the QSA indexer (`Qwen4ExpTextQSAIndexer`): raw keys cached per token, mean-pooled over complete
  blocks of r tokens, normed and roped at the block's first position, scored by the sum over heads
  of relu(q . k) / sqrt(D); attention sees the top B / r blocks plus the incomplete tail;
* PLE (`Qwen4ExpTextPLELayer`, `Qwen4ExpTextNGramEmbedding`): n-gram ids by
  `_shift_right_ignore_eos` over the cached N - 1 ids and the new tokens, XOR of token x multiplier,
  modulo each head's prime, rows concatenated; the signed-sqrt sigmoid gate per stream; the dilated
  depthwise causal conv with its own state.

Extra state per layer (cloned with the rest): `index_k` (raw indexer keys) on indexed layers,
`ple_ids` (the last N - 1 token ids, EOS at the start) and `ple_conv` ((K - 1) * N rows) on PLE layers.
"""

from __future__ import annotations

import numpy as np

from reference import full_attention, moe, rmsnorm, sigmoid, silu
from reference_qwen35 import Qwen35Reference

__all__ = ["Qwen4ExpReference", "ngram_rows"]


def shift_right_ignore_eos(history: list[int], shift: int, eos: int) -> list[int]:
    """transformers' `_shift_right_ignore_eos`: position q gets history[q - shift] when that token
    lies in q's segment (segments end at an EOS, which belongs to the segment it ends), else EOS."""
    out = []
    last_eos = -1            # the last EOS strictly before q
    for q in range(len(history)):
        in_segment = q - (last_eos + 1)
        out.append(history[q - shift] if in_segment >= shift and q - shift >= 0 else eos)
        if history[q] == eos:
            last_eos = q
    return out


def ngram_rows(context: list[int], tokens: list[int], multipliers, sizes, offsets, heads_per_ngram: int,
               eos: int) -> np.ndarray:
    """Table rows (T, n_heads) of the new `tokens` given the cached `context` (N - 1 ids)."""
    n = len(multipliers)
    history = list(context) + list(tokens)
    shifted = [shift_right_ignore_eos(history, s, eos) for s in range(n)]
    first = len(history) - len(tokens)
    rows = np.zeros((len(tokens), (n - 1) * heads_per_ngram), dtype=np.int64)
    for t in range(len(tokens)):
        q = first + t
        for order in range(2, n + 1):
            mixed = 0
            for s in range(order):
                mixed ^= int(shifted[s][q]) * int(multipliers[s])
            for g in range(heads_per_ngram):
                h = (order - 2) * heads_per_ngram + g
                rows[t, h] = mixed % int(sizes[h]) + int(offsets[h])
    return rows


class Qwen4ExpReference(Qwen35Reference):
    """Float64 Qwen4-Exp from HF weights; `eos_id` is the PLE's n-gram reset token.

    API as Qwen35Reference (reset, forward, clone, hidden, conv_state, ssm_state, kv_cache) plus
    `index_keys(layer)`, `ple_context(layer)`, `ple_conv_state(layer)` and `last_ple_rows`."""

    def __init__(self, cfg, hf: dict[str, np.ndarray], eos_id: int, n_vocab: int | None = None):
        self.eos = int(eos_id)
        self.gated_norm_gate = sigmoid if cfg.output_gate_type == "sigmoid" else silu
        self.hash = {k: np.asarray(v) for k, v in hf.items() if np.asarray(v).dtype.kind == "i"}
        super().__init__(cfg, {k: v for k, v in hf.items() if k not in self.hash}, n_vocab)
        self.last_ple_rows: dict[int, np.ndarray] = {}

    def reset(self) -> None:
        super().reset()
        cfg = self.cfg
        for il, st in enumerate(self._layers):
            if cfg.indexed[il]:
                st["index_k"] = []
            if il + 1 in cfg.ple_layer_ids:
                st["ple_ids"] = [self.eos] * (cfg.ngram_size - 1)
                st["ple_conv"] = np.zeros(((cfg.ple_conv_kernel_size - 1) * cfg.ngram_size,
                                           cfg.hc_count * cfg.hidden_size))

    # ---- state ----------------------------------------------------------------------------------

    def index_keys(self, layer: int) -> np.ndarray:
        """(n_past, D) raw indexer keys of an indexed layer."""
        return np.stack(self._layers[layer]["index_k"])

    def ple_context(self, layer: int) -> list[int]:
        return list(self._layers[layer]["ple_ids"])

    def ple_conv_state(self, layer: int) -> np.ndarray:
        return self._layers[layer]["ple_conv"].copy()

    # ---- blocks ---------------------------------------------------------------------------------

    def _grouped_norm(self, x, weight):
        """RMSNorm over each stream's E values of x (T, H*E), times 1 + weight (H*E)."""
        T, H = x.shape[0], self.cfg.hc_count
        y = rmsnorm(x.reshape(T, H, -1), self.hp.eps).reshape(T, -1)
        return y * (1.0 + weight)

    def _hyper_connection(self, p: str, x):
        """(block input (T, E), injection weights (T, H) or None) of the module under prefix p."""
        w, H = self.hf, self.cfg.hc_count
        T = x.shape[0]
        xn = self._grouped_norm(x, w[p + "hc_norm.weight"])
        g = sigmoid(silu(xn @ w[p + "input_mix_weight_down.weight"].T / H) @ w[p + "input_mix_weight_up.weight"].T)
        mixed = (g * xn).reshape(T, H, -1).mean(axis=1)
        if p + "block_inject_weight.weight" not in w:
            return mixed, None
        return mixed, 2.0 * sigmoid(xn @ w[p + "block_inject_weight.weight"].T / H)

    @staticmethod
    def _inject(x, y, inj):
        """Every stream s adds inj[s] * y: x (T, H*E), y (T, E), inj (T, H)."""
        return x + (inj[:, :, None] * y[:, None, :]).reshape(x.shape)

    def _ple(self, il: int, x, tokens: list[int]):
        cfg, w, st = self.cfg, self.hf, self._layers[il]
        p = f"model.layers.{il}.ple."
        e = p + "ple_embedding."
        rows = ngram_rows(st["ple_ids"], tokens, self.hash[e + "layer_multipliers"],
                          self.hash[e + "ngram_heads_vocab_sizes"], self.hash[e + "ngram_heads_offsets"],
                          cfg.heads_per_ngram, self.eos)
        self.last_ple_rows[il] = rows
        st["ple_ids"] = (st["ple_ids"] + list(tokens))[-(cfg.ngram_size - 1):]
        T, H, E = len(tokens), cfg.hc_count, cfg.hidden_size
        emb = w[e + "ngram_embedding.weight"][rows].reshape(T, -1)
        key = self._grouped_norm(emb @ w[p + "key_proj.weight"].T, w[p + "norm_key.weight"]).reshape(T, H, E)
        value = emb @ w[p + "value_proj.weight"].T
        query = self._grouped_norm(x, w[p + "norm_query.weight"]).reshape(T, H, E)
        a = (key * query).sum(axis=-1) / np.sqrt(E)
        a = np.sign(a) * np.sqrt(np.maximum(np.abs(a), 1e-6))
        gated = (sigmoid(a)[:, :, None] * value[:, None, :]).reshape(T, H * E)
        u = self._grouped_norm(gated, w[p + "norm_conv.weight"])
        kern, dil = cfg.ple_conv_kernel_size, cfg.ngram_size
        conv_w = w[p + "conv1d.weight"][:, 0, :]        # (H*E, K)
        hist = len(st["ple_conv"])
        window = np.concatenate([st["ple_conv"], u], axis=0)
        conv = np.zeros_like(u)
        for t in range(T):
            for j in range(kern):
                conv[t] += conv_w[:, j] * window[hist + t - (kern - 1 - j) * dil]
        st["ple_conv"] = window[-hist:].copy()
        return gated + silu(conv)

    def _indexer(self, il: int, h, positions) -> dict[int, np.ndarray]:
        """The tokens each query of h (T, E) attends to, by sequence index."""
        cfg, w, st = self.cfg, self.hf, self._layers[il]
        p = f"model.layers.{il}.self_attn.indexer."
        D, n_i, r = cfg.indexer_head_dim, cfg.indexer_n_heads, cfg.indexer_compress_ratio
        T = h.shape[0]
        qk = h @ w[p + "index_qk_proj.weight"].T
        q = rmsnorm(qk[:, :n_i * D].reshape(T, n_i, D), self.hp.eps) * (1.0 + w[p + "q_layernorm.weight"])
        first = len(st["index_k"])
        st["index_k"].extend(qk[t, n_i * D:].copy() for t in range(T))
        keys = np.stack(st["index_k"])
        selected = {}
        for t in range(T):
            qt = self._rope(q[t], positions[t])
            n = first + t + 1
            n_blocks = n // r
            chosen = np.zeros(0, dtype=int)
            if n_blocks:
                pooled = rmsnorm(keys[:n_blocks * r].reshape(n_blocks, r, D).mean(axis=1), self.hp.eps)
                pooled = pooled * (1.0 + w[p + "k_layernorm.weight"])
                # a block's key takes its first token's position (text: the sequence index)
                pooled = np.stack([self._rope(pooled[j], j * r) for j in range(n_blocks)])
                score = np.maximum(qt @ pooled.T, 0.0).sum(axis=0) / np.sqrt(D)
                top = np.argsort(-score, kind="stable")[:min(cfg.indexer_budget // r, n_blocks)]
                chosen = (top[:, None] * r + np.arange(r)).reshape(-1)
            selected[first + t] = np.sort(np.concatenate([chosen, np.arange(n_blocks * r, n)]))
        return selected

    # ---- forward --------------------------------------------------------------------------------

    def forward(self, tokens, embeddings=None, positions=None) -> np.ndarray:
        """Logits (n_tokens, n_vocab) for text tokens appended to the sequence."""
        if embeddings is not None or positions is not None:
            raise NotImplementedError("the qwen4exp reference covers text only")
        cfg, hp, w = self.cfg, self.hp, self.hf
        tokens = [int(t) for t in tokens]
        positions = list(range(self.n_past, self.n_past + len(tokens)))
        x = np.tile(w["model.embed_tokens.weight"][tokens], (1, cfg.hc_count))
        for il in range(hp.n_layer):
            p, st, view = f"model.layers.{il}.", self._layers[il], self._views[il]
            if il + 1 in cfg.ple_layer_ids:
                x = x + self._ple(il, x, tokens)
            h, inj = self._hyper_connection(p + "attn_hyper_connection.", x)
            if hp.recurrent[il]:
                y = self._linear_attention(p, h, st)
            else:
                chosen = self._indexer(il, h, positions) if cfg.indexed[il] else None
                y = full_attention(view, "", hp, h, positions, st["k"], st["v"], rope=self._rope,
                                   select=None if chosen is None else chosen.__getitem__)
            x = self._inject(x, y, inj)
            h, inj = self._hyper_connection(p + "mlp_hyper_connection.", x)
            x = self._inject(x, moe(view, "", hp, h), inj)
        out, _ = self._hyper_connection("model.hyper_connection_mixer.", x)
        self._last_hidden = out.copy()
        self.n_past += len(tokens)
        return out @ self._lm_head().T
