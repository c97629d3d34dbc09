# 2026-12-01T23:00:28Z, binaries of commit fcf094d, 1 GPU(s) (h200-1gpu)
mpirun --oversubscribe --bind-to none -np 1 $HOCCL_BIN_DIR/bench --no-table --interference --no-check --json docs/results/h200-1gpu/interference_1rank.json
