#!/usr/bin/env bash
# Runs on the H200 machine, from the repository root, with binaries packed by
# scripts/gpu/pack.sh into carry/:
# every test executable with the GPU tests included (host-backend tests run too), then
# the demo under mpirun with 4 ranks (several ranks per GPU when fewer GPUs exist).
# CORE_SKIP="name ..." leaves those test executables out.
# Logs go to $OUT.
set -u
cd "$(dirname "$0")/../.."   # repository root; binaries in carry/
OUT=${OUT:-/tmp/hoccl-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 HOCCL_LOG=${HOCCL_LOG:-warn} RUST_BACKTRACE=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader \
       OMPI_MCA_btl_vader_single_copy_mechanism=none
nvidia-smi -L | tee "$OUT/gpus.txt"
[ -x carry/hoccl-info ] && carry/hoccl-info > "$OUT/hoccl-info.txt" 2>&1
status=0
export HOCCL_TEST_DATA=$PWD/tests/data
for t in carry/tests/*; do
  n=$(basename "$t")
  case "$n" in
    codec_*) continue ;;   # scripts/gpu/codec.sh runs those
    plan_cli|zip_cli) continue ;;  # exec the build machine's target/ paths; CPU-only anyway
  esac
  case " ${CORE_SKIP:-} " in *" $n "*) echo "test $n: skipped (CORE_SKIP)"; continue ;; esac
  # Host-backend and plain tests first, then the same bodies on CUDA (the ignored ones).
  for mode in host cuda; do
    args=(--test-threads=1); [ $mode = cuda ] && args+=(--ignored)
    timeout "${TEST_LIMIT:-150}" "$t" "${args[@]}" > "$OUT/test-$n-$mode.log" 2>&1
    rc=$?; [ $rc = 0 ] || status=1
    echo "test $n ($mode): rc=$rc $(grep -E '^test result' "$OUT/test-$n-$mode.log" | tail -1)"
    grep -E "^test .*FAILED|panicked at" "$OUT/test-$n-$mode.log" | head -4
  done
done
for t in carry/cpp/*_check carry/cpp/allgather_demo; do
  [ -x "$t" ] || continue
  for np in 2 4; do
    HOCCL_TIMEOUT_MS=30000 timeout 120 mpirun --oversubscribe -np $np "$t" > "$OUT/cpp-$(basename "$t")-np$np.log" 2>&1
    rc=$?; [ $rc = 0 ] || status=1
    echo "c++ $(basename "$t") np=$np: rc=$rc"
  done
done
# Many streams waiting on collectives at once, one rank per process (README "Hardware queues").
for np in 2 4; do
  timeout 150 mpirun --oversubscribe -np $np carry/streams_check --streams 1,4,16,32,64 > "$OUT/streams-np$np.log" 2>&1
  rc=$?; [ $rc = 0 ] || status=1
  echo "streams_check np=$np: rc=$rc"; tail -6 "$OUT/streams-np$np.log"
done
timeout 200 mpirun --oversubscribe -np 4 carry/demo ${DEMO_ARGS:-} > "$OUT/demo.log" 2>&1; rc=$?
[ $rc = 0 ] || status=1
echo "demo: rc=$rc"; cat "$OUT/demo.log" | tail -30
exit $status
