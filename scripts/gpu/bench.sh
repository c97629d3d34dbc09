#!/usr/bin/env bash
# The full benchmark on the GPU machine, from the binary the lead copies to carry/bench
# (target/release/examples/bench). Run from the repository root: bash scripts/gpu/bench.sh
#
#   1. table: sendrecv, allgather, alltoall, broadcast, 2M..1G, checked, --compare nccl
#      (NCCL default and limited to 1/4/8 CTAs) -> $OUT/bench.json, $OUT/bench_table.log
#   2. CPU launch cost per op (hoccl and NCCL), --no-check  -> $OUT/launch.{json,log}
#   3. GEMM interference (cuBLAS bf16 8192^3 alone / + hoccl / + NCCL AllGather 256M)
#                                                            -> $OUT/interference.{json,log}
#   4. plot of busbw against size                            -> $OUT/bench.png
# Runs 2 and 3 launch no verification fill, so their last lines show whether hoccl's kernel
# module was ever loaded (it must not be: the collectives are copy-engine only).
#
# One rank per GPU when there are >= 2 GPUs; 4 ranks sharing the one GPU otherwise (NCCL
# refuses shared GPUs, so its columns are then skipped with a message). Expected time:
# ~2 minutes on one GPU, ~3-4 minutes on 4 GPUs with NCCL; every step has a time limit so
# the whole script stays under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN="${BENCH_BIN:-carry/bench}"
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
if [ ! -x "$BIN" ]; then
  echo "bench.sh: $BIN not found or not executable (copy target/release/examples/bench there)" >&2
  exit 2
fi

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
# ob1 over shared memory: the bootstrap's few messages never go through UCX (which would
# touch CUDA itself); the collectives' data never goes through MPI at all.
export OMPI_MCA_pml="${OMPI_MCA_pml:-ob1}" OMPI_MCA_oob_tcp_if_include="${OMPI_MCA_oob_tcp_if_include:-lo}"
export NCCL_NVLS_ENABLE=0
export HOCCL_LOG="${HOCCL_LOG:-warn}"

# NCCL and cuBLAS from the torch venv's pip packages (the binary also searches these).
sp=/opt/torch/.venv/lib/python3.12/site-packages
if [ -z "${HOCCL_NCCL_LIB:-}" ]; then
  for f in "$sp/nvidia/nccl/lib/libnccl.so.2" "$sp/nvidia/cu13/lib/libnccl.so.2"; do
    [ -e "$f" ] && { export HOCCL_NCCL_LIB="$f"; break; }
  done
  [ -z "${HOCCL_NCCL_LIB:-}" ] && f=$(find /opt /usr/local -name libnccl.so.2 2>/dev/null | head -n1) && [ -n "$f" ] && export HOCCL_NCCL_LIB="$f"
fi
if [ -z "${HOCCL_CUBLAS_LIB:-}" ]; then
  for f in "$sp/nvidia/cublas/lib/libcublas.so.13" "$sp/nvidia/cu13/lib/libcublas.so.13" /usr/local/cuda/lib64/libcublas.so.13; do
    [ -e "$f" ] && { export HOCCL_CUBLAS_LIB="$f"; break; }
  done
fi

ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
ngpu=${ngpu:-0}
if [ "$ngpu" -ge 2 ]; then np=$ngpu; else np=4; fi
{
  echo "bench.sh: $(date -u +%FT%TZ), $ngpu GPU(s), $np ranks"
  echo "NCCL: ${HOCCL_NCCL_LIB:-<search>}  cuBLAS: ${HOCCL_CUBLAS_LIB:-<search>}"
  nvidia-smi --query-gpu=index,name,pci.bus_id,clocks.sm,clocks.max.sm --format=csv 2>&1
  nvidia-smi topo -m 2>&1
} | tee "$OUT/machine.log"

status=0
step() { # step NAME LIMIT_S ARGS... : one mpirun with a time limit, logged to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name: mpirun -np $np $BIN $*" | tee "$OUT/$name.log"
  timeout --signal=TERM --kill-after=15 "$limit" \
    mpirun --oversubscribe --bind-to none -np "$np" "$BIN" "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

step bench_table 270 --compare nccl --json "$OUT/bench.json"
step launch 60 --no-table --launch-cost --compare nccl --no-check --json "$OUT/launch.json"
step interference 120 --no-table --interference --compare nccl --no-check --json "$OUT/interference.json"
if [ "$ngpu" -lt 2 ]; then
  # Several processes on one GPU time-slice its contexts, which slows any GEMM whatever the
  # collective does; one rank (its AllGather is a local copy-engine copy) isolates what the
  # copy engines' traffic alone costs the GEMM.
  np_all=$np; np=1
  step interference_1rank 90 --no-table --interference --no-check --json "$OUT/interference_1rank.json"
  np=$np_all
fi

py=python3
python3 -c 'import matplotlib' 2>/dev/null || py=/opt/torch/.venv/bin/python3
if [ -s "$OUT/bench.json" ]; then
  "$py" scripts/plot_bench.py "$OUT/bench.json" -o "$OUT/bench.png" 2>&1 | tee "$OUT/plot.log" || status=1
else
  echo "bench.sh: no $OUT/bench.json, no plot" | tee "$OUT/plot.log"
  status=1
fi
echo "bench.sh: done in $SECONDS s, status $status; results in $OUT"
exit $status
