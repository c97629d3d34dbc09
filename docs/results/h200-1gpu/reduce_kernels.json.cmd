# 2026-12-02T02:57:15Z, binaries of commit 6f9ac7d, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/reduce_bench --json-out docs/results/h200-1gpu/reduce_kernels.json
