#!/usr/bin/env bash
# Build ggml-python 0.0.45 with ggml's Vulkan backend and install it into a Python environment.
#
#   scripts/install-vulkan.sh [--venv DIR] [--no-apt]
#
# --venv DIR   create (if needed) and install into this virtual environment, with deltarun
#              installed editable into it too; default: the current `python`'s environment.
# --no-apt     do not install Debian packages (they must already be there).
#
# Exit status 3: apt is unavailable (no apt-get, no root/sudo, or no network) for a needed step.
# Environment: DELTARUN_WHEEL_CACHE (default ~/.cache/deltarun-wheels) keeps the built wheel (per
# CPU, see scripts/ggml-wheel.sh) and the unpacked Vulkan headers between runs, outside the clone;
# a second run installs the cached wheel in seconds instead of compiling for ~10 minutes. NICE
# (default 10) is the build's niceness, JOBS the number of compile jobs. The CPU side is built with
# GGML_LLAMAFILE=ON, as scripts/install.sh does.
#
# Works without a GPU: Mesa's lavapipe (mesa-vulkan-drivers) runs Vulkan on the CPU; select it
# with GGML_VK_VISIBLE_DEVICES=0 (ggml-vulkan skips CPU devices otherwise).
set -euo pipefail

VENV=""
APT=1
REPO=$(cd "$(dirname "$0")/.." && pwd)
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) VENV=$2; shift 2 ;;
    --no-apt) APT=0; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
log() { echo "[install-vulkan] $*" >&2; }
. "$REPO/scripts/ggml-wheel.sh"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo

# 1. Debian packages: the shader compiler, loader + headers, lavapipe, vulkaninfo, SPIR-V headers.
PKGS="glslc libvulkan-dev mesa-vulkan-drivers vulkan-tools spirv-headers"
if [ "$APT" = 1 ]; then
  missing=""
  for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  if [ -n "$missing" ]; then
    log "installing Debian packages:$missing"
    if ! command -v apt-get >/dev/null || ! $SUDO apt-get update -qq \
       || ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null; then
      log "apt is unavailable: cannot install$missing"
      exit 3
    fi
  fi
fi

# 2. Vulkan headers new enough for ggml-vulkan (VK_EXT_layer_settings, Vulkan-Headers >= 1.3.261).
#    Debian 12 ships 1.3.239: fetch trixie's libvulkan-dev with a private apt state (the system's
#    sources, lists and status untouched) and only unpack it; the system loader works with it.
CMAKE_ARGS="-DGGML_VULKAN=ON;-DGGML_LLAMAFILE=ON"
if ! grep -q LayerSettingEXT /usr/include/vulkan/vulkan_structs.hpp 2>/dev/null; then
  HDR=$CACHE/vulkan-headers
  if ! grep -q LayerSettingEXT "$HDR/usr/include/vulkan/vulkan_structs.hpp" 2>/dev/null; then
    log "system Vulkan headers are too old; fetching Debian trixie's libvulkan-dev headers into $HDR"
    APTD=$CACHE/apt-trixie
    rm -rf "$APTD" "$HDR"
    mkdir -p "$APTD/lists/partial" "$APTD/cache/archives/partial" "$APTD/etc/preferences.d" "$APTD/deb" "$HDR"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
      > "$APTD/etc/sources.list"
    : > "$APTD/status"
    APTOPTS=(-o "Dir::Etc::SourceList=$APTD/etc/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
             -o "Dir::Etc::Preferences=/dev/null" -o "Dir::Etc::PreferencesParts=$APTD/etc/preferences.d"
             -o "Dir::State::Lists=$APTD/lists" -o "Dir::State::status=$APTD/status"
             -o "Dir::Cache=$APTD/cache" -o "APT::Sandbox::User=root")
    if ! apt-get "${APTOPTS[@]}" update -qq || ! (cd "$APTD/deb" && apt-get "${APTOPTS[@]}" download libvulkan-dev); then
      log "apt is unavailable: cannot download trixie's libvulkan-dev"
      exit 3
    fi
    dpkg -x "$APTD"/deb/libvulkan-dev_*.deb "$HDR"
    grep -q LayerSettingEXT "$HDR/usr/include/vulkan/vulkan_structs.hpp" \
      || { log "the downloaded headers still lack VK_EXT_layer_settings"; exit 1; }
  fi
  CMAKE_ARGS="$CMAKE_ARGS;-DVulkan_INCLUDE_DIR=$HDR/usr/include"
fi

# 3. The environment, and the wheel: cached, or built once (about 10 minutes on 2 cores).
pick_python "$VENV"
install_ggml_wheel vulkan "$CMAKE_ARGS"
if [ -n "$VENV" ]; then
  "$PY" -m pip install -q -e "$REPO[test]"
fi

# 4. Check: the build has the Vulkan backend and lavapipe (or a GPU) shows up.
GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0} "$PY" - <<'PY'
import ctypes
import ggml
n = ggml.ggml_backend_vk_get_device_count()
print(f"[install-vulkan] ggml-python with Vulkan: {n} device(s)")
for i in range(n):
    buf = ctypes.create_string_buffer(256)
    ggml.ggml_backend_vk_get_device_description(i, buf, 256)
    print(f"[install-vulkan]   Vulkan{i}: {buf.value.decode()}")
PY
