"""`deltarun bench`: llama-bench style prompt-processing and generation throughput."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from deltarun.base.errors import ModelFileError
from deltarun.base.interface import DELTA_NET_MODES
from deltarun.cli.options import check_backends, model_argument, note_gpu_layers, pin_threads_option, rpc_options
from deltarun.runner.backend import MAX_THREADS
from deltarun.runner.memory import KV_TYPES, MAX_CONTEXT, MAX_SEQUENCES

#: the largest value of each list option: threads and sequences as the runtime takes them, token
#: counts (-p, -n, -d, -ub) and layers (-ngl) within the longest context
_MOST = {"threads": MAX_THREADS, "parallel": MAX_SEQUENCES}


def _int_list(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> list[int]:
    """-p 128 -p 256,512 -> [128, 256, 512]; each value a non-negative integer (positive for -t/-b),
    at most what the model can take (`_MOST`)."""
    out: list[int] = []
    minimum = 1 if param.name in ("threads", "ubatch", "parallel") else 0   # -p/-n 0 skip; -ngl 0 is all on the CPU
    most = _MOST.get(param.name or "", MAX_CONTEXT)
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                n = int(part)
            except ValueError:
                raise click.BadParameter(f"{part!r} is not an integer", ctx=ctx, param=param)
            if n < minimum:
                raise click.BadParameter(f"{n} is below {minimum}", ctx=ctx, param=param)
            if n > most:
                raise click.BadParameter(f"{n} is above {most}", ctx=ctx, param=param)
            if n not in out:
                out.append(n)
    return out


def _str_list(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for value in values:
        out += [p.strip() for p in value.split(",") if p.strip() and p.strip() not in out]
    return out


@click.command("bench")
@model_argument(required=True)
@click.option("--n-prompt", "-p", multiple=True, callback=_int_list, metavar="N[,N...]",
              help="Prompt sizes to measure (pp tests) [default: 512]; 0 skips them.")
@click.option("--n-gen", "-n", multiple=True, callback=_int_list, metavar="N[,N...]",
              help="Generation lengths to measure (tg tests) [default: 128]; 0 skips them.")
@click.option("--repetitions", "-r", type=click.IntRange(min=1), default=5, show_default=True,
              help="Measured runs per test (after one warm-up run).")
@click.option("--threads", "-t", multiple=True, callback=_int_list, metavar="N[,N...]",
              help="CPU thread counts [default: physical cores].")
@click.option("--ubatch", "-ub", multiple=True, callback=_int_list, metavar="N[,N...]",
              help="Ubatch sizes (tokens per graph) [default: 512].")
@click.option("--backend", multiple=True, callback=_str_list, metavar="NAME[,NAME...]",
              help="ggml backends: cpu, cpu-ref, vulkan[:N], cuda[:N], auto (`deltarun devices` lists them) "
                   "[default: cpu].")
@click.option("--gpu-layers", "-ngl", multiple=True, callback=_int_list, metavar="N[,N...]",
              help="With a device backend: layers on the device, the rest on the CPU, as llama-bench -ngl "
                   "[default: all on the device].")
@rpc_options
@click.option("--kv-type", type=click.Choice(sorted(KV_TYPES)), default="f16", show_default=True,
              help="Type of the KV cache.")
@click.option("--delta-net", type=click.Choice(DELTA_NET_MODES), default="fused", show_default=True,
              help="Gated delta-net kernel.")
@click.option("--depth", "-d", multiple=True, callback=_int_list, metavar="D[,D...]",
              help="Also measure tg after D tokens of context (tg<N>@d<D>), as llama-bench -d.")
@click.option("--parallel", multiple=True, callback=_int_list, metavar="P[,P...]",
              help="Also measure aggregate tg with P sequences decoding together (tg<N>x<P>, "
                   "one eval_batch per step).")
@click.option("--profile", is_flag=True,
              help="Also time every ggml op of a pp and a tg ubatch (per op type and per node group: "
                   "attention, delta net, MoE/FFN, LM head); see deltarun.apps.op_profile.")
@click.option("--repack/--no-repack", default=True, show_default=True,
              help="Lay out Q4_0 / IQ4_NL matrices (Q4_K where ggml has no tiled K-quant product) for "
                   "ggml's interleaved CPU kernels at load.")
@pin_threads_option()
@click.option("--output", "-o", type=click.Choice(["md", "json", "csv"]), default="md", show_default=True,
              help="Report format (json schema: see deltarun.apps.bench).")
def bench(model: Path, n_prompt: list[int], n_gen: list[int], repetitions: int, threads: list[int],
          ubatch: list[int], backend: list[str], gpu_layers: list[int], kv_type: str, delta_net: str,
          depth: list[int], parallel: list[int], profile: bool, repack: bool, output: str, rpc: str | None = None,
          tensor_split: str | None = None, pin_threads: bool | None = None) -> None:
    """Measure prompt processing (pp) and generation (tg) speed of MODEL.gguf, like llama-bench.

    -p, -n, -t, -ub and --backend take several values (repeated or comma-separated) and run as a
    grid. pp<P>: P tokens evaluated from an empty state in ubatches of -ub tokens; with pp1 in the
    grid (-p 1,2,4,8) the column "x pp1" gives each ubatch's seconds relative to one token's. tg<N>: N
    single-token evaluations after a 16-token prompt. Each test runs once as a warm-up, then -r
    times; t/s is the mean ± standard deviation over those runs. tg<N>@d<D>: tg after D tokens of
    context. tg<N>x<P>: P sequences decoding N tokens together, t/s counted over all of them.
    --profile: seconds per ggml op and node group of one pp and one tg ubatch (a table after the
    results; "profiles" in the JSON).
    """
    from deltarun.apps.bench import (BenchConfig, BenchReport, check_config, has_ubatch_cost, iter_bench,
                                       machine_info, markdown_header, markdown_row, to_csv, to_json)
    from deltarun.runner.devices import llamafile_note

    cfg = BenchConfig(model=model, n_prompt=n_prompt or [512], n_gen=n_gen or [128], threads=threads,
                      ubatch=ubatch or [512], backends=backend or ["cpu"], gpu_layers=gpu_layers,
                      repetitions=repetitions,
                      kv_type=kv_type, delta_net=delta_net, depth=depth, parallel=parallel, profile=profile,
                      rpc=rpc, tensor_split=tensor_split, repack=repack, pin_threads=pin_threads)
    check_backends(cfg.backends)          # before the table header: nothing is printed for a bad option
    check_config(cfg)
    note_gpu_layers(cfg.backends, gpu_layers)
    if not model.is_file():
        raise ModelFileError(f"{model}: no such file")
    settings: dict[str, Any] = {}
    info: dict[str, Any] = {}
    results = []
    profiles: list[Any] = []
    cost = has_ubatch_cost(cfg.n_prompt)
    if output == "md":
        click.echo(markdown_header(cost))
    for r in iter_bench(cfg, settings, info, profiles):
        results.append(r)
        if output == "md":
            click.echo(markdown_row(info, r, cost))
    report = BenchReport(machine_info(), info, settings, results, profiles)
    if profiles and output == "md":
        from deltarun.apps.op_profile import format_profiles

        for i in range(0, len(profiles), 2):   # pp and tg of one backend / ubatch / threads
            p = profiles[i]
            click.echo(f"\nprofile ({p.threads} threads): seconds per ggml op and node group "
                       "(eval callback, node by node)")
            click.echo(format_profiles(profiles[i:i + 2]))
    if output == "json":
        click.echo(to_json(report))
    elif output == "csv":
        click.echo(to_csv(report), nl=False)
    else:
        import deltarun

        features = report.machine["ggml_cpu_features"]
        click.echo(f"\ndeltarun {deltarun.__version__}, {report.machine['platform']}, "
                   f"{report.machine['cpu_count']} CPUs, ggml CPU: {' '.join(features)}", err=True)
    note = llamafile_note(report.machine["ggml_cpu_features"])
    if note:
        click.echo(note, err=True)
