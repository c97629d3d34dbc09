#!/usr/bin/env bash
# Which driver calls of one thread block while another thread of the process waits for the GPU
# inside the driver (scripts/gpu/driver_lock_probe.c), without and with MPS
#   -> driver-lock.txt (one block per mode: how long A's call took, each of B's calls, BLOCKED lines)
set -u
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
out="$results/driver-lock.txt"
probe="$bin/driver_lock_probe"   # built by build.sh
if [ ! -x "$probe" ]; then
  inc="${CUDA_HOME:-/usr/local/cuda}/include"
  probe="$logs/driver_lock_probe"
  cc -O1 -I"$inc" scripts/gpu/driver_lock_probe.c -o "$probe" -ldl -lpthread \
    || { echo "driverlock.sh: no probe in \$HOCCL_BIN_DIR and cannot build it (cuda.h in $inc?)" >&2; exit 2; }
fi
record "$out" "bash scripts/gpu/driverlock.sh (cc scripts/gpu/driver_lock_probe.c; probe MODE [ctx2] for each mode, then under MPS)"
run_all() {
  for m in dtoh dtoh-async ctxsync streamsync free; do
    echo "## $1, mode $m, B in A's context"; timeout 20 "$probe" "$m"
    echo "## $1, mode $m, B in a context of its own"; timeout 20 "$probe" "$m" ctx2
  done
}
run_all "no MPS" > "$out" 2>&1
mps_dir=$(mktemp -d "${TMPDIR:-/tmp}/hoccl-mps.XXXXXX")
export CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if nvidia-cuda-mps-control -d; then
  run_all "MPS" >> "$out" 2>&1
  echo quit | nvidia-cuda-mps-control
fi
rm -rf "$mps_dir"
grep -E "^##|BLOCKED|returned" "$out"
