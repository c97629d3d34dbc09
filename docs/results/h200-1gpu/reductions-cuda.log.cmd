# 2026-12-04T03:45Z, binaries of commit 0950672, 1 GPU(s) (h200-1gpu); HOCCL_LOG=warn
$HOCCL_BIN_DIR/tests/reductions cuda:: --ignored --test-threads=1
