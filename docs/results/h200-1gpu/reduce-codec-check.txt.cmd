# 2026-12-02T00:22:20Z, binaries of commit 4cb0f45, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/codec_bench --min-size 256M --max-size 256M
