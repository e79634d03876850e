"""Perplexity over a text, and KL divergence against saved reference log-probabilities.

Like llama.cpp's `perplexity`: the tokens are cut into non-overlapping windows of n_ctx tokens;
each window is evaluated from an empty state and only its second half is scored, so every scored
token has at least n_ctx/2 tokens of context: for positions i in [n_ctx/2, n_ctx-1) the window
contributes -log p(token[i+1] | token[0..i]). The final PPL is exp(mean NLL) over all scored
tokens, with llama.cpp's error estimate: the standard error of the mean NLL,
sqrt((E[x^2] - E[x]^2) / (n-1)), propagated through exp (PPL * se).

KL base files (`--kl-base`) are .npz archives written atomically (temporary file + rename) and
streamed, so neither writing nor comparing holds all log-probs in memory:

    tokens.npy    int32 [n_windows, n_ctx]   the evaluated windows
    n_ctx.npy     int64 []                    the window size
    version.npy   int64 []                    FORMAT_VERSION
    model.npy     str []                      the model file the base came from (information only)
    logprobs.npy  float16 [n_positions, n_vocab]  log-softmax at each scored position, window order
    nll.npy       float32 [n_positions]       -log p of the actual next token (exact base PPL)

float16 keeps the log-probs compact (2 bytes per vocabulary entry, like llama.cpp's 16-bit base
files); its rounding (about 5e-4 relative) bounds the KL of a model against its own base at ~1e-7.
"""

from __future__ import annotations

import math
import os
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterator

import numpy as np

from deltarun.base.errors import DeltarunError
from deltarun.runner.files import temporary_beside
from deltarun.runner.sampling import log_softmax

if TYPE_CHECKING:  # annotations only: the applications open models lazily
    from deltarun.runner.model import Model

FORMAT_VERSION = 1
ROW_BLOCK = 64          # scored positions processed at once (bounds float64 memory to 64 x n_vocab)
F16_MIN = -65000.0


class KLBaseError(DeltarunError):
    """A KL base file is missing parts, damaged, or was made from other tokens."""


def ppl_estimate(nll: np.ndarray) -> tuple[float, float]:
    """(PPL, its error) from per-token NLLs, as llama.cpp computes them."""
    x = np.asarray(nll, dtype=np.float64)
    n = x.size
    if n == 0:
        return float("nan"), float("nan")
    mean = float(x.mean())
    ppl = math.exp(mean)
    if n < 2:
        return ppl, float("nan")
    var = float((x * x).mean()) - mean * mean
    se = math.sqrt(var / (n - 1)) if var > 0 else 0.0
    return ppl, ppl * se


def split_windows(tokens: list[int], n_ctx: int, max_windows: int | None = None,
                  bos_id: int | None = None) -> list[list[int]]:
    """Non-overlapping windows of n_ctx tokens (the remainder is dropped); with `bos_id` the first
    token of each window is replaced by BOS, as llama.cpp does for vocabularies that add one."""
    if n_ctx < 4:
        raise DeltarunError(f"the window (--ctx) must be at least 4 tokens, not {n_ctx}")
    n = len(tokens) // n_ctx
    if max_windows is not None and max_windows > 0:
        n = min(n, max_windows)
    if n == 0:
        raise DeltarunError(f"the text has {len(tokens)} tokens: at least one window of {n_ctx} tokens (--ctx) "
                            f"is needed")
    windows = [list(tokens[i * n_ctx:(i + 1) * n_ctx]) for i in range(n)]
    if bos_id is not None:
        for w in windows:
            w[0] = bos_id
    return windows


def scored_per_window(n_ctx: int) -> int:
    return n_ctx - 1 - n_ctx // 2


@dataclass
class WindowResult:
    index: int            # 0-based
    n_scored: int
    nll_mean: float
    ppl: float            # of this window alone
    running_ppl: float    # over all windows so far
    running_err: float
    seconds: float


@dataclass
class KLStats:
    n_positions: int
    kl_mean: float
    kl_max: float
    kl_median: float
    kl_p99: float
    top1_agreement: float   # fraction of positions where both argmax tokens agree
    ppl_base: float
    ppl: float
    ppl_ratio: float        # ppl / ppl_base

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PerplexityResult:
    n_ctx: int
    n_windows: int
    n_tokens: int            # tokens in the text (or in the base file)
    n_scored: int
    ppl: float
    ppl_err: float
    nll_mean: float
    windows: list[WindowResult] = field(default_factory=list)
    kl: KLStats | None = None
    kl_base_written: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kl"] = self.kl.as_dict() if self.kl else None
        return d


# --------------------------------------------------------------------------------------------- base files
def _write_npy(zf: zipfile.ZipFile, name: str, arr: np.ndarray) -> None:
    with zf.open(name, "w") as f:
        np.lib.format.write_array(f, np.asarray(arr), allow_pickle=False)


class KLBaseWriter:
    """Streams log-probs into a temporary .npz beside `path`; `commit` renames it into place."""

    def __init__(self, path: str | Path, windows: list[list[int]], n_vocab: int, model_name: str = ""):
        self.path = Path(path)
        n_ctx = len(windows[0])
        self.n_rows = len(windows) * scored_per_window(n_ctx)
        self.n_vocab = n_vocab
        self.rows_written = 0
        self.nll: list[np.ndarray] = []
        fd, self.tmp = temporary_beside(self.path)
        os.close(fd)
        try:
            self.zf = zipfile.ZipFile(self.tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
            _write_npy(self.zf, "version.npy", np.array(FORMAT_VERSION, dtype=np.int64))
            _write_npy(self.zf, "n_ctx.npy", np.array(n_ctx, dtype=np.int64))
            _write_npy(self.zf, "model.npy", np.array(model_name))
            _write_npy(self.zf, "tokens.npy", np.asarray(windows, dtype=np.int32))
            self.f: BinaryIO = self.zf.open("logprobs.npy", "w", force_zip64=True)  # type: ignore[assignment]
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype("<f2")), "fortran_order": False,
                      "shape": (self.n_rows, n_vocab)}
            np.lib.format.write_array_header_2_0(self.f, header)
        except BaseException:
            self.abort()
            raise

    def write(self, logprobs: np.ndarray, nll: np.ndarray) -> None:
        rows = np.clip(logprobs, F16_MIN, None).astype("<f2")
        self.f.write(rows.tobytes())
        self.rows_written += rows.shape[0]
        self.nll.append(np.asarray(nll, dtype=np.float32))

    def commit(self) -> None:
        if self.rows_written != self.n_rows:
            self.abort()
            raise KLBaseError(f"internal error: wrote {self.rows_written} of {self.n_rows} rows")
        self.f.close()
        _write_npy(self.zf, "nll.npy", np.concatenate(self.nll))
        self.zf.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        _close_quietly(getattr(self, "f", None), getattr(self, "zf", None))
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


class KLBaseReader:
    """Reads a base file written by KLBaseWriter, streaming the log-probs row block by row block."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.zf = zipfile.ZipFile(self.path)
        except (OSError, zipfile.BadZipFile) as e:
            raise KLBaseError(f"{path}: not a KL base file ({e})") from e
        try:
            names = set(self.zf.namelist())
            missing = {"version.npy", "n_ctx.npy", "tokens.npy", "logprobs.npy"} - names
            if missing:
                raise KLBaseError(f"{path}: not a deltarun KL base file (missing {', '.join(sorted(missing))})")
            version = int(self._small("version.npy"))
            if version != FORMAT_VERSION:
                raise KLBaseError(f"{path}: KL base format version {version}; this deltarun reads {FORMAT_VERSION}")
            self.n_ctx = int(self._small("n_ctx.npy"))
            self.tokens = self._small("tokens.npy").astype(np.int64)
            self.model_name = str(self._small("model.npy")) if "model.npy" in names else ""
            self.nll = self._small("nll.npy").astype(np.float64) if "nll.npy" in names else None
            self.f = self.zf.open("logprobs.npy")
            major, minor = np.lib.format.read_magic(self.f)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(self.f)
        except KLBaseError:
            self.close()
            raise
        except Exception as e:
            self.close()
            raise KLBaseError(f"{path}: damaged KL base file ({type(e).__name__}: {e})") from e
        if (self.tokens.ndim != 2 or self.tokens.shape[1] != self.n_ctx or len(shape) != 2 or fortran
                or dtype != np.dtype("<f2") or shape[0] != self.tokens.shape[0] * scored_per_window(self.n_ctx)):
            self.close()
            raise KLBaseError(f"{path}: inconsistent KL base file (tokens {self.tokens.shape}, log-probs {shape})")
        self.n_rows, self.n_vocab = int(shape[0]), int(shape[1])

    def _small(self, name: str) -> np.ndarray:
        with self.zf.open(name) as f:
            return np.lib.format.read_array(f, allow_pickle=False)

    def read(self, n_rows: int) -> np.ndarray:
        need = n_rows * self.n_vocab * 2
        data = self.f.read(need)
        if len(data) != need:
            raise KLBaseError(f"{self.path}: the log-probs end early (truncated file)")
        return np.frombuffer(data, dtype="<f2").reshape(n_rows, self.n_vocab)

    def close(self) -> None:
        _close_quietly(getattr(self, "f", None), getattr(self, "zf", None))


def _close_quietly(*handles: Any) -> None:
    """Close the npy stream and its zip archive, ignoring errors (used when giving up on a file)."""
    for handle in handles:
        try:
            if handle is not None:
                handle.close()
        except Exception:
            pass


# --------------------------------------------------------------------------------------------- the run
def window_logits(model: Model, window: list[int]) -> np.ndarray:
    """Logits at positions n_ctx/2 .. n_ctx-1 of a window evaluated from an empty state."""
    first = len(window) // 2
    model.reset()
    if first:
        model.eval(window[:first], continued=True)
    return model.eval(window[first:], all_logits=True)


def iter_perplexity(model: Model, windows: list[list[int]], kl_base: str | Path | None = None,
                    progress: Callable[[WindowResult], None] | None = None,
                    result: PerplexityResult | None = None) -> Iterator[WindowResult]:
    """Score the windows one by one (yielding each); fills `result` (totals, KL) at the end.

    With `kl_base`: an existing file is compared against (its windows must equal `windows`); a
    missing one is written.
    """
    n_ctx = len(windows[0])
    if model.n_ctx < n_ctx:
        raise DeltarunError(f"the model was opened with a context of {model.n_ctx} tokens, the windows have {n_ctx}")
    first = n_ctx // 2
    m = scored_per_window(n_ctx)
    reader: KLBaseReader | None = None
    writer: KLBaseWriter | None = None
    if kl_base is not None:
        if Path(kl_base).exists():
            reader = KLBaseReader(kl_base)
            if reader.n_vocab != model.hp.n_vocab:
                reader.close()
                raise KLBaseError(f"{kl_base}: base has a vocabulary of {reader.n_vocab}, the model {model.hp.n_vocab}")
            if reader.tokens.shape != (len(windows), n_ctx) or not np.array_equal(reader.tokens, np.asarray(windows)):
                reader.close()
                raise KLBaseError(f"{kl_base}: the base was computed on other tokens "
                                  f"({reader.tokens.shape[0]} windows of {reader.n_ctx}); use the same text and --ctx")
        else:
            writer = KLBaseWriter(kl_base, windows, model.hp.n_vocab, model_name=str(model.path))
    nll_all = np.empty(len(windows) * m, dtype=np.float64)
    kl_parts: list[np.ndarray] = []
    nll_base_parts: list[np.ndarray] = []
    agree = 0
    try:
        for w, window in enumerate(windows):
            t0 = time.perf_counter()
            logits = window_logits(model, window)
            targets = np.asarray(window[first + 1:], dtype=np.int64)          # m tokens
            nll = np.empty(m, dtype=np.float64)
            for b in range(0, m, ROW_BLOCK):
                e = min(m, b + ROW_BLOCK)
                lp = log_softmax(logits[b:e])
                nll[b:e] = -lp[np.arange(e - b), targets[b:e]]
                if writer is not None:
                    writer.write(lp, nll[b:e])
                if reader is not None:
                    base = reader.read(e - b).astype(np.float64)
                    base = log_softmax(base)  # renormalise what float16 rounded
                    p = np.exp(base)
                    kl_parts.append((p * (base - lp)).sum(axis=1))
                    row0 = w * m + b
                    nll_base_parts.append(reader.nll[row0:row0 + e - b] if reader.nll is not None
                                          else -base[np.arange(e - b), targets[b:e]])
                    agree += int((base.argmax(axis=1) == lp.argmax(axis=1)).sum())
            nll_all[w * m:(w + 1) * m] = nll
            done = nll_all[:(w + 1) * m]
            running, running_err = ppl_estimate(done)
            wr = WindowResult(index=w, n_scored=m, nll_mean=float(nll.mean()), ppl=math.exp(float(nll.mean())),
                              running_ppl=running, running_err=running_err, seconds=time.perf_counter() - t0)
            if progress is not None:
                progress(wr)
            yield wr
        if writer is not None:
            writer.commit()
            writer = None
    finally:
        if writer is not None:
            writer.abort()
        if reader is not None:
            reader.close()
        model.reset()
    if result is not None:
        ppl, err = ppl_estimate(nll_all)
        result.n_ctx, result.n_windows, result.n_scored = n_ctx, len(windows), nll_all.size
        result.ppl, result.ppl_err, result.nll_mean = ppl, err, float(nll_all.mean())
        if kl_base is not None and kl_parts:
            kl = np.concatenate(kl_parts)
            ppl_base, _ = ppl_estimate(np.concatenate(nll_base_parts))
            result.kl = KLStats(n_positions=int(kl.size), kl_mean=float(kl.mean()), kl_max=float(kl.max()),
                                kl_median=float(np.median(kl)), kl_p99=float(np.percentile(kl, 99)),
                                top1_agreement=agree / kl.size, ppl_base=ppl_base, ppl=ppl,
                                ppl_ratio=ppl / ppl_base)
        elif kl_base is not None:
            result.kl_base_written = str(kl_base)


def tokenize_text(model: Model, text: str) -> list[int]:
    """Tokens of a plain text (special-token texts are not parsed), with BOS when the vocab adds one."""
    return model.tokenizer.encode(text, add_special=True, parse_special=False)


def bos_for_windows(model: Model) -> int | None:
    tok = model.tokenizer
    return tok.bos_id if tok.add_bos and tok.bos_id is not None else None


def run_perplexity(model: Model, tokens: list[int] | None = None, *, n_ctx: int | None = None,
                   max_windows: int | None = None, kl_base: str | Path | None = None,
                   progress: Callable[[WindowResult], None] | None = None) -> PerplexityResult:
    """Perplexity of `tokens` in windows of `n_ctx` (default: the model's context).

    Without `tokens`, an existing `kl_base` provides them (the windows it was computed on).
    """
    windows = prepare_windows(model, tokens, n_ctx=n_ctx, max_windows=max_windows, kl_base=kl_base)
    result = PerplexityResult(n_ctx=0, n_windows=0, n_tokens=len(tokens) if tokens is not None else
                              sum(len(w) for w in windows), n_scored=0, ppl=float("nan"), ppl_err=float("nan"),
                              nll_mean=float("nan"))
    result.windows = list(iter_perplexity(model, windows, kl_base, progress, result))
    return result


def prepare_windows(model: Model, tokens: list[int] | None, *, n_ctx: int | None = None,
                    max_windows: int | None = None, kl_base: str | Path | None = None) -> list[list[int]]:
    if tokens is None:
        if kl_base is None or not Path(kl_base).exists():
            raise DeltarunError("no text: give the text to score (or an existing --kl-base file)")
        reader = KLBaseReader(kl_base)
        try:
            windows = reader.tokens.tolist()
        finally:
            reader.close()
        if max_windows:
            raise DeltarunError("--chunks cannot shorten the windows of a KL base; give the text instead")
        return windows
    return split_windows(tokens, n_ctx or model.n_ctx, max_windows, bos_for_windows(model))
