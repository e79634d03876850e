"""`deltarun compare`: run the same graphs on two backends (or kernels, or weight files) and compare.

The rules, the per-op limits and the JSON schema are documented in `deltarun.apps.compare`.
Exit status: 0 when everything is within its limits, 8 (`LIMITS_EXCEEDED`) when a limit is
exceeded or a NaN appears, and the usual error codes when the comparison could not run. With
--against the nodes exceed their limits by design (the weights differ): the report is the result
and the status is 0 unless the logits hold a NaN.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import numpy as np

from deltarun.base.errors import DeltarunError
from deltarun.base.interface import DELTA_NET_MODES
from deltarun.cli.options import (CONTEXT_SIZE, THREAD_COUNT, check_backends, explicit_options, model_argument,
                                  note_gpu_layers, resolve_model)

DEFAULT_TOKENS = 16
DEFAULT_STEPS = 8
LIMITS_EXCEEDED = 8   # exit status: the comparison ran and found a difference over a limit
#: options of the text comparison, refused with --mmproj (which compares the vision tower)
TEXT_ONLY = ("against", "prompt", "n_tokens", "decode_steps", "delta_net", "gpu_layers", "kv_type", "ctx")


def _pair(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    if value is None:
        return None
    parts = [p.strip() for p in value.split(",")]
    if not 1 <= len(parts) <= 2 or not all(parts):
        raise click.BadParameter(f"{value!r}: give one value or two separated by a comma", ctx=ctx, param=param)
    return parts


def prompt_tokens(model: Path, prompt: str | None, n_tokens: int | None, seed: int) -> list[int]:
    """The prompt's tokens: -p encoded (repeated or cut to --tokens N when given), else N
    pseudo-random token ids (seeded) from the model's vocabulary."""
    from deltarun.base.gguf_file import GGUFFile
    from deltarun.base.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(model).reader)
    if prompt is None:
        rng = np.random.default_rng(seed)
        return [int(t) for t in rng.integers(0, tok.n_vocab, n_tokens or DEFAULT_TOKENS)]
    ids = [int(t) for t in tok.encode(prompt)]
    if not ids:
        raise DeltarunError("the prompt encodes to no tokens")
    if n_tokens is not None:
        ids = (ids * -(-n_tokens // len(ids)))[:n_tokens]
    return ids


@click.command("compare")
@model_argument()
@click.option("--backends", callback=_pair, default=None, metavar="A[,B]",
              help="Backends of the two sides, e.g. cpu,vulkan or cpu,cpu-ref; one name runs both sides on "
                   "it [default: cpu,cpu-ref; cpu with --against].")
@click.option("--against", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              metavar="B.gguf", help="Side b runs this file (another weight type of the same model, e.g. Q8_0 "
                                     "against F32): what the quantisation costs.")
@click.option("--prompt", "-p", default=None, help="Prompt text [default: --tokens random token ids].")
@click.option("--tokens", "n_tokens", type=CONTEXT_SIZE, default=None,
              help=f"Prompt length in tokens [default: {DEFAULT_TOKENS} random ids; with -p the prompt is "
                   "repeated or cut to this length].")
@click.option("--seed", "-s", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the random prompt.")
@click.option("--decode-steps", "-n", type=click.IntRange(min=0), default=DEFAULT_STEPS, show_default=True,
              help="Tokens generated greedily and compared after the prompt (0: the prefill graph only).")
@click.option("--delta-net", callback=_pair, default=None, metavar="A[,B]",
              help="Delta-net kernel per side (fused or primitive), e.g. fused,primitive [default: fused].")
@click.option("--gpu-layers", "-ngl", type=click.IntRange(min=0), default=None,
              help="Layers on the device for device sides (like llama.cpp -ngl) [default: all].")
@click.option("--kv-type", type=click.Choice(["f32", "f16"]), default="f32", show_default=True,
              help="KV cache type of both sides.")
@click.option("--ctx", "-c", type=CONTEXT_SIZE, default=None,
              help="Context size [default: prompt + decode steps + 1].")
@click.option("--threads", "-t", type=THREAD_COUNT, default=None, help="CPU threads.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schema in deltarun.apps.compare).")
@click.option("--show", type=click.Choice(["named", "all", "failures"]), default="named", show_default=True,
              help="Table rows: named nodes, every node, or only failed nodes.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines on stderr.")
@click.option("--mmproj", callback=_pair, default=None, metavar="A[,B]",
              help="Compare MODEL's vision tower (mmproj-*.gguf) instead of the text model; a second file "
                   "(e.g. mmproj-Q8_0.gguf against mmproj-F32.gguf) runs on side b: what its weight type costs.")
@click.option("--image", "image_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --mmproj: the image both sides encode [default: --seed's random pixels, 2 x 3 image tokens].")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE",
              help="Also write the report as one self-contained page: the graph coloured by each node's NMSE "
                   "against its limit, the first node over its limit marked, the logits metrics.")
def compare(model: Path | None, backends: list[str] | None, against: Path | None, prompt: str | None,
            n_tokens: int | None, seed: int, decode_steps: int, delta_net: list[str] | None, gpu_layers: int | None,
            kv_type: str, ctx: int | None, threads: int | None, as_json: bool, show: str, quiet: bool,
            html_path: Path | None, mmproj: list[str] | None = None, image_file: Path | None = None) -> None:
    """Run MODEL on two sides and compare every named node, the logits and the greedy continuation.

    Sides differ by backend (--backends cpu,vulkan), by delta-net kernel (--delta-net
    fused,primitive) or by weights file (--against B.gguf). Per node, in graph order: NMSE =
    sum((a-b)^2)/sum(a^2) of side b against side a, checked against per-op limits (1e-7, 5e-4 for
    matrix products and what depends on them); the first node over its limit is shown with its
    inputs' errors. Then logits NMSE, top-1 agreement, KL divergence and the greedy continuations.

    Exit status: 0 within every limit; 8 when a limit is exceeded (or a NaN appears); with
    --against 0 unless the logits hold a NaN, since two weight files exceed the node limits by
    design and the logits metrics are the result; 1-7 when the comparison could not run (a bad
    file 2, a backend 5, ...).

    With --mmproj the vision tower is compared instead: one image through both sides' towers, every
    named node, then the embeddings (NMSE, limit 5e-4); two mmproj files exit 0 unless NaN, as --against.
    """
    from deltarun.apps import compare as cmp

    if image_file is not None and mmproj is None:
        raise click.UsageError("--image goes with --mmproj (the vision tower that reads it)")
    if mmproj is not None:
        given = explicit_options(TEXT_ONLY)
        if given:
            raise click.UsageError(f"--mmproj compares the vision tower on an image: drop {', '.join(given)}")
        _compare_towers(model, mmproj, backends, image_file, seed, threads, as_json, show, quiet, html_path)
        return
    if html_path is not None and not html_path.resolve().parent.is_dir():
        raise click.BadParameter(f"{html_path}: no such folder", param_hint="'--html'")
    path = resolve_model(model, quiet=quiet or as_json)
    if not path.exists():
        raise DeltarunError(f"no such model file: {path}")
    names = backends or (["cpu"] if against is not None else ["cpu", "cpu-ref"])
    if len(names) == 1:
        names = names * 2
    modes = delta_net or ["fused"]
    if len(modes) == 1:
        modes = modes * 2
    for m in modes:
        if m not in DELTA_NET_MODES:
            raise click.BadParameter(f"{m!r} is not one of {', '.join(DELTA_NET_MODES)}", param_hint="'--delta-net'")
    check_backends(names)                 # before any work: side a would otherwise run in full first
    note_gpu_layers(names, gpu_layers)
    tokens = prompt_tokens(path, prompt, n_tokens, seed)
    a = cmp.Side(path, names[0], modes[0], gpu_layers)
    b = cmp.Side(against or path, names[1], modes[1], gpu_layers)
    say = None if quiet else (lambda s: click.echo(s, err=True))
    report = cmp.compare(a, b, tokens, decode_steps, prompt_text=prompt, n_threads=threads, kv_type=kv_type,
                         n_ctx=ctx, progress=say)
    if html_path is not None:
        from deltarun.apps.graph_page import render_compare_html
        from deltarun.runner.files import write_atomically

        write_atomically(html_path, render_compare_html(report))
        if say:
            say(f"wrote {html_path}")
    click.echo(cmp.to_json(report) if as_json else cmp.to_text(report, show=show), nl=False)
    sys.stdout.flush()
    if not report["passed"]:
        if against is not None and report["logits"]["status"] != "nan":    # NaN logits are never expected
            if not quiet:
                click.echo("compare: the two weight files exceed the node limits, as different weights do; "
                           "the logits metrics above are what the change costs", err=True)
            return
        click.echo(f"compare: limits exceeded: {'; '.join(report['failures'])}", err=True)
        sys.exit(LIMITS_EXCEEDED)


def _compare_towers(model: Path | None, mmproj: list[str], backends: list[str] | None, image_file: Path | None,
                    seed: int, threads: int | None, as_json: bool, show: str, quiet: bool,
                    html_path: Path | None = None) -> None:
    """`compare --mmproj A[,B]`: the vision tower on two sides (backends, or two mmproj files)."""
    from deltarun.apps import vision_graph as vg
    from deltarun.runner.vision import VisionEncoder

    path = resolve_model(model, quiet=quiet or as_json)
    files = [Path(f) for f in mmproj]
    for f in [path] + files:
        if not f.is_file():
            raise DeltarunError(f"no such file: {f}")
    names = backends or (["cpu", "cpu"] if len(files) == 2 else ["cpu", "cpu-ref"])
    if len(names) == 1:
        names = names * 2
    files = files * (3 - len(files))
    check_backends(names)
    with VisionEncoder(files[0], backend="cpu", n_threads=threads) as enc:
        vg.check_fits(enc, path)
        image, label = vg.image_for(enc, image_file, seed)
    say = None if quiet else (lambda s: click.echo(s, err=True))
    report = vg.compare_towers(vg.TowerSide(files[0], names[0]), vg.TowerSide(files[1], names[1]), image,
                               str(image_file) if image_file is not None else None, n_threads=threads, progress=say)
    from deltarun.apps import compare as cmp

    if html_path is not None:
        from deltarun.apps.graph_page import render_compare_html
        from deltarun.runner.files import write_atomically

        write_atomically(html_path, render_compare_html(report))
        if say:
            say(f"wrote {html_path}")
    click.echo(cmp.to_json(report) if as_json else vg.to_text(report, show=show), nl=False)
    sys.stdout.flush()
    if not report["passed"]:
        if files[0] != files[1] and report["embeddings"]["status"] != "nan":
            if not quiet:
                click.echo("compare: the two mmproj files exceed the node limits, as different weights do; "
                           "the embeddings metrics above are what the change costs", err=True)
            return
        click.echo(f"compare: limits exceeded: {'; '.join(report['failures'])}", err=True)
        sys.exit(LIMITS_EXCEEDED)
