# 2026-12-02T13:05Z, binaries of commit 0146afe, 1 GPU(s) (h200-1gpu)
HOCCL_LOG=warn HOCCL_TIMEOUT_MS=20000 $HOCCL_BIN_DIR/tests/graphs --ignored --test-threads=1
