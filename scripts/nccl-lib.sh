#!/usr/bin/env bash
# Build libnccl.so.2 (hoccl's NCCL-compatible library) with cargo and lay it out under its
# soname: <target>/<profile>/hoccl-nccl/libnccl.so.2 plus a libnccl.so link, the directory
# to put on LD_LIBRARY_PATH (or whose libnccl.so.2 to LD_PRELOAD). Prints that directory.
#   scripts/nccl-lib.sh            release build
#   scripts/nccl-lib.sh --debug    debug build
# cargo's own environment applies (CARGO_TARGET_DIR, HOCCL_NO_CUDA, HOCCL_NVCC, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
profile=release
args=(--release)
if [[ "${1:-}" == "--debug" ]]; then
  profile=debug
  args=()
fi
cargo build "${args[@]}" -p hoccl-nccl >&2
target="${CARGO_TARGET_DIR:-target}"
out="$target/$profile/hoccl-nccl"
mkdir -p "$out"
# A copy, not a link: the file cargo writes is replaced on every build.
cp -f "$target/$profile/libnccl.so" "$out/libnccl.so.2.tmp"
mv -f "$out/libnccl.so.2.tmp" "$out/libnccl.so.2"
ln -sfn libnccl.so.2 "$out/libnccl.so"
cd "$out" && pwd
