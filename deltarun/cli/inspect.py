"""`deltarun inspect`: what a GGUF file holds and what running it would take.

Works on any GGUF, including files deltarun cannot run: each part that can be worked out is shown,
and why the file cannot be run is said instead of failing. Only input that is not a readable
GGUF at all is an error. An mmproj file (`general.architecture = clip`) is shown as the vision
tower it is: its projector, layers and the text model it fits, and what images cost in tokens.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from deltarun.base.errors import ModelFileError
from deltarun.base.gguf_file import GGUFFile
from deltarun.cli.options import CONTEXT_SIZE, MODEL_DEFAULTS, RS_SLOT_COUNT
from deltarun.runner.memory import KV_TYPES, memory_bytes
from deltarun.runner.units import format_bytes, format_count

LAYER_CODES = {"linear": "L", "attention": "A", "mtp": "M", "unknown": "?"}
MAX_TEXT_VALUE = 72  # characters of a metadata value shown in the text view

_BLK = re.compile(r"^blk\.(\d+)\.")


@dataclass
class Layers:
    kinds: list[str]                 # per block: linear / attention / mtp / unknown
    source: str                      # "metadata" or "tensor names"

    def of(self, kind: str) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == kind]

    @property
    def pattern(self) -> str:
        return "".join(LAYER_CODES[k] for k in self.kinds)


@dataclass
class Report:
    """Everything `inspect` shows; `--json` prints it as it is."""

    path: str
    file_size: int
    gguf_version: int
    architecture: str | None
    runnable: bool
    problems: list[str]
    metadata: dict[str, Any]
    tensors: list[dict[str, Any]]
    layers: dict[str, Any] | None
    parameters: dict[str, int]
    memory: dict[str, Any]
    hparams: dict[str, Any] | None = field(default=None)
    vision: dict[str, Any] | None = field(default=None)     # an mmproj's tower (`_vision_report`)
    #: what the family says of the parts the file switches on (its optional `describe()`)
    parts: list[str] = field(default_factory=list)


def _layers_from_hparams(hp: Any) -> Layers:
    kinds = ["linear" if r else "attention" for r in hp.recurrent] + ["mtp"] * hp.n_mtp
    return Layers(kinds, "metadata")


def _layers_from_tensors(f: GGUFFile) -> Layers | None:
    """Guess each block's kind from the names of its tensors (for files whose metadata is unusable)."""
    names: dict[int, list[str]] = {}
    for name in f.tensors:
        m = _BLK.match(name)
        if m:
            names.setdefault(int(m.group(1)), []).append(name[m.end():])
    if not names:
        return None
    kinds = []
    for il in range(max(names) + 1):
        own = names.get(il, [])
        if any(n.startswith("nextn.") for n in own):
            kinds.append("mtp")
        elif any(n.startswith(("ssm_", "attn_qkv", "attn_gate")) for n in own):
            kinds.append("linear")
        elif any(n.startswith(("attn_q.", "attn_k.", "attn_v.")) for n in own):
            kinds.append("attention")
        else:
            kinds.append("unknown")
    return Layers(kinds, "tensor names")


def _block_of(name: str) -> int | None:
    m = _BLK.match(name)
    return int(m.group(1)) if m else None


def build_report(path: Path, n_ctx: int, rs_slots: int, kv_type: str) -> Report:
    """Read `path` (a GGUF; ModelFileError otherwise) and work out everything that can be."""
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, not a GGUF file")
    f = GGUFFile(path)
    problems: list[str] = []
    arch = f.get("general.architecture")
    if not isinstance(arch, str):
        problems.append("general.architecture is missing")
        arch = None

    hp = None
    runnable = False
    vision = None
    parts: list[str] = []
    if arch == "clip":
        vision = _vision_report(f, problems)
        runnable = vision is not None
    elif arch is not None:
        try:
            from deltarun.base.registry import graph_family_for

            family = graph_family_for(f)                  # reads and validates hparams and tensors
            hp = getattr(family, "hp", None)
            parts = list(getattr(family, "describe", lambda: [])())
            runnable = True
        except Exception as e:  # noqa: BLE001 - inspect reports whatever stops a run
            problems.append(_clean(e, f.path))
            hp = _try_hparams(f, arch)
    if runnable and vision is None:
        try:
            from deltarun.base.tokenizer import Tokenizer

            Tokenizer.from_gguf(f.reader)
        except Exception as e:  # noqa: BLE001
            runnable = False
            problems.append(f"tokenizer: {_clean(e, f.path)}")

    layers = _layers_from_hparams(hp) if hp is not None and hasattr(hp, "recurrent") else _layers_from_tensors(f)
    mtp_blocks = set(layers.of("mtp")) if layers else set()

    tensors = [{"name": t.name, "type": t.type_name, "shape": list(t.ne), "bytes": t.nbytes}
               for t in f.tensors.values()]
    total = sum(t.n_elements for t in f.tensors.values())
    mtp = sum(t.n_elements for t in f.tensors.values() if _block_of(t.name) in mtp_blocks)
    params = {"total": total, "trunk": total - mtp, "mtp": mtp}
    if hp is not None and getattr(hp, "n_expert", 0):
        share = hp.n_expert_used / hp.n_expert
        params["active_per_token"] = int(sum(
            t.n_elements * (share if "_exps." in t.name else 1.0)
            for t in f.tensors.values() if _block_of(t.name) not in mtp_blocks))

    memory: dict[str, Any] = {"n_ctx": n_ctx, "rs_slots": rs_slots, "kv_type": kv_type, "n_seq": 1,
                              "weights": sum(t.nbytes for t in f.tensors.values())}
    if hp is not None and vision is None:
        try:
            rs = memory_bytes(hp, 0, 1, rs_slots, kv_type)
            both = memory_bytes(hp, n_ctx, 1, rs_slots, kv_type)
            memory.update(kv_cache=both - rs, recurrent_state=rs, total=memory["weights"] + both)
        except Exception as e:  # noqa: BLE001
            problems.append(f"memory: {e}")
    hparams = None
    if hp is not None:
        try:
            hparams = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(hp).items()
                       if k != "recurrent"}
        except TypeError:
            hparams = None
    return Report(
        path=str(f.path), file_size=f.file_size, gguf_version=int(f.get("GGUF.version", 0) or 0),
        architecture=arch, runnable=runnable, problems=problems, metadata=f.metadata(), tensors=tensors,
        layers=None if layers is None else {
            "pattern": layers.pattern, "source": layers.source, "linear_attention": layers.of("linear"),
            "full_attention": layers.of("attention"), "mtp": layers.of("mtp"), "unknown": layers.of("unknown")},
        parameters=params, memory=memory, hparams=hparams, vision=vision, parts=parts,
    )


#: image sizes (width, height) whose token counts an mmproj's report shows
SAMPLE_IMAGES = ((640, 480), (1024, 1024), (1920, 1080))


def _vision_report(f: GGUFFile, problems: list[str]) -> dict[str, Any] | None:
    """An mmproj's tower as `--mmproj` would run it (its keys and tensors validated by the projector
    family), with the image tokens of a few image sizes under the processor's pixel bounds; None,
    with the problem said, when deltarun cannot run it."""
    from deltarun.base.registry import projector_for
    from deltarun.runner.images import MAX_PIXELS_DEFAULT, MIN_PIXELS_DEFAULT, image_tokens

    try:
        hp = projector_for(f).hp
    except Exception as e:  # noqa: BLE001 - inspect reports whatever stops a run
        problems.append(_clean(e, f.path))
        return None
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(hp).items()}
    out["pixel_bounds"] = [MIN_PIXELS_DEFAULT, MAX_PIXELS_DEFAULT]
    out["image_tokens"] = {f"{w}x{h}": image_tokens(w, h, hp) for w, h in SAMPLE_IMAGES}
    return out


def _try_hparams(f: GGUFFile, arch: str) -> Any:
    """The family's hyper-parameters when they can be read even though the file cannot run."""
    from deltarun.base.registry import available_architectures

    entry = available_architectures().get(arch)
    if entry is None:
        return None
    try:
        family = entry.load() if hasattr(entry, "load") else entry
        return family.read_hparams(f)
    except Exception:  # noqa: BLE001 - already reported by the runnability check
        return None


def _clean(e: Exception, path: Path) -> str:
    """An exception as one line, without the file name every message starts with."""
    msg = str(e)
    prefix = f"{path}: "
    if msg.startswith(prefix):
        msg = msg[len(prefix):]
    if not isinstance(e, Exception) or type(e).__module__.startswith("deltarun"):
        return msg
    return f"{type(e).__name__}: {msg}"


# --- text output ------------------------------------------------------------------------------
def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str):
        if len(value) > MAX_TEXT_VALUE or not value.isprintable() or not value:
            text = repr(value[:MAX_TEXT_VALUE - 16])
            return text + (f"... ({len(value)} chars)" if len(value) > MAX_TEXT_VALUE - 16 else "")
        return value
    text = str(value)
    return text if len(text) <= MAX_TEXT_VALUE else text[:MAX_TEXT_VALUE - 4] + " ..."


def print_report(r: Report) -> None:
    echo = click.echo
    echo(f"file          {r.path}")
    echo(f"size          {format_bytes(r.file_size)} ({r.file_size} bytes), GGUF v{r.gguf_version}, "
         f"{len(r.tensors)} tensors, {len(r.metadata)} metadata keys")
    echo(f"architecture  {r.architecture or '?'}")
    if r.runnable:
        echo("runnable      yes")
    else:
        echo("runnable      no")
        for p in r.problems:
            echo(f"  - {p}")

    echo("\nmetadata")
    width = max((len(k) for k in r.metadata), default=0)
    for key, value in r.metadata.items():
        echo(f"  {key:<{width}}  {_short(value)}")

    echo("\ntensors")
    nw = max((len(t["name"]) for t in r.tensors), default=4)
    echo(f"  {'name':<{nw}}  {'type':<6}  {'shape':<20}  {'bytes':>12}")
    for t in r.tensors:
        shape = "[" + ", ".join(map(str, t["shape"])) + "]"
        echo(f"  {t['name']:<{nw}}  {t['type']:<6}  {shape:<20}  {t['bytes']:>12}")
    by_type: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for t in r.tensors:
        by_type[t["type"]] += t["bytes"]
        count[t["type"]] += 1
    echo("  by type: " + ", ".join(f"{k} {count[k]} tensors {format_bytes(v)}" for k, v in by_type.most_common()))

    echo("")
    if r.vision is not None:
        _print_vision(r.vision, r.parameters["total"], r.memory["weights"])
        return
    if r.layers is None:
        echo("layers        none found")
    else:
        L = r.layers
        n_trunk = len(L["linear_attention"]) + len(L["full_attention"]) + len(L["unknown"])
        echo(f"layers        {n_trunk} trunk + {len(L['mtp'])} MTP (from {L['source']})")
        echo(f"  pattern            {L['pattern']}   (L linear attention, A full attention, M MTP"
             + (", ? unknown)" if L["unknown"] else ")"))
        echo(f"  linear attention   {_ids(L['linear_attention'])}")
        echo(f"  full attention     {_ids(L['full_attention'])}")
        echo(f"  MTP                {_ids(L['mtp'])}")
        if L["unknown"]:
            echo(f"  unknown            {_ids(L['unknown'])}")
        for line in r.parts:
            echo(f"  {line}")

    p = r.parameters
    line = f"parameters    {format_count(p['total'])} ({p['total']:,})"
    if p["mtp"]:
        line += f": {format_count(p['trunk'])} trunk + {format_count(p['mtp'])} MTP"
    echo(line)
    if "active_per_token" in p:
        echo(f"  active per token   {format_count(p['active_per_token'])} (trunk, routed experts counted "
             f"as used/total)")

    m = r.memory
    echo(f"memory        for --ctx {m['n_ctx']}, --rs-slots {m['rs_slots']}, KV {m['kv_type']}, 1 sequence")
    echo(f"  weights            {format_bytes(m['weights']):>12}")
    if "kv_cache" in m:
        echo(f"  KV cache           {format_bytes(m['kv_cache']):>12}")
        echo(f"  recurrent state    {format_bytes(m['recurrent_state']):>12}")
        echo(f"  total              {format_bytes(m['total']):>12}   (compute buffers not included)")
    else:
        echo("  KV cache and recurrent state: unknown (hyper-parameters unreadable)")


def _print_vision(v: dict[str, Any], n_params: int, weights: int) -> None:
    echo = click.echo
    echo(f"vision tower  {v['projector']}: {v['n_layer']} ViT blocks, width {v['n_embd']}, {v['n_head']} heads, "
         f"feed-forward {v['n_ff']}")
    echo(f"  patches            {v['patch_size']} x {v['patch_size']} pixels, merged {v['n_merge']} x {v['n_merge']} "
         f"into one image token (image sides are multiples of {v['patch_size'] * v['n_merge']})")
    echo(f"  position grid      {v['n_pos_side']} x {v['n_pos_side']} learned positions (interpolated)")
    deep = v["deepstack_layers"]
    echo(f"  deepstack taps     {_ids(deep) if deep else 'none'}")
    echo(f"  projects to        {v['proj_dim']} (the text model's hidden size must be this)")
    echo(f"  normalisation      mean {_short(tuple(round(x, 4) for x in v['image_mean']))}, "
         f"std {_short(tuple(round(x, 4) for x in v['image_std']))}")
    lo, hi = v["pixel_bounds"]
    echo(f"image tokens  resized within {lo:,} .. {hi:,} pixels: "
         + ", ".join(f"{k} -> {n}" for k, n in v["image_tokens"].items()))
    echo(f"parameters    {format_count(n_params)} ({n_params:,}), weights {format_bytes(weights)}")
    echo("use           --mmproj FILE with the text model it was published with (generate, chat, serve)")


def _ids(ids: list[int]) -> str:
    if not ids:
        return "-"
    # compress runs: 0-2, 4-6
    parts, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)


@click.command("inspect")
@click.argument("model", metavar="MODEL.gguf", type=click.Path(path_type=Path))
@click.option("--ctx", "-c", type=CONTEXT_SIZE, default=MODEL_DEFAULTS["ctx"], show_default=True,
              help="Context size the memory figures are for.")
@click.option("--rs-slots", type=RS_SLOT_COUNT, default=MODEL_DEFAULTS["rs_slots"], show_default=True,
              help="Recurrent-state slots K the memory figures are for.")
@click.option("--kv-type", type=click.Choice(sorted(KV_TYPES)), default=MODEL_DEFAULTS["kv_type"],
              show_default=True, help="KV cache type the memory figures are for.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def inspect(model: Path, ctx: int, rs_slots: int, kv_type: str, as_json: bool) -> None:
    """Show a GGUF file's metadata, tensors, layer pattern, parameter count and memory needs.

    Works on files deltarun cannot run (it says why); long arrays are shown as their length.
    """
    report = build_report(model, ctx, rs_slots, kv_type)
    if as_json:
        click.echo(json.dumps(asdict(report), indent=1, default=str))
    else:
        print_report(report)
