#!/usr/bin/env bash
# hoccl's libnccl.so.2 in place of NCCL, on a GPU machine (scripts/gpu/common.sh: binaries,
# folders). Every step writes its log under the results folder; one line per step goes to
# nccl-summary.txt:
#   1. tests/nccl/ctypes_check.py: the library loaded by path with ctypes, as vLLM does
#      (torch itself keeps NCCL's own library), 2 ranks
#   2. tests/nccl/torch_check.py under torchrun, 2, 3 and 4 ranks (and one per GPU with more),
#      our library put in through LD_PRELOAD (torch's wheels load their NCCL by path, ahead
#      of LD_LIBRARY_PATH: which one LD_LIBRARY_PATH gives is recorded);
#      NCCL_DEBUG=VERSION must print hoccl's banner and /proc/self/maps of every rank must
#      show our library as the only libnccl (--expect-lib)
#   3. the nccl* symbols libtorch_cuda.so needs (nm -D --undefined-only) against the ones
#      our library exports: any missing symbol fails
#   4. the C programs of ctest/nccl, compiled here against include/hoccl-nccl/nccl.h and
#      linked to our library, with 2 and 3 ranks (processes sharing the GPUs), on CUDA;
#      nccl_check again with 2 ranks on each default stream (0, cudaStreamLegacy,
#      cudaStreamPerThread)
# With fewer GPUs than ranks the ranks share a GPU, which needs MPS: it is started here
# (nvidia-cuda-mps-control -d) and stopped when the script exits.
#   HOCCL_NCCL_LIB   our libnccl.so.2 (default: $HOCCL_BIN_DIR/nccl/libnccl.so.2 from build.sh,
#                    else built here by scripts/nccl-lib.sh when cargo is installed)
#   TORCH_PYTHON     a Python with torch (default /opt/torch/.venv/bin/python)
#   NCCL_STEP_LIMIT  seconds per step (default 300)
set -uo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
export HOCCL_LOG="${HOCCL_LOG:-warn}" HOCCL_TIMEOUT_MS="${HOCCL_TIMEOUT_MS:-60000}"
py="${TORCH_PYTHON:-/opt/torch/.venv/bin/python}"
summary="$results/nccl-summary.txt"
: > "$summary"
status=0
note() { echo "$*" | tee -a "$summary"; }
fail() { status=1; note "FAIL $*"; }

# ---------------------------------------------------------------- our library ------------
lib="${HOCCL_NCCL_LIB:-}"
[ -z "$lib" ] && [ -f "$bin/nccl/libnccl.so.2" ] && lib="$bin/nccl/libnccl.so.2"   # from build.sh
if [ -z "$lib" ]; then
  [ -x "${HOME:-/root}/.cargo/bin/cargo" ] && export PATH="${HOME:-/root}/.cargo/bin:$PATH"
  if command -v cargo >/dev/null 2>&1; then
    d=$(bash scripts/nccl-lib.sh 2> "$logs/nccl-build.log") || { echo "nccl.sh: scripts/nccl-lib.sh failed ($logs/nccl-build.log)" >&2; exit 1; }
    lib="$d/libnccl.so.2"
  elif [ -f build/cmake/lib/hoccl-nccl/libnccl.so.2 ]; then
    lib="$root/build/cmake/lib/hoccl-nccl/libnccl.so.2"   # made by build.sh's CMake build
  else
    echo "nccl.sh: no libnccl.so.2: set HOCCL_NCCL_LIB, or install Rust" >&2
    exit 2
  fi
fi
lib="$(cd "$(dirname "$lib")" && pwd)/$(basename "$lib")"
libdir="$(dirname "$lib")"
[ -x "$py" ] || { echo "nccl.sh: no Python at $py (set TORCH_PYTHON)" >&2; exit 2; }
site=$("$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
torch_cuda="$site/torch/lib/libtorch_cuda.so"
note "# $(date -u +%FT%TZ) $ngpu GPU(s); our library $lib; torch $("$py" -c 'import torch; print(torch.__version__)') at $site"

nranks=2
if [ "$ngpu" -lt 4 ]; then
  # Up to 4 processes share a GPU (torch_check runs 4 ranks): MPS. Four clients with 32
  # hardware queues each do not start under MPS; torch opens its context before hoccl could
  # choose, so the queue count is set here.
  export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-16}"
  mps_dir=$(mktemp -d "${TMPDIR:-/tmp}/hoccl-mps.XXXXXX")
  export CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; rm -rf "$mps_dir"' EXIT
  trap 'exit 143' TERM INT HUP
  nvidia-cuda-mps-control -d || { note "FAIL MPS did not start"; exit 1; }
  note "# MPS started (ranks share GPUs)"
fi

# step NAME CMD...: run CMD under the step limit into $results/nccl-NAME.log; one line.
step() {
  local name=$1 out="$results/nccl-$1.log" rc
  shift
  record "$out" "$*"
  echo "\$ $*" > "$out"
  timeout --kill-after=15 "${NCCL_STEP_LIMIT:-300}" "$@" >> "$out" 2>&1
  rc=$?
  if [ $rc = 0 ]; then note "ok   $name"; else fail "$name (exit $rc; $out)"; tail -n 8 "$out" | sed 's/^/     /' | tee -a "$summary"; fi
  return $rc
}

# ---------------------------------------------------------------- 1. ctypes --------------
step ctypes "$py" tests/nccl/ctypes_check.py --lib "$lib" --nranks 2 --timeout 240

# ---------------------------------------------------------------- 2. torch ---------------
nps=(2 3 4)
[ "$ngpu" -gt 4 ] && nps+=("$ngpu")
torchrun="$(dirname "$py")/torchrun"
# PyTorch's wheels load the NCCL of the nvidia-nccl wheel by its path, ahead of
# LD_LIBRARY_PATH, so for torch our library goes in through LD_PRELOAD; which library
# LD_LIBRARY_PATH gives torch is recorded, not required.
probe=$(env LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$py" -c '
import torch
torch.cuda.nccl.version()
print(sorted({l.split()[-1] for l in open("/proc/self/maps") if "libnccl" in l}))' 2>&1 | tail -n 1)
note "note torch with LD_LIBRARY_PATH=$libdir maps libnccl: $probe"
for np in "${nps[@]}"; do
  name="torch-LD_PRELOAD-np$np"
  if step "$name" env LD_PRELOAD="$lib" NCCL_DEBUG=VERSION "$torchrun" --nproc-per-node "$np" \
       tests/nccl/torch_check.py --expect-lib "$lib" --timeout 270; then
    if grep -q "served by hoccl" "$results/nccl-$name.log"; then
      note "ok   $name: NCCL_DEBUG=VERSION printed hoccl's banner"
    else
      fail "$name: no hoccl banner under NCCL_DEBUG=VERSION"
    fi
  fi
  grep -h "libnccl mapped" "$results/nccl-$name.log" | sort -u | sed 's/^/     /' | tee -a "$summary"
done

# ---------------------------------------------------------------- 3. symbols -------------
syms="$results/nccl-symbols.txt"
{
  echo "# nccl symbols libtorch_cuda.so needs ($torch_cuda), and whether our library exports them"
  readelf -d "$torch_cuda" | grep -E 'RPATH|RUNPATH' || echo "# no RPATH/RUNPATH"
} > "$syms"
record "$syms" "nm -D --undefined-only $torch_cuda | grep nccl; nm -D --defined-only $lib"
nm -D --undefined-only "$torch_cuda" | awk '{print $NF}' | grep -i nccl | sed 's/@.*//' | sort -u > "$logs/nccl-needed.txt"
nm -D --defined-only "$lib" | awk '{print $NF}' | sed 's/@.*//' | sort -u > "$logs/nccl-exported.txt"
missing=$(comm -23 "$logs/nccl-needed.txt" "$logs/nccl-exported.txt")
while read -r s; do
  [ -n "$s" ] || continue
  if grep -qx "$s" "$logs/nccl-exported.txt"; then echo "exported $s"; else echo "MISSING  $s"; fi
done < "$logs/nccl-needed.txt" >> "$syms"
others=$(grep -v -E '^p?nccl' "$logs/nccl-exported.txt" | grep -v -E '^(_init|_fini)$' || true)
if [ -n "$missing" ]; then
  fail "symbols: libtorch_cuda.so needs $(echo "$missing" | wc -l) symbol(s) our library lacks: $(echo $missing)"
else
  note "ok   symbols: all $(wc -l < "$logs/nccl-needed.txt") nccl symbols of libtorch_cuda.so are exported"
fi
# NCCL's export map has only nccl*/pncclX; anything else is reported (tests/nccl_exports.rs
# is where the export list itself is checked).
[ -z "$others" ] || note "note symbols: exports beyond nccl*/pnccl*: $(echo $others)"

# ---------------------------------------------------------------- 4. C programs ----------
cdir="$root/build/nccl-ctest"
mkdir -p "$cdir"
for src in ctest/nccl/*.c; do
  [ -f "$src" ] || continue
  prog="$cdir/$(basename "$src" .c)"
  if ! cc -std=c99 -O1 -Wall -Wextra -Werror -Iinclude/hoccl-nccl -Ictest "$src" -o "$prog" \
       -L"$libdir" -l:"$(basename "$lib")" -Wl,-rpath,"$libdir" -ldl > "$results/nccl-build-$(basename "$src" .c).log" 2>&1; then
    fail "compile $src ($results/nccl-build-$(basename "$src" .c).log)"
    continue
  fi
  for np in 2 3; do
    step "$(basename "$prog")-np$np" env HOCCL_BACKEND=cuda "$prog" "$np"
  done
done
# nccl_check with every collective on the default streams: stream 0 (the legacy default
# stream), cudaStreamLegacy and cudaStreamPerThread, 2 processes.
if [ -x "$cdir/nccl_check" ]; then
  for s in null legacy per-thread; do
    step "nccl_check-np2-stream-$s" env HOCCL_BACKEND=cuda "$cdir/nccl_check" 2 "$s"
  done
fi


record "$summary" "bash scripts/gpu/nccl.sh"
note "# nccl.sh: $([ $status = 0 ] && echo OK || echo FAILED)"
exit $status
