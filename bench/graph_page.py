#!/usr/bin/env python3
"""How fast the graph page of a 48-layer model opens and redraws in headless Chromium.

    python bench/graph_page.py                 # tiny-48 Q8_0, 5 fresh browser sessions
    python bench/graph_page.py --runs 3 --preset tiny

The model is the `tiny-48` preset of deltarun.model_files.generate (48 layers like Qwen3-Next-80B:
36 delta-net + 12 full-attention; ~3,800 graph nodes and ~950 leafs for an 8-token ubatch),
written once to /tmp/drbench. The page is made by `deltarun graph MODEL --format html` (timed as a
whole process). Each run starts a fresh headless Chromium (Debian's, through the system
chromedriver: tests/browser.py), opens the file and reads:

- first paint: `graphPage.firstPaintMs`, the page's own mark at the end of its first canvas draw,
  in ms since navigation start (performance.now()), i.e. HTML parse + JSON parse + layout bands +
  first frame; and the browser's first-contentful-paint entry;
- redraw: the mean of 20 full redraws (`graphPage.redrawMs(20)`) in the opening view (layers
  collapsed), with every layer expanded and the whole graph fitted (every tensor drawn), and
  expanded at zoom 1 (only what is in view drawn);
- expand: the time to expand all layers (geometry rebuild).

Prints one JSON object per run and the medians. The 1-minute load average is printed too: the
machine is shared, so numbers taken under load are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser import start_browser, wait_for  # noqa: E402

OUT = Path("/tmp/drbench")


def make_page(preset: str, wtype: str) -> tuple[Path, float, int]:
    from deltarun.model_files import generate as gen

    OUT.mkdir(parents=True, exist_ok=True)
    model = OUT / f"{preset}-{wtype}.gguf"
    if not model.exists():
        gen.write_model(model, preset, wtype)
    page = OUT / f"{preset}-{wtype}-graph.html"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "deltarun", "graph", str(model), "--format", "html", "-o", str(page)],
                   check=True, capture_output=True)
    return page, time.perf_counter() - t0, page.stat().st_size


def one_run(page: Path) -> dict:
    d = start_browser()
    try:
        t0 = time.perf_counter()
        d.get(page.as_uri())
        wait_for(lambda: d.execute_script("return !!(window.graphPage && window.graphPage.ready)"), 60, "first paint")
        wall = time.perf_counter() - t0
        r = d.execute_script("""
            const p = window.graphPage, out = {};
            out.first_paint_ms = p.firstPaintMs;
            const fcp = performance.getEntriesByType('paint').find(e => e.name === 'first-contentful-paint');
            out.fcp_ms = fcp ? fcp.startTime : null;
            out.tensors = p.tensorIds().length;
            out.redraw_opening_ms = p.redrawMs(20);
            out.drawn_opening = p.drawnTensors;
            let t = performance.now(); p.setCollapsed(false); out.expand_ms = performance.now() - t;
            p.fit();
            out.redraw_fit_all_ms = p.redrawMs(20);
            out.drawn_fit_all = p.drawnTensors;
            const ids = p.tensorIds();
            p.select(ids[Math.floor(ids.length / 2)]);
            out.redraw_zoom1_ms = p.redrawMs(20);
            out.drawn_zoom1 = p.drawnTensors;
            return out;""")
        r["wall_to_ready_s"] = round(wall, 3)
        errors = [e for e in d.get_log("browser") if e.get("level") == "SEVERE"]
        r["console_errors"] = len(errors)
        return r
    finally:
        d.quit()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-48")
    ap.add_argument("--type", dest="wtype", default="q8_0")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    page, make_s, size = make_page(a.preset, a.wtype)
    print(json.dumps({"page": str(page), "bytes": size, "make_page_s": round(make_s, 2),
                      "loadavg_1min": os.getloadavg()[0]}))
    runs = []
    for _ in range(a.runs):
        r = one_run(page)
        r["loadavg_1min"] = os.getloadavg()[0]
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}))
        runs.append(r)
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float)) and runs[0][k] is not None]
    med = {k: round(statistics.median(r[k] for r in runs), 2) for k in keys}
    print("median:", json.dumps(med))


if __name__ == "__main__":
    main()
