"""`deltarun graph`: dump the ggml graph the runner computes for one ubatch shape.

The graph is built through the model's own graph cache (`Model.graph`), so the dump is exactly
what `eval` runs for that shape. With `--values -p PROMPT` the prompt is run through that graph and
the values of every node (or those matching `--filter`) are recorded through the scheduler's eval
callback; `--dump-dir` also saves them as .npy files with a manifest. The JSON schema is
documented in `deltarun.apps.graph_dump`.

With `--mmproj FILE` the dump is of the model's vision tower instead (`deltarun.apps.vision_graph`):
the graph of the image given with `--image` (its size after preprocessing sets the graph's shape;
a seeded random image without one), and `--values` computes it on that image.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from deltarun.base.errors import DeltarunError
from deltarun.base.interface import DELTA_NET_MODES
from deltarun.cli.options import (CONTEXT_SIZE, RS_SLOT_COUNT, THREAD_COUNT, check_backends, explicit_options,
                                  note_gpu_layers)

if TYPE_CHECKING:
    from deltarun.apps.graph_dump import GraphDump

FORMATS = ("txt", "json", "dot", "svg", "html")
#: options that shape a text model's graph, refused with --mmproj
TEXT_ONLY = ("tokens", "seqs", "past", "decode", "outputs", "rs_slots", "delta_net", "ctx", "kv_type", "gpu_layers",
             "rpc", "tensor_split", "prompt")
DEFAULT_TOKENS = 8
DEFAULT_DECODE_PAST = 32


@click.command("graph")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--tokens", type=click.IntRange(min=1), default=None,
              help=f"Tokens per sequence in the ubatch [default: {DEFAULT_TOKENS}; 1 with --decode].")
@click.option("--seqs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Sequences in the ubatch (opens the model with n_seq_max = SEQS).")
@click.option("--past", type=click.IntRange(min=0), default=None,
              help=f"Tokens already in the KV cache [default: 0; {DEFAULT_DECODE_PAST} with --decode].")
@click.option("--decode", is_flag=True, help="The one-token decode graph (n_tokens = 1 after some past).")
@click.option("--outputs", type=click.Choice(["last", "all"]), default="last", show_default=True,
              help="Logit rows computed: the last token of each sequence, or every token.")
@click.option("--rs-slots", type=RS_SLOT_COUNT, default=1, show_default=True,
              help="Recurrent-state slots K per sequence (K-1 tokens can be rolled back).")
@click.option("--delta-net", type=click.Choice(DELTA_NET_MODES), default="fused", show_default=True,
              help="Gated delta-net kernel: ggml's fused op or primitive ops.")
@click.option("--ctx", "-c", type=CONTEXT_SIZE, default=4096, show_default=True,
              help="Context size in tokens (KV rows per sequence).")
@click.option("--kv-type", type=click.Choice(["f16", "f32"]), default="f16", show_default=True,
              help="Type of the KV cache.")
@click.option("--threads", "-t", type=THREAD_COUNT, default=None, help="CPU threads.")
@click.option("--backend", default="cpu", show_default=True, metavar="NAME",
              help="ggml backend: cpu, cpu-ref, vulkan[:N], cuda[:N], auto (`deltarun devices`).")
@click.option("--gpu-layers", "-ngl", type=click.IntRange(min=0), default=None,
              help="With a device backend: the last N layers on the device, the rest on the CPU (as -ngl); "
                   "the dump shows each node's backend and the scheduler's splits [default: all on the device].")
@click.option("--rpc", default=None, metavar="HOST:PORT[,HOST:PORT...]",
              help="Split the layers over these RPC servers' devices and the local backend; the dump shows "
                   "the placement, each node's backend and the splits.")
@click.option("--tensor-split", "-ts", default=None, metavar="A,B,...",
              help="With --rpc: share of the layers per device (RPC devices, then the local one).")
@click.option("--layer", type=click.IntRange(min=0), default=None,
              help="Keep only the nodes of layer L (names ending in -L) and their direct sources.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="txt", show_default=True,
              help="txt table, json (stable schema), graphviz dot, svg (needs graphviz's `dot`), or html "
                   "(one self-contained page: pan, zoom, search, details; see the README).")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write to FILE (atomically) instead of stdout.")
@click.option("--values", "values", is_flag=True,
              help="Run the prompt (-p) through the graph and record node statistics.")
@click.option("--prompt", "-p", default=None, help="Prompt text for --values (implies --values).")
@click.option("--filter", "patterns", multiple=True, metavar="PATTERN",
              help="With --values: record only nodes whose name matches; a glob (`attn_norm-*`) or "
                   "`re:REGEX`. May be repeated. With --layer, only that layer's nodes are recorded.")
@click.option("--dump-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="With --values: save the recorded tensors as .npy files plus manifest.json.")
@click.option("--mmproj", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Dump MODEL's vision tower (mmproj-*.gguf) instead of the text graph.")
@click.option("--image", "image_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --mmproj: the image (PNG, JPEG, WebP, GIF) whose size sets the tower's graph and whose "
                   "pixels --values runs [default: random pixels of 2 x 3 image tokens].")
@click.option("--first", "n_first", type=click.IntRange(min=0), default=8, show_default=True,
              help="With --values: how many leading elements to show per node.")
def graph(model: Path, tokens: int | None, seqs: int, past: int | None, decode: bool, outputs: str,
          rs_slots: int, delta_net: str, ctx: int, kv_type: str, threads: int | None, backend: str,
          gpu_layers: int | None, rpc: str | None, tensor_split: str | None,
          layer: int | None, fmt: str, output: Path | None, values: bool, prompt: str | None,
          patterns: tuple[str, ...], dump_dir: Path | None, n_first: int, mmproj: Path | None = None,
          image_file: Path | None = None) -> None:
    """Dump the ggml graph the runner computes for one ubatch shape of MODEL (or, with --mmproj,
    for one image through its vision tower)."""
    from deltarun.apps import graph_dump as gd
    from deltarun.runner.model import Model

    if image_file is not None and mmproj is None:
        raise click.UsageError("--image goes with --mmproj (the vision tower that reads it)")
    if mmproj is not None:
        given = explicit_options(TEXT_ONLY)
        if given:
            raise click.UsageError(f"--mmproj dumps the vision tower, whose graph the image sets: drop "
                                   f"{', '.join(given)}")
        if not values and (patterns or dump_dir is not None):
            raise click.UsageError("--filter and --dump-dir go with --values")
        if fmt == "svg":
            gd.graphviz_dot()
        check_backends([backend])
        dump = _tower_dump(model, mmproj, image_file, backend, threads, layer, values, patterns, dump_dir, n_first)
        _emit(dump, fmt, output)
        return
    values = values or prompt is not None
    if values and prompt is None:
        raise click.UsageError("--values needs a prompt: -p PROMPT")
    if not values and (patterns or dump_dir is not None):
        raise click.UsageError("--filter and --dump-dir go with --values -p PROMPT")
    if values and (tokens is not None or past is not None):
        raise click.UsageError("with --values the prompt sets the tokens (and --decode the past): "
                               "drop --tokens/--past")
    if decode and tokens not in (None, 1):
        raise click.UsageError("--decode is the one-token graph: drop --tokens")
    if fmt == "svg":
        gd.graphviz_dot()  # fail before loading anything when graphviz is missing
    check_backends([backend])
    note_gpu_layers([backend], gpu_layers)

    n_tok = 1 if decode else (tokens or DEFAULT_TOKENS)
    n_past = (past if past is not None else DEFAULT_DECODE_PAST) if decode else (past or 0)
    all_outputs = outputs == "all"
    m = None
    try:
        if values:
            m = Model(model, backend=backend, n_ctx=ctx, n_ubatch=ctx, n_threads=threads, rs_slots=rs_slots,
                      n_seq_max=seqs, kv_type=kv_type, delta_net=delta_net, gpu_layers=gpu_layers,
                      rpc=rpc, tensor_split=tensor_split)
            ids = m.tokenizer.encode(prompt or "")
            if len(ids) > ctx:
                raise DeltarunError(f"the prompt has {len(ids)} tokens, more than the context {ctx}")
            dump, arrays = gd.capture_values(m, ids, n_seqs=seqs, decode=decode, all_outputs=all_outputs,
                                             layer=layer, patterns=patterns, keep_arrays=dump_dir is not None,
                                             n_first=n_first, prompt=prompt)
            if dump_dir is not None:
                manifest = gd.write_dump_dir(dump, arrays, dump_dir)
                click.echo(f"wrote {len(arrays)} tensors and {manifest}", err=True)
        else:
            batch = max(n_tok * seqs, rs_slots)
            m = Model(model, backend=backend, n_ctx=ctx, n_ubatch=batch, n_threads=threads, rs_slots=rs_slots,
                      n_seq_max=seqs, kv_type=kv_type, delta_net=delta_net, gpu_layers=gpu_layers,
                      rpc=rpc, tensor_split=tensor_split)
            shape = gd.ubatch_shape(m, n_tok, seqs, n_past, all_outputs)
            dump = gd.dump_graph(m, shape, layer=layer, n_past=n_past)
    finally:
        if m is not None:
            m.close()
    _emit(dump, fmt, output)


def _tower_dump(model: Path, mmproj: Path, image_file: Path | None, backend: str, threads: int | None,
                layer: int | None, values: bool, patterns: tuple[str, ...], dump_dir: Path | None,
                n_first: int) -> "GraphDump":
    """The vision tower's dump (and --dump-dir's files) for `graph --mmproj`."""
    from deltarun.apps import graph_dump as gd
    from deltarun.apps import vision_graph as vg
    from deltarun.runner.vision import VisionEncoder

    with VisionEncoder(mmproj, backend=backend, n_threads=threads) as enc:
        vg.check_fits(enc, model)
        image, label = vg.image_for(enc, image_file)
        dump, arrays = vg.dump_tower(enc, image, label, layer=layer, values=values, patterns=patterns,
                                     keep_arrays=dump_dir is not None, n_first=n_first)
    if dump_dir is not None:
        manifest = gd.write_dump_dir(dump, arrays, dump_dir)
        click.echo(f"wrote {len(arrays)} tensors and {manifest}", err=True)
    return dump


def _emit(dump: "GraphDump", fmt: str, output: Path | None) -> None:
    """Render the dump in `fmt` to `output` (atomically) or stdout."""
    from deltarun.apps import graph_dump as gd

    if fmt == "txt":
        data: str | bytes = dump.to_txt()
    elif fmt == "json":
        data = dump.to_json()
    elif fmt == "dot":
        data = dump.to_dot()
    elif fmt == "html":
        from deltarun.apps.graph_page import render_graph_html

        data = render_graph_html(dump.to_dict())
    else:
        data = gd.render_svg(dump.to_dot())
    if output is not None:
        gd.write_atomically(output, data)
        click.echo(f"wrote {output}", err=True)
    elif isinstance(data, bytes):
        click.get_binary_stream("stdout").write(data)
    else:
        click.echo(data, nl=False)
