# 2026-12-01T22:15:54Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/codec_bench --json --fixture tests/data/minilm-weight-l3-ffn-in.bf16 --min-size 1M --max-size 256M
