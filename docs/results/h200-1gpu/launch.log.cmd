# 2026-12-01T22:16:10Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu), from /work/main
mpirun --oversubscribe --bind-to none -np 4 /work/main/carry/bench --no-table --launch-cost --compare nccl --no-check --json /work/main/docs/results/h200-1gpu/launch.json
