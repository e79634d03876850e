"""The CPU gated delta net writes its rollback snapshots into the recurrent cache itself (ggml patch
gated-delta-net-slots-in-place, `Memory.ssm_slots_in_place`): the graphs leave out the copy of
the snapshots, and every logit and every rollback slot is bit for bit what the copying graphs give
(the kernel computes the same states and only writes them elsewhere). Kimi's KDA (a per-channel
gate) runs ggml's generic loop, the others the AVX-512 row kernel where the CPU has it."""

from __future__ import annotations

import numpy as np
import pytest

from deltarun.base.ggml_compat import cpu_writes_slots_in_place
from deltarun.base.ggml_util import ggml, name_of, tensor_to_numpy
from deltarun.runner.model import Model


def _node_names(m: Model) -> set[str]:
    names = set()
    for g in m._graphs.values():
        names.update(name_of(ggml.ggml_graph_node(g.gf, i)) for i in range(ggml.ggml_graph_n_nodes(g.gf)))
    return names


def _run(path, in_place: bool) -> tuple[list[np.ndarray], list[np.ndarray], set[str]]:
    """Prompts, verification steps with rollbacks, two sequences together, a prompt longer than the
    kernel's 64-token chunk; sequences 1 and 2 (cells past the first: the state views start
    mid-cache); then every linear-attention layer's slots."""
    with Model(path, n_ctx=160, rs_slots=4, n_seq_max=3, n_threads=2, ssm_slots_in_place=in_place) as m:
        assert m.memory.ssm_slots_in_place == in_place       # this CPU build writes them in place
        out = [m.eval(list(range(10, 30)), seq=1, all_logits=True)]
        out.append(m.eval([7, 8, 9], seq=1, all_logits=True, keep_start=False))     # T < K
        m.rollback(2, 1)
        out.append(m.eval([4], seq=1))                                              # one token, T < K
        out.append(m.eval([5, 6, 11, 12, 13], seq=1, all_logits=True))              # T > K
        m.rollback(3, 1)
        m.copy_seq(1, 2)
        out.extend(m.eval_batch({1: [1, 2], 2: [3, 4]}, all_logits=True).values())   # two cells, one graph
        out.append(m.eval([(i * 7) % 90 + 5 for i in range(130)], seq=0))            # 130 tokens: chunks of 64
        slots = [tensor_to_numpy(m.memory.ssm[il]).copy() for il in sorted(m.memory.ssm)]
        return out, slots, _node_names(m)


def test_this_ggml_writes_the_slots_in_place():
    """The wheel scripts/install.sh builds carries the patch (without it the copy stays)."""
    assert cpu_writes_slots_in_place()


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35", "tiny-kimi-linear"])
def test_slots_written_in_place_equal_the_copied_ones(tiny_model_path, preset):
    path = tiny_model_path(preset)
    with Model(path, n_ctx=16, n_threads=1) as m:
        assert m.memory.ssm_slots_in_place          # chosen on the CPU backend with this ggml
    copied, copied_slots, copied_names = _run(path, False)
    in_place, in_place_slots, in_place_names = _run(path, True)
    assert any(n.startswith("ssm_state_store-") for n in copied_names)
    assert not any(n.startswith("ssm_state_store-") for n in in_place_names)
    for a, b in zip(copied, in_place, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(copied_slots, in_place_slots, strict=True):
        np.testing.assert_array_equal(a, b)
