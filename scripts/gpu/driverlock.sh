#!/usr/bin/env bash
# What a design without host threads after the enqueue has to live with, and what it gains:
#   1. which driver calls of one thread block while another thread of the process waits for
#      the GPU inside the driver (scripts/gpu/driver_lock_probe.c), without and with MPS
#      -> driver-lock.txt (per mode: how long A's call took, each of B's calls, BLOCKED lines)
#   2. two processes under MPS exchanging data with every copy and flag operation enqueued by
#      the calling thread (scripts/gpu/callside_probe.c): staged through a receiver-owned ring,
#      and direct into the peer's buffer, 4 KiB - 64 MiB -> callside.txt
#   3. what each driver call of an enqueue costs the calling thread, two processes calling
#      at once, without and with MPS (callside_probe calls)       -> driver-calls.txt
# Both probes are built by scripts/gpu/build.sh (or here, from $CUDA_HOME/include/cuda.h).
set -u
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
probe() { # NAME: the binary from build.sh, or built here
  if [ -x "$bin/$1" ]; then echo "$bin/$1"; return; fi
  local inc="${CUDA_HOME:-/usr/local/cuda}/include"
  cc -O1 -I"$inc" "scripts/gpu/$1.c" -o "$logs/$1" -ldl -lpthread >&2 || { echo "driverlock.sh: no $1 in \$HOCCL_BIN_DIR and cannot build it (cuda.h in $inc?)" >&2; exit 2; }
  echo "$logs/$1"
}
lock=$(probe driver_lock_probe) || exit 2
side=$(probe callside_probe) || exit 2
out="$results/driver-lock.txt"
record "$out" "bash scripts/gpu/driverlock.sh (driver_lock_probe MODE [ctx2] for each mode, without and with MPS)"
run_all() {
  for m in dtoh dtoh-async ctxsync streamsync free; do
    echo "## $1, mode $m, B in A's context"; timeout 20 "$lock" "$m"
    echo "## $1, mode $m, B in a context of its own"; timeout 20 "$lock" "$m" ctx2
  done
}
run_all "no MPS" > "$out" 2>&1
dc="$results/driver-calls.txt"
record "$dc" "bash scripts/gpu/driverlock.sh (callside_probe calls 0 5000, without MPS, then under MPS)"
{ echo "## no MPS"; timeout 60 "$side" calls 0 5000; } > "$dc" 2>&1
mps_dir=$(mktemp -d "${TMPDIR:-/tmp}/hoccl-mps.XXXXXX")
export CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
status=0
if nvidia-cuda-mps-control -d; then
  run_all "MPS" >> "$out" 2>&1
  { echo "## MPS"; timeout 60 "$side" calls 0 5000; } >> "$dc" 2>&1
  cs="$results/callside.txt"
  record "$cs" "bash scripts/gpu/driverlock.sh (under MPS: callside_probe staged|direct BYTES N 4)"
  for mode in staged direct; do
    for b in 4096 65536 2097152 67108864; do
      n=2000; [ "$b" -ge 67108864 ] && n=200
      timeout 60 "$side" "$mode" "$b" "$n" 4 || status=1
    done
  done > "$cs" 2>&1
  echo quit | nvidia-cuda-mps-control
  cat "$cs"
fi
rm -rf "$mps_dir"
grep -E "^##|BLOCKED|returned" "$out"
cat "$dc"
exit $status
