# 2026-12-02T02:56:23Z, binaries of commit 6f9ac7d, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/codec_bench --json-out docs/results/h200-1gpu/codec-bench-bf16.json
