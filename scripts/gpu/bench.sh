#!/usr/bin/env bash
# The collective benchmarks on a GPU machine, against NCCL (scripts/gpu/common.sh: binaries,
# folders). examples/bench under mpirun:
#   1. table: sendrecv, allgather, alltoall, broadcast, 2M..1G, every point checked,
#      --compare nccl (NCCL default and limited to 1/4/8 CTAs) -> bench.json, bench_table.log
#   2. CPU launch cost per op (hoccl and NCCL), --no-check    -> launch.json, launch.log
#   3. GEMM interference (cuBLAS bf16 8192^3 alone / + hoccl / + NCCL AllGather 256M)
#                                                            -> interference.json/.log
#      (with one GPU also a one-rank run: interference_1rank.json/.log)
#   4. plot of busbw against size (python3 with matplotlib)  -> bench.png
#   and the machine (GPUs, clocks, topology)                 -> machine.log
# Runs 2 and 3 launch no verification fill, so their last lines show whether hoccl's kernel
# module was ever loaded (it must not be: the collectives are copy-engine only).
# Results go to docs/results/<machine>/ (each with a .cmd file: the command that made it).
#
# One rank per GPU when there are 2 or more GPUs; 4 ranks sharing the one GPU otherwise
# (NCCL refuses shared GPUs, so its columns are then skipped with a message). ~2 minutes
# on one GPU, 3-4 minutes on 4 GPUs with NCCL; every step has a time limit, 8 minutes in all.
#   HOCCL_NCCL_LIB, HOCCL_CUBLAS_LIB  libnccl.so.2 and libcublas.so.13 (default: searched in
#                                     the pip packages of python3, then under /opt, /usr/local)
set -uo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
need bench
BIN="$bin/bench"
export HOCCL_LOG="${HOCCL_LOG:-warn}"

# NCCL and cuBLAS from pip's nvidia-* packages when python3 has them.
site_dirs=$(python3 -c 'import site; print("\n".join(site.getsitepackages()))' 2>/dev/null || true)
find_lib() { # find_lib NAME SUBDIR...: the first SITE/nvidia/SUBDIR/lib/NAME, else one under /opt, /usr/local
  local name=$1 d s
  shift
  for d in $site_dirs; do
    for s in "$@"; do
      [ -e "$d/nvidia/$s/lib/$name" ] && { echo "$d/nvidia/$s/lib/$name"; return; }
    done
  done
  find /opt /usr/local -name "$name" 2>/dev/null | head -n1
}
[ -n "${HOCCL_NCCL_LIB:-}" ] || HOCCL_NCCL_LIB=$(find_lib libnccl.so.2 nccl cu13)
[ -n "${HOCCL_CUBLAS_LIB:-}" ] || HOCCL_CUBLAS_LIB=$(find_lib libcublas.so.13 cublas cu13)
[ -n "$HOCCL_NCCL_LIB" ] && export HOCCL_NCCL_LIB
[ -n "$HOCCL_CUBLAS_LIB" ] && export HOCCL_CUBLAS_LIB

if [ "$ngpu" -ge 2 ]; then np=$ngpu; else np=4; fi
{
  echo "bench.sh: $(date -u +%FT%TZ), $ngpu GPU(s), $np ranks"
  echo "NCCL: ${HOCCL_NCCL_LIB:-<search>}  cuBLAS: ${HOCCL_CUBLAS_LIB:-<search>}"
  nvidia-smi --query-gpu=index,name,pci.bus_id,clocks.sm,clocks.max.sm --format=csv 2>&1
  nvidia-smi topo -m 2>&1
} | tee "$results/machine.log"
record "$results/machine.log" "nvidia-smi --query-gpu=index,name,pci.bus_id,clocks.sm,clocks.max.sm --format=csv; nvidia-smi topo -m"

status=0
step() { # step NAME LIMIT ARGS...: one mpirun with a time limit, logged to $results/NAME.log
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS cmd=("${HOCCL_MPIRUN[@]}" --bind-to none -np "$np" "$BIN" "$@")
  record "$results/$name.log" "${cmd[*]}"
  local prev="" a
  for a in "$@"; do   # the JSON file, made by the same command
    [ "$prev" = --json ] && record "$a" "${cmd[*]}"
    prev=$a
  done
  echo "=== $name: ${cmd[*]}" | tee "$results/$name.log"
  timeout --signal=TERM --kill-after=15 "$limit" "${cmd[@]}" 2>&1 | tee -a "$results/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$results/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

step bench_table 270 --compare nccl --json "$results/bench.json"
step launch 60 --no-table --launch-cost --compare nccl --no-check --json "$results/launch.json"
step interference 120 --no-table --interference --compare nccl --no-check --json "$results/interference.json"
if [ "$ngpu" -lt 2 ]; then
  # Several processes on one GPU time-slice its contexts, which slows any GEMM whatever the
  # collective does; one rank (its AllGather is a local copy-engine copy) isolates what the
  # copy engines' traffic alone costs the GEMM.
  np_all=$np; np=1
  step interference_1rank 90 --no-table --interference --no-check --json "$results/interference_1rank.json"
  np=$np_all
fi

if [ ! -s "$results/bench.json" ]; then
  echo "bench.sh: no bench.json, no plot"
  status=1
elif python3 -c 'import matplotlib' 2>/dev/null; then
  python3 scripts/plot_bench.py "$results/bench.json" -o "$results/bench.png" || status=1
  record "$results/bench.png" "python3 scripts/plot_bench.py $results/bench.json -o $results/bench.png"
else
  echo "bench.sh: python3 has no matplotlib: no bench.png (python3 scripts/plot_bench.py bench.json -o bench.png)"
fi
echo "bench.sh: done in $SECONDS s, status $status; results in $results"
exit $status
