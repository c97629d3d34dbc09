#!/usr/bin/env bash
# Build everything the GPU scripts run, in release mode, into a folder of prebuilt binaries:
#   <dir>/tests/<name>   every test executable (cargo test --release --no-run), by target name
#   <dir>/<name>         the examples (demo, bench, codec_bench, streams_check, ...) and tools
#                        (hoccl-info, hoccl-zip, ...)
#   <dir>/cpp/<name>     the C and C++ checks of ctest/ (when CMake is installed)
#   <dir>/ptxas.log      registers and spills of every CUDA kernel, from the build
#   <dir>/nccl/          libnccl.so.2 (the NCCL-compatible library) and its libnccl.so link
# The other scripts of scripts/gpu/ build this folder themselves when Rust is installed; run
# it directly to make the folder on one machine and run the GPU scripts on another (which
# needs the repository and Open MPI, not Rust; binaries built on Debian 12 run on newer
# glibc): copy the folder there and set HOCCL_BIN_DIR to it.
#
#   bash scripts/gpu/build.sh [--archive FILE]
#       --archive FILE  also pack the folder into FILE (tar.xz) to copy elsewhere; unpacked
#                       as <dir>/bundle.txz by the GPU scripts
#   HOCCL_BIN_DIR   the folder (default build/gpu-bin; emptied first)
# nvcc: HOCCL_NVCC, else on PATH or /usr/local/cuda/bin; without one, scripts/setup.sh
# installs the pinned nvcc wheels.
set -euo pipefail
cd "$(dirname "$0")/../.."
archive=""
while [ $# -gt 0 ]; do
  case "$1" in
    --archive) archive="${2:?--archive needs a file name}"; shift 2 ;;
    *) echo "usage: $0 [--archive FILE]" >&2; exit 2 ;;
  esac
done
[ -x "${HOME:-/root}/.cargo/bin/cargo" ] && export PATH="${HOME:-/root}/.cargo/bin:$PATH"
if [ "${HOCCL_NO_CUDA:-}" = 1 ]; then
  echo "build.sh: HOCCL_NO_CUDA=1: the binaries will have no CUDA kernels (the codec's GPU tests fail)" >&2
elif [ -z "${HOCCL_NVCC:-}" ] && ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  export "$(bash scripts/setup.sh | tail -n1)"
fi
bin="${HOCCL_BIN_DIR:-build/gpu-bin}"
target="${CARGO_TARGET_DIR:-target}"
rm -rf "$bin" && mkdir -p "$bin/tests"

echo "build.sh: cargo build --release --bins --examples"
cargo build --release --bins --examples
echo "build.sh: cargo test --release --no-run"
cargo test --release --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, os, shutil, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"] \
            and m["target"]["kind"] not in (["bin"], ["example"]):
        shutil.copy(m["executable"], os.path.join(sys.argv[1], "tests", m["target"]["name"]))
' "$bin"
# Examples (cargo also leaves NAME-HASH copies there) and tools (hoccl-info, ...).
for f in "$target"/release/examples/*; do
  [ -f "$f" ] && [ -x "$f" ] && case "${f##*/}" in *-*) ;; *) cp "$f" "$bin/" ;; esac
done
for f in "$target"/release/hoccl-*; do
  [ -f "$f" ] && [ -x "$f" ] && cp "$f" "$bin/"
done
ptx=$(ls -t "$target"/release/build/hoccl-*/out/ptxas.log 2>/dev/null | head -n1 || true)
[ -n "$ptx" ] && cp "$ptx" "$bin/ptxas.log"
# The NCCL-compatible library (scripts/gpu/nccl.sh takes it from here).
echo "build.sh: libnccl.so.2 (scripts/nccl-lib.sh)"
nccl_dir=$(bash scripts/nccl-lib.sh)
mkdir -p "$bin/nccl"
cp "$nccl_dir/libnccl.so.2" "$bin/nccl/"
ln -sfn libnccl.so.2 "$bin/nccl/libnccl.so"

if command -v cmake >/dev/null; then
  # CMake's cargo step finds the release library just built (same target dir and profile).
  echo "build.sh: CMake build of the C and C++ checks"
  cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release > /dev/null
  cmake --build build/cmake -j "$(nproc)"
  mkdir -p "$bin/cpp"
  for f in build/cmake/ctest/*_check build/cmake/examples/cpp/allgather_demo; do
    [ -x "$f" ] && cp "$f" "$bin/cpp/"
  done
fi
# The probes of scripts/gpu/driverlock.sh, against the cuda.h of the nvcc in use.
nvcc_path="${HOCCL_NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
cuda_inc="$(dirname "$(dirname "$nvcc_path")")/include"
if [ -f "$cuda_inc/cuda.h" ]; then
  cc -O1 -I"$cuda_inc" scripts/gpu/driver_lock_probe.c -o "$bin/driver_lock_probe" -ldl -lpthread
  cc -O1 -I"$cuda_inc" scripts/gpu/callside_probe.c -o "$bin/callside_probe" -ldl
else
  echo "build.sh: no cuda.h beside $nvcc_path: driver_lock_probe and callside_probe not built" >&2
fi
find "$bin" -type f -perm -u+x -exec strip --strip-debug {} +
# The commit the binaries come from (with "+changes" when the tree had uncommitted edits),
# for the .cmd files the GPU scripts write beside each result.
{ git rev-parse --short HEAD 2>/dev/null || echo unknown; } | tr -d '\n' > "$bin/commit.txt"
git diff --quiet HEAD 2>/dev/null || echo -n "+changes" >> "$bin/commit.txt"
if [ -n "$archive" ]; then
  # One thread and a dictionary larger than the folder: every binary embeds the same
  # kernel fatbin, which the dictionary then stores once (~10 MB instead of ~110).
  tar cf - -C "$bin" . | xz -T1 --lzma2=preset=6,dict=768MiB > "$archive"
  echo "build.sh: $archive ($(du -h "$archive" | cut -f1)): unpack it or put it at \$HOCCL_BIN_DIR/bundle.txz"
fi
echo "build.sh: binaries in $bin ($(du -sh "$bin" | cut -f1))"
