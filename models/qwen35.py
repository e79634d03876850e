"""Writes synthetic Qwen3.5 GGUF files (`qwen35`, `qwen35moe`) the way llama.cpp's converter does.

Why in two steps: a graph that broadcasts key heads to value heads the wrong way still gives
plausible logits, so the only trustworthy check starts from weights in Hugging Face's order and
names. `hf_weights(cfg, n_vocab, seed)` makes those (what a `Qwen3_5ForCausalLM` /
`Qwen3_5MoeForCausalLM` checkpoint holds, MTP block under `mtp.*`); `convert(cfg, hf)` then does
what `conversion/qwen.py` (llama.cpp, vendored in llama-cpp-python 0.3.36) does to them:

* `_QwenMtpMixin.filter_tensors`: `mtp.layers.0.X` -> block `n_layer`, `mtp.fc` -> `eh_proj`,
  `mtp.pre_fc_norm_embedding` -> `enorm`, `mtp.pre_fc_norm_hidden` -> `hnorm`, `mtp.norm` ->
  `shared_head.norm` (all under `blk.{n_layer}.nextn.`);
* `_LinearAttentionVReorderBase.modify_tensors` (only when value heads != key heads): every
  value-head-indexed tensor goes from HF's grouped order (key head g's value heads together) to
  tiled order (value head j of every key head, then j+1): V rows of `in_proj_qkv` and of the conv
  kernel, `in_proj_z`, `in_proj_b`, `in_proj_a`, `A_log`, `dt_bias`, `out_proj` columns;
* `Qwen3NextModel.modify_tensors`: `A_log` -> `-exp(A_log)` (`ssm_a`), `dt_bias` -> `ssm_dt.bias`,
  conv kernel squeezed to (channels, kernel), and every `*norm.weight` except the gated
  `linear_attn.norm.weight` stored as `1 + w` (Qwen3.5's RMSNorm is zero-centred: it multiplies by
  `1 + weight`);
* `Qwen2MoeModel.modify_tensors`: `experts.gate_up_proj` split into `ffn_gate_exps` / `ffn_up_exps`;
* metadata of `TextModel`, `Qwen2MoeModel`, `Qwen3NextModel`, `_QwenMtpMixin` and
  `_Qwen35MRopeMixin.set_gguf_parameters` (`rope.dimension_sections` padded to 4 entries,
  `rope.dimension_count` = head_dim x partial_rotary_factor, `attention.recurrent_layers` with the
  MTP block as `False`, `nextn_predict_layers`).

Types follow the converter's rule (1-D tensors, norms, routers, the shared-expert gate and the conv
kernel stay F32); k-quants use ggml's quantizer like `generate.py`. The vocabulary is the packaged
tiny cut of the Qwen2 BPE with pre-tokenizer `qwen35`, the chat template the Qwen3.5 one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import gguf
import numpy as np

from deltarun.model_files.generate import _FILE_TYPES, config_and_vocab, gguf_tensor_name, write_gguf_file

CHAT_TEMPLATE_RESOURCE = "data/qwen35-chat-template.jinja"


@dataclass(frozen=True)
class Qwen35Config:
    """A Qwen3.5 text model's hyper-parameters, named as in transformers' `Qwen3_5TextConfig` /
    `Qwen3_5MoeTextConfig` (configuration_qwen3_5*.py)."""

    moe: bool = False
    #: the vocabulary the file carries (models/vocab.py VOCABS)
    vocab: str = "tiny"
    hidden_size: int = 256
    num_hidden_layers: int = 4
    full_attention_interval: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    partial_rotary_factor: float = 0.25
    #: rope_parameters["mrope_section"] (3 entries in HF configs; the converter pads to 4).
    mrope_section: tuple[int, ...] = (3, 3, 2)
    rope_theta: float = 10_000_000.0
    rms_norm_eps: float = 1e-6
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    intermediate_size: int = 512          # dense FFN (qwen35)
    num_experts: int = 8                  # qwen35moe
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 256
    shared_expert_intermediate_size: int = 256
    mtp_num_hidden_layers: int = 1
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    layer_types: tuple[str, ...] = field(default=())
    #: Scales what each block adds to the residual stream (its output projections), as
    #: `generate.ModelConfig.residual_scale`. Near 0 the model "echoes": the residual stays the
    #: input token's embedding, so with tied embeddings greedy decoding repeats the last token, and
    #: the MTP block's eh_proj passes the embedding through, so every MTP draft is right, at the
    #: same shapes and cost as random weights (speculative-decoding benchmarks).
    residual_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.layer_types:  # transformers' default pattern (Qwen3_5TextConfig.__post_init__)
            kinds = tuple("linear_attention" if (i + 1) % self.full_attention_interval else "full_attention"
                          for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", kinds)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers "
                             "(use config_with to change the depth)")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.residual_scale < 1.0 and not self.tie_word_embeddings:
            raise ValueError("an echo model (residual_scale < 1) needs tied embeddings: its LM head is the embedding")

    @property
    def arch(self) -> str:
        return "qwen35moe" if self.moe else "qwen35"

    @property
    def n_rot(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_sections(self) -> list[int]:
        """`rope.dimension_sections` as the converter writes it: padded with zeros to 4 entries."""
        return (list(self.mrope_section) + [0, 0, 0, 0])[:4]

    @property
    def recurrent(self) -> list[bool]:
        return [t == "linear_attention" for t in self.layer_types]

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


PRESETS: dict[str, Qwen35Config] = {
    # Unit-test models: 3 linear + 1 full layer, one MTP block, value heads = 2 x key heads, rotary
    # dims 16 = 2 x (3 + 3 + 2) sections.
    "tiny-qwen35": Qwen35Config(),
    "tiny-qwen35moe": Qwen35Config(moe=True),
    # The layer shapes of Qwen/Qwen3.5-0.8B, the smallest published Qwen3.5 (dense), from its
    # config.json as quoted verbatim in two public test fixtures found with the code search
    # (find_string '"linear_num_value_heads": 16', ids 54905607740 and 54606364174): hidden 1024,
    # 24 layers (every 4th full attention), 8 query / 2 KV heads of 256, FFN 3584, 16 key / 16 value
    # linear heads of 128, conv 4, partial_rotary_factor 0.25, mrope_section [11, 11, 10],
    # rope_theta 1e7, tied embeddings, 1 MTP layer. Attention/FFN shapes agree with
    # THUDM/slime scripts/models/qwen3.5-0.8B.sh. Random weights; tiny vocabulary.
    # (With 16 = 16 heads the converter's value-head reorder is the identity on this shape.)
    "bench-qwen35": Qwen35Config(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, mrope_section=(11, 11, 10), linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, intermediate_size=3584,
        tie_word_embeddings=True, max_position_embeddings=262144,
    ),
}
# bench-qwen35 with the published 248,320-row embedding and LM head (tied), which dominate
# decoding a 0.8B model: llama.cpp's Qwen2 vocabulary padded as the converter pads (models/vocab.py).
PRESETS["bench-qwen35-vocab248k"] = dataclasses.replace(PRESETS["bench-qwen35"], vocab="qwen2-248k")
# Speculative decoding at weight-bound shapes: the same layers with the 151,936-token Qwen2
# vocabulary (674M parameters), with random weights (MTP drafts almost never right) and as echo
# models (every draft right; see Qwen35Config.residual_scale: small, not zero, so every product
# still runs on real numbers). Same tensors, types and cost per token.
PRESETS["bench-qwen35-vocab151k"] = dataclasses.replace(PRESETS["bench-qwen35"], vocab="qwen2")
PRESETS["bench-qwen35-echo"] = dataclasses.replace(PRESETS["bench-qwen35"], residual_scale=1e-3)
PRESETS["bench-qwen35-echo-vocab151k"] = dataclasses.replace(PRESETS["bench-qwen35-vocab151k"], residual_scale=1e-3)


# --------------------------------------------------------------------------------------------
# Hugging Face weights
# --------------------------------------------------------------------------------------------


def hf_config(cfg: Qwen35Config, n_vocab: int) -> dict[str, object]:
    """The config.json of a text-only checkpoint with `hf_weights` (`Qwen3_5ForCausalLM` /
    `Qwen3_5MoeForCausalLM`: the published files nest these fields under `text_config`)."""
    config: dict[str, object] = {
        "architectures": ["Qwen3_5MoeForCausalLM" if cfg.moe else "Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_moe_text" if cfg.moe else "qwen3_5_text", "vocab_size": n_vocab,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "layer_types": list(cfg.layer_types), "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": "silu", "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings, "mtp_num_hidden_layers": cfg.mtp_num_hidden_layers,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor,
                            "mrope_section": list(cfg.mrope_section), "mrope_interleaved": True},
    }
    if cfg.moe:
        config.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                      moe_intermediate_size=cfg.moe_intermediate_size,
                      shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    else:
        config["intermediate_size"] = cfg.intermediate_size
    return config


def hf_weights(cfg: Qwen35Config, n_vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights named and shaped as a Hugging Face Qwen3.5 checkpoint (torch shapes).

    Zero-centred RMSNorm weights (`input_layernorm`, `q_norm`, ...) are small around 0 (the model
    multiplies by 1 + w); the gated `linear_attn.norm` is around 1 (multiplied as it is).
    """
    rng = np.random.default_rng(seed)
    E = cfg.hidden_size
    depth_scale = cfg.residual_scale / np.sqrt(2.0 * max(cfg.num_hidden_layers, 1))   # output projections

    def lin(n_out: int, n_in: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * (scale / np.sqrt(n_in))).astype(np.float32)

    def znorm(n: int) -> np.ndarray:  # zero-centred: the model uses 1 + w
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    def attention(p: str) -> dict[str, np.ndarray]:
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        return {
            p + "self_attn.q_proj.weight": lin(2 * hd * nh, E),   # per head: hd query rows, hd gate rows
            p + "self_attn.k_proj.weight": lin(hd * nkv, E),
            p + "self_attn.v_proj.weight": lin(hd * nkv, E),
            p + "self_attn.o_proj.weight": lin(E, hd * nh, depth_scale),
            p + "self_attn.q_norm.weight": znorm(hd),
            p + "self_attn.k_norm.weight": znorm(hd),
        }

    def linear_attention(p: str) -> dict[str, np.ndarray]:
        nv = cfg.linear_num_value_heads
        q = p + "linear_attn."
        return {
            q + "in_proj_qkv.weight": lin(cfg.conv_dim, E),
            q + "in_proj_z.weight": lin(cfg.value_dim, E),
            q + "in_proj_b.weight": lin(nv, E),
            q + "in_proj_a.weight": lin(nv, E),
            q + "conv1d.weight": (rng.standard_normal((cfg.conv_dim, 1, cfg.linear_conv_kernel_dim)) * 0.5
                                  ).astype(np.float32),
            q + "dt_bias": rng.uniform(-1.0, 1.0, nv).astype(np.float32),
            q + "A_log": np.log(rng.uniform(0.1, 1.6, nv)).astype(np.float32),
            q + "norm.weight": (1.0 + 0.1 * rng.standard_normal(cfg.linear_value_head_dim)).astype(np.float32),
            q + "out_proj.weight": lin(E, cfg.value_dim, depth_scale),
        }

    def mlp(p: str) -> dict[str, np.ndarray]:
        if not cfg.moe:
            ff = cfg.intermediate_size
            return {p + "mlp.gate_proj.weight": lin(ff, E), p + "mlp.up_proj.weight": lin(ff, E),
                    p + "mlp.down_proj.weight": lin(E, ff, depth_scale)}
        ne, ff, fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        return {
            # A wide router keeps top-k margins clear, so tiny numeric noise does not swap experts.
            p + "mlp.gate.weight": lin(ne, E, 4.0),
            p + "mlp.experts.gate_up_proj": np.stack([lin(2 * ff, E) for _ in range(ne)]),
            p + "mlp.experts.down_proj": np.stack([lin(E, ff, depth_scale) for _ in range(ne)]),
            p + "mlp.shared_expert.gate_proj.weight": lin(fs, E),
            p + "mlp.shared_expert.up_proj.weight": lin(fs, E),
            p + "mlp.shared_expert.down_proj.weight": lin(E, fs, depth_scale),
            p + "mlp.shared_expert_gate.weight": lin(1, E, 2.0),
        }

    def block(p: str, recurrent: bool) -> dict[str, np.ndarray]:
        t = {p + "input_layernorm.weight": znorm(E), p + "post_attention_layernorm.weight": znorm(E)}
        t.update(linear_attention(p) if recurrent else attention(p))
        t.update(mlp(p))
        return t

    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((n_vocab, E)).astype(np.float32),
        "model.norm.weight": znorm(E),
    }
    if not cfg.tie_word_embeddings:
        # A large LM-head scale gives peaked distributions, so greedy choices have clear margins.
        w["lm_head.weight"] = (rng.standard_normal((n_vocab, E)) * (4.0 / np.sqrt(E))).astype(np.float32)
    for il, rec in enumerate(cfg.recurrent):
        w.update(block(f"model.layers.{il}.", rec))
    for j in range(cfg.mtp_num_hidden_layers):
        w.update(block(f"mtp.layers.{j}.", recurrent=False))
    if cfg.mtp_num_hidden_layers:
        fc = lin(E, 2 * E)
        if cfg.residual_scale < 1.0:   # echo models: fc(concat(embedding, hidden)) passes the embedding
            fc = np.concatenate([np.eye(E, dtype=np.float32), fc[:, E:] * cfg.residual_scale], axis=1)
        w["mtp.fc.weight"] = fc
        w["mtp.pre_fc_norm_embedding.weight"] = znorm(E)
        w["mtp.pre_fc_norm_hidden.weight"] = znorm(E)
        w["mtp.norm.weight"] = znorm(E)
    return w


# --------------------------------------------------------------------------------------------
# The converter
# --------------------------------------------------------------------------------------------

# HF tensor name (after the MTP rename, without "model.layers.N.") -> GGUF name (without "blk.N.").
_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.down_proj.weight": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "eh_proj.weight": "nextn.eh_proj.weight",
    "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight",
    "shared_head.norm.weight": "nextn.shared_head_norm.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
_MTP_RENAMES = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
                "norm": "shared_head.norm"}


def _mtp_name(name: str, n_layer: int) -> str:
    """`_QwenMtpMixin.filter_tensors`: MTP tensors become block `n_layer + i` tensors."""
    parts = name.split(".", 3)
    if parts[0] != "mtp":
        return name
    if len(parts) == 4 and parts[1] == "layers":
        return f"model.layers.{n_layer + int(parts[2])}.{parts[3]}"
    return f"model.layers.{n_layer}.{_MTP_RENAMES[parts[1]]}.{parts[2]}"


def reorder_v_heads(x: np.ndarray, axis: int, n_k_heads: int, v_per_k: int, head_dim: int) -> np.ndarray:
    """`_reorder_v_heads`: along `axis`, view (n_k_heads, v_per_k, head_dim) and swap the first two."""
    axis = axis % x.ndim
    shape = x.shape
    y = x.reshape(shape[:axis] + (n_k_heads, v_per_k, head_dim) + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(y, axis, axis + 1)).reshape(shape)


def _reorder_linear_attention(cfg: Qwen35Config, name: str, x: np.ndarray) -> np.ndarray:
    """`_LinearAttentionVReorderBase.modify_tensors` on one HF tensor."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if nk == nv or "linear_attn." not in name:
        return x
    r, dv = nv // nk, cfg.linear_value_head_dim
    if ".in_proj_qkv." in name or ".conv1d" in name:
        if ".conv1d" in name:
            x = x.squeeze()
        qk = 2 * cfg.key_dim
        return np.concatenate([x[:qk], reorder_v_heads(x[qk:], 0, nk, r, dv)], axis=0)
    if ".in_proj_z." in name:
        return reorder_v_heads(x, 0, nk, r, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name:
        return reorder_v_heads(x, 0, nk, r, 1)
    if ".A_log" in name or ".dt_bias" in name:
        return reorder_v_heads(x[:, None], 0, nk, r, 1)[:, 0]
    if ".out_proj." in name:
        return reorder_v_heads(x, 1, nk, r, dv)
    return x


def convert(cfg: Qwen35Config, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GGUF tensors (numpy order, float32) from HF tensors, as conversion/qwen.py writes them."""
    out: dict[str, np.ndarray] = {}
    for hf_name, x in hf.items():
        name = _mtp_name(hf_name, cfg.num_hidden_layers)
        x = _reorder_linear_attention(cfg, name, np.asarray(x, dtype=np.float32))
        # Qwen3NextModel.modify_tensors
        if name.endswith(".A_log"):
            x = -np.exp(x)
        elif "conv1d" in name:
            x = x.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x + np.float32(1.0)
        # Qwen2MoeModel.modify_tensors: the fused gate_up is split in two
        pieces = [(name, x)]
        if name.endswith("mlp.experts.gate_up_proj"):
            n_ff = x.shape[-2] // 2
            base = name.removesuffix(".gate_up_proj")
            pieces = [(base + ".gate_proj.weight", x[..., :n_ff, :]), (base + ".up_proj.weight", x[..., n_ff:, :])]
        elif name.endswith("mlp.experts.down_proj"):
            pieces = [(name + ".weight", x)]
        for piece_name, arr in pieces:
            out[_gguf_name(piece_name)] = np.ascontiguousarray(arr, dtype=np.float32)
    return out


def _gguf_name(name: str) -> str:
    return gguf_tensor_name(name, _GLOBAL_NAMES, _BLOCK_NAMES)


def model_tensors(cfg: Qwen35Config, n_vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The GGUF tensors of a synthetic model: `convert(cfg, hf_weights(cfg, n_vocab, seed))`."""
    return convert(cfg, hf_weights(cfg, n_vocab, seed))


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def chat_template() -> str:
    """The Qwen3.5 chat template (llama.cpp models/templates/Qwen3.5-4B.jinja, MIT)."""
    return resources.files("deltarun.model_files").joinpath(CHAT_TEMPLATE_RESOURCE).read_text(encoding="utf-8")


def add_metadata(w: gguf.GGUFWriter, cfg: Qwen35Config, wtype: str) -> None:
    """The keys `set_gguf_parameters` of the converter's class chain writes for this config (also the
    start of qwen4exp's, models/qwen4exp.py)."""
    arch = cfg.arch
    n_blocks = cfg.num_hidden_layers + cfg.mtp_num_hidden_layers
    # TextModel
    w.add_block_count(n_blocks)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if not cfg.moe:  # Qwen3_5MoeTextConfig has no intermediate_size
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_sections(cfg.rope_sections)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(_FILE_TYPES[wtype])
    # Qwen2MoeModel
    if cfg.moe:
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    # _QwenMtpMixin
    if cfg.mtp_num_hidden_layers:
        w.add_nextn_predict_layers(cfg.mtp_num_hidden_layers)
    # Qwen3NextModel
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.value_dim)
    w.add_array(f"{arch}.attention.recurrent_layers", cfg.recurrent + [False] * cfg.mtp_num_hidden_layers)
    w.add_full_attention_interval(cfg.full_attention_interval)
    w.add_rope_dimension_count(cfg.n_rot)


def write_model(path: str | Path, config: Qwen35Config | str = "tiny-qwen35", wtype: str = "f32",
                seed: int = 0, name: str | None = None) -> Path:
    """Write a synthetic Qwen3.5 GGUF to `path` and return the path."""
    cfg, vocab = config_and_vocab(config, PRESETS, wtype)
    tensors = model_tensors(cfg, vocab.n_vocab, seed)
    return write_gguf_file(path, cfg.arch, name, lambda w: add_metadata(w, cfg, wtype), tensors, wtype,
                           (vocab, "qwen35", chat_template()))


def config_with(preset: str = "tiny-qwen35", **changes: object) -> Qwen35Config:
    """A preset with some fields changed (handy in tests); the layer pattern follows a new depth."""
    if ("num_hidden_layers" in changes or "full_attention_interval" in changes) and "layer_types" not in changes:
        changes["layer_types"] = ()
    return dataclasses.replace(PRESETS[preset], **changes)
