# 2026-12-04T06:06Z, binaries of commit 3e59c20, 1 GPU(s) (h200-1gpu); HOCCL_LOG=warn
$HOCCL_BIN_DIR/tests/internode cuda:: --ignored --test-threads=1
