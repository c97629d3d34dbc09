# 2026-12-01T22:15:39Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/codec_bench --json --tiers 1 --min-size 1M
