"""What a Qwen3-Next GGUF must hold: hyper-parameters and the tensors they imply.

Everything here is checked in Python before a graph is built, so a malformed file ends in a
`ModelFileError` that names the key or tensor, never in a GGML_ASSERT that kills the process.
Key and tensor names are llama.cpp's (`qwen3next.` prefix); shapes are ggml `ne` order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import gguf

from deltarun.runner.errors import ModelFileError, TokenizerError, UnsupportedModelError
from deltarun.runner.gguf_file import GGUFFile

ARCH = "qwen3next"

# Types ggml's CPU backend multiplies (mul_mat / mul_mat_id / get_rows) for weight matrices.
MATMUL_TYPES = {
    gguf.GGMLQuantizationType[n] for n in (
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
        "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "IQ1_M",
        "TQ1_0", "TQ2_0", "MXFP4")
}
# Small tensors used in element-wise ops must stay F32 (ggml's CPU ggml_mul aborts on an F16
# norm weight times F32 activations). The shared-expert gate is a matrix product and may be F16.
F32_ONLY = ("ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ssm_norm.weight", "_norm.weight", "norm.weight")
F32_OR_F16 = ("ffn_gate_inp_shexp.weight",)

MAX_DIM = 1 << 20  # far above any real model; guards against absurd metadata
MAX_CONTEXT = 1 << 26
REDO = "re-download the file or convert the model again"


@dataclass(frozen=True)
class HParams:
    """Qwen3-Next hyper-parameters, named after llama.cpp's."""

    n_layer: int              # trunk layers (block_count minus MTP layers)
    n_ctx_train: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_freq_base: float
    n_rot: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    ssm_d_conv: int
    ssm_d_inner: int
    ssm_d_state: int
    ssm_n_v_heads: int        # ssm.time_step_rank
    ssm_n_k_heads: int        # ssm.group_count
    recurrent: tuple[bool, ...] = field(default=())
    n_mtp: int = 0
    n_vocab: int = 0

    @property
    def head_k_dim(self) -> int:
        return self.ssm_d_state

    @property
    def head_v_dim(self) -> int:
        return self.ssm_d_inner // self.ssm_n_v_heads

    @property
    def key_dim(self) -> int:
        return self.head_k_dim * self.ssm_n_k_heads

    @property
    def value_dim(self) -> int:
        return self.head_v_dim * self.ssm_n_v_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_size(self) -> int:
        """Floats of one conv-state snapshot of one layer and sequence."""
        return (self.ssm_d_conv - 1) * self.conv_dim

    @property
    def ssm_state_size(self) -> int:
        """Floats of one SSM-state snapshot of one layer and sequence."""
        return self.head_v_dim * self.head_v_dim * self.ssm_n_v_heads

    @property
    def linear_layers(self) -> list[int]:
        return [i for i in range(self.n_layer) if self.recurrent[i]]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.n_layer) if not self.recurrent[i]]


def _int(f: GGUFFile, key: str, default: int | None = None, limit: int = MAX_DIM) -> int:
    """A positive integer hyper-parameter no larger than `limit`."""
    value = f.get(f"{ARCH}.{key}", default)
    if value is None:
        raise ModelFileError(f"{f.path}: required metadata key '{ARCH}.{key}' is missing; {REDO}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFileError(f"{f.path}: {ARCH}.{key} must be an integer, found {_show(value)}; {REDO}")
    if not 0 < value <= limit:
        raise ModelFileError(f"{f.path}: {ARCH}.{key} = {value} is out of range (1..{limit}); {REDO}")
    return value


def _float(f: GGUFFile, key: str, default: float | None = None) -> float:
    value = f.get(f"{ARCH}.{key}", default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ModelFileError(f"{f.path}: {ARCH}.{key} must be a positive finite number, found {_show(value)}; "
                             f"{REDO}")
    return float(value)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _vocab_size(f: GGUFFile) -> int:
    """Entries of tokenizer.ggml.tokens, without decoding them; 0 when the file has none."""
    sig = f.value_type("tokenizer.ggml.tokens")
    if sig is None:
        return 0
    if sig != (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING):
        found = "/".join(gguf.GGUFValueType(t).name for t in sig)
        raise TokenizerError(f"{f.path}: metadata key 'tokenizer.ggml.tokens' must be an array of strings, "
                             f"found {found}; {REDO}")
    return len(f.reader.fields["tokenizer.ggml.tokens"].data)


def read_hparams(f: GGUFFile) -> HParams:
    """Read and sanity-check the hyper-parameters of a qwen3next file."""
    if f.architecture != ARCH:
        raise UnsupportedModelError(f"{f.path}: architecture {f.architecture!r} is not {ARCH!r}")
    n_layer_all = _int(f, "block_count")
    # Every block holds several tensors; a block_count above the file's tensor count is damage (and
    # would make expected_tensors enumerate millions of names).
    if n_layer_all > len(f.tensors):
        raise ModelFileError(f"{f.path}: {ARCH}.block_count = {n_layer_all} but the file holds only "
                             f"{len(f.tensors)} tensors; {REDO}")
    n_mtp = f.get(f"{ARCH}.nextn_predict_layers", 0) or 0
    if isinstance(n_mtp, bool) or not isinstance(n_mtp, int) or not 0 <= n_mtp < n_layer_all:
        raise ModelFileError(f"{f.path}: {ARCH}.nextn_predict_layers = {_show(n_mtp)} is out of range "
                             f"(0..block_count-1 = {n_layer_all - 1}); {REDO}")
    n_layer = n_layer_all - n_mtp

    rec = f.get(f"{ARCH}.attention.recurrent_layers")
    if rec is not None:
        if not isinstance(rec, list) or len(rec) != n_layer_all or not all(
                isinstance(x, (bool, int)) for x in rec):
            raise ModelFileError(f"{f.path}: {ARCH}.attention.recurrent_layers must hold {n_layer_all} booleans "
                                 f"(one per block), found {_show(rec)}; {REDO}")
        recurrent = tuple(bool(x) for x in rec[:n_layer])
    else:
        interval = _int(f, "full_attention_interval", 4)
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))

    n_expert_used = _int(f, "expert_used_count")
    # A zero (or absent) optional length means "use the fallback", as in llama.cpp.
    n_ff = _int(f, "feed_forward_length") if f.get(f"{ARCH}.feed_forward_length") else 0
    n_expert = _int(f, "expert_count")
    if f.get(f"{ARCH}.expert_feed_forward_length"):
        n_ff_exp = _int(f, "expert_feed_forward_length")
    elif n_ff:
        n_ff_exp = n_ff // n_expert_used
    else:
        raise ModelFileError(f"{f.path}: required metadata key '{ARCH}.expert_feed_forward_length' is missing; "
                             f"{REDO}")
    n_ff_shexp = (_int(f, "expert_shared_feed_forward_length")
                  if f.get(f"{ARCH}.expert_shared_feed_forward_length") else n_ff_exp)
    hp = HParams(
        n_layer=n_layer,
        n_ctx_train=_int(f, "context_length", limit=MAX_CONTEXT),
        n_embd=_int(f, "embedding_length"),
        n_ff=n_ff,
        n_head=_int(f, "attention.head_count"),
        n_head_kv=_int(f, "attention.head_count_kv"),
        head_dim=_int(f, "attention.key_length"),
        rms_eps=_float(f, "attention.layer_norm_rms_epsilon"),
        rope_freq_base=_float(f, "rope.freq_base", 10000.0),
        n_rot=_int(f, "rope.dimension_count"),
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_exp=n_ff_exp,
        n_ff_shexp=n_ff_shexp,
        ssm_d_conv=_int(f, "ssm.conv_kernel"),
        ssm_d_inner=_int(f, "ssm.inner_size"),
        ssm_d_state=_int(f, "ssm.state_size"),
        ssm_n_v_heads=_int(f, "ssm.time_step_rank"),
        ssm_n_k_heads=_int(f, "ssm.group_count"),
        recurrent=recurrent,
        n_mtp=n_mtp,
        n_vocab=_vocab_size(f) or _vocab_from_embd(f),
    )
    check_hparams(hp, str(f.path))
    value_length = f.get(f"{ARCH}.attention.value_length")
    if value_length is not None and value_length != hp.head_dim:
        raise ModelFileError(f"{f.path}: {ARCH}.attention.value_length = {_show(value_length)} differs from "
                             f"key_length {hp.head_dim}; {ARCH} uses one head size for both: {REDO}")
    return hp


def _vocab_from_embd(f: GGUFFile) -> int:
    info = f.tensors.get("token_embd.weight")
    if info is None or len(info.ne) != 2:
        raise ModelFileError(f"{f.path}: the file has no vocabulary (tokenizer.ggml.tokens) and its tensor "
                             f"'token_embd.weight' is missing or not 2-D; {REDO}")
    return info.ne[1]


def check_hparams(hp: HParams, where: str) -> None:
    """Relations between hyper-parameters that the graph relies on."""
    def bad(msg: str) -> None:
        raise ModelFileError(f"{where}: {msg}; the hyper-parameters are inconsistent: {REDO}")

    for name in ("n_embd", "n_head", "n_head_kv", "head_dim", "n_rot", "n_expert", "n_expert_used", "n_ff_exp",
                 "n_ff_shexp", "ssm_d_conv", "ssm_d_inner", "ssm_d_state", "ssm_n_v_heads", "ssm_n_k_heads"):
        value = getattr(hp, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_DIM:
            bad(f"{name} = {value!r} is out of range (1..{MAX_DIM})")
    if not 0 < hp.n_ctx_train <= MAX_CONTEXT:
        bad(f"context_length {hp.n_ctx_train} is out of range (1..{MAX_CONTEXT})")
    if len(hp.recurrent) != hp.n_layer:
        bad(f"{len(hp.recurrent)} layer kinds for {hp.n_layer} layers")
    if hp.n_layer <= 0:
        bad("the model has no trunk layers")
    if hp.n_head % hp.n_head_kv != 0:
        bad(f"attention.head_count {hp.n_head} is not a multiple of head_count_kv {hp.n_head_kv}")
    if hp.n_rot > hp.head_dim or hp.n_rot % 2:
        bad(f"rope.dimension_count {hp.n_rot} must be even and at most key_length {hp.head_dim}")
    if hp.n_expert_used > hp.n_expert:
        bad(f"expert_used_count {hp.n_expert_used} exceeds expert_count {hp.n_expert}")
    if hp.ssm_n_v_heads % hp.ssm_n_k_heads != 0:
        bad(f"ssm.time_step_rank (value heads) {hp.ssm_n_v_heads} is not a multiple of "
            f"ssm.group_count (key heads) {hp.ssm_n_k_heads}")
    if hp.ssm_d_inner % hp.ssm_n_v_heads != 0 or hp.head_v_dim != hp.ssm_d_state:
        bad(f"ssm.inner_size {hp.ssm_d_inner} must equal time_step_rank {hp.ssm_n_v_heads} x "
            f"state_size {hp.ssm_d_state}")
    if hp.ssm_d_conv < 2:
        bad(f"ssm.conv_kernel {hp.ssm_d_conv} must be at least 2")
    if hp.n_vocab <= 0:
        bad("the vocabulary is empty")


def expected_tensors(hp: HParams, f: GGUFFile) -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (ne, required) for every tensor the graph reads; alternatives resolved from the file."""
    E, V = hp.n_embd, hp.n_vocab
    t: dict[str, tuple[tuple[int, ...], bool]] = {
        "token_embd.weight": ((E, V), True),
        "output_norm.weight": ((E,), True),
        "output.weight": ((E, V), False),
    }
    for il in range(hp.n_layer + hp.n_mtp):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"] = ((E,), True)
        t[p + "post_attention_norm.weight"] = ((E,), True)
        if il < hp.n_layer and hp.recurrent[il]:
            if p + "ssm_in.weight" in f.tensors:
                t[p + "ssm_in.weight"] = ((E, 2 * hp.key_dim + 2 * hp.value_dim), True)
            else:
                t[p + "attn_qkv.weight"] = ((E, hp.conv_dim), True)
                t[p + "attn_gate.weight"] = ((E, hp.value_dim), True)
            t[p + "ssm_conv1d.weight"] = ((hp.ssm_d_conv, hp.conv_dim), True)
            t[p + "ssm_dt.bias"] = ((hp.ssm_n_v_heads,), True)
            t[p + "ssm_a"] = ((hp.ssm_n_v_heads,), True)
            t[p + "ssm_ba.weight"] = ((E, 2 * hp.ssm_n_v_heads), True)
            t[p + "ssm_norm.weight"] = ((hp.head_v_dim,), True)
            t[p + "ssm_out.weight"] = ((hp.value_dim, E), True)
        else:
            hd = hp.head_dim
            t[p + "attn_q.weight"] = ((E, 2 * hd * hp.n_head), True)
            t[p + "attn_k.weight"] = ((E, hd * hp.n_head_kv), True)
            t[p + "attn_v.weight"] = ((E, hd * hp.n_head_kv), True)
            t[p + "attn_output.weight"] = ((hd * hp.n_head, E), True)
            t[p + "attn_q_norm.weight"] = ((hd,), True)
            t[p + "attn_k_norm.weight"] = ((hd,), True)
        ff, ne = hp.n_ff_exp, hp.n_expert
        t[p + "ffn_gate_inp.weight"] = ((E, ne), True)
        if p + "ffn_gate_up_exps.weight" in f.tensors:
            t[p + "ffn_gate_up_exps.weight"] = ((E, 2 * ff, ne), True)
        else:
            t[p + "ffn_gate_exps.weight"] = ((E, ff, ne), True)
            t[p + "ffn_up_exps.weight"] = ((E, ff, ne), True)
        t[p + "ffn_down_exps.weight"] = ((ff, E, ne), True)
        t[p + "ffn_gate_inp_shexp.weight"] = ((E,), True)
        t[p + "ffn_gate_shexp.weight"] = ((E, hp.n_ff_shexp), True)
        t[p + "ffn_up_shexp.weight"] = ((E, hp.n_ff_shexp), True)
        t[p + "ffn_down_shexp.weight"] = ((hp.n_ff_shexp, E), True)
        if il >= hp.n_layer:
            n = p + "nextn."
            t[n + "eh_proj.weight"] = ((2 * E, E), True)
            t[n + "enorm.weight"] = ((E,), True)
            t[n + "hnorm.weight"] = ((E,), True)
            t[n + "shared_head_norm.weight"] = ((E,), False)
            t[n + "shared_head_head.weight"] = ((E, V), False)
            t[n + "embed_tokens.weight"] = ((E, V), False)
    return t


def _same_shape(found: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Equal up to trailing ones (a [n] tensor may be stored as [n, 1])."""
    a, b = list(found), list(want)
    while len(a) > 1 and a[-1] == 1:
        a.pop()
    while len(b) > 1 and b[-1] == 1:
        b.pop()
    return a == b


def validate_tensors(hp: HParams, f: GGUFFile) -> None:
    """Every required tensor present with the right shape and a type ggml can use for it; then the
    vocabulary and chat template the runner builds from the file, so that every problem with the
    file surfaces here, with the file's name, before anything reaches ggml."""
    T = gguf.GGMLQuantizationType
    for name, (ne, required) in expected_tensors(hp, f).items():
        info = f.tensors.get(name)
        if info is None:
            if required:
                raise ModelFileError(f"{f.path}: required tensor {name!r} is missing (expected shape {list(ne)}); "
                                     f"the file is incomplete or not a {ARCH} model: {REDO}")
            continue
        if not _same_shape(info.ne, ne):
            raise ModelFileError(f"{f.path}: tensor {name!r} has shape {list(info.ne)}, expected {list(ne)} "
                                 f"from the hyper-parameters; the file is inconsistent: {REDO}")
        qtype = T(info.ggml_type)
        if name.endswith(F32_OR_F16):
            if qtype not in (T.F32, T.F16):
                raise ModelFileError(f"{f.path}: tensor {name!r} has type {qtype.name}; it must be F32 or F16 "
                                     f"(convert the model again, keeping it unquantized)")
        elif name.endswith(F32_ONLY):
            if qtype != T.F32:
                raise ModelFileError(f"{f.path}: tensor {name!r} has type {qtype.name}; it must be F32 "
                                     f"(convert the model again, keeping it unquantized)")
        elif qtype not in MATMUL_TYPES:
            raise ModelFileError(f"{f.path}: tensor {name!r} has type {qtype.name}, which ggml cannot multiply "
                                 f"(weights must be one of {', '.join(sorted(t.name for t in MATMUL_TYPES))})")
    tok = f.tokenizer()
    if tok.n_vocab != hp.n_vocab:
        raise ModelFileError(f"{f.path}: the vocabulary has {tok.n_vocab} tokens but the model expects "
                             f"{hp.n_vocab}; {REDO}")
    f.chat_templates()
