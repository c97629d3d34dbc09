# 2026-12-04T01:16Z, binaries of commit 3dc6379, 1 GPU(s) (h200-1gpu); HOCCL_LOG=warn
$HOCCL_BIN_DIR/tests/internode cuda:: --ignored --test-threads=1
