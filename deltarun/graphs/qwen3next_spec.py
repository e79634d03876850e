"""Former home of the qwen3next spec, kept so existing imports work: the hyper-parameters are
`deltarun.graphs.interface.HParams`, the readers and checks `deltarun.graphs.spec`, the expected
tensors `Qwen3NextGraph.tensor_spec` (deltarun/graphs/qwen3next.py)."""

from __future__ import annotations

from deltarun.graphs import spec
from deltarun.graphs.interface import HParams
from deltarun.graphs.qwen3next import Qwen3NextGraph
from deltarun.graphs.spec import _same_shape, check_hparams  # noqa: F401  (re-exported)
from deltarun.runner.gguf_file import GGUFFile

ARCH = Qwen3NextGraph.arch


def read_hparams(f: GGUFFile) -> HParams:
    return Qwen3NextGraph.read_hparams(f)


def expected_tensors(hp: HParams, f: GGUFFile) -> dict[str, tuple[tuple[int, ...], bool]]:
    return Qwen3NextGraph.tensor_spec(hp, f.tensors)


def validate_tensors(hp: HParams, f: GGUFFile) -> None:
    spec.validate_tensors(hp, f, expected_tensors(hp, f))
