"""Qwen3.5 MoE (`general.architecture = qwen35moe`): qwen35 with qwen3next's MoE + shared expert
FFN in every block and in the MTP block (llama.cpp's src/models/qwen35moe.cpp)."""

from __future__ import annotations

from deltarun.graphs.qwen35 import Qwen35Family


class Qwen35MoeFamily(Qwen35Family):
    """Graph builder for `general.architecture = qwen35moe`."""

    arch = "qwen35moe"
    moe = True
