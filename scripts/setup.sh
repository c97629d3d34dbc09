#!/usr/bin/env bash
# Idempotent setup for hoccl on Debian 12: the apt packages and the five pinned nvcc wheels,
# each installed only if missing. Needs a Rust toolchain (rustup, Rust >= 1.85) already.
# Progress goes to stderr; the last line on stdout is the variable the build needs:
#   HOCCL_NVCC=/canonical/path/to/nvcc       (or HOCCL_NO_CUDA=1 when HOCCL_NO_CUDA=1)
# so callers do:  export "$(bash scripts/setup.sh | tail -n1)"
#   HOCCL_PREFIX   where the nvcc wheels go (default: $HOME/.cache/hoccl/cuda)
#   HOCCL_NO_CUDA  =1: skip the wheels (build without kernels)
set -euo pipefail
prefix="${HOCCL_PREFIX:-${HOME:-/root}/.cache/hoccl/cuda}"

# libclang-dev is all bindgen needs (no clang binary); make is CMake's default generator.
apt_pkgs=(libopenmpi-dev openmpi-bin libibverbs-dev libclang-dev cmake make pkg-config g++
          python3-pip ca-certificates)
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

# Rust is not an apt package here (Debian 12's rustc is too old): report, do not install.
cargo_bin="$(command -v cargo || true)"
[ -n "$cargo_bin" ] || [ ! -x "${HOME:-/root}/.cargo/bin/cargo" ] || cargo_bin="${HOME:-/root}/.cargo/bin/cargo"
if [ -z "$cargo_bin" ]; then
  echo "setup: cargo not found: install Rust >= 1.85 with rustup (https://rustup.rs)" >&2
  exit 1
fi

if [ "${HOCCL_NO_CUDA:-}" = 1 ]; then
  echo "setup: HOCCL_NO_CUDA=1: skipping the nvcc wheels" >&2
  echo "HOCCL_NO_CUDA=1"
  exit 0
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
# nvcc finds its headers relative to its real path: hand out the canonical one.
nvcc="$(readlink -f "$prefix/nvidia/cu13/bin/nvcc")"
"$nvcc" --version >/dev/null
echo "HOCCL_NVCC=$nvcc"
