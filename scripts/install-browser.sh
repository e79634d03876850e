#!/usr/bin/env bash
# Install headless Chromium and its driver (Debian's `chromium` and `chromium-driver`) for the
# browser tests of the pages (tests/test_pages.py), which drive /usr/bin/chromium through
# /usr/bin/chromedriver with selenium. Nothing is downloaded but Debian packages (selenium's own
# driver manager is not used: the tests point it at the system driver).
#
#   scripts/install-browser.sh
#
# Exit status: 0 when both are installed (or already were), 3 when apt is unavailable (no
# apt-get, or neither root nor password-less sudo), other codes when apt-get fails.
set -euo pipefail
log() { echo "[install-browser] $*" >&2; }
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  log "chromium and chromedriver are installed: $(/usr/bin/chromium --version 2>/dev/null | head -1)"
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  log "no apt-get: install Chromium and its driver with your system's package manager"; exit 3
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else log "neither root nor password-less sudo"; exit 3; fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >&2
$SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver >&2
log "installed: $(/usr/bin/chromium --version 2>/dev/null | head -1)"
