# 2026-12-02T13:42Z, binaries of commit fdb601e, 1 GPU(s) (h200-1gpu)
compute-sanitizer --tool memcheck|racecheck --error-exitcode 86 $HOCCL_BIN_DIR/tests/fused_drc --ignored --exact TEST --test-threads=1
