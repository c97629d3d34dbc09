#!/usr/bin/env bash
# Idempotent setup for hoccl on Debian 12: the apt packages and the five pinned nvcc wheels,
# each installed only if missing. Needs a Rust toolchain (rustup, Rust >= 1.85) already.
# Prints one line per step on stderr; what the installers print goes to a log file
# (${XDG_CACHE_HOME:-~/.cache}/hoccl/setup.log), whose last lines are shown if a step fails.
# The last line on stdout is the variable the build needs:
#   HOCCL_NVCC=/canonical/path/to/nvcc       (or HOCCL_NO_CUDA=1 when HOCCL_NO_CUDA=1)
# so callers do:  export "$(bash scripts/setup.sh | tail -n1)"
#   HOCCL_PREFIX   where the nvcc wheels go (default: $HOME/.cache/hoccl/cuda, where the
#                  build looks when HOCCL_NVCC is not set)
#   HOCCL_NO_CUDA  =1: skip the wheels (build without kernels)
set -euo pipefail
home="${HOME:-/root}"
prefix="${HOCCL_PREFIX:-$home/.cache/hoccl/cuda}"
log_dir="${XDG_CACHE_HOME:-$home/.cache}/hoccl"
mkdir -p "$log_dir"
log="$log_dir/setup.log"
echo "== scripts/setup.sh, $(date -u +%FT%TZ)" > "$log"

say() { echo "setup: $*" >&2; }

# step DESCRIPTION CMD...: run CMD with its output appended to the log; one line on stderr.
step() {
  local what=$1 t0=$SECONDS rc=0
  shift
  printf 'setup: %s... ' "$what" >&2
  echo "== $what: $*" >> "$log"
  "$@" >> "$log" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then
    echo "done ($((SECONDS - t0)) s)" >&2
    return
  fi
  echo "FAILED (exit $rc)" >&2
  say "full log: $log; its last lines:"
  tail -n 25 "$log" | sed 's/^/  /' >&2
  exit 1
}

# ---------------------------------------------------------------- apt packages -----------
# libclang-dev is all bindgen needs (no clang binary); make is CMake's default generator.
apt_pkgs=(libopenmpi-dev openmpi-bin libibverbs-dev libclang-dev cmake make pkg-config g++
          python3-pip ca-certificates)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  say "apt packages: all ${#apt_pkgs[@]} present"
else
  sudo_cmd=(); [ "$(id -u)" = 0 ] || sudo_cmd=(sudo)
  echo "missing apt packages: ${missing[*]}" >> "$log"
  step "apt-get update" "${sudo_cmd[@]}" apt-get update
  step "installing ${#missing[@]} apt packages (${missing[*]})" \
    "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
fi

# ---------------------------------------------------------------- Rust -------------------
# Rust is not an apt package here (Debian 12's rustc is too old): report, do not install.
cargo_bin="$(command -v cargo || true)"
[ -n "$cargo_bin" ] || [ ! -x "$home/.cargo/bin/cargo" ] || cargo_bin="$home/.cargo/bin/cargo"
if [ -z "$cargo_bin" ]; then
  say "cargo not found: install Rust >= 1.85 with rustup (https://rustup.rs), then run this again"
  exit 1
fi
say "cargo: $("$cargo_bin" --version 2>/dev/null || echo "$cargo_bin")"

# ---------------------------------------------------------------- nvcc wheels ------------
if [ "${HOCCL_NO_CUDA:-}" = 1 ]; then
  say "HOCCL_NO_CUDA=1: no nvcc wheels (the build skips the CUDA kernels)"
  echo "HOCCL_NO_CUDA=1"
  exit 0
fi
# No CUDA toolkit is installed: nvcc comes from five pip wheels, pinned together. An
# unpinned part pulls a newer release whose PTX ISA the 13.0 ptxas and the 580 driver of the
# GPU machines reject; cccl carries the headers cuda_bf16.h needs. Debian's pip installs
# only with --target (PEP 668). nvcc finds its headers relative to its own real path, so it
# is called by its canonical path, never through a symlink; no CUDA_HOME or -I is needed.
wheels=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
        nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)
stamp="$prefix/.hoccl-wheels"
want="${wheels[*]}"
if [ -x "$prefix/nvidia/cu13/bin/nvcc" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  say "nvcc wheels: present in $prefix"
else
  mkdir -p "$prefix"
  step "installing the ${#wheels[@]} pinned nvcc wheels into $prefix" \
    env PIP_ROOT_USER_ACTION=ignore python3 -m pip install --disable-pip-version-check --no-input \
      --upgrade --target "$prefix" "${wheels[@]}"
  echo "$want" > "$stamp"
fi
nvcc="$(readlink -f "$prefix/nvidia/cu13/bin/nvcc")"
step "checking nvcc" "$nvcc" --version
echo "HOCCL_NVCC=$nvcc"
