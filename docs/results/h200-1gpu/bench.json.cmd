# 2026-12-01T23:00:02Z, binaries of commit fcf094d, 1 GPU(s) (h200-1gpu)
mpirun --oversubscribe --bind-to none -np 4 $HOCCL_BIN_DIR/bench --compare nccl --json docs/results/h200-1gpu/bench.json
