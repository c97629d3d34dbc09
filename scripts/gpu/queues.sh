#!/usr/bin/env bash
# The hardware-queue failures of several ranks in one CUDA context (README, Known limits;
# docs/results/h200-1gpu/queues-twentysixth.txt), on the GPU machine from carry/:
#   1. the thread-rank CUDA collectives binary RUNS times each: without the tests'
#      allocation barrier (the default) and with it (HOCCL_TEST_ALLOC_BARRIER=1);
#   2. examples/queue_probe: a blocked stream, then fresh and recycled (CHURN) queues and
#      streams with a copy / a fill kernel each: what runs behind it;
#   3. examples/wait_probe: 16-64 streams waiting on a host flag or an event, then copies;
#   4. wait_probe race, a kernel enqueued while other threads enqueue waits: a device per
#      thread (the enqueue gate closes by itself) and one shared device (it stays open
#      unless HOCCL_SERIAL_ENQUEUE=1), each with and without the gate.
# Each failing run's log (every rank's state at its first failure) is kept in $OUT/fails.
# Up to ~5 min with RUNS=10 (a failing run takes ~11 s):
#   LIMIT_queues=400 bash scripts/gpu/all.sh queues     (or: OUT=dir bash scripts/gpu/queues.sh)
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/hoccl-out}; mkdir -p "$OUT/fails"
export NCCL_NVLS_ENABLE=0 HOCCL_TEST_DATA=$PWD/tests/data
status=0
for mode in default barrier; do
  ok=0
  for i in $(seq 1 "${RUNS:-10}"); do
    L=$OUT/fails/$mode-$i.log
    if [ $mode = barrier ]; then export HOCCL_TEST_ALLOC_BARRIER=1; else unset HOCCL_TEST_ALLOC_BARRIER; fi
    timeout 60 carry/tests/collectives --ignored --test-threads=1 > "$L" 2>&1; rc=$?
    if [ $rc = 0 ]; then ok=$((ok + 1)); rm -f "$L"; else
      status=1
      echo "  $mode run $i: rc=$rc $(grep -m1 ERROR "$L" | cut -c1-140)"
    fi
  done
  unset HOCCL_TEST_ALLOC_BARRIER
  echo "thread-rank collectives ($mode): $ok of ${RUNS:-10} runs ok"
done
for args in "3 3 3" "16 16 16" "16 16 16 200" "40 40 40"; do
  echo "queue_probe $args:"
  timeout 30 carry/queue_probe $args 2>&1 | sed 's/^/  /'
done
# How many waiting streams stop the driver or the copies (twenty-seventh session: with 32
# queues 30 were fine and the 32nd blocked its enqueue, flag or event alike; with 8 queues
# 8 stopped the copies).
for args in "flag 16" "flag 30" "flag 32" "event 32" "event 64"; do
  echo "wait_probe $args:"
  timeout 20 carry/wait_probe $args 2>&1 | sed 's/^/  /'
done
echo "wait_probe flag 8, 8 queues:"
CUDA_DEVICE_MAX_CONNECTIONS=8 timeout 20 carry/wait_probe flag 8 2>&1 | sed 's/^/  /'
# Twenty-eighth session: without the gate ~1 round in 10 stalls; with it none should.
for run in "auto 1" "0 1" "auto 0" "1 0"; do
  set -- $run
  echo "wait_probe race 200 3 $2, HOCCL_SERIAL_ENQUEUE=$1:"
  HOCCL_SERIAL_ENQUEUE=$1 timeout 150 carry/wait_probe race 200 3 $2 2>&1 | tail -n 2 | sed 's/^/  /'
done
exit $status
