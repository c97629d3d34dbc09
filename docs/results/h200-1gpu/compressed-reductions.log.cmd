# 2026-12-02T03:34:32Z, binaries of commit 73df9ff+changes, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/tests/compressed --ignored cuda::reductions --test-threads=1
