# 2026-12-01T22:16:10Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu)
mpirun --oversubscribe --bind-to none -np 4 $HOCCL_BIN_DIR/bench --no-table --launch-cost --compare nccl --no-check --json docs/results/h200-1gpu/launch.json
