# 2026-12-02T04:04:00Z, binaries of commit 6fac19e, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/tests/compressed --include-ignored cuda:: --test-threads=1
