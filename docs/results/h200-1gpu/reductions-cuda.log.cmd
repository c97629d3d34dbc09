# 2026-12-04T06:08Z, binaries of commit c805f1c, 1 GPU(s) (h200-1gpu); HOCCL_LOG=warn
$HOCCL_BIN_DIR/tests/reductions cuda:: --ignored --test-threads=1
