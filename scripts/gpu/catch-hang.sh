#!/usr/bin/env bash
# On the GPU machine: run a command up to RUNS times with carry/stacks/libbt.so preloaded;
# when its output shows PATTERN (default: a logged ERROR) or it runs past LIMIT seconds,
# wait 3 s, record every thread's state (/proc) and backtrace (SIGUSR2 via carry/stacks/tgk),
# kill it and keep the log. Symbolize on the build machine with scripts/gpu/symbolize.sh.
#   RUNS=4 PATTERN=ERROR LIMIT=80 bash scripts/gpu/catch-hang.sh carry/tests/collectives --ignored --test-threads=1
# Output in $OUT: hang-N.log.gz (the output with the backtraces), tasks-N.txt.
set -u
cd "$(dirname "$0")/../.."
[ -f carry/bundle.txz ] && tar xJf carry/bundle.txz -C carry && rm -f carry/bundle.txz
O=${OUT:-/tmp/hoccl-out}; mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 RUST_BACKTRACE=1 HOCCL_TEST_DATA=$PWD/tests/data
for i in $(seq 1 "${RUNS:-4}"); do
  L=$O/hang-$i.log
  LD_PRELOAD=$PWD/carry/stacks/libbt.so "$@" > "$L" 2>&1 &
  P=$!
  t=0; caught=0
  while kill -0 $P 2>/dev/null; do
    if grep -q "${PATTERN:-ERROR}" "$L" || [ $t -ge $((2 * ${LIMIT:-80})) ]; then caught=1; break; fi
    sleep 0.5; t=$((t + 1))
  done
  if [ $caught = 1 ]; then
    sleep 3
    if ! kill -0 $P 2>/dev/null; then
      # It ended by itself (a timeout is an error now, not a hang): the log, with each
      # rank's state at its first failure, is what there is.
      wait $P; echo "run $i: failed and exited (rc=$?): $(grep -m1 "${PATTERN:-ERROR}" "$L" | cut -c1-150)"
      gzip -f "$L"
      continue
    fi
    for d in /proc/$P/task/*; do
      echo "$(basename "$d") $(cat "$d/comm") state=$(awk '{print $3}' "$d/stat") wchan=$(cat "$d/wchan")"
    done > "$O/tasks-$i.txt"
    carry/stacks/tgk $P; sleep 1
    kill -9 $P; wait $P 2>/dev/null
    echo "run $i: caught: $(grep -m1 "${PATTERN:-ERROR}" "$L" | cut -c1-150)"
    gzip -f "$L"
    continue
  fi
  wait $P; rc=$?
  echo "run $i: rc=$rc $(grep -E '^test result' "$L" | tail -1)"
  rm -f "$L"
done
