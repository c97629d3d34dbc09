# 2026-12-02T03:34:48Z, binaries of commit 73df9ff+changes, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/codec_bench --min-size 256M --max-size 256M
