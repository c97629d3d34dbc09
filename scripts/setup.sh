#!/usr/bin/env bash
# Idempotent setup for hoccl on Debian 12: apt packages and the pinned nvcc wheels.
# Installs only what is missing. Prints the environment to source on stdout's last line.
#   HOCCL_PREFIX   where the nvcc wheels go (default: $HOME/.cache/hoccl/cuda)
set -euo pipefail
prefix="${HOCCL_PREFIX:-${HOME:-/root}/.cache/hoccl/cuda}"
apt_pkgs=(libopenmpi-dev openmpi-bin libibverbs-dev libclang-dev clang cmake pkg-config g++ python3-pip)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing apt packages: ${missing[*]}" >&2
  sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >&2
fi
# The five nvcc wheels, pinned together (an unpinned part pulls a newer PTX ISA that the
# 13.0 driver rejects). See ../shared/TOOLCHAIN.md.
wheels=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
        nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)
stamp="$prefix/.hoccl-wheels"
want="${wheels[*]}"
if [ ! -x "$prefix/nvidia/cu13/bin/nvcc" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing pinned nvcc wheels into $prefix" >&2
  mkdir -p "$prefix"
  python3 -m pip install -q --disable-pip-version-check --upgrade --target "$prefix" "${wheels[@]}" >&2
  echo "$want" > "$stamp"
fi
nvcc="$(readlink -f "$prefix/nvidia/cu13/bin/nvcc")"
"$nvcc" --version >/dev/null
echo "HOCCL_NVCC=$nvcc"
