# 2026-12-02T02:56:49Z, binaries of commit 6f9ac7d, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/codec_bench --json --fixture tests/data/minilm-weight-l3-ffn-in.bf16 --min-size 1M --max-size 256M
