#!/usr/bin/env bash
# A/B of kernel variants on the device: carry/kernels/NAME.fatbin for NAME in $VARS (built here
# by `scripts/gpu/variants.sh build NAME "-DFLAGS"` after `scripts/gpu/pack.sh`; copy this file
# to carry/ab.sh, since it runs from carry/). Each round runs codec_bench for every tier mode in
# TIERS (2 1) and every variant in turn, so the variants of one call share the machine's state.
# ROUNDS (2), MINSIZE (256M), MAXSIZE (1G), TESTV (1: the GPU codec tests on TVARS, default
# VARS), DT (dtypes at 256 MiB, tiers DTT); writes $OUT/ab.txt, tests.txt, smi.txt.
set -u
cd "$(dirname "$0")/.."
[ -f carry/bundle.txz ] && tar xJf carry/bundle.txz -C carry && rm -f carry/bundle.txz
export NCCL_NVLS_ENABLE=0 HOCCL_TEST_DATA=$PWD/tests/data
O=${OUT:-/tmp/ab}; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee $O/smi.txt
if [ "${TESTV:-1}" = 1 ]; then
  for v in ${TVARS:-$VARS}; do
    echo "== tests $v: $(HOCCL_KERNELS=$PWD/carry/kernels/$v.fatbin timeout 90 carry/codec_cuda --ignored --test-threads=1 2>&1 | grep -E 'test result|FAILED|panicked' | tr '\n' ' ')"
  done | tee $O/tests.txt
fi
for r in $(seq 1 ${ROUNDS:-2}); do
  for t in ${TIERS:-2 1}; do
    for v in $VARS; do
      echo "== round $r tiers $t $v"
      HOCCL_KERNELS=$PWD/carry/kernels/$v.fatbin timeout 60 carry/codec_bench --tiers $t --min-size ${MINSIZE:-256M} --max-size ${MAXSIZE:-1G} 2>&1 | tail -n +2
    done
  done
  if [ -n "${DT:-}" ]; then
    for d in $DT; do for v in $VARS; do
      echo "== round $r $d $v"
      HOCCL_KERNELS=$PWD/carry/kernels/$v.fatbin timeout 60 carry/codec_bench --dtype $d --tiers ${DTT:-2} --min-size 256M --max-size 256M 2>&1 | tail -n +2
    done; done
  fi
done 2>&1 | tee $O/ab.txt
