"""`deltarun devices`: the devices ggml's registry knows, and the backend names that select them."""

from __future__ import annotations

import json

import click


@click.command("devices")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def devices(as_json: bool) -> None:
    """List ggml's devices (name, description, type, free/total memory) and the --backend name of each.

    Which backends exist depends on how ggml-python was built: the PyPI wheel has only the CPU;
    see the README (scripts/install-vulkan.sh, scripts/install-cuda.sh) for the Vulkan and CUDA
    variants. ggml-vulkan lists CPU devices such as Mesa's lavapipe only with GGML_VK_VISIBLE_DEVICES=0.
    """
    from deltarun.runner.units import format_bytes, format_table
    from deltarun.runner import backend as be

    devs = be.list_devices()
    built = {kind: be.build_has(kind) for kind in be.DEVICE_KINDS}
    best = be.best_device()
    if as_json:
        click.echo(json.dumps({"devices": [d.to_dict() for d in devs], "built_with": built,
                               "auto": best.backend_name if best else "cpu",
                               "cpu_features": be.cpu_features()}, indent=1))
        return
    rows = []
    for d in devs:
        mem = f"{format_bytes(d.memory_free)} / {format_bytes(d.memory_total)}" if d.memory_total else "-"
        use = d.backend_name + (", cpu-ref" if d.backend_name == "cpu" else "")
        rows.append([str(d.index), d.name, d.description, d.type + (" (software)" if d.software else ""), mem, use])
    for line in format_table(["#", "name", "description", "type", "memory free / total", "--backend"], rows, ""):
        click.echo(line)
    click.echo("")
    click.echo("auto picks: " + (f"{best.backend_name} ({best.description})" if best else "cpu"))
    features = be.cpu_features()
    click.echo(f"ggml CPU backend built with: {' '.join(features)}; default threads {be.physical_cores()}")
    note = be.llamafile_note(features)
    if note:
        click.echo(note)
    for kind, ok in built.items():
        if not ok:
            click.echo(f"{kind}: not in this build; {be.install_hint(kind)}")
        elif not any(d.registry.lower() == kind for d in devs):
            hint = " (for Mesa's lavapipe set GGML_VK_VISIBLE_DEVICES=0)" if kind == "vulkan" else ""
            click.echo(f"{kind}: built in, but no device found{hint}")
