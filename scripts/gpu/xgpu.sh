#!/usr/bin/env bash
# Correctness across GPUs (one rank per GPU, peers over NVLink): the C++ collective and
# error checks and the demo under mpirun with as many ranks as GPUs. GPU machine with 2+
# GPUs, repository root, carry/ unpacked (all.sh). Logs to $OUT.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/hoccl-xgpu}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 HOCCL_LOG=${HOCCL_LOG:-warn} HOCCL_TIMEOUT_MS=30000
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader \
       OMPI_MCA_btl_vader_single_copy_mechanism=none
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${ngpu:-0}" -ge 2 ] || { echo "xgpu.sh: needs 2+ GPUs, found ${ngpu:-0}"; exit 2; }
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
status=0
for t in carry/cpp/collectives_check carry/cpp/errors_check carry/demo; do
  [ -x "$t" ] || { echo "xgpu.sh: $t missing"; status=1; continue; }
  timeout 150 mpirun --oversubscribe --bind-to none -np "$ngpu" "$t" > "$OUT/$(basename "$t")-np$ngpu.log" 2>&1
  rc=$?; [ $rc = 0 ] || status=1
  echo "$(basename "$t") np=$ngpu: rc=$rc"; tail -4 "$OUT/$(basename "$t")-np$ngpu.log"
done
exit $status
