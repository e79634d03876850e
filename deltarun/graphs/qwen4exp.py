"""Qwen3.8-Flash-Next (`general.architecture = qwen4exp`): spec and graph, as a block diagram.

    tokens -> embedding -> H identical residual streams [n_embd, H, T]
           -> n_layer x [ (the PLE layer:) + hashed n-gram embeddings into every stream
                          -> hyper-connection mix -> gated delta net (sigmoid output gate) |
                          QSA: gated attention over the lightning indexer's blocks
                          -> injected into every stream -> hyper-connection mix -> MoE with
                          shared expert -> injected ]
           -> the output hyper-connection mix (no norm after it) -> LM head

Keys, tensors and the converter's transforms are in docs/qwen4exp-gguf.md; the reference is
transformers' `Qwen4ExpForCausalLM` (llama.cpp's graph for it is marked "do not use as a
reference"). The blocks: graphs/blocks/hyper.py (hyper-connections), qsa.py (the indexer; its keys
ride in the K-cache rows), ple.py (the n-gram rows from the mapped table; the convolution's
history rides in the conv-state rows, rolled back with them), and qwen35's delta net, attention
and MoE. Converted files carry no MTP block (the converter drops it), so there is none here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from deltarun.base.errors import ModelFileError
from deltarun.base.ggml_util import Tensor, ggml
from deltarun.base.gguf_file import GGUFFile
from deltarun.base.interface import HParams, UbatchShape
from deltarun.graphs import spec
from deltarun.graphs.blocks import attention, delta_net, ffn, head, hyper, ple, qsa
from deltarun.graphs.blocks.attention import output_ids
from deltarun.graphs.blocks.base import GraphContext
from deltarun.graphs.blocks.delta_net import DeltaNet, linear_attention
from deltarun.graphs.family import HybridFamily, Spec

ARCH = "qwen4exp"


@dataclass(frozen=True)
class Qwen4Extras:
    """What HParams does not hold: hyper-connections, the indexer, the PLE layer (None without)."""

    n_streams: int
    low_rank: int
    qsa: qsa.QsaShape
    ratios: tuple[int, ...]         # per layer; 0: no indexer (dense attention or a linear layer)
    ple: ple.PleShape | None


def _list(f: GGUFFile, key: str, n: int | None, what: str) -> list[int]:
    value = f.get(key)
    if not isinstance(value, list) or (n is not None and len(value) != n) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value):
        size = f"{n} " if n is not None else ""
        raise ModelFileError(f"{f.path}: {key} must list {size}non-negative integers ({what}), found "
                             f"{spec._show(value)}; {spec.REDO}")
    return value


def read_extras(f: GGUFFile, n_layer: int, recurrent: tuple[bool, ...], n_rot: int, n_vocab: int) -> Qwen4Extras:
    a = ARCH
    bad = f"{f.path}: {a}."
    n_streams = spec._int(f, a, "hyper_connection.count")
    if n_streams < 2:
        raise ModelFileError(f"{bad}hyper_connection.count = {n_streams}: hyper-connections need at least 2 streams; "
                             f"{spec.REDO}")
    low_rank = spec._int(f, a, "hyper_connection.low_rank")
    shape = qsa.QsaShape(n_heads=spec._int(f, a, "attention.indexer.head_count"),
                         key_length=spec._int(f, a, "attention.indexer.key_length"),
                         budget=spec._int(f, a, "attention.indexer.top_k"))
    ratios = tuple(_list(f, f"{a}.attention.compress_ratios", n_layer, "the indexer's block length per layer"))
    if any(r and rec for r, rec in zip(ratios, recurrent)):
        raise ModelFileError(f"{bad}attention.compress_ratios gives a linear-attention layer an indexer; {spec.REDO}")
    if len({r for r in ratios if r}) > 1:
        raise ModelFileError(f"{bad}attention.compress_ratios = {list(ratios)}: layers with different block "
                             "lengths are not supported")
    ratio = max(ratios, default=0)
    if ratio and shape.budget % ratio:
        raise ModelFileError(f"{bad}attention.indexer.top_k = {shape.budget} is not a multiple of the block "
                             f"length {ratio}; {spec.REDO}")
    if ratio and n_rot > shape.key_length:
        raise ModelFileError(f"{bad}attention.indexer.key_length = {shape.key_length} is below the rope "
                             f"dimensions ({n_rot}); {spec.REDO}")
    return Qwen4Extras(n_streams, low_rank, shape, ratios, _read_ple(f, n_layer, recurrent, n_vocab))


def _read_ple(f: GGUFFile, n_layer: int, recurrent: tuple[bool, ...], n_vocab: int) -> ple.PleShape | None:
    a = ARCH
    bad = f"{f.path}: {a}."
    if f.get(f"{a}.ple.layers") is None:
        return None
    layers = _list(f, f"{a}.ple.layers", None, "zero-based layer numbers")
    if len(layers) != 1:
        raise ModelFileError(f"{bad}ple.layers = {layers}: one PLE layer is supported (a converted file holds one "
                             "table and one set of hash constants)")
    layer = layers[0]
    if layer >= n_layer or not recurrent[layer]:
        raise ModelFileError(f"{bad}ple.layers = {layers}: the PLE layer must be a linear-attention layer; "
                             f"{spec.REDO}")
    n = spec._int(f, a, "ple.ngram_size")
    per = spec._int(f, a, "ple.heads_per_ngram")
    if n < 2 or per < 1:
        raise ModelFileError(f"{bad}ple.ngram_size = {n}, heads_per_ngram = {per}: n-grams need n >= 2 and a head; "
                             f"{spec.REDO}")
    n_heads = (n - 1) * per
    eos = spec._int(f, a, "ple.eos_token_id")
    if eos >= n_vocab:
        raise ModelFileError(f"{bad}ple.eos_token_id = {eos} is outside the vocabulary; {spec.REDO}")
    multipliers = _list(f, f"{a}.ple.layer_multipliers", n, "one per n-gram position")
    if any(m * max(n_vocab - 1, 1) >= 1 << 63 for m in multipliers):
        raise ModelFileError(f"{bad}ple.layer_multipliers overflow 63 bits with this vocabulary; {spec.REDO}")
    sizes = _list(f, f"{a}.ple.head_vocab_sizes", n_heads, "one per n-gram head")
    if not all(sizes):
        raise ModelFileError(f"{bad}ple.head_vocab_sizes holds a zero; {spec.REDO}")
    return ple.PleShape(layer=layer, ngram_size=n, heads_per_ngram=per,
                        conv_kernel=spec._int(f, a, "ple.conv_kernel"), eos=eos,
                        row_dim=spec._int(f, a, "embedding_length_per_layer_input"),
                        multipliers=tuple(multipliers), sizes=tuple(sizes),
                        offsets=tuple(_list(f, f"{a}.ple.head_offsets", n_heads, "one per n-gram head")))


class Qwen4ExpFamily(HybridFamily):
    """Graph builder for `general.architecture = qwen4exp`."""

    arch = ARCH
    delta_net_layout = DeltaNet(beta_alpha="split", broadcast="tiled", legacy_ssm_in=False, output_gate="sigmoid")

    def __init__(self, gguf_file: GGUFFile):
        self.extras = self.read_hparams_and_extras(gguf_file)[1]
        super().__init__(gguf_file)
        p = self.extras.ple
        if p is not None and self.file.tensors[ple.TABLE].ne[1] < p.rows_addressed:
            raise ModelFileError(f"{gguf_file.path}: {ple.TABLE} has {self.file.tensors[ple.TABLE].ne[1]} rows, fewer "
                                 f"than the n-gram heads address ({p.rows_addressed}); {spec.REDO}")

    # --- spec ---------------------------------------------------------------------------------
    @classmethod
    def read_hparams_and_extras(cls, f: GGUFFile) -> tuple[HParams, Qwen4Extras]:
        hp = spec.read_hparams(f, cls.arch, moe=True, rope_sections=True)
        if hp.n_mtp:
            raise ModelFileError(f"{f.path}: {cls.arch} files from the converter have no MTP block "
                                 f"(nextn_predict_layers = {hp.n_mtp}); deltarun does not run one")
        x = read_extras(f, hp.n_layer, hp.recurrent, hp.n_rot, hp.n_vocab)
        ple_state = [0] * hp.n_layer
        if x.ple is not None:
            ple_state[x.ple.layer] = x.ple.history * hp.n_embd * x.n_streams
        k_extra = [x.qsa.key_length if r else 0 for r in x.ratios]
        return dataclasses.replace(hp, k_row_extra=tuple(k_extra), conv_state_extra=tuple(ple_state)), x

    @classmethod
    def read_hparams(cls, f: GGUFFile) -> HParams:
        return cls.read_hparams_and_extras(f)[0]

    def expected_tensors(self) -> Spec:
        hp, x = self.hp, self.extras
        E, H, R = hp.n_embd, x.n_streams, x.low_rank
        t = {"token_embd.weight": ((E, hp.n_vocab), True), "output.weight": ((E, hp.n_vocab), False)}
        t.update(hyper.tensors(E, H, R, "output_hc_", inject=False))
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            t.update(hyper.tensors(E, H, R, p + "hc_attn_", inject=True))
            t.update(hyper.tensors(E, H, R, p + "hc_ffn_", inject=True))
            if hp.recurrent[il]:
                t.update(delta_net.tensors(hp, p, self.delta_net_layout, self.file.tensors))
            elif x.ratios[il]:
                t.update(qsa.tensors(hp, p, x.qsa))
            else:
                t.update(attention.tensors(hp, p))
            t.update(ffn.moe_tensors(hp, p, self.file.tensors))
            if x.ple is not None and il == x.ple.layer:
                t.update(ple.tensors(E, H, x.ple, p))
                found = self.file.tensors.get(ple.TABLE)     # padded by the converter: any row count
                n_rows = found.ne[1] if found is not None and len(found.ne) == 2 else x.ple.rows_addressed
                t[ple.TABLE] = ((x.ple.row_dim, n_rows), True)
        return t

    def describe(self) -> list[str]:
        """`inspect`'s lines on the parts this file switches on."""
        x = self.extras
        lines = [f"hyper-connections  {x.n_streams} streams, rank {x.low_rank}"]
        indexed = [il for il, r in enumerate(x.ratios) if r]
        if indexed:
            r = max(x.ratios)
            lines.append(f"QSA indexer        layers {', '.join(map(str, indexed))}: {x.qsa.n_heads} heads of "
                         f"{x.qsa.key_length}, the best {x.qsa.budget // r} blocks of {r} tokens")
        if x.ple is not None:
            p = x.ple
            lines.append(f"PLE n-grams        layer {p.layer}: orders 2..{p.ngram_size}, {p.n_heads} heads of "
                         f"{p.row_dim}, {self.file.tensors[ple.TABLE].ne[1]:,} table rows (mapped, read by row)")
        return lines

    def gathered_weights(self) -> frozenset[str]:
        """The token embeddings and the n-gram table: read by rows, kept as mapped from the file."""
        return super().gathered_weights() | {ple.TABLE}

    def graph_size(self, ub: UbatchShape) -> int:
        """The base count plus what hyper-connections (about 40 nodes per layer), the indexer (about
        50 + 4 per pooled token) and the PLE layer (about 40 + 4 per tap) add."""
        return super().graph_size(ub) + 200 * self.hp.n_layer + 512

    # --- graph --------------------------------------------------------------------------------
    def forward(self, g: GraphContext) -> None:
        hp, H = g.hp, self.extras.n_streams
        x = hyper.streams(g, head.embed(g), H)
        for il in range(hp.n_layer):
            x = self.decoder_block(g, x, il, last=il == hp.n_layer - 1)
        out, _ = hyper.mix(g, x, "output_hc_", -1, H)
        head.logits(g, out)

    def forward_mtp(self, g: GraphContext, tokens: Tensor | None = None, hidden: Tensor | None = None,
                    prefix: str = "") -> None:
        raise ModelFileError(f"{self.file.path}: {self.arch} files carry no MTP block")

    def decoder_block(self, g: GraphContext, x: Tensor, il: int, last: bool) -> Tensor:
        """(PLE) -> mix -> delta net | QSA -> inject -> mix -> MoE -> inject, on the streams x."""
        c, hp, ex = g.ctx, g.hp, self.extras
        H, E = ex.n_streams, hp.n_embd
        p = f"blk.{il}."
        if ex.ple is not None and il == ex.ple.layer:
            x = ggml.ggml_add(c, x, ple.ple(g, x, il, ex.ple))
        cur, inject = hyper.mix(g, x, p + "hc_attn_", il, H)
        g.expand(cur)          # layer by layer, as qwen3next.decoder_block (state reads on this layer's device)
        if hp.recurrent[il]:
            cur = linear_attention(g, cur, il, self.delta_net_layout)
        elif ex.ratios[il]:
            cur = qsa.qsa_attention(g, cur, il, ex.qsa, ex.ratios[il])
        else:
            cur = attention.full_attention(g, cur, il)
        rows = output_ids(g) if last else None
        if rows is not None:     # only the rows whose logits are asked for go on
            cur = ggml.ggml_get_rows(c, cur, rows.out_ids)
            inject = ggml.ggml_get_rows(c, inject, rows.out_ids)
            flat = ggml.ggml_get_rows(c, ggml.ggml_reshape_2d(c, x, E * H, g.ub.n_tokens), rows.out_ids)
            x = ggml.ggml_reshape_3d(c, flat, E, H, g.ub.n_outputs)
        x = hyper.combine(g, x, cur, inject, il)
        cur, inject = hyper.mix(g, x, p + "hc_ffn_", il, H)
        return g.cb(hyper.combine(g, x, ffn.moe(g, cur, il), inject, il), "l_out", il)

