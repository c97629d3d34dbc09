# 2026-12-02T02:57:19Z, binaries of commit 6f9ac7d, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/codec_bench --min-size 256M --max-size 256M
