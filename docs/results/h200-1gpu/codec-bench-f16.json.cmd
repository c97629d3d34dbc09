# 2026-12-02T02:56:41Z, binaries of commit 6f9ac7d, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/codec_bench --json --dtype f16 --min-size 1M --max-size 256M
