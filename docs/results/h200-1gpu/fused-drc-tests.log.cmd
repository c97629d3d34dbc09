# 2026-12-02T13:42Z, binaries of commit fdb601e, 1 GPU(s) (h200-1gpu); the first command ran without HOCCL_TEST_DATA (cuda_real_fixtures could not open its fixture), the second with it
$HOCCL_BIN_DIR/tests/fused_drc --ignored --test-threads=1
HOCCL_TEST_DATA=$PWD/tests/data $HOCCL_BIN_DIR/tests/fused_drc --ignored cuda_real_fixtures --test-threads=1
