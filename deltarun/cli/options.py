"""Options shared by the commands that open a model (generate, chat, bench, perplexity, ...).

Each group is a decorator, so every command spells an option the same way and validates it with
the same click type:

    @click.command()
    @model_argument()
    @model_options
    @sampling_options
    def cmd(model, **opts):
        with open_model(model=model, **opts) as m:
            sampler = Sampler(sampling_params(**opts))

`open_model` and `sampling_params` take the command's keyword arguments as they are and ignore
the ones that are not theirs, so a command can pass `**opts` straight through.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Callable

import click

from deltarun.base.errors import DeltarunError
from deltarun.base.interface import DELTA_NET_MODES
from deltarun.runner.devices import physical_cores
from deltarun.runner.draft_vocab import DEFAULT_DRAFT_VOCAB, MIN_HEAD_SHARE
from deltarun.runner.backend import MAX_THREADS
from deltarun.runner.memory import KV_TYPES, MAX_CONTEXT, MAX_RS_SLOTS
from deltarun.runner.sampling import MAX_REPEAT_PENALTY, MIN_REPEAT_PENALTY, SamplingParams

F = Callable[..., Any]

_DEFAULTS = SamplingParams()

#: Defaults of the model options, for callers that open a model without click.
MODEL_DEFAULTS: dict[str, Any] = {
    "ctx": 4096, "ubatch": 512, "threads": None, "rs_slots": 1, "delta_net": "fused", "kv_type": "f16",
    "backend": "cpu", "gpu_layers": None, "rpc": None, "tensor_split": None, "repack": True, "pin_threads": None,
}


#: the click types of the sizes the runtime bounds (runner.memory, runner.backend), one per concept
#: for every command that takes them
CONTEXT_SIZE = click.IntRange(min=1, max=MAX_CONTEXT)
THREAD_COUNT = click.IntRange(min=1, max=MAX_THREADS)
RS_SLOT_COUNT = click.IntRange(min=1, max=MAX_RS_SLOTS)


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange that also refuses nan and inf: nan passes every bound check (it compares
    false), and no setting here means anything at infinity."""

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def _apply(f: F, decorators: list[Callable[[F], F]]) -> F:
    for d in reversed(decorators):  # reversed so --help lists them in the order written
        f = d(f)
    return f


def model_argument(required: bool = False) -> Callable[[F], F]:
    """The MODEL.gguf argument; when optional, a missing model means the built-in trained one."""
    return click.argument("model", required=required, metavar="[MODEL]" if not required else "MODEL",
                          type=click.Path(dir_okay=False, path_type=Path))


def model_options(f: F) -> F:
    """--ctx --ubatch --threads --pin-threads --rs-slots --delta-net --kv-type --backend --gpu-layers --repack
    --rpc --tensor-split."""
    return _apply(f, [
        click.option("--ctx", "-c", type=CONTEXT_SIZE, default=MODEL_DEFAULTS["ctx"], show_default=True,
                     help="Context size in tokens (KV cache rows per sequence)."),
        click.option("--ubatch", "-ub", type=click.IntRange(min=1), default=MODEL_DEFAULTS["ubatch"],
                     show_default=True, help="Ubatch size: most tokens evaluated by one graph."),
        click.option("--threads", "-t", type=THREAD_COUNT, default=None,
                     help=f"CPU threads [default: physical cores, here {physical_cores()}]."),
        pin_threads_option(),
        click.option("--rs-slots", type=RS_SLOT_COUNT, default=MODEL_DEFAULTS["rs_slots"],
                     show_default=True,
                     help="Recurrent-state slots K per sequence (K-1 tokens can be rolled back)."),
        click.option("--delta-net", type=click.Choice(DELTA_NET_MODES), default=MODEL_DEFAULTS["delta_net"],
                     show_default=True, help="Gated delta-net kernel: ggml's fused op or primitive ops."),
        click.option("--kv-type", type=click.Choice(sorted(KV_TYPES)), default=MODEL_DEFAULTS["kv_type"],
                     show_default=True, help="Type of the KV cache."),
        click.option("--backend", default=MODEL_DEFAULTS["backend"], show_default=True, metavar="NAME",
                     help="ggml backend to run on: cpu, cpu-ref (reference kernels), vulkan[:N], cuda[:N], or "
                          "auto (the best device found, CPU last); `deltarun devices` lists them."),
        click.option("--gpu-layers", "-ngl", type=click.IntRange(min=0), default=MODEL_DEFAULTS["gpu_layers"],
                     help="With a device backend: keep the first layers on the CPU and put the last N on the "
                          "device (the output layer too when N > layers), like llama.cpp -ngl [default: all on "
                          "the device]."),
        click.option("--repack/--no-repack", default=MODEL_DEFAULTS["repack"], show_default=True,
                     help="On the CPU, lay out the matrices ggml has interleaved kernels for (Q4_0, IQ4_NL "
                          "on x86) for them at load, as llama.cpp does; Q4_K stays as it is where ggml's tiled "
                          "K-quant product (x86 AVX2) computes prompts faster from it. --no-repack maps every "
                          "weight from the file as it is."),
        *rpc_options_list(),
    ])


def pin_threads_option() -> Callable[[F], F]:
    """--pin-threads/--no-pin-threads (cpu_threads.ThreadPinning), also for bench."""
    return click.option("--pin-threads/--no-pin-threads", default=MODEL_DEFAULTS["pin_threads"],
                        help="Keep each CPU compute thread on a core of its own, as llama.cpp's --cpu-strict 1 "
                             "[default: when --threads is the number of physical cores].")


def rpc_options_list() -> list[Callable[[F], F]]:
    """--rpc --tensor-split (layer_split.LayerSplit), also for commands with options of their own."""
    return [
        click.option("--rpc", default=MODEL_DEFAULTS["rpc"], metavar="HOST:PORT[,HOST:PORT...]",
                     help="Also use the devices of these `deltarun rpc-server`s (ggml RPC); the layers are "
                          "split over them and the local backend (see --tensor-split)."),
        click.option("--tensor-split", "-ts", default=MODEL_DEFAULTS["tensor_split"], metavar="A,B,...",
                     help="Share of the layers per device, in order: each --rpc server's devices, then the "
                          "local --backend device [default: by free memory]."),
    ]


def rpc_options(f: F) -> F:
    """--rpc --tensor-split alone, for commands with model options of their own (bench)."""
    return _apply(f, rpc_options_list())


def sampling_options(f: F) -> F:
    """--seed --temp --top-k --top-p --min-p --repeat-penalty --repeat-last-n."""
    return _apply(f, [
        click.option("--seed", "-s", type=click.IntRange(min=0), default=None,
                     help="Random seed of the sampler [default: random, printed at the end]."),
        click.option("--temp", type=FiniteFloatRange(min=0.0), default=_DEFAULTS.temperature, show_default=True,
                     help="Temperature; 0 is greedy (argmax)."),
        click.option("--top-k", type=click.IntRange(min=0), default=_DEFAULTS.top_k, show_default=True,
                     help="Keep the k most likely tokens (0 = all)."),
        click.option("--top-p", type=FiniteFloatRange(min=0.0, max=1.0, min_open=True), default=_DEFAULTS.top_p,
                     show_default=True, help="Nucleus sampling: smallest set with this probability (1 = off)."),
        click.option("--min-p", type=FiniteFloatRange(min=0.0, max=1.0), default=_DEFAULTS.min_p,
                     show_default=True, help="Drop tokens below min-p x the top probability (0 = off)."),
        click.option("--repeat-penalty", type=FiniteFloatRange(min=MIN_REPEAT_PENALTY, max=MAX_REPEAT_PENALTY),
                     default=_DEFAULTS.repeat_penalty, show_default=True,
                     help="Penalty for recently seen tokens (1 = off)."),
        click.option("--repeat-last-n", type=click.IntRange(min=-1), default=_DEFAULTS.repeat_last_n,
                     show_default=True, help="How many recent tokens the penalty looks at (0 = off, -1 = all)."),
    ])


def reasoning_budget_option(f: F) -> F:
    """--reasoning-budget N, llama.cpp's name and meaning (runner.reasoning.thinking_budget)."""
    return click.option("--reasoning-budget", type=click.IntRange(min=-1), default=-1, show_default=True,
                        metavar="N", help="Tokens the model may think (inside <think> ... </think>) before the "
                        "template's end-of-thinking marker is forced: -1 no limit, 0 no thinking.")(f)


def sampling_params(temp: float = _DEFAULTS.temperature, top_k: int = _DEFAULTS.top_k,
                    top_p: float = _DEFAULTS.top_p, min_p: float = _DEFAULTS.min_p,
                    repeat_penalty: float = _DEFAULTS.repeat_penalty,
                    repeat_last_n: int = _DEFAULTS.repeat_last_n, seed: int | None = None,
                    **_other: Any) -> SamplingParams:
    """SamplingParams from the sampling options; a missing seed is drawn now (so it can be printed)."""
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    return SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed)


def resolve_model(model: str | Path | None, quiet: bool = False) -> Path:
    """The model path to open: the one given, or the built-in model (a small Qwen3-Next trained on
    Shakespeare, shipped with deltarun).

    Using the built-in model is announced on stderr unless `quiet`.
    """
    if model is not None:
        return Path(model)
    from deltarun.model_files import generate as gen

    path = gen.default_model_path()
    if not quiet:
        click.echo(f"no model given: using the built-in model {path} (a small Qwen3-Next trained on Shakespeare)",
                   err=True)
    try:
        return gen.ensure_default_model()
    except OSError as e:
        raise DeltarunError(f"cannot open the built-in model: {e}") from e


def explicit_options(names: tuple[str, ...] | list[str]) -> list[str]:
    """Which of the current command's parameters (by name) the user set rather than left at their
    defaults, spelt as options (`--rs-slots`): for refusing options that a mode does not use."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    spelt = {p.name: max(p.opts, key=len) for p in ctx.command.params}
    out = []
    for name in names:
        src = ctx.get_parameter_source(name)
        if src is not None and src not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP):
            out.append(spelt.get(name, "--" + name.replace("_", "-")))
    return out


def check_backends(names: list[str]) -> None:
    """Refuse an unknown or unavailable backend before any work (a BackendError, exit status 5)."""
    from deltarun.runner.backend import check_backend

    for name in names:
        check_backend(name)


def note_gpu_layers(backends: list[str], gpu_layers: Any) -> None:
    """Say so when --gpu-layers is given but every backend is the CPU, where it changes nothing."""
    from deltarun.runner.backend import check_backend
    from deltarun.runner.devices import best_device

    if gpu_layers is None or gpu_layers == []:
        return
    kinds = {check_backend(name) for name in backends}
    if kinds <= {"cpu", "cpu-ref"} or (kinds <= {"cpu", "cpu-ref", "auto"} and best_device() is None):
        click.echo("note: --gpu-layers has no effect on the CPU backend (everything runs on the CPU)", err=True)


def open_model(model: str | Path | None = None, *, ctx: int = MODEL_DEFAULTS["ctx"],
               ubatch: int = MODEL_DEFAULTS["ubatch"], threads: int | None = None,
               rs_slots: int = MODEL_DEFAULTS["rs_slots"], delta_net: str = MODEL_DEFAULTS["delta_net"],
               kv_type: str = MODEL_DEFAULTS["kv_type"], backend: str = MODEL_DEFAULTS["backend"],
               gpu_layers: int | None = MODEL_DEFAULTS["gpu_layers"], n_seq_max: int = 1, quiet: bool = False,
               mtp: bool = False, rpc: str | None = None, tensor_split: str | None = None, capture_slots: int = 0,
               repack: bool = MODEL_DEFAULTS["repack"], pin_threads: bool | None = MODEL_DEFAULTS["pin_threads"],
               draft_vocab: int | None = None, **_other: Any):
    """Open `model` (or the built-in model when None) with the model options' values, in a
    process whose host memory is settled for it (`runner.host_memory`)."""
    from deltarun.runner.host_memory import settle_host_memory
    from deltarun.runner.model import Model

    settle_host_memory()
    path = resolve_model(model, quiet=quiet)
    check_backends([backend])
    if not quiet:
        note_gpu_layers([backend], gpu_layers)
    return Model(path, backend=backend, n_ctx=ctx, n_ubatch=ubatch, n_threads=threads, rs_slots=rs_slots,
                 n_seq_max=n_seq_max, kv_type=kv_type, delta_net=delta_net, gpu_layers=gpu_layers, mtp=mtp,
                 rpc=rpc, tensor_split=tensor_split, capture_slots=capture_slots, repack=repack,
                 pin_threads=pin_threads, draft_vocab=draft_vocab)


#: --draft-max when not given: llama.cpp's MTP depth (each MTP draft runs the block and its LM head
#: in turn), and a longer reach for the cheap n-gram and draft-model sources.
DRAFT_MAX_DEFAULTS = {"mtp": 3}
DRAFT_MAX_DEFAULT = 8


def _draft_max(ctx: click.Context, param: click.Parameter, value: int | None) -> int:
    """--draft-max, or the default of the --draft source (click processes an option left off the
    command line after the given ones, so a given --draft is known here)."""
    if value is not None:
        return value
    return DRAFT_MAX_DEFAULTS.get(ctx.params.get("draft") or "", DRAFT_MAX_DEFAULT)


def draft_options(f: F) -> F:
    """--draft ngram|mtp|PATH --draft-max N: speculative decoding."""
    return _apply(f, [
        click.option("--draft", default=None, metavar="ngram|mtp|PATH",
                     help="Speculative decoding: prompt-lookup n-grams, the model's MTP block, or a smaller "
                          "draft GGUF with the same vocabulary."),
        click.option("--draft-max", type=click.IntRange(min=1, max=64), default=None, callback=_draft_max,
                     help=f"Most drafted tokens verified per target ubatch (needs --rs-slots > N; raised "
                          f"automatically) [default: {DRAFT_MAX_DEFAULTS['mtp']} with mtp, {DRAFT_MAX_DEFAULT} "
                          f"otherwise]. The length adapts to how many are accepted, and drafting pauses while "
                          f"drafts are mostly wrong."),
        click.option("--draft-vocab", type=click.IntRange(min=0), default=None, metavar="N",
                     help=f"With --draft mtp: the MTP block's LM head over the first N token ids only (BPE "
                          f"ids run most frequent first; drafts of later ids are never made, the output does "
                          f"not change); 0: the whole vocabulary [default: {DEFAULT_DRAFT_VOCAB} where the LM "
                          f"head is at least {MIN_HEAD_SHARE:.0%} of a token's weight reads, else 0]."),
    ])


def check_draft(model: Path, draft: str | None, draft_vocab: int | None = None) -> None:
    """Refuse a --draft that cannot work from the GGUF headers alone, before any model loads: a
    missing draft file, a draft model with another vocabulary, mtp on a model without an MTP block,
    --draft-vocab without --draft mtp."""
    if draft_vocab is not None and draft != "mtp":
        raise DeltarunError("--draft-vocab sets the MTP block's LM head: it needs --draft mtp")
    if draft is None or draft == "ngram":
        return
    from deltarun.runner.speculative import check_draft_vocab
    from deltarun.base.gguf_file import GGUFFile
    from deltarun.base.registry import graph_family_for

    target = graph_family_for(GGUFFile(model)).hp
    if draft == "mtp":
        if not target.n_mtp:
            raise DeltarunError(f"{model}: --draft mtp needs a model with an MTP block (nextn_predict_layers is 0)")
        return
    path = Path(draft)
    if not path.is_file():
        raise DeltarunError(f"--draft {draft}: no such draft model file (give ngram, mtp or a GGUF path)")
    check_draft_vocab(graph_family_for(GGUFFile(path)).hp.n_vocab, target.n_vocab)


def draft_model_options(opts: dict[str, Any]) -> dict[str, Any]:
    """The model options a draft GGUF is opened with: the target's, without rollback slots (its drafts
    are never rolled back, see ModelDraft)."""
    return dict(opts, rs_slots=1)


def open_with_draft(model: str | Path | None, draft: str | None, draft_max: int, **opts: Any):
    """Open the target (with enough rollback slots and its MTP block if asked) and the draft source."""
    from deltarun.runner.speculative import ModelDraft, MtpDraft, NgramDraft

    if draft is None:
        check_draft(Path(), draft, opts.get("draft_vocab"))
        return open_model(model, **opts), None
    check_draft(resolve_model(model, quiet=True), draft, opts.get("draft_vocab"))
    opts = dict(opts)
    opts["rs_slots"] = max(int(opts.get("rs_slots") or 1), draft_max + 1)
    opts["ubatch"] = max(int(opts.get("ubatch") or MODEL_DEFAULTS["ubatch"]), draft_max + 1)
    target = open_model(model, mtp=draft == "mtp", **opts)
    try:
        if draft == "ngram":
            return target, NgramDraft()
        if draft == "mtp":
            return target, MtpDraft(target, defer=True)
        source = ModelDraft(open_model(Path(draft), quiet=True, **draft_model_options(opts)), target.hp.n_vocab)
        return target, source
    except BaseException:
        target.close()
        raise
