"""`deltarun devices`: the devices ggml's registry knows, and the backend names that select them."""

from __future__ import annotations

import json

import click


@click.command("devices")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@click.option("--rpc", default=None, metavar="HOST:PORT[,HOST:PORT...]",
              help="Also list the devices of these `deltarun rpc-server`s (each is probed first).")
def devices(as_json: bool, rpc: str | None) -> None:
    """List ggml's devices (name, description, type, free/total memory) and the --backend name of each.

    Which backends exist depends on how ggml-python was built: the PyPI wheel has only the CPU;
    see the README (scripts/install-vulkan.sh, scripts/install-cuda.sh) for the Vulkan and CUDA
    variants. ggml-vulkan lists CPU devices such as Mesa's lavapipe only with GGML_VK_VISIBLE_DEVICES=0.
    With --rpc, the devices of those RPC servers are listed too (their --backend name is rpc:HOST:PORT).
    """
    from deltarun.runner import devices as devices_mod
    from deltarun.runner import rpc as rpc_mod
    from deltarun.runner.units import format_bytes, format_table

    servers = [rpc_mod.probe(ep) for ep in rpc_mod.parse_endpoints(rpc)] if rpc else []
    if servers:
        rpc_mod.add_servers([s.endpoint for s in servers])
    devs = devices_mod.list_devices()
    built = {kind: devices_mod.build_has(kind) for kind in devices_mod.DEVICE_KINDS}
    best = devices_mod.best_device()
    if as_json:
        click.echo(json.dumps({"devices": [d.to_dict() for d in devs], "built_with": built,
                               "auto": best.backend_name if best else "cpu",
                               "cpu_features": devices_mod.cpu_features(),
                               "amx_tiles": devices_mod.amx_tile_types(),
                               "ggml_python": getattr(devices_mod.ggml, "__version__", ""),
                               "ggml": devices_mod.ggml_version(),
                               "rpc": {"built_in": rpc_mod.available(),
                                       "servers": [{"endpoint": s.endpoint, "protocol": s.version_text,
                                                    "devices": len(s.devices)} for s in servers]}}, indent=1))
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
    features = devices_mod.cpu_features()
    click.echo(f"ggml CPU backend built with: {' '.join(features)}; default threads {devices_mod.physical_cores()}")
    tiles = devices_mod.amx_tile_types()
    click.echo("matrix products on AMX tiles: " + (", ".join(tiles) + " weights (several columns)" if tiles else "none"))
    click.echo(f"ggml-python {getattr(devices_mod.ggml, '__version__', '?')} on ggml {devices_mod.ggml_version()}")
    for note in (devices_mod.llamafile_note(features), devices_mod.patches_note()):
        if note:
            click.echo(note)
    for s in servers:
        click.echo(f"rpc: {s.endpoint} speaks protocol {s.version_text}, {len(s.devices)} device(s)")
    click.echo("rpc: built in (`--rpc HOST:PORT`, `deltarun rpc-server`)" if rpc_mod.available()
               else f"rpc: not in this build; {rpc_mod.install_hint()}")
    for kind, ok in built.items():
        if not ok:
            click.echo(f"{kind}: not in this build; {devices_mod.install_hint(kind)}")
        elif not any(d.registry.lower() == kind for d in devs):
            hint = " (for Mesa's lavapipe set GGML_VK_VISIBLE_DEVICES=0)" if kind == "vulkan" else ""
            click.echo(f"{kind}: built in, but no device found{hint}")
