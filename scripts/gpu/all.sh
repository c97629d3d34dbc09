#!/usr/bin/env bash
# One GPU-machine session: run the given sub-scripts (default: core bench) from the
# repository root with binaries in carry/, each writing into its own folder, then pack every
# log into $OUT/logs.tgz (the device tool returns at most 8 files) and copy the key results
# (bench.json, bench.png, summary) beside it.
#   bash scripts/gpu/all.sh [core] [bench] [codec] [device]
set -u
cd "$(dirname "$0")/../.."
FINAL=${OUT:-/tmp/hoccl-final}; mkdir -p "$FINAL"
# pack.sh ships carry/ as one bundle (the device tool's 64 MiB limit)
[ -f carry/bundle.txz ] && tar xJf carry/bundle.txz -C carry && rm -f carry/bundle.txz
W=$(mktemp -d /tmp/hoccl-run.XXXX)
export NCCL_NVLS_ENABLE=0
parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(core bench)
status=0
for p in "${parts[@]}"; do
  mkdir -p "$W/$p"
  t0=$SECONDS
  limit_var="LIMIT_$p"; limit=${!limit_var:-300}
  OUT="$W/$p" timeout "$limit" bash "scripts/gpu/$p.sh" > "$W/$p/console.log" 2>&1; rc=$?
  [ $rc = 0 ] || status=1
  echo "=== $p: rc=$rc in $((SECONDS - t0)) s" | tee -a "$W/summary.txt"
  tail -n "${TAIL:-25}" "$W/$p/console.log" | tee -a "$W/summary.txt"
done
tar czf "$FINAL/logs.tgz" -C "$W" .
for f in bench/bench.json bench/bench.png summary.txt codec/bench-bf16.json codec/summary.txt; do
  [ -f "$W/$f" ] && cp "$W/$f" "$FINAL/$(dirname "$f" | tr / _)_$(basename "$f")"
done
exit $status
