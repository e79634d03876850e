"""Headless Chromium for the page tests: Debian's /usr/bin/chromium driven through the system's
/usr/bin/chromedriver by selenium (no driver download, no usage statistics).

Tests skip with the reason when the browser is missing, unless DELTARUN_REQUIRE_BROWSER=1 (set by
.ci/run once scripts/install-browser.sh has installed it), where they fail instead. Screenshots go
to tests/screenshots/ (not committed; DELTARUN_SCREENSHOTS overrides) for a person to look at.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import pytest

CHROMIUM = os.environ.get("DELTARUN_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("DELTARUN_CHROMEDRIVER", "/usr/bin/chromedriver")
SCREENSHOTS = Path(os.environ.get("DELTARUN_SCREENSHOTS", Path(__file__).parent / "screenshots"))


def _unavailable(reason: str) -> None:
    if os.environ.get("DELTARUN_REQUIRE_BROWSER") == "1":
        pytest.fail(f"browser tests required but {reason}")
    pytest.skip(f"{reason}: run scripts/install-browser.sh (Debian's chromium and chromium-driver)")


def start_browser(width: int = 1400, height: int = 900, scale: float = 1.0) -> Any:
    """A headless Chromium session that records the page's console."""
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        _unavailable(f"no {CHROMIUM} or {CHROMEDRIVER}")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium is not installed (pip install -e '.[test]')")
    os.environ["SE_AVOID_STATS"] = "true"  # selenium manager: no statistics (it is not used: the driver is given)
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              f"--window-size={width},{height}", "--no-first-run", "--disable-extensions",
              f"--force-device-scale-factor={scale}"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))


def wait_for(cond: Callable[[], Any], timeout: float = 20.0, what: str = "the page") -> Any:
    """Poll `cond` until it returns something true (bounded in time)."""
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        last = cond()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def console_errors(driver: Any) -> list[dict]:
    """SEVERE entries of the browser console since the last call."""
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def screenshot(driver: Any, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path

