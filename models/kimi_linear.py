"""Writes synthetic Kimi-Linear GGUF files (`kimi-linear`) the way llama.cpp's converter does.

As for Qwen3.5 (models/qwen35.py), in two steps, so that a test can start from weights no GGUF
layout has touched: `hf_weights(cfg, n_vocab, seed)` makes what a `KimiLinearForCausalLM`
checkpoint holds (moonshotai's names, which llama.cpp's tensor_mapping.py maps: `self_attn.q_conv1d`,
`f_a_proj`, `b_proj`, `A_log`, `dt_bias`, `g_a_proj`, `o_norm`, `kv_a_proj_with_mqa`, `kv_b_proj`,
`block_sparse_moe.experts.N.w1`, ... in torch shapes); `convert(cfg, hf)` then does what
`conversion/kimi_linear.py` (llama.cpp, vendored in llama-cpp-python 0.3.36) does to them:

* `q/k/v_conv1d.weight` [channels, 1, d_conv] reshaped to numpy (1, channels, 1, d_conv)
  (ggml ne [d_conv, 1, channels, 1]: the same memory);
* `A_log` [1, 1, H, 1] stored as `-exp(A_log)` (`ssm_a`), `dt_bias` renamed to `ssm_dt.bias`;
* the experts' `w1`, `w3`, `w2` stacked into `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`;
* `kv_b_proj` [H (nope + v), kv_lora] split per head into `attn_k_b` (k rows, transposed to
  (H, kv_lora, nope)) and `attn_v_b` ((H, v, kv_lora));
* metadata of `TextModel` and `KimiLinearModel.set_gguf_parameters`: `attention.head_count_kv`
  per layer (1 for MLA layers, 0 for KDA layers), `attention.key_length` = kv_lora + rope, the MLA
  head sizes, `kda.head_dim`, the MoE keys (see docs/kimi-linear-gguf.md).

Norm weights are stored as they are (Kimi's RMSNorm multiplies by w, not 1 + w). Types follow the
converter's rule (1-D tensors, norms, the router and the conv kernels stay F32). The vocabulary is
the packaged tiny cut of the Qwen2 BPE, or (`vocab="tiny-kimi-k2"`) a small one in the layout the
converter writes from Kimi-K2's tiktoken ranks, with the `kimi-k2` pre-tokenizer (models/vocab.py).
The chat template is the one a converted file carries with that vocabulary, Kimi-Linear-48B-A3B-
Instruct's (models/data/NOTICE.md); the Qwen2 vocabulary has none of its special tokens, so those
files get the Qwen3 template.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import gguf
import numpy as np

from deltarun.model_files.generate import (_FILE_TYPES, chat_template, config_and_vocab, gguf_tensor_name,
                                           write_gguf_file)

ARCH = "kimi-linear"
#: moonshotai/Kimi-Linear-48B-A3B-Instruct's chat_template.jinja (models/data/NOTICE.md)
CHAT_TEMPLATE_RESOURCE = "data/kimi-linear-chat-template.jinja"
GATING_SIGMOID = 2   # gguf.ExpertGatingFuncType.SIGMOID


@dataclass(frozen=True)
class KimiLinearConfig:
    """A Kimi-Linear model's hyper-parameters, named as in its config.json (`linear_attn_config`
    flattened: `full_attn_layers` / `kda_layers` are 1-based layer numbers)."""

    vocab: str = "tiny"
    hidden_size: int = 128
    num_hidden_layers: int = 4
    full_attn_layers: tuple[int, ...] = (2, 4)
    num_attention_heads: int = 4        # MLA heads = KDA heads (linear_attn_config.num_heads)
    kda_head_dim: int = 32              # linear_attn_config.head_dim
    short_conv_kernel_size: int = 4
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    intermediate_size: int = 256        # the leading dense layers
    first_k_dense_replace: int = 1
    num_experts: int = 8
    num_experts_per_token: int = 2
    moe_intermediate_size: int = 64
    num_shared_experts: int = 1
    routed_scaling_factor: float = 2.446
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if any(not 1 <= i <= self.num_hidden_layers for i in self.full_attn_layers):
            raise ValueError(f"full_attn_layers {self.full_attn_layers} must be 1-based layer numbers "
                             f"up to {self.num_hidden_layers}")
        if self.q_lora_rank is not None:
            raise ValueError("only Kimi-Linear's uncompressed query (q_lora_rank = None) is generated")

    @property
    def recurrent(self) -> list[bool]:
        return [i + 1 not in self.full_attn_layers for i in range(self.num_hidden_layers)]

    @property
    def kda_dim(self) -> int:
        return self.num_attention_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


PRESETS: dict[str, KimiLinearConfig] = {
    # Unit-test model: KDA, MLA, KDA, MLA; layer 0 dense, the others MoE with a shared expert.
    "tiny-kimi-linear": KimiLinearConfig(),
    # The same with Kimi-K2's tokenizer layout (a small `kimi-k2` vocabulary, models/vocab.py).
    "tiny-kimi-linear-k2vocab": KimiLinearConfig(vocab="tiny-kimi-k2"),
    # Speed runs: the layer shapes of moonshotai/Kimi-Linear-48B-A3B (docs/kimi-linear-gguf.md:
    # hidden 2304, 32 heads, KDA head dim 128, conv 4, MLA kv_lora 512 / nope 128 / rope 64 / v 128,
    # dense FFN 9216, experts of 1024 with one shared, top-8 sigmoid routing scaled by 2.446) and
    # its first four layers (KDA dense, KDA MoE, KDA MoE, MLA MoE: the published pattern has MLA at
    # every 4th layer and one leading dense layer). Two deviations, both for the memory the
    # generator holds (F32 copies of every tensor): 32 routed experts instead of 256 (the 8 a token
    # uses are the same size, so decoding costs what it costs in the real model; a prompt's ubatch
    # reads 32 experts' weights, not up to 256), and the tiny kimi-k2 vocabulary instead of 163,840
    # rows (bench-kimi-linear-vocab164k has that size).
    "bench-kimi-linear": KimiLinearConfig(
        vocab="tiny-kimi-k2", hidden_size=2304, num_hidden_layers=4, full_attn_layers=(4,),
        num_attention_heads=32, kda_head_dim=128, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, intermediate_size=9216, num_experts=32,
        num_experts_per_token=8, moe_intermediate_size=1024, max_position_embeddings=1048576,
    ),
}
# bench-kimi-linear with the published 163,840-row embedding and LM head (not tied), which a
# decoding step reads in full: llama.cpp's Qwen2 vocabulary padded as the converter pads.
PRESETS["bench-kimi-linear-vocab164k"] = dataclasses.replace(PRESETS["bench-kimi-linear"], vocab="qwen2-164k")


# --------------------------------------------------------------------------------------------
# Hugging Face weights
# --------------------------------------------------------------------------------------------


def hf_weights(cfg: KimiLinearConfig, n_vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights named and shaped as a Kimi-Linear checkpoint (torch shapes)."""
    rng = np.random.default_rng(seed)
    E, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.kda_head_dim
    depth_scale = 1.0 / np.sqrt(2.0 * cfg.num_hidden_layers)

    def lin(n_out: int, n_in: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * (scale / np.sqrt(n_in))).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def kda(p: str) -> dict[str, np.ndarray]:
        t = {p + f"{x}_proj.weight": lin(H * d, E) for x in "qkv"}
        for x in "qkv":
            t[p + f"{x}_conv1d.weight"] = (rng.standard_normal((H * d, 1, cfg.short_conv_kernel_size)) * 0.5
                                           ).astype(np.float32)
        t[p + "f_a_proj.weight"] = lin(d, E)
        t[p + "f_b_proj.weight"] = lin(H * d, d)
        t[p + "b_proj.weight"] = lin(H, E)
        t[p + "A_log"] = np.log(rng.uniform(0.5, 4.0, (1, 1, H, 1))).astype(np.float32)
        t[p + "dt_bias"] = (rng.standard_normal(H * d) * 0.5).astype(np.float32)
        t[p + "g_a_proj.weight"] = lin(d, E)
        t[p + "g_b_proj.weight"] = lin(H * d, d)
        t[p + "o_norm.weight"] = norm(d)
        t[p + "o_proj.weight"] = lin(E, H * d, depth_scale)
        return t

    def mla(p: str) -> dict[str, np.ndarray]:
        return {
            p + "q_proj.weight": lin(H * cfg.qk_head_dim, E),
            p + "kv_a_proj_with_mqa.weight": lin(cfg.kv_lora_rank + cfg.qk_rope_head_dim, E),
            p + "kv_a_layernorm.weight": norm(cfg.kv_lora_rank),
            p + "kv_b_proj.weight": lin(H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            p + "o_proj.weight": lin(E, H * cfg.v_head_dim, depth_scale),
        }

    def mlp(p: str, n_ff: int, scale: float) -> dict[str, np.ndarray]:
        return {p + "gate_proj.weight": lin(n_ff, E), p + "up_proj.weight": lin(n_ff, E),
                p + "down_proj.weight": lin(E, n_ff, scale)}

    def moe(p: str) -> dict[str, np.ndarray]:
        ff = cfg.moe_intermediate_size
        t = {p + "gate.weight": lin(cfg.num_experts, E, 4.0),
             p + "gate.e_score_correction_bias": (rng.standard_normal(cfg.num_experts) * 0.5).astype(np.float32)}
        for j in range(cfg.num_experts):
            q = f"{p}experts.{j}."
            t[q + "w1.weight"] = lin(ff, E)
            t[q + "w2.weight"] = lin(E, ff, depth_scale)
            t[q + "w3.weight"] = lin(ff, E)
        t.update(mlp(p + "shared_experts.", ff * cfg.num_shared_experts, depth_scale))
        return t

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": (rng.standard_normal((n_vocab, E))).astype(np.float32)}
    for il in range(cfg.num_hidden_layers):
        p = f"model.layers.{il}."
        w[p + "input_layernorm.weight"] = norm(E)
        w[p + "post_attention_layernorm.weight"] = norm(E)
        w.update(kda(p + "self_attn.") if cfg.recurrent[il] else mla(p + "self_attn."))
        if il < cfg.first_k_dense_replace:
            w.update(mlp(p + "mlp.", cfg.intermediate_size, depth_scale))
        else:
            w.update(moe(p + "block_sparse_moe."))
    w["model.norm.weight"] = norm(E)
    w["lm_head.weight"] = lin(n_vocab, E)
    return w


def hf_config(cfg: KimiLinearConfig, n_vocab: int) -> dict[str, object]:
    """The config.json of a checkpoint with `hf_weights`, in the published model's fields (what
    transformers' `KimiLinearConfig` and llama.cpp's converter read). No bos/eos/pad ids: the
    tiny vocabularies are smaller than the published model's ids."""
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": n_vocab,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "mla_use_nope": True,
        "intermediate_size": cfg.intermediate_size, "first_k_dense_replace": cfg.first_k_dense_replace,
        "num_experts": cfg.num_experts, "num_experts_per_token": cfg.num_experts_per_token,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_shared_experts": cfg.num_shared_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu", "tie_word_embeddings": False,
        "model_max_length": cfg.max_position_embeddings, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None,
        "linear_attn_config": {
            "full_attn_layers": list(cfg.full_attn_layers),
            "kda_layers": [i + 1 for i, recurrent in enumerate(cfg.recurrent) if recurrent],
            "num_heads": cfg.num_attention_heads, "head_dim": cfg.kda_head_dim,
            "short_conv_kernel_size": cfg.short_conv_kernel_size,
        },
    }


# --------------------------------------------------------------------------------------------
# Conversion (conversion/kimi_linear.py + gguf-py's tensor map)
# --------------------------------------------------------------------------------------------

_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_conv1d.weight": "ssm_conv1d_q.weight",
    "self_attn.k_conv1d.weight": "ssm_conv1d_k.weight",
    "self_attn.v_conv1d.weight": "ssm_conv1d_v.weight",
    "self_attn.f_a_proj.weight": "ssm_f_a.weight",
    "self_attn.f_b_proj.weight": "ssm_f_b.weight",
    "self_attn.b_proj.weight": "ssm_beta.weight",
    "self_attn.A_log": "ssm_a",
    "self_attn.dt_proj.bias": "ssm_dt.bias",
    "self_attn.g_a_proj.weight": "ssm_g_a.weight",
    "self_attn.g_b_proj.weight": "ssm_g_b.weight",
    "self_attn.o_norm.weight": "ssm_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.k_b_proj.weight": "attn_k_b.weight",
    "self_attn.v_b_proj.weight": "attn_v_b.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.e_score_correction_bias": "exp_probs_b.bias",
    "block_sparse_moe.experts.w1.weight": "ffn_gate_exps.weight",
    "block_sparse_moe.experts.w3.weight": "ffn_up_exps.weight",
    "block_sparse_moe.experts.w2.weight": "ffn_down_exps.weight",
    "block_sparse_moe.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "block_sparse_moe.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "block_sparse_moe.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}


def _gguf_name(name: str) -> str:
    return gguf_tensor_name(name, _GLOBAL_NAMES, _BLOCK_NAMES)


def convert(cfg: KimiLinearConfig, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GGUF tensors (numpy order, float32) from HF tensors, as conversion/kimi_linear.py writes them."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, x in hf.items():
        x = np.asarray(x, dtype=np.float32)
        if name.endswith(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")):
            channels, d_conv = x.shape[0], x.shape[-1]
            x = x.reshape(1, channels, 1, d_conv)
        if name.endswith(".A_log"):
            x = -np.exp(x)
        if name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        if ".block_sparse_moe.experts." in name:      # stacked once every expert is seen
            head, rest = name.split(".block_sparse_moe.experts.")
            j, wid = rest.split(".", 1)
            experts.setdefault((head, wid), {})[int(j)] = x
            continue
        if name.endswith("kv_b_proj.weight"):
            H, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
            kv_b = x.reshape(H, nope + v, x.shape[-1])
            k_b, v_b = kv_b[:, :nope], kv_b[:, nope:]
            out[_gguf_name(name.replace("kv_b_proj", "k_b_proj"))] = np.ascontiguousarray(k_b.transpose(0, 2, 1))
            out[_gguf_name(name.replace("kv_b_proj", "v_b_proj"))] = np.ascontiguousarray(v_b)
            continue
        out[_gguf_name(name)] = np.ascontiguousarray(x)
    for (head, wid), by_index in experts.items():
        stacked = np.stack([by_index[j] for j in range(cfg.num_experts)])
        out[_gguf_name(f"{head}.block_sparse_moe.experts.{wid}")] = np.ascontiguousarray(stacked)
    return out


def model_tensors(cfg: KimiLinearConfig, n_vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The GGUF tensors of a synthetic model: `convert(cfg, hf_weights(cfg, n_vocab, seed))`."""
    return convert(cfg, hf_weights(cfg, n_vocab, seed))


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _add_metadata(w: gguf.GGUFWriter, cfg: KimiLinearConfig, n_vocab: int, wtype: str) -> None:
    """The keys `TextModel` and `KimiLinearModel.set_gguf_parameters` write for this config."""
    p = ARCH
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_token)
    w.add_uint32(f"{p}.expert_gating_func", GATING_SIGMOID)   # moe_router_activation_func = sigmoid
    w.add_file_type(_FILE_TYPES[wtype])
    w.add_uint32(f"{p}.vocab_size", n_vocab)
    w.add_array(f"{p}.attention.head_count_kv", [0 if r else 1 for r in cfg.recurrent])
    w.add_uint32(f"{p}.ssm.conv_kernel", cfg.short_conv_kernel_size)
    w.add_uint32(f"{p}.kda.head_dim", cfg.kda_head_dim)
    w.add_uint32(f"{p}.attention.kv_lora_rank", cfg.kv_lora_rank)
    w.add_uint32(f"{p}.rope.dimension_count", cfg.qk_rope_head_dim)
    w.add_uint32(f"{p}.attention.key_length", cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_uint32(f"{p}.attention.key_length_mla", cfg.qk_head_dim)
    w.add_uint32(f"{p}.attention.value_length_mla", cfg.v_head_dim)
    w.add_uint32(f"{p}.expert_feed_forward_length", cfg.moe_intermediate_size)
    w.add_uint32(f"{p}.expert_shared_count", cfg.num_shared_experts)
    w.add_uint32(f"{p}.leading_dense_block_count", cfg.first_k_dense_replace)
    w.add_float32(f"{p}.expert_weights_scale", cfg.routed_scaling_factor)


def write_model(path: str | Path, config: KimiLinearConfig | str = "tiny-kimi-linear", wtype: str = "f32",
                seed: int = 0, name: str | None = None) -> Path:
    """Write a synthetic Kimi-Linear GGUF to `path` and return the path."""
    cfg, vocab = config_and_vocab(config, PRESETS, wtype)
    tensors = model_tensors(cfg, vocab.n_vocab, seed)
    template = kimi_chat_template() if vocab.pre == "kimi-k2" else chat_template()
    return write_gguf_file(path, ARCH, name, lambda w: _add_metadata(w, cfg, vocab.n_vocab, wtype), tensors, wtype,
                           (vocab, vocab.pre, template))


def kimi_chat_template() -> str:
    """Kimi-Linear-48B-A3B-Instruct's chat template, as the converter copies it into the GGUF."""
    return resources.files("deltarun.model_files").joinpath(CHAT_TEMPLATE_RESOURCE).read_text(encoding="utf-8")


def config_with(preset: str = "tiny-kimi-linear", **changes: object) -> KimiLinearConfig:
    """A preset with some fields changed (handy in tests)."""
    return dataclasses.replace(PRESETS[preset], **changes)
