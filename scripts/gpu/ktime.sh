#!/usr/bin/env bash
# Durations of the codec kernels one by one (Nsight Compute's gpu__time_duration; clocks
# left alone, as METHOD.md asks), while examples/codec_bench runs one size at a time. ncu
# serializes the launches, so each figure is one kernel alone: its own ramp and tail, no
# launch gap. The benchmark's time per call minus these is what lies between the kernels.
# GPU machine, repository root, carry/ unpacked. Writes $OUT/ktime.txt.
#   KTIME_SIZES ("64M 256M 1G"), KTIME_TIERS ("2 1"), KTIME_KERNELS (names without
#   hoccl_bfx_), HOCCL_KERNELS (a fatbin to use)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/hoccl-ktime}; mkdir -p "$out"
command -v ncu >/dev/null || { echo "ktime.sh: no ncu on this machine" >&2; exit 2; }
log=$out/ktime.txt
: > "$log"
for tiers in ${KTIME_TIERS:-2 1}; do
  for size in ${KTIME_SIZES:-64M 256M 1G}; do
    for k in ${KTIME_KERNELS:-compress_begin compress_bf16_8 decompress_begin decompress_bf16}; do
      # skip the round-trip check's launch; five timed launches, median
      timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --csv -k "regex:hoccl_bfx_$k\$" \
        --launch-skip 1 --launch-count 5 \
        carry/codec_bench --tiers "$tiers" --min-size "$size" --max-size "$size" > "$out/raw-$k-$tiers-$size.csv" 2>&1
      python3 - "$k" "$size" "$tiers" "$out/raw-$k-$tiers-$size.csv" <<'PY' | tee -a "$log"
import csv, sys
k, size, tiers, f = sys.argv[1:5]
rows = [r for r in csv.reader(open(f)) if len(r) > 5]
hdr = [i for i, r in enumerate(rows) if "Metric Value" in r]
if not hdr:
    print(f"{k:18s} tiers {tiers} {size:>5s}: no rows"); sys.exit()
h = rows[hdr[0]]; iv = h.index("Metric Value"); iu = h.index("Metric Unit")
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
us = sorted(float(r[iv].replace(",", "")) * scale[r[iu]] for r in rows[hdr[0] + 1:] if len(r) > iv)
print(f"{k:18s} tiers {tiers} {size:>5s}: median {us[len(us)//2]:9.2f} us  (min {us[0]:.2f}, max {us[-1]:.2f}, n {len(us)})")
PY
    done
  done
done
