"""Model weights as ggml tensors, without copying them on the CPU.

On a host-memory backend the mapped GGUF file itself becomes the backend buffer
(`ggml_backend_cpu_buffer_from_ptr`), and each weight tensor points into it: loading costs no copy
and resident memory grows only with the pages the graph touches. Other backends get a buffer of
their own and the bytes are uploaded once. With a `Placement` (`--gpu-layers`) each tensor goes
where its layer is: CPU layers stay mapped, device layers are uploaded, one buffer per device
(several with `--rpc`, see layer_split.LayerSplit).
"""

from __future__ import annotations

import contextlib
import mmap
from typing import Any

from deltarun.base.errors import BackendError, ModelFileError
from deltarun.base.ggml_log import without_debug_log
from deltarun.base.ggml_util import Tensor, ctypes, ggml, new_context, set_name
from deltarun.base.gguf_file import GGUFFile, TensorInfo
from deltarun.runner.backend import Backend, alloc_tensors
from deltarun.runner.placement import Placement
from deltarun.runner.repack import RepackMode, cpu_repack_buffer_type, repack_supports, worth_repacking

TENSOR_ALIGNMENT = 32


class Weights:
    """Every tensor of the file that the graph reads, by GGUF name.

    With `repack` (a model wholly on the CPU) the matrices ggml's CPU_REPACK buffer type has
    kernels for are copied into it at load, laid out for those kernels: on x86 Q4_0, Q4_K, IQ4_NL
    and MXFP4 (and Q2_K with AVX-512), except Q4_K where ggml's tiled K-quant product takes it
    instead (repack.TILED_TYPES); `repack="all"` takes Q4_K too (what llama.cpp does by default).
    `gathered` names the weights a graph reads rows of (the token embeddings), which stay as they
    are in the file.
    """

    def __init__(self, f: GGUFFile, names: list[str], backend: Backend, placement: Placement | None = None,
                 repack: RepackMode = False, gathered: frozenset[str] = frozenset()):
        self.file = f
        self.ctx = new_context(len(names) + 1)
        self.tensors: dict[str, Tensor] = {}
        self.buffer: Any = None          # the mapped file (CPU) or the device buffer
        self.buffers: list[Any] = []     # every buffer holding weights
        #: backend name -> bytes of the weights placed there
        self.bytes_by_backend: dict[str, int] = {}
        self.repacked: list[str] = []    # names of the weights in the CPU_REPACK buffer
        infos = [f.tensors[n] for n in names]
        for info in infos:
            self.tensors[info.name] = self._new_tensor(info)
        tied = "output.weight" not in f.tensors
        where = {i.name: (placement.for_tensor(i.name, tied) if placement else backend) for i in infos}
        on_cpu = [i for i in infos if where[i.name].is_cpu]
        on_dev: dict[int, list[TensorInfo]] = {}    # backend handle -> its tensors (several with --rpc)
        for i in infos:
            if not where[i.name].is_cpu:
                on_dev.setdefault(where[i.name].handle, []).append(i)
        for group in [on_cpu, *on_dev.values()]:
            if group:
                name = where[group[0].name].name
                self.bytes_by_backend[name] = self.bytes_by_backend.get(name, 0) + sum(i.nbytes for i in group)
        buft = cpu_repack_buffer_type() if repack and not on_dev and backend.is_cpu else None
        if buft is not None:
            chosen = {i.name for i in on_cpu if i.name not in gathered and worth_repacking(self.tensors[i.name], repack)
                      and repack_supports(self.tensors[i.name], buft)}
            if chosen:
                self.repacked = [i.name for i in on_cpu if i.name in chosen]
                self._upload([i for i in on_cpu if i.name in chosen], backend, buft)
                on_cpu = [i for i in on_cpu if i.name not in chosen]
        if on_cpu:
            self._map_into_cpu_buffer(on_cpu)
            self._advise_random([i for i in on_cpu if i.name in gathered])
        for group in on_dev.values():
            self.buffer = self._upload(group, where[group[0].name])

    def _new_tensor(self, info: TensorInfo) -> Tensor:
        dims = (ctypes.c_int64 * len(info.ne))(*info.ne)
        t = ggml.ggml_new_tensor(self.ctx, info.ggml_type, len(info.ne), dims)
        if int(ggml.ggml_nbytes(t)) != info.nbytes:
            raise ModelFileError(f"{self.file.path}: tensor {info.name!r} size mismatch "
                                 f"({info.nbytes} bytes in file, ggml expects {ggml.ggml_nbytes(t)})")
        return set_name(t, info.name)

    def _map_into_cpu_buffer(self, infos: list[TensorInfo]) -> None:
        base = self.file.data_base_address
        if base % TENSOR_ALIGNMENT:
            raise BackendError("the model mapping is not aligned for ggml")
        self.buffer = ggml.ggml_backend_cpu_buffer_from_ptr(ctypes.c_void_p(base), self.file.file_size)
        if not self.buffer:
            raise BackendError("ggml could not wrap the mapped model file in a CPU buffer")
        ggml.ggml_backend_buffer_set_usage(self.buffer, ggml.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        self.buffers.append(self.buffer)
        for info in infos:
            status = ggml.ggml_backend_tensor_alloc(self.buffer, self.tensors[info.name],
                                                    ctypes.c_void_p(base + info.offset))
            if status != 0:
                raise BackendError(f"ggml could not place tensor {info.name!r} in the mapped buffer")

    def _advise_random(self, infos: list[TensorInfo]) -> None:
        """Advise the mapped pages of weights read by rows (token embeddings, qwen4exp's n-gram
        table) MADV_RANDOM: no readahead and no fault-around, so reading a row maps little more
        than its own page, and a table of tens of GB stays on disk but for the rows prompts touch
        (measured in tests/test_qwen4exp.py). Without it a cold row read maps 16 pages around it."""
        mapping = getattr(self.file.reader.data, "_mmap", None)
        if mapping is None or not hasattr(mmap, "MADV_RANDOM"):
            return
        page = mmap.PAGESIZE
        for info in infos:
            start = info.offset // page * page
            with contextlib.suppress(OSError, ValueError):   # advice only: never fatal
                mapping.madvise(mmap.MADV_RANDOM, start, info.offset + info.nbytes - start)

    def _upload(self, infos: list[TensorInfo], backend: Backend, buft: Any = None) -> Any:
        """Allocate `infos`' tensors in one buffer of `backend` (or of `buft`) and copy their bytes;
        the buffer. Into CPU_REPACK ggml lays each tensor out as it is set, announcing each in a
        DEBUG log line, which is left out."""
        buffer = alloc_tensors(backend, [self.tensors[i.name] for i in infos], "the weights", buft)
        ggml.ggml_backend_buffer_set_usage(buffer, ggml.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        self.buffers.append(buffer)
        base = self.file.data_base_address
        where = backend.name if buft is None else ggml.ggml_backend_buft_name(buft).decode()
        quiet = without_debug_log() if buft is not None else contextlib.nullcontext()
        with _upload_progress(sum(i.nbytes for i in infos), where) as bar, quiet:
            for info in infos:
                ggml.ggml_backend_tensor_set(self.tensors[info.name], ctypes.c_void_p(base + info.offset), 0,
                                             info.nbytes)
                bar.update(info.nbytes)
        return buffer

    @property
    def nbytes(self) -> int:
        return sum(int(ggml.ggml_nbytes(t)) for t in self.tensors.values())

    def free(self) -> None:
        for buffer in self.buffers:
            ggml.ggml_backend_buffer_free(buffer)
        self.buffers = []
        self.buffer = None
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None


PROGRESS_MIN_BYTES = 256 << 20


def _upload_progress(total: int, where: str) -> Any:
    """A progress bar on stderr while a large model is copied to a device (a terminal only).

    On the CPU nothing is copied (the file is mapped), so loading is one quick call and shows none.
    """
    import sys

    from tqdm import tqdm

    quiet = total < PROGRESS_MIN_BYTES or not sys.stderr.isatty()
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"loading weights to {where}",
                disable=quiet, leave=False)
