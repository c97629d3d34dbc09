# 2026-12-02T17:15Z, binaries of commit 8acdf75, 1 GPU (h200-1gpu)
SANITIZE_LIMIT=60 bash scripts/gpu/sanitize.sh
compute-sanitizer --tool racecheck --error-exitcode 86 --print-limit 20 $HOCCL_BIN_DIR/tests/reduce_kernels --ignored --exact fused::fused_reduce_random_sizes_alignments_and_raw_blocks --test-threads=1   # 280 s limit
