"""Reading and checking a hybrid model's file: hyper-parameters and the tensors a family expects.

Everything here is checked in Python before a graph is built, so a malformed file ends in a
`ModelFileError` that names the key or tensor, never in a GGML_ASSERT that kills the process.
Key and tensor names are llama.cpp's, under the family's key prefix (`qwen3next.`, `qwen35.`,
...); shapes are ggml `ne` order. Each family lists its expected tensors from its blocks' parts.
"""

from __future__ import annotations

import math

import gguf

from deltarun.base.errors import ModelFileError, TokenizerError, UnsupportedModelError
from deltarun.base.gguf_file import GGUFFile
from deltarun.base.interface import HParams

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


def _int(f: GGUFFile, arch: str, key: str, default: int | None = None, limit: int = MAX_DIM) -> int:
    """A positive integer hyper-parameter no larger than `limit`."""
    value = f.get(f"{arch}.{key}", default)
    if value is None:
        raise ModelFileError(f"{f.path}: required metadata key '{arch}.{key}' is missing; {REDO}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFileError(f"{f.path}: {arch}.{key} must be an integer, found {_show(value)}; {REDO}")
    if not 0 < value <= limit:
        raise ModelFileError(f"{f.path}: {arch}.{key} = {value} is out of range (1..{limit}); {REDO}")
    return value


def _float(f: GGUFFile, arch: str, key: str, default: float | None = None) -> float:
    value = f.get(f"{arch}.{key}", default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ModelFileError(f"{f.path}: {arch}.{key} must be a positive finite number, found {_show(value)}; "
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


def read_hparams(f: GGUFFile, arch: str, *, moe: bool, rope_sections: bool) -> HParams:
    """Read and sanity-check the hyper-parameters of a hybrid model under the key prefix `arch`.

    moe: the FFN is a MoE with a shared expert (`expert_*` keys) rather than dense (`feed_forward_length`).
    rope_sections: the model uses multi-section rope (`rope.dimension_sections`, required).
    """
    if f.architecture != arch:
        raise UnsupportedModelError(f"{f.path}: architecture {f.architecture!r} is not {arch!r}")
    n_layer_all = _int(f, arch, "block_count")
    # Every block holds several tensors; a block_count above the file's tensor count is damage (and
    # would make expected_tensors enumerate millions of names).
    if n_layer_all > len(f.tensors):
        raise ModelFileError(f"{f.path}: {arch}.block_count = {n_layer_all} but the file holds only "
                             f"{len(f.tensors)} tensors; {REDO}")
    n_mtp = f.get(f"{arch}.nextn_predict_layers", 0) or 0
    if isinstance(n_mtp, bool) or not isinstance(n_mtp, int) or not 0 <= n_mtp < n_layer_all:
        raise ModelFileError(f"{f.path}: {arch}.nextn_predict_layers = {_show(n_mtp)} is out of range "
                             f"(0..block_count-1 = {n_layer_all - 1}); {REDO}")
    n_layer = n_layer_all - n_mtp

    rec = f.get(f"{arch}.attention.recurrent_layers")
    if rec is not None:
        if not isinstance(rec, list) or len(rec) != n_layer_all or not all(
                isinstance(x, (bool, int)) for x in rec):
            raise ModelFileError(f"{f.path}: {arch}.attention.recurrent_layers must hold {n_layer_all} booleans "
                                 f"(one per block), found {_show(rec)}; {REDO}")
        recurrent = tuple(bool(x) for x in rec[:n_layer])
    else:
        interval = _int(f, arch, "full_attention_interval", 4)
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))

    if moe:
        n_ff, n_expert, n_expert_used, n_ff_exp, n_ff_shexp = _moe_sizes(f, arch)
    else:
        n_ff, n_expert, n_expert_used, n_ff_exp, n_ff_shexp = _int(f, arch, "feed_forward_length"), 0, 0, 0, 0
    hp = HParams(
        n_layer=n_layer,
        n_ctx_train=_int(f, arch, "context_length", limit=MAX_CONTEXT),
        n_embd=_int(f, arch, "embedding_length"),
        n_ff=n_ff,
        n_head=_int(f, arch, "attention.head_count"),
        n_head_kv=_int(f, arch, "attention.head_count_kv"),
        head_dim=_int(f, arch, "attention.key_length"),
        rms_eps=_float(f, arch, "attention.layer_norm_rms_epsilon"),
        rope_freq_base=_float(f, arch, "rope.freq_base", 10000.0),
        n_rot=_int(f, arch, "rope.dimension_count"),
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_exp=n_ff_exp,
        n_ff_shexp=n_ff_shexp,
        ssm_d_conv=_int(f, arch, "ssm.conv_kernel"),
        ssm_d_inner=_int(f, arch, "ssm.inner_size"),
        ssm_d_state=_int(f, arch, "ssm.state_size"),
        ssm_n_v_heads=_int(f, arch, "ssm.time_step_rank"),
        ssm_n_k_heads=_int(f, arch, "ssm.group_count"),
        recurrent=recurrent,
        n_mtp=n_mtp,
        n_vocab=_vocab_size(f) or _vocab_from_embd(f),
        rope_sections=_rope_sections(f, arch) if rope_sections else (),
    )
    check_hparams(hp, str(f.path))
    value_length = f.get(f"{arch}.attention.value_length")
    if value_length is not None and value_length != hp.head_dim:
        raise ModelFileError(f"{f.path}: {arch}.attention.value_length = {_show(value_length)} differs from "
                             f"key_length {hp.head_dim}; {arch} uses one head size for both: {REDO}")
    return hp


def _moe_sizes(f: GGUFFile, arch: str) -> tuple[int, int, int, int, int]:
    """n_ff (0 when absent), n_expert, n_expert_used, n_ff_exp, n_ff_shexp."""
    n_expert_used = _int(f, arch, "expert_used_count")
    # A zero (or absent) optional length means "use the fallback", as in llama.cpp.
    n_ff = _int(f, arch, "feed_forward_length") if f.get(f"{arch}.feed_forward_length") else 0
    n_expert = _int(f, arch, "expert_count")
    if f.get(f"{arch}.expert_feed_forward_length"):
        n_ff_exp = _int(f, arch, "expert_feed_forward_length")
    elif n_ff:
        n_ff_exp = n_ff // n_expert_used
    else:
        raise ModelFileError(f"{f.path}: required metadata key '{arch}.expert_feed_forward_length' is missing; "
                             f"{REDO}")
    n_ff_shexp = (_int(f, arch, "expert_shared_feed_forward_length")
                  if f.get(f"{arch}.expert_shared_feed_forward_length") else n_ff_exp)
    return n_ff, n_expert, n_expert_used, n_ff_exp, n_ff_shexp


def _rope_sections(f: GGUFFile, arch: str) -> tuple[int, ...]:
    """rope.dimension_sections: 4 non-negative section sizes (the checks against n_rot are in check_hparams)."""
    key = f"{arch}.rope.dimension_sections"
    value = f.get(key)
    if value is None:
        raise ModelFileError(f"{f.path}: required metadata key '{key}' is missing; {REDO}")
    if not isinstance(value, list) or len(value) != 4 or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_DIM for x in value):
        raise ModelFileError(f"{f.path}: {key} must hold 4 non-negative integers, found {_show(value)}; {REDO}")
    return tuple(value)


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

    sizes = ["n_embd", "n_head", "n_head_kv", "head_dim", "n_rot", "ssm_d_conv", "ssm_d_inner", "ssm_d_state",
             "ssm_n_v_heads", "ssm_n_k_heads"]
    sizes += ["n_expert", "n_expert_used", "n_ff_exp", "n_ff_shexp"] if hp.n_expert else ["n_ff"]
    for name in sizes:
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
    if hp.rope_sections and sum(hp.rope_sections) != hp.n_rot // 2:
        bad(f"rope.dimension_sections {list(hp.rope_sections)} must add up to rope.dimension_count / 2 = "
            f"{hp.n_rot // 2}")
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


def _same_shape(found: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Equal up to trailing ones (a [n] tensor may be stored as [n, 1])."""
    a, b = list(found), list(want)
    while len(a) > 1 and a[-1] == 1:
        a.pop()
    while len(b) > 1 and b[-1] == 1:
        b.pop()
    return a == b


def validate_tensors(hp: HParams, f: GGUFFile, expected: dict[str, tuple[tuple[int, ...], bool]]) -> None:
    """Every required tensor present with the right shape and a type ggml can use for it; then the
    vocabulary and chat template the runner builds from the file, so that every problem with the
    file surfaces here, with the file's name, before anything reaches ggml."""
    T = gguf.GGMLQuantizationType
    for name, (ne, required) in expected.items():
        info = f.tensors.get(name)
        if info is None:
            if required and name.startswith(tuple(f"blk.{il}." for il in range(hp.n_layer, hp.n_layer + hp.n_mtp))):
                raise ModelFileError(f"{f.path}: the MTP block (nextn_predict_layers = {hp.n_mtp}) lacks tensor "
                                     f"{name!r} (expected shape {list(ne)}); {REDO}")
            if required:
                raise ModelFileError(f"{f.path}: required tensor {name!r} is missing (expected shape {list(ne)}); "
                                     f"the file is incomplete or not a {f.architecture} model: {REDO}")
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
