#!/usr/bin/env bash
# Hardware counters of the codec kernels (Nsight Compute; clocks left alone, as METHOD.md
# asks) while examples/codec_bench runs one size. GPU machine, repository root, carry/
# unpacked (all.sh does it). Writes $OUT/ncu-<kernel>-<tiers>tier.txt.
#   PROFILE_SIZE (256M), PROFILE_KERNELS (kernel names without hoccl_bfx_), PROFILE_TIERS,
#   HOCCL_KERNELS (a fatbin to use), PROFILE_FULL=0 (skip the --set full reports)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/hoccl-profile}; mkdir -p "$out"
size=${PROFILE_SIZE:-256M}
command -v ncu >/dev/null || { echo "profile.sh: no ncu on this machine" >&2; exit 2; }
for tiers in ${PROFILE_TIERS:-2 1}; do
  [ "${PROFILE_FULL:-1}" = 0 ] && break  # only the per-instruction report below
  for k in ${PROFILE_KERNELS:-compress_bf16_8 decompress_bf16}; do
    f="$out/ncu-$k-${tiers}tier.txt"
    # skip the round-trip check's launch; profile one timed launch
    timeout 120 ncu --clock-control none --set full -k "regex:hoccl_bfx_$k\$" --launch-skip 1 --launch-count 1 \
      carry/codec_bench --tiers "$tiers" --min-size "$size" --max-size "$size" > "$f" 2>&1
    echo "== $k tiers $tiers: rc=$?"
    grep -E "Duration|DRAM Throughput|Issue Slots Busy|Achieved Occupancy|Executed Instructions  |No Eligible|Warp Cycles Per Issued|Registers Per|Block Limit" "$f" | head -12
  done
done
# PROFILE_SOURCE=FATBIN (a build with -lineinfo): per-source-line executed instructions and
# stall samples (SourceCounters) of each kernel, as CSV: $OUT/src-<kernel>-<tiers>tier.csv.
if [ -n "${PROFILE_SOURCE:-}" ]; then
  # -lineinfo names the build machine's paths; point them at this checkout
  [ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
  for tiers in ${PROFILE_TIERS:-2 1}; do
    for k in ${PROFILE_KERNELS:-compress_bf16_8 decompress_bf16}; do
      rep="$out/src-$k-${tiers}tier"
      HOCCL_KERNELS=$PWD/$PROFILE_SOURCE timeout 120 ncu --clock-control none --section SourceCounters --section InstructionStats \
        --import-source yes -k "regex:hoccl_bfx_$k\$" --launch-skip 1 --launch-count 1 -f -o "$rep" \
        carry/codec_bench --tiers "$tiers" --min-size "$size" --max-size "$size" > "$rep.log" 2>&1
      echo "== source $k tiers $tiers: rc=$?"
      # per SASS instruction (address, executed count, stall samples): map it back to source
      # lines on the build machine with scripts/gpu/srcprof.py FATBIN KERNEL CSV
      ncu -i "$rep.ncu-rep" --page source --print-source sass --csv > "$rep.csv" 2>> "$rep.log" \
        || ncu -i "$rep.ncu-rep" --page source --csv > "$rep.csv" 2>> "$rep.log"
      wc -l "$rep.csv"; rm -f "$rep.ncu-rep"
    done
  done
fi
