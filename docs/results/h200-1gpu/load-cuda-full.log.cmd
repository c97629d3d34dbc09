# 2026-12-02T16:00Z, binaries of commit 536c2c0, 1 GPU (h200-1gpu), 4 thread ranks in one process
HOCCL_STRESS=full HOCCL_LOG=warn $HOCCL_BIN_DIR/tests/load --ignored --test-threads=1 --nocapture
