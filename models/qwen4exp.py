"""Writes synthetic Qwen3.8-Flash-Next GGUF files (`qwen4exp`) the way llama.cpp's converter does.

As for Qwen3.5 (models/qwen35.py), in two steps, so that a test can start from weights a graph never
saw in GGUF order: `hf_weights(cfg, n_vocab, seed)` makes what a `Qwen4ExpForCausalLM` holds after
loading (transformers 5.24 `modeling_qwen4_exp.py` names and torch shapes; the n-gram table as one
`ngram_embedding.weight`, which is the row concatenation of the checkpoint's shards, and its three
int64 buffers), and `convert(cfg, hf)` does what `conversion/qwen4exp.py` (llama-cpp-python 0.3.36)
does to them. The facts are in docs/qwen4exp-gguf.md.

What is shared with Qwen3.5 is reused, not repeated: the config is a `Qwen35Config` (MoE, no MTP)
with Qwen4's fields added; the Gated DeltaNet, attention and MoE weights come from
`qwen35.hf_weights` (without the layer norms Qwen4 does not have) and go through `qwen35.convert`
(value-head reorder, `-exp(A_log)`, `1 + w` norms, the split `gate_up_proj`); the metadata starts with
`qwen35`'s. What is Qwen4's own, here:

* hyper-connection weights (`hc_norm` stored `1 + w`, `input_mix_weight_down/up`,
  `block_inject_weight`) per layer and for the final mixer;
* the indexer: `index_qk_proj` split into `indexer.q_proj` / `indexer.k_proj`, `q/k_layernorm`
  stored `1 + w`;
* PLE: `key_proj`, `value_proj`, three grouped norms (`1 + w`), the dilated conv kernel squeezed,
  the table as `per_layer_token_embd.weight`, the hash constants as u64 array keys. The converter
  can carry one PLE layer only (one table name, one set of constants), so files have at most one.

The Gated DeltaNet's output gate is sigmoid (`output_gate_type = "sigmoid"`): the file has no key
for it and llama.cpp assumes sigmoid.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from deltarun.model_files import qwen35
from deltarun.model_files.generate import config_and_vocab, write_gguf_file

ARCH = "qwen4exp"

# transformers' hash constants (modular_qwen4_exp.py)
_MASK64 = (1 << 64) - 1
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_M1 = 0xBF58476D1CE4E5B9
_SPLITMIX_M2 = 0x94D049BB133111EB
_PRIME_1 = 10007


@dataclass(frozen=True)
class Qwen4ExpConfig(qwen35.Qwen35Config):
    """`Qwen4ExpTextConfig`'s hyper-parameters (field names as in transformers). Qwen3.5's fields
    keep their meaning; `layer_types` uses the real checkpoint's spelling `full_attention` for the
    indexed (QSA) layers, as the converter expects."""

    moe: bool = True
    mtp_num_hidden_layers: int = 0
    hc_count: int = 4
    hc_lowrank: int = 320
    #: one-based decoder layer ids with a PLE module (linear-attention layers only)
    ple_layer_ids: tuple[int, ...] = ()
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    indexer_n_heads: int = 4
    indexer_head_dim: int = 64
    indexer_budget: int = 2048
    indexer_compress_ratio: int = 4
    output_gate_type: str = "sigmoid"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.moe or self.mtp_num_hidden_layers:
            raise ValueError("qwen4exp is a MoE model without an MTP block in converted files")
        if self.hc_count <= 1:
            raise ValueError(f"hc_count must be > 1, got {self.hc_count}")
        if self.indexer_budget % self.indexer_compress_ratio:
            raise ValueError("indexer_budget must be divisible by indexer_compress_ratio")
        if self.n_rot > self.indexer_head_dim:
            raise ValueError(f"the rotary dims ({self.n_rot}) must fit the indexer head ({self.indexer_head_dim})")
        if self.output_gate_type not in ("sigmoid", "silu"):
            raise ValueError(f"output_gate_type must be sigmoid or silu, got {self.output_gate_type!r}")
        for lid in self.ple_layer_ids:
            if not 1 <= lid <= self.num_hidden_layers or self.layer_types[lid - 1] != "linear_attention":
                raise ValueError(f"PLE layer id {lid} is not a one-based linear-attention layer")
        if self.ple_layer_ids and self.ple_dim % self.ngram_heads:
            raise ValueError(f"ple_embed_dim {self.ple_dim} is not a multiple of the {self.ngram_heads} n-gram heads")

    @property
    def arch(self) -> str:
        return ARCH

    @property
    def ple_dim(self) -> int:
        """P: the concatenated n-gram embedding width (`ple_embed_dim`, default hidden_size)."""
        return self.hidden_size if self.ple_embed_dim is None else self.ple_embed_dim

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_row_dim(self) -> int:
        """d: one head's row of the n-gram table."""
        return self.ple_dim // self.ngram_heads

    @property
    def indexed(self) -> list[bool]:
        return [t == "full_attention" for t in self.layer_types]


PRESETS: dict[str, Qwen4ExpConfig] = {
    # Unit-test model with every part on: 3 Gated DeltaNet layers (the second with PLE) and one QSA
    # layer; 4 streams; the indexer keeps 2 blocks of 4 tokens, so prompts past 8 + 3 tokens select.
    # rotary dims 8 = 2 x (2 + 1 + 1) sections; 4 n-gram heads (2 bigram, 2 trigram) of 16 columns
    # over primes just above 1000 (a 4,096-row table).
    "tiny-qwen4exp": Qwen4ExpConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25,
        mrope_section=(2, 1, 1), linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, hc_count=4, hc_lowrank=16, ple_layer_ids=(2,), ngram_size=3,
        heads_per_ngram=2, ngram_vocab_size_base=1000, indexer_n_heads=4, indexer_head_dim=16,
        indexer_budget=8, indexer_compress_ratio=4,
    ),
    # Speed measurements at transformers' Qwen4ExpTextConfig defaults (bench-qwen4exp-published,
    # below, takes the published per-layer shapes): the per-layer shapes are the defaults (hidden
    # 2048, 16 query / 2 KV heads of 256, linear 16 key / 32 value heads of 128, experts of 512,
    # shared 512, 4 streams of rank 320, n-grams up to 3 with 8 heads each into 2048) with 4 layers
    # (3 Gated DeltaNet, the second with PLE, 1 QSA), 32 experts (512 there) top-10, a 20,000-row
    # base for the n-gram heads (20,000,000 there), and the indexer the defaults leave unset: 16
    # heads of 128, a 2048-token budget in blocks of 4.
    "bench-qwen4exp": Qwen4ExpConfig(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        partial_rotary_factor=0.25, mrope_section=(11, 11, 10), linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, num_experts=32, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, hc_count=4, hc_lowrank=320,
        ple_layer_ids=(2,), ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000, indexer_n_heads=16,
        indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4, max_position_embeddings=262144,
    ),
}
# The published Qwen3.8-Flash-Next's per-layer shapes, as several public test fixtures quote its
# text_config (find_string '"ngram_vocab_size_base": ', e.g. a "public_text_config" with id
# 67354409970; hidden 2560, 48 layers, 512 experts agree across others): hidden 2560, 24 query
# / 2 KV heads of 256, linear 16 key / 48 value heads of 128, experts of 640 top-10 and a shared
# one of 640, 4 streams of rank 320, PLE on layer 2 into 2560 with n-grams up to 3 of 8 heads,
# an indexer of 4 heads of 128 (one key head), a 2048-token budget in blocks of 4, the sigmoid
# output gate. As bench-qwen4exp: 4 layers (3 Gated DeltaNet, the second with PLE, 1 QSA), 32
# experts (512 there: the 10 a token uses are the same size), a 20,000-row n-gram base
# (20,000,000 there: a token reads a few rows of it either way).
PRESETS["bench-qwen4exp-published"] = dataclasses.replace(
    PRESETS["bench-qwen4exp"], hidden_size=2560, num_attention_heads=24, linear_num_value_heads=48,
    moe_intermediate_size=640, shared_expert_intermediate_size=640, ple_embed_dim=2560, indexer_n_heads=4,
    output_gate_type="sigmoid")


# --------------------------------------------------------------------------------------------
# The n-gram hash constants (transformers' Qwen4ExpTextNGramEmbedding.__init__)
# --------------------------------------------------------------------------------------------


def _splitmix64(value: int) -> int:
    value = (value + _SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _SPLITMIX_M1) & _MASK64
    value = ((value ^ (value >> 27)) * _SPLITMIX_M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(cfg: Qwen4ExpConfig, n_vocab: int, ple_index: int) -> list[int]:
    """The odd multipliers of PLE layer `ple_index` (its position in `ple_layer_ids`), one per
    n-gram position; each below (2^63 - 1) / n_vocab, so token x multiplier never overflows."""
    half = max(1, ((1 << 63) - 1) // max(n_vocab, 1) // 2)
    base = cfg.seed + _PRIME_1 * ple_index
    return [2 * (_splitmix64((base + _SPLITMIX_GAMMA * (i + 1)) & _MASK64) % half) + 1
            for i in range(cfg.ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_vocab_sizes(cfg: Qwen4ExpConfig, ple_index: int) -> list[int]:
    """Head h of PLE layer k hashes into the (k * n_heads + h + 1)-th prime >= ngram_vocab_size_base."""
    sizes, p, needed = [], cfg.ngram_vocab_size_base - 1, (ple_index + 1) * cfg.ngram_heads
    while len(sizes) < needed:
        p += 1
        if _is_prime(p):
            sizes.append(p)
    return sizes[ple_index * cfg.ngram_heads:]


def table_rows(cfg: Qwen4ExpConfig, ple_index: int) -> int:
    """Rows of a PLE layer's table: its heads' sizes summed, padded to the divisor."""
    div = cfg.make_ngram_vocab_size_divisible_by
    return -(-sum(head_vocab_sizes(cfg, ple_index)) // div) * div


# --------------------------------------------------------------------------------------------
# Hugging Face weights
# --------------------------------------------------------------------------------------------


def hf_config(cfg: Qwen4ExpConfig, n_vocab: int, eos_id: int) -> dict[str, object]:
    """The config.json of a text-only checkpoint with `hf_weights` (`Qwen4ExpForCausalLM`): Qwen3.5
    MoE's fields and this family's, under transformers' names. The n-gram embeddings hash ids
    across `eos_id`, so it is part of the model."""
    config = qwen35.hf_config(cfg, n_vocab)
    config.pop("mtp_num_hidden_layers")
    config.update(
        architectures=["Qwen4ExpForCausalLM"], model_type="qwen4_exp_text", eos_token_id=eos_id,
        hc_count=cfg.hc_count, hc_lowrank=cfg.hc_lowrank, ple_layer_ids=list(cfg.ple_layer_ids),
        ple_embed_dim=cfg.ple_embed_dim, ple_conv_kernel_size=cfg.ple_conv_kernel_size, ngram_size=cfg.ngram_size,
        heads_per_ngram=cfg.heads_per_ngram, ngram_vocab_size_base=cfg.ngram_vocab_size_base,
        make_ngram_vocab_size_divisible_by=cfg.make_ngram_vocab_size_divisible_by, seed=cfg.seed,
        indexer_n_heads=cfg.indexer_n_heads, indexer_kv_heads=1, indexer_head_dim=cfg.indexer_head_dim,
        indexer_budget=cfg.indexer_budget, indexer_compress_ratio=cfg.indexer_compress_ratio,
        output_gate_type=cfg.output_gate_type)
    return config


def hf_weights(cfg: Qwen4ExpConfig, n_vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights named and shaped as a loaded `Qwen4ExpForCausalLM` (float32; the hash buffers int64).

    Zero-centred norms (hyper-connection, PLE, q/k and indexer norms) are small around 0."""
    base = qwen35.hf_weights(cfg, n_vocab, seed)
    w = {k: v for k, v in base.items()
         if not k.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")) and k != "model.norm.weight"}
    rng = np.random.default_rng([seed, 4])
    E, H, R = cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank
    HE = H * E

    def lin(n_out: int, n_in: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * (scale / np.sqrt(n_in))).astype(np.float32)

    def znorm(n: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    def hyper_connection(p: str, inject: bool) -> None:
        w[p + "hc_norm.weight"] = znorm(HE)
        w[p + "input_mix_weight_down.weight"] = lin(R, HE)
        w[p + "input_mix_weight_up.weight"] = lin(HE, R, 2.0)
        if inject:
            w[p + "block_inject_weight.weight"] = lin(H, HE, 2.0)

    for il in range(cfg.num_hidden_layers):
        p = f"model.layers.{il}."
        hyper_connection(p + "attn_hyper_connection.", True)
        hyper_connection(p + "mlp_hyper_connection.", True)
        if cfg.indexed[il]:
            D = cfg.indexer_head_dim
            w[p + "self_attn.indexer.index_qk_proj.weight"] = lin((cfg.indexer_n_heads + 1) * D, E, 2.0)
            w[p + "self_attn.indexer.q_layernorm.weight"] = znorm(D)
            w[p + "self_attn.indexer.k_layernorm.weight"] = znorm(D)
        if il + 1 in cfg.ple_layer_ids:
            k = cfg.ple_layer_ids.index(il + 1)
            q = p + "ple."
            P = cfg.ple_dim
            w[q + "key_proj.weight"] = lin(HE, P)
            w[q + "value_proj.weight"] = lin(E, P)
            for n in ("norm_key", "norm_query", "norm_conv"):
                w[q + n + ".weight"] = znorm(HE)
            w[q + "conv1d.weight"] = (rng.standard_normal((HE, 1, cfg.ple_conv_kernel_size)) * 0.5).astype(np.float32)
            sizes = head_vocab_sizes(cfg, k)
            e = q + "ple_embedding."
            table = rng.standard_normal((table_rows(cfg, k), cfg.ple_row_dim))
            w[e + "ngram_embedding.weight"] = table.astype(np.float32)
            w[e + "layer_multipliers"] = np.array(layer_multipliers(cfg, n_vocab, k), dtype=np.int64)
            w[e + "ngram_heads_vocab_sizes"] = np.array(sizes, dtype=np.int64)
            w[e + "ngram_heads_offsets"] = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    hyper_connection("model.hyper_connection_mixer.", False)
    return w


# --------------------------------------------------------------------------------------------
# The converter
# --------------------------------------------------------------------------------------------

# HF (without "model.layers.N.") -> GGUF (without "blk.N."); norms here are stored 1 + w
_HC_NAMES = {"hc_norm.weight": "norm.weight", "input_mix_weight_down.weight": "down.weight",
             "input_mix_weight_up.weight": "up.weight", "block_inject_weight.weight": "inject.weight"}
_PLE_NAMES = {"key_proj.weight": "ple_key.weight", "value_proj.weight": "ple_value.weight",
              "norm_key.weight": "ple_norm_key.weight", "norm_query.weight": "ple_norm_query.weight",
              "norm_conv.weight": "ple_norm_conv.weight", "conv1d.weight": "ple_conv1d.weight"}
PLE_TABLE = "per_layer_token_embd.weight"
_HASH_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


def _own_tensor(cfg: Qwen4ExpConfig, name: str, x: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """`Qwen4ExpTextModel.modify_tensors` (plus the inherited `1 + w` on `hc_norm`) for a tensor
    Qwen3.5 does not have; None for the ones `qwen35.convert` handles."""
    if name.startswith("model.hyper_connection_mixer."):
        leaf = name.removeprefix("model.hyper_connection_mixer.")
        return [("output_hc_" + _HC_NAMES[leaf], x + np.float32(1.0) if leaf == "hc_norm.weight" else x)]
    parts = name.split(".", 3)
    if parts[:2] != ["model", "layers"]:
        return None
    blk, rest = f"blk.{parts[2]}.", parts[3]
    for module, short in (("attn_hyper_connection.", "hc_attn_"), ("mlp_hyper_connection.", "hc_ffn_")):
        if rest.startswith(module):
            leaf = rest.removeprefix(module)
            return [(blk + short + _HC_NAMES[leaf], x + np.float32(1.0) if leaf == "hc_norm.weight" else x)]
    if rest == "self_attn.indexer.index_qk_proj.weight":
        n_q = cfg.indexer_n_heads * cfg.indexer_head_dim
        return [(blk + "indexer.q_proj.weight", x[:n_q]), (blk + "indexer.k_proj.weight", x[n_q:])]
    if rest in ("self_attn.indexer.q_layernorm.weight", "self_attn.indexer.k_layernorm.weight"):
        return [(blk + f"indexer.{rest.split('.')[2][0]}_norm.weight", x + np.float32(1.0))]
    if rest == "ple.ple_embedding.ngram_embedding.weight":
        return [(PLE_TABLE, x)]
    if rest.startswith("ple.ple_embedding."):
        return []  # the hash buffers become keys (ple_hash_keys)
    if rest.startswith("ple."):
        leaf = rest.removeprefix("ple.")
        if leaf == "conv1d.weight":
            x = x.squeeze()
        elif leaf.startswith("norm_"):
            x = x + np.float32(1.0)
        return [(blk + _PLE_NAMES[leaf], x)]
    return None


def convert(cfg: Qwen4ExpConfig, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GGUF tensors (numpy order, float32) from HF tensors, as conversion/qwen4exp.py writes them."""
    if len(cfg.ple_layer_ids) > 1:
        raise ValueError("the converter carries one PLE layer: its table and hash keys have no layer number")
    out: dict[str, np.ndarray] = {}
    shared: dict[str, np.ndarray] = {}
    for name, x in hf.items():
        own = _own_tensor(cfg, name, x)
        if own is None:
            shared[name] = x
        for gguf_name, arr in own or []:
            out[gguf_name] = np.ascontiguousarray(arr, dtype=np.float32)
    return {**qwen35.convert(cfg, shared), **out}


def ple_hash_keys(hf: dict[str, np.ndarray]) -> dict[str, list[int]]:
    """The u64 array keys `set_gguf_parameters` reads from the first PLE layer's buffers."""
    keys = {}
    for buffer, key in zip(_HASH_BUFFERS, ("layer_multipliers", "head_vocab_sizes", "head_offsets")):
        found = [v for k, v in hf.items() if k.endswith("ple_embedding." + buffer)]
        if found:
            keys[key] = [int(v) for v in found[0]]
    return keys


def model_tensors(cfg: Qwen4ExpConfig, n_vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The GGUF tensors of a synthetic model: `convert(cfg, hf_weights(cfg, n_vocab, seed))`."""
    return convert(cfg, hf_weights(cfg, n_vocab, seed))


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _add_metadata(w: gguf.GGUFWriter, cfg: Qwen4ExpConfig, hf: dict[str, np.ndarray], eos_id: int,
                  wtype: str) -> None:
    """Qwen3.5-MoE's keys, then what `Qwen4ExpTextModel.set_gguf_parameters` adds."""
    qwen35.add_metadata(w, cfg, wtype)
    w.add_uint32(f"{ARCH}.hyper_connection.count", cfg.hc_count)
    w.add_uint32(f"{ARCH}.hyper_connection.low_rank", cfg.hc_lowrank)
    w.add_uint32(f"{ARCH}.attention.indexer.head_count", cfg.indexer_n_heads)
    w.add_uint32(f"{ARCH}.attention.indexer.key_length", cfg.indexer_head_dim)
    w.add_uint32(f"{ARCH}.attention.indexer.top_k", cfg.indexer_budget)
    w.add_array(f"{ARCH}.attention.compress_ratios",
                [cfg.indexer_compress_ratio if ix else 0 for ix in cfg.indexed])
    if not cfg.ple_layer_ids:
        return
    w.add_array(f"{ARCH}.ple.layers", [i - 1 for i in cfg.ple_layer_ids])
    w.add_uint32(f"{ARCH}.ple.ngram_size", cfg.ngram_size)
    w.add_uint32(f"{ARCH}.ple.heads_per_ngram", cfg.heads_per_ngram)
    w.add_uint32(f"{ARCH}.ple.conv_kernel", cfg.ple_conv_kernel_size)
    w.add_uint32(f"{ARCH}.ple.eos_token_id", eos_id)
    w.add_uint32(f"{ARCH}.embedding_length_per_layer_input", cfg.ple_row_dim)
    for key, values in ple_hash_keys(hf).items():
        w.add_key_value(f"{ARCH}.ple.{key}", values, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT64)


def write_model(path: str | Path, config: Qwen4ExpConfig | str = "tiny-qwen4exp", wtype: str = "f32",
                seed: int = 0, name: str | None = None) -> Path:
    """Write a synthetic Qwen3.8-Flash-Next GGUF to `path` and return the path."""
    cfg, vocab = config_and_vocab(config, PRESETS, wtype)
    hf = hf_weights(cfg, vocab.n_vocab, seed)
    return write_gguf_file(path, ARCH, name, lambda w: _add_metadata(w, cfg, hf, vocab.eos_id, wtype),
                           convert(cfg, hf), wtype, (vocab, "qwen35", qwen35.chat_template()))


def config_with(preset: str = "tiny-qwen4exp", **changes: object) -> Qwen4ExpConfig:
    """A preset with some fields changed (handy in tests); the layer pattern follows a new depth."""
    if ("num_hidden_layers" in changes or "full_attention_interval" in changes) and "layer_types" not in changes:
        changes["layer_types"] = ()
    return dataclasses.replace(PRESETS[preset], **changes)
