# 2026-12-02T17:12Z, binaries of commit 8acdf75, 1 GPU (h200-1gpu)
HOCCL_LOG=warn HOCCL_TIMEOUT_MS=20000 $HOCCL_BIN_DIR/tests/stale_imports --ignored --test-threads=1 --nocapture
