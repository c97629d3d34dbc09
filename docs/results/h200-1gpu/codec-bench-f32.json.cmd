# 2026-12-01T22:15:50Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/codec_bench --json --dtype f32 --min-size 1M --max-size 256M
