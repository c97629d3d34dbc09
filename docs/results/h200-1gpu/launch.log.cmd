# 2026-12-01T23:00:14Z, binaries of commit fcf094d, 1 GPU(s) (h200-1gpu)
mpirun --oversubscribe --bind-to none -np 4 $HOCCL_BIN_DIR/bench --no-table --launch-cost --compare nccl --no-check --json docs/results/h200-1gpu/launch.json
