"""`deltarun perplexity`: perplexity of a model on a text, and KL divergence against a base."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import click

from deltarun.base.errors import DeltarunError
from deltarun.cli.options import model_argument, model_options, open_model
from deltarun.cli.text_io import read_text_file


def _fmt(x: float, digits: int = 4) -> str:
    return "nan" if math.isnan(x) else f"{x:.{digits}f}"


@click.command("perplexity")
@model_argument()
@click.option("--file", "-f", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="UTF-8 text to score (optional when --kl-base names an existing file).")
@click.option("--chunks", type=click.IntRange(min=1), default=None, help="Score at most this many windows.")
@click.option("--kl-base", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE",
              help="Reference log-probs (.npz): written when FILE does not exist, compared against when it does.")
@click.option("--output", "-o", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="Report format on stdout.")
@model_options
def perplexity(model: Path | None, file: Path | None, chunks: int | None, kl_base: Path | None, output: str,
               **opts: Any) -> None:
    """Perplexity of MODEL.gguf over a text, in windows of --ctx tokens (like llama.cpp's).

    Each window is evaluated from an empty state and its second half is scored. Per-window
    values and the final estimate (with its error) go to stdout, a progress bar to stderr.
    --kl-base compares against saved log-probs of a reference run (another quantisation,
    backend or build): mean/max KL divergence, top-1 agreement and the PPL ratio.
    Without MODEL the built-in model (a small Qwen3-Next trained on Shakespeare) is used.
    """
    from deltarun.apps.perplexity import PerplexityResult, iter_perplexity, prepare_windows, tokenize_text

    if file is None and (kl_base is None or not kl_base.exists()):
        raise click.UsageError("give the text with -f FILE (or an existing --kl-base file to reuse its tokens)")
    text = read_text_file(file) if file is not None else None
    if text is None:  # the windows come from the base: open the model with their size
        from deltarun.apps.perplexity import KLBaseReader

        reader = KLBaseReader(kl_base)  # type: ignore[arg-type]
        opts["ctx"] = reader.n_ctx
        reader.close()
    with open_model(model, **opts) as m:
        tokens = tokenize_text(m, text) if text is not None else None
        windows = prepare_windows(m, tokens, n_ctx=opts["ctx"], max_windows=chunks, kl_base=kl_base)
        n_ctx = len(windows[0])
        if m.n_ctx < n_ctx:
            raise DeltarunError(f"the KL base uses windows of {n_ctx} tokens: run with --ctx {n_ctx}")
        result = PerplexityResult(n_ctx=n_ctx, n_windows=len(windows),
                                  n_tokens=len(tokens) if tokens is not None else len(windows) * n_ctx,
                                  n_scored=0, ppl=float("nan"), ppl_err=float("nan"), nll_mean=float("nan"))
        text_mode = output == "text"
        if text_mode:
            click.echo(f"{m.path}: {result.n_tokens} tokens, {len(windows)} windows of {n_ctx} "
                       f"(scoring the second half of each)", err=True)
        with click.progressbar(length=len(windows), label="perplexity", file=sys.stderr,
                               show_pos=True, show_eta=True) as bar:
            for w in iter_perplexity(m, windows, kl_base, None, result):
                result.windows.append(w)
                bar.update(1)
                if text_mode:
                    click.echo(f"window {w.index + 1:4d}: ppl {_fmt(w.ppl):>12}   running {_fmt(w.running_ppl)} "
                               f"+/- {_fmt(w.running_err, 5)}   ({w.seconds:.2f} s)")
    if output == "json":
        click.echo(json.dumps(result.as_dict(), indent=2))
        return
    click.echo(f"Final estimate: PPL = {_fmt(result.ppl)} +/- {_fmt(result.ppl_err, 5)} "
               f"({result.n_scored} tokens scored)")
    if result.kl_base_written:
        click.echo(f"saved log-probs of {result.n_scored} positions to {result.kl_base_written}")
    if result.kl is not None:
        k = result.kl
        click.echo(f"KL divergence vs {kl_base}: mean {k.kl_mean:.6g}, max {k.kl_max:.6g}, median {k.kl_median:.6g}, "
                   f"99% {k.kl_p99:.6g} ({k.n_positions} positions)")
        click.echo(f"top-1 agreement: {100.0 * k.top1_agreement:.2f}%")
        click.echo(f"PPL ratio: {k.ppl_ratio:.6f} (PPL {_fmt(k.ppl)} vs base {_fmt(k.ppl_base)})")
