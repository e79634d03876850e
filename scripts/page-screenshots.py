#!/usr/bin/env python3
"""Write the README's screenshots of the pages into docs/ (small PNGs from headless Chromium).

    python scripts/page-screenshots.py [--out docs]

Makes the tiny model (F32 and Q4_K) in a temporary folder, then:
- docs/graph-page.png: `deltarun graph --format html` of the tiny model, node attn_norm-0 selected;
- docs/compare-page.png: `deltarun compare F32 --against Q4_K --html`, opened on its first failure;
- docs/chat-page.png: `deltarun serve`'s chat page (the server in this process) after one streamed
  answer of the tiny model (random weights: the text is gibberish).
Needs Debian's chromium and chromium-driver (scripts/install-browser.sh).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser import start_browser, wait_for  # noqa: E402

SCALE = 0.7  # device scale factor: a 1280 x 760 window becomes a 896 x 532 PNG


def deltarun(*args: object, ok_codes: tuple[int, ...] = (0,)) -> None:
    r = subprocess.run([sys.executable, "-m", "deltarun", *map(str, args)], capture_output=True, text=True)
    if r.returncode not in ok_codes:
        raise SystemExit(f"deltarun {' '.join(map(str, args))} failed ({r.returncode}): {r.stderr.strip()}")


def page_shot(driver, page: Path, out: Path, script: str = "") -> None:
    driver.get(page.as_uri())
    wait_for(lambda: driver.execute_script("return !!(window.graphPage && window.graphPage.ready)"))
    if script:
        driver.execute_script(script)
    time.sleep(0.3)
    driver.save_screenshot(str(out))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    from deltarun.model_files import generate as gen

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        f32 = gen.write_model(d / "tiny-f32.gguf", "tiny", "f32")
        q4 = gen.write_model(d / "tiny-q4_k.gguf", "tiny", "q4_k")
        deltarun("graph", f32, "--rs-slots", "2", "--format", "html", "-o", d / "graph.html")
        deltarun("compare", f32, "--against", q4, "-s", "2", "-q", "--html", d / "compare.html", ok_codes=(7,))
        driver = start_browser(1280, 760, scale=SCALE)
        try:
            page_shot(driver, d / "graph.html", a.out / "graph-page.png",
                      "const p = window.graphPage; p.select(p.tensorIds().find(i => i === 'n4'));")
            page_shot(driver, d / "compare.html", a.out / "compare-page.png")
            chat_shot(driver, f32, a.out / "chat-page.png")
        finally:
            driver.quit()


def chat_shot(driver, model: Path, out: Path) -> None:
    from selenium.webdriver.common.keys import Keys

    from deltarun.apps.serve.server import ServeHandle, ServeSettings
    from deltarun.runner.model import Model

    with ServeHandle(lambda: Model(model, n_ctx=1024, n_seq_max=1, n_ubatch=64), ServeSettings(parallel=1)) as h:
        driver.get(h.base_url + "/")
        driver.execute_script("localStorage.clear()")
        driver.refresh()
        wait_for(lambda: driver.find_element("id", "model-name").text)
        driver.find_element("id", "system-prompt").send_keys("You are a helpful assistant.", Keys.TAB)
        driver.execute_script("document.querySelectorAll('details.settings')[1].open = true")
        driver.find_element("id", "max_tokens").clear()
        driver.find_element("id", "max_tokens").send_keys("40", Keys.TAB)
        box = driver.find_element("id", "input")
        box.send_keys("Write a haiku about graphs", Keys.ENTER)
        wait_for(lambda: driver.find_elements("css selector", ".msg.assistant .stats"), 120)
        time.sleep(0.3)
        driver.save_screenshot(str(out))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
