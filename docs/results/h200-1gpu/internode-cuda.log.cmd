# 2026-12-04T09:44Z, binaries of commit 2cf71ad, 1 GPU(s) (h200-1gpu); HOCCL_LOG=warn (cuda::relays ran in relays-cuda.log)
$HOCCL_BIN_DIR/tests/internode cuda:: --ignored --test-threads=1 --skip cuda::relays
