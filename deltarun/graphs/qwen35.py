"""Qwen3.5 dense (`general.architecture = qwen35`): qwen3next's block diagram with three changes.

    tokens -> embedding
           -> n_layer x [ RMSNorm -> gated delta net | gated attention (IMRoPE)
                          -> + residual -> RMSNorm -> dense SwiGLU FFN -> + residual ]
           -> RMSNorm -> LM head;  MTP block as qwen3next's, with a dense FFN

What differs from qwen3next (see shared/docs/qwen35-gguf.md and llama.cpp's
src/models/qwen35.cpp): keys under `qwen35.`; interleaved multi-section rope
(`rope.dimension_sections`, 4 positions per token); separate `ssm_beta` / `ssm_alpha` instead
of the fused `ssm_ba`, no legacy `ssm_in`; value heads stored tiled by the converter, so q/k
broadcast tiled; a dense FFN (`feed_forward_length`) in every block instead of the MoE.
"""

from __future__ import annotations

from deltarun.graphs.blocks.delta_net import DeltaNet
from deltarun.graphs.qwen3next import Qwen3NextFamily


class Qwen35Family(Qwen3NextFamily):
    """Graph builder for `general.architecture = qwen35`."""

    arch = "qwen35"
    delta_net_layout = DeltaNet(beta_alpha="split", broadcast="tiled", legacy_ssm_in=False)
    moe = False
    rope_sections = True
