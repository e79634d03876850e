"""`deltarun make-tiny`: write a small synthetic Qwen3-Next GGUF (random weights, real layout)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from deltarun.base.errors import DeltarunError
from deltarun.model_files import kimi_linear, qwen35, qwen4exp
from deltarun.model_files.generate import PRESETS, WEIGHT_TYPES, write_model


@click.command("make-tiny")
@click.argument("out", metavar="OUT.gguf", type=click.Path(dir_okay=False, writable=True, path_type=Path))
@click.option("--type", "wtype", type=click.Choice(list(WEIGHT_TYPES)), default="f32", show_default=True,
              help="Type of the 2-D weights (norms, routers, conv and ssm_a stay F32, like converted files).")
@click.option("--preset", type=click.Choice(list(PRESETS) + list(qwen35.PRESETS) + list(kimi_linear.PRESETS)
                                      + list(qwen4exp.PRESETS)),
              default="tiny", show_default=True,
              help="Model shape: tiny (n_v = 2 n_k heads), tiny-eqheads (n_v = n_k), tiny-legacy (ssm_in), "
                   "tiny-tied (no output.weight, merged gate_up), tiny-mtp (one MTP layer), bench (hidden 1024), "
                   "bench-vocab151k (bench with the real 151,936-token Qwen2 vocabulary); "
                   "Qwen3.5: tiny-qwen35 (dense FFN), tiny-qwen35moe (MoE), bench-qwen35 (Qwen3.5-0.8B shapes), "
                   "bench-qwen35-echo (the same shapes, greedy repeats the last token: every MTP draft right), "
                   "-vocab151k / -vocab248k (with the real 151,936 / 248,320-token vocabularies); "
                   "Kimi-Linear: tiny-kimi-linear (KDA + MLA + MoE), -k2vocab (a small kimi-k2 vocabulary), "
                   "bench-kimi-linear (Kimi-Linear-48B-A3B layer shapes, 4 layers, 32 experts), "
                   "-vocab164k (with a 163,840-row vocabulary); "
                   "Qwen3.8-Flash-Next: tiny-qwen4exp (Gated DeltaNet + QSA attention, hyper-connections, "
                   "hashed n-gram PLE, MoE).")
@click.option("--mtp", is_flag=True, help="Add one multi-token-prediction (nextn) layer to the preset.")
@click.option("--seed", "-s", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the random weights.")
def make_tiny(out: Path, wtype: str, preset: str, mtp: bool, seed: int) -> None:
    """Write a synthetic Qwen3-Next model to OUT.gguf.

    The file has the keys, tensor names, shapes and stored conventions of a converted real model,
    so everything deltarun does with real files can be tried on it.
    """
    if preset in qwen35.PRESETS:
        _make_qwen35(out, wtype, preset, seed)
        return
    if preset in kimi_linear.PRESETS:
        _make_other(kimi_linear, out, wtype, preset, seed)
        return
    if preset in qwen4exp.PRESETS:
        _make_other(qwen4exp, out, wtype, preset, seed)
        return
    cfg = PRESETS[preset]
    if mtp and cfg.n_mtp == 0:
        cfg = dataclasses.replace(cfg, n_mtp=1)
    try:
        path = write_model(out, cfg, wtype, seed, name=f"deltarun synthetic qwen3next {preset} {wtype}")
    except OSError as e:
        raise DeltarunError(f"cannot write {out}: {e.strerror or e}") from e
    size = path.stat().st_size
    layers = cfg.n_layer + cfg.n_mtp
    extra = f" + {cfg.n_mtp} MTP" if cfg.n_mtp else ""
    click.echo(f"wrote {path}: preset {preset}, type {wtype}, seed {seed}, {cfg.n_layer} layers{extra} "
               f"({layers} blocks), {size / 2**20:.1f} MiB")


def _make_other(family: object, out: Path, wtype: str, preset: str, seed: int) -> None:
    """A preset of another family's generator (HF-order weights converted as llama.cpp does)."""
    try:
        path = family.write_model(out, preset, wtype, seed)  # type: ignore[attr-defined]
    except OSError as e:
        raise DeltarunError(f"cannot write {out}: {e.strerror or e}") from e
    click.echo(f"wrote {path}: preset {preset}, type {wtype}, seed {seed}, {path.stat().st_size / 2**20:.1f} MiB")


def _make_qwen35(out: Path, wtype: str, preset: str, seed: int) -> None:
    """A Qwen3.5 preset: HF-order random weights converted as llama.cpp's converter does (MTP included)."""
    cfg = qwen35.PRESETS[preset]
    try:
        path = qwen35.write_model(out, cfg, wtype, seed, name=f"deltarun synthetic {cfg.arch} {preset} {wtype}")
    except OSError as e:
        raise DeltarunError(f"cannot write {out}: {e.strerror or e}") from e
    n_mtp = cfg.mtp_num_hidden_layers
    click.echo(f"wrote {path}: preset {preset} ({cfg.arch}), type {wtype}, seed {seed}, {cfg.num_hidden_layers} "
               f"layers + {n_mtp} MTP ({cfg.num_hidden_layers + n_mtp} blocks), {path.stat().st_size / 2**20:.1f} MiB")
