#!/usr/bin/env bash
# Kernel variants on a GPU machine without rebuilding Rust: every carry/kernels/NAME.fatbin
# (built here by `scripts/gpu/variants.sh build NAME "-DFLAG ..." ...`) is loaded through
# HOCCL_KERNELS and runs the codec's GPU tests (GPU bytes == CPU bytes, round trips) and a
# short benchmark. Writes $OUT/NAME.txt and a summary.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

build() {  # build machine: NAME "FLAGS" pairs
  set -e
  local nvcc
  nvcc=$(readlink -f "${HOCCL_NVCC:-$HOME/.cache/hoccl/cuda/nvidia/cu13/bin/nvcc}")
  mkdir -p carry/kernels target/variants
  local unity=target/variants/all.cu
  : > "$unity"
  for f in cuda/*.cu; do echo "#include \"$root/$f\"" >> "$unity"; done
  while [ $# -ge 2 ]; do
    local name=$1 flags=$2; shift 2
    # shellcheck disable=SC2086
    "$nvcc" -fatbin -gencode arch=compute_90,code=sm_90 -O3 -std=c++17 --use_fast_math -Xptxas=-v \
      $flags -I cuda -o "carry/kernels/$name.fatbin" "$unity" 2> "carry/kernels/$name.ptxas"
    echo "$name ($flags):"; grep -A3 -E "entry function .hoccl_bfx_(decompress_bf16|compress_bf16_8)." "carry/kernels/$name.ptxas" | grep -E "spill|Used" | tr -s " "
  done
}

run() {
  local out=${OUT:-/tmp/hoccl-variants}; mkdir -p "$out"
  export HOCCL_TEST_DATA=$root/tests/data
  local fail=0
  for f in carry/kernels/*.fatbin; do
    local name; name=$(basename "$f" .fatbin)
    {
      echo "== $name"
      HOCCL_KERNELS=$root/$f timeout 60 carry/codec_cuda --ignored --test-threads=1 2>&1 | grep -E "test result|FAILED|panicked" || true
      HOCCL_KERNELS=$root/$f timeout 30 carry/codec_bench --min-size "${VAR_MIN:-32K}" --max-size 1G
      HOCCL_KERNELS=$root/$f timeout 20 carry/codec_bench --tiers 1 --min-size 64M --max-size 1G | tail -n +2
    } > "$out/$name.txt" 2>&1
    grep -q "test result: ok" "$out/$name.txt" || fail=1
    cat "$out/$name.txt"
  done
  return $fail
}

case "${1:-run}" in
  build) shift; build "$@" ;;
  run) run ;;
  *) echo "usage: $0 build NAME FLAGS [NAME FLAGS ...] | run" >&2; exit 2 ;;
esac
