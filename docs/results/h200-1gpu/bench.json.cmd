# 2026-12-01T22:15:57Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu)
mpirun --oversubscribe --bind-to none -np 4 $HOCCL_BIN_DIR/bench --compare nccl --json docs/results/h200-1gpu/bench.json
