# 2026-12-02T02:56:46Z, binaries of commit 6f9ac7d, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/codec_bench --json --dtype f32 --min-size 1M --max-size 256M
