#!/usr/bin/env bash
# Build ggml-python 0.0.45's bindings on ggml 0.25.3 (scripts/ggml-wheel.sh: the same pinned source
# and kernel patches as scripts/install.sh) with ggml's Vulkan backend, and install them into a
# Python environment.
#
#   scripts/install-vulkan.sh [--venv DIR] [--no-apt] [--env-file FILE]
#
# --venv DIR       create (if needed) and install into this virtual environment, with deltarun
#                  installed editable into it too; default: the current `python`'s environment.
# --no-apt         do not install Debian packages (they must already be there).
# --env-file FILE  write the environment the tests need into FILE (`. FILE` before running them):
#                  VK_DRIVER_FILES when a newer lavapipe was unpacked (step 3), else nothing.
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
ENV_FILE=""
REPO=$(cd "$(dirname "$0")/.." && pwd)
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) VENV=$2; shift 2 ;;
    --no-apt) APT=0; shift ;;
    --env-file) ENV_FILE=$2; shift 2 ;;
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

# Downloads Debian packages with a private apt state (its own sources list, lists, cache and empty
# status: the system's apt stays untouched) and unpacks them into a folder; nothing is installed.
#   private_unpack SUITE DEST PKG...   (exit status 3 when apt cannot fetch them)
private_unpack() {
  local suite=$1 dest=$2; shift 2
  local aptd=$CACHE/apt-$suite
  rm -rf "$aptd" "$dest"
  mkdir -p "$aptd/lists/partial" "$aptd/cache/archives/partial" "$aptd/etc/preferences.d" "$aptd/deb" "$dest"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main" \
    > "$aptd/etc/sources.list"
  : > "$aptd/status"
  local opts=(-o "Dir::Etc::SourceList=$aptd/etc/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
              -o "Dir::Etc::Preferences=/dev/null" -o "Dir::Etc::PreferencesParts=$aptd/etc/preferences.d"
              -o "Dir::State::Lists=$aptd/lists" -o "Dir::State::status=$aptd/status"
              -o "Dir::Cache=$aptd/cache" -o "APT::Sandbox::User=root")
  if ! apt-get "${opts[@]}" update -qq || ! (cd "$aptd/deb" && apt-get "${opts[@]}" download "$@"); then
    log "apt is unavailable: cannot download $* from $suite"
    exit 3
  fi
  local deb
  for deb in "$aptd"/deb/*.deb; do dpkg -x "$deb" "$dest"; done
}

# 2. Vulkan headers new enough for ggml-vulkan (VK_EXT_layer_settings, Vulkan-Headers >= 1.3.261).
#    Debian 12 ships 1.3.239: unpack trixie's libvulkan-dev; the system loader works with it.
CMAKE_ARGS="-DGGML_VULKAN=ON;-DGGML_LLAMAFILE=ON;-DGGML_RPC=ON"
if ! grep -q LayerSettingEXT /usr/include/vulkan/vulkan_structs.hpp 2>/dev/null; then
  HDR=$CACHE/vulkan-headers
  if ! grep -q LayerSettingEXT "$HDR/usr/include/vulkan/vulkan_structs.hpp" 2>/dev/null; then
    log "system Vulkan headers are too old; fetching Debian trixie's libvulkan-dev headers into $HDR"
    private_unpack trixie "$HDR" libvulkan-dev
    grep -q LayerSettingEXT "$HDR/usr/include/vulkan/vulkan_structs.hpp" \
      || { log "the downloaded headers still lack VK_EXT_layer_settings"; exit 1; }
  fi
  CMAKE_ARGS="$CMAKE_ARGS;-DVulkan_INCLUDE_DIR=$HDR/usr/include"
fi

# 3. lavapipe for testing without a GPU. Debian 12's (Mesa 22.3.6) corrupts its own heap now and
#    then while it runs ggml's graphs: a fault in its command-execution thread, 2-3 runs in 12 of
#    `deltarun compare` on the tiny-legacy model, none in 31 with Mesa 25.0.7 (2026-11-30). Where
#    the system's Mesa is older than 24, unpack bookworm-backports' mesa-vulkan-drivers into the
#    cache (libvulkan_lvp.so runs with the system's LLVM 15 and libdrm) and point the Vulkan loader
#    at it through VK_DRIVER_FILES in --env-file; the system's Mesa stays installed and in use
#    everywhere else.
DRIVER_ENV=""
MESA=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null || true)
CODENAME=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
if [ -n "$MESA" ] && dpkg --compare-versions "$MESA" lt 24 && [ "$CODENAME" = bookworm ]; then
  LVP=$CACHE/lavapipe-bookworm-backports
  ICD=$LVP/lvp_icd.json
  if [ ! -f "$ICD" ]; then
    log "system lavapipe is Mesa $MESA; unpacking bookworm-backports' mesa-vulkan-drivers into $LVP"
    private_unpack bookworm-backports "$LVP" mesa-vulkan-drivers
    LIB=$(ls "$LVP"/usr/lib/*/libvulkan_lvp.so | head -1)
    sed "s#\"library_path\": *\"[^\"]*\"#\"library_path\": \"$LIB\"#" "$LVP"/usr/share/vulkan/icd.d/lvp_icd.json > "$ICD"
  fi
  DRIVER_ENV="export VK_DRIVER_FILES=$ICD"
  export VK_DRIVER_FILES=$ICD
  log "lavapipe: $(vulkaninfo --summary 2>/dev/null | sed -n 's/^[[:space:]]*driverInfo *= *//p' | head -1) ($ICD)"
elif [ -n "$MESA" ]; then
  log "lavapipe: the system's Mesa $MESA"
fi
if [ -n "$ENV_FILE" ]; then
  mkdir -p "$(dirname "$ENV_FILE")"
  echo "$DRIVER_ENV" > "$ENV_FILE"
fi

# 4. The environment, and the wheel: cached, or built once (about 10 minutes on 2 cores).
pick_python "$VENV"
install_ggml_wheel vulkan-rpc "$CMAKE_ARGS"
if [ -n "$VENV" ]; then
  "$PY" -m pip install -q -e "$REPO[test]"
fi

# 5. Check: the build has the Vulkan backend and lavapipe (or a GPU) shows up.
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
