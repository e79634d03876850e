"""`deltarun generate`: continue a prompt, streaming the text as the tokens come."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from deltarun.base.errors import DeltarunError, ImageError
from deltarun.cli.options import (draft_options, model_argument, model_options, open_with_draft,
                                  reasoning_budget_option, sampling_options, sampling_params)
from deltarun.cli.text_io import read_text_file, silence_stdout

if TYPE_CHECKING:
    from deltarun.runner.model import Model
    from deltarun.runner.reasoning import ThinkingBudget
    from deltarun.runner.speculative import MtpFeed


def _read_prompt(prompt: str | None, file: Path | None) -> str:
    if prompt is not None and file is not None:
        raise click.UsageError("give the prompt with -p or with -f, not both")
    if file is not None:
        prompt = read_text_file(file)
    if prompt is None:
        raise click.UsageError("no prompt: give one with -p TEXT or -f FILE")
    if prompt == "":
        raise click.BadParameter("the prompt is empty", param_hint="'-p' / '--prompt'")
    return prompt


def _timing(label: str, n: int, seconds: float) -> str:
    ms = seconds * 1000.0
    per = ms / n if n else 0.0
    tps = n / seconds if seconds > 0 else 0.0
    return f"{label:>13}: {ms:10.2f} ms / {n:5d} tokens ({per:8.2f} ms per token, {tps:9.2f} tokens per second)"


@click.command("generate")
@model_argument()
@click.option("--prompt", "-p", default=None, help="Prompt text (special tokens like <|im_start|> are parsed).")
@click.option("--file", "-f", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Read the prompt from this file.")
@click.option("--n-predict", "-n", type=click.IntRange(min=-1), default=128, show_default=True,
              help="Most tokens to generate (-1: until the end of generation or a full context).")
@click.option("--echo/--no-echo", default=False, show_default=True, help="Print the prompt before the output.")
@click.option("--vs-plain", is_flag=True,
              help="With --draft: decode again without speculation and report both speeds.")
@click.option("--mmproj", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The model's vision tower (mmproj-*.gguf), for --image.")
@click.option("--image", "image_files", type=click.Path(dir_okay=False, path_type=Path), multiple=True,
              help="An image (PNG, JPEG, WebP, GIF) placed at the next <__media__> in the prompt, or before "
                   "the prompt without one; repeatable. Needs --mmproj.")
@draft_options
@reasoning_budget_option
@sampling_options
@model_options
def generate(model: Path | None, prompt: str | None, file: Path | None, n_predict: int, echo: bool,
             draft: str | None, draft_max: int, vs_plain: bool, mmproj: Path | None = None,
             image_files: tuple[Path, ...] = (), reasoning_budget: int = -1, **opts: object) -> None:
    """Continue a prompt with MODEL.gguf and stream the text to stdout.

    Without MODEL the built-in model (a small Qwen3-Next trained on Shakespeare) is used.
    Timings go to stderr at the end, like llama.cpp's. With --reasoning-budget, a think block
    (opened by the prompt, as a Qwen3.5 chat prompt's `<think>\n`, or by the model) ends with
    the chat template's end-of-thinking marker after that many tokens.
    """
    from deltarun.base.tokenizer import StreamDecoder
    from deltarun.runner.generation import GenerationStats, generate_tokens
    from deltarun.runner.sampling import LogitsProcessors, Sampler
    from deltarun.runner.speculative import MtpFeed

    text = _read_prompt(prompt, file)
    if image_files and mmproj is None:
        raise ImageError("--image needs the model's vision tower: pass its mmproj file with --mmproj")
    if image_files and vs_plain:
        raise click.UsageError("--vs-plain compares text-only generations; leave it out with --image")
    params = sampling_params(**opts)  # type: ignore[arg-type]
    t_load = time.perf_counter()
    m, source = open_with_draft(model, draft, draft_max, **opts)
    with m:
        load_seconds = time.perf_counter() - t_load
        feed = MtpFeed(source) if source is not None and source.needs_hidden else None
        tokens, n_before, before_seconds = _prefill_images(m, mmproj, image_files, text, feed)
        if not tokens:
            raise DeltarunError("the prompt encodes to no tokens")
        if len(tokens) > m.n_ctx:
            raise DeltarunError(f"the prompt has {len(tokens)} tokens but the context holds {m.n_ctx}; "
                                f"raise --ctx")
        if echo:
            click.echo(text, nl=False)
        budget = _thinking_budget(m, text, reasoning_budget)
        stats = GenerationStats()
        stats.n_prompt, stats.prompt_seconds = n_before, before_seconds   # the images and the text before them
        decoder = StreamDecoder(m.tokenizer)
        interrupted = False
        # nothing is rolled back after a step here: plain steps need not save their start state
        stream = generate_tokens(m, tokens, n_predict, Sampler(params), stats=stats, draft=source, draft_max=draft_max,
                                 processors=LogitsProcessors(budget=budget) if budget is not None else None,
                                 feed=feed, undoable=False)
        try:
            for tok in stream:
                piece = decoder.push(tok)
                if piece:
                    click.echo(piece, nl=False)
            click.echo(decoder.flush())
        except KeyboardInterrupt:
            interrupted = True
            stats.stop_reason = "interrupted"
            click.echo(decoder.flush())
        except BrokenPipeError:  # e.g. `| head`: the reader is gone, stop quietly
            silence_stdout()
            raise SystemExit(0)

        err = dict(err=True)
        click.echo("", **err)
        click.echo(f"{'model':>13}: {m.path} ({m.n_ctx} ctx, {m.backend.name}, delta-net {m.delta_net})", **err)
        if params.greedy:
            click.echo(f"{'sampling':>13}: greedy", **err)
        else:
            click.echo(f"{'sampling':>13}: seed {params.seed}, temp {params.temperature}, top-k {params.top_k}, "
                       f"top-p {params.top_p}, min-p {params.min_p}, repeat-penalty {params.repeat_penalty} "
                       f"(last {params.repeat_last_n})", **err)
        click.echo(f"{'stop':>13}: {_stop_text(stats.stop_reason)}", **err)
        if budget is not None:
            click.echo(f"{'thinking':>13}: {budget.n_thinking} tokens (--reasoning-budget {reasoning_budget})", **err)
        click.echo(f"{'load time':>13}: {load_seconds * 1000.0:10.2f} ms", **err)
        click.echo(_timing("prompt eval", stats.n_prompt, stats.prompt_seconds), **err)
        click.echo(_timing("generation", stats.n_generated, stats.generate_seconds), **err)
        if source is not None:
            click.echo(f"{'speculative':>13}: draft {draft}, draft-max {draft_max}: {stats.n_accepted}/"
                       f"{stats.n_drafted} drafts accepted ({stats.acceptance:.1%}), "
                       f"{stats.tokens_per_step:.2f} tokens per verification step ({stats.n_steps} steps)", **err)
            source.close()
            if vs_plain and not interrupted:
                m.reset()
                plain = GenerationStats()
                again = _thinking_budget(m, text, reasoning_budget)      # a fresh budget: the same answer
                processors = LogitsProcessors(budget=again) if again is not None else None
                sampler = Sampler(sampling_params(**{**opts, "seed": params.seed}))
                same = list(generate_tokens(m, tokens, n_predict, sampler, stats=plain,
                                            processors=processors, undoable=False)) == stats.tokens
                ratio = stats.generate_tps / plain.generate_tps if plain.generate_tps else 0.0
                click.echo(_timing("plain", plain.n_generated, plain.generate_seconds), **err)
                click.echo(f"{'speed-up':>13}: {ratio:.2f}x over plain decoding"
                           f"{' (same tokens)' if same else ' (tokens differ: sampled output)'}", **err)
    if interrupted:
        raise SystemExit(130)


def _thinking_budget(m: "Model", text: str, budget: int) -> "ThinkingBudget | None":
    """--reasoning-budget's processor (None: -1), with the chat template's marker, inside the block
    when the prompt text leaves it open."""
    from deltarun.apps.chat import opens_thinking
    from deltarun.base.chat_template import ChatTemplate
    from deltarun.runner.reasoning import NO_BUDGET, ThinkingTags, thinking_budget

    if budget == NO_BUDGET:
        return None
    tags = ThinkingTags.of_tokenizer(m.tokenizer, ChatTemplate.from_model(m).reasoning_separator())
    return thinking_budget(budget, tags, opens_thinking(text), m.tokenizer.token_bytes)


def _prefill_images(m: "Model", mmproj: Path | None, image_files: tuple[Path, ...],
                    text: str, feed: "MtpFeed | None" = None) -> tuple[list[int], int, float]:
    """The prompt's tokens left to evaluate after its images (evaluated here with the vision tower:
    the images and the text before them), how many tokens were evaluated and in how long; `feed`
    (an MTP draft's `MtpFeed`) is handed their hidden rows."""
    from deltarun.runner.images import load_image
    from deltarun.runner.multimodal import prefill_with_images
    from deltarun.runner.vision import VisionEncoder

    if mmproj is None:
        return m.tokenizer.encode(text), 0, 0.0
    t0 = time.perf_counter()
    with VisionEncoder(mmproj, backend=m.backend) as enc:
        enc.check_text_model(m.hp.n_embd, m.family.arch)
        prepared = [load_image(p, enc.hp) for p in image_files]
        start = m.n_past()
        rest = prefill_with_images(m, enc, text, prepared, feed=feed)
        return rest, m.n_past() - start, time.perf_counter() - t0


def _stop_text(reason: str) -> str:
    return {
        "eog": "end of generation token",
        "length": "reached -n",
        "context": "context full (raise --ctx)",
        "interrupted": "interrupted",
    }.get(reason, reason or "-")
