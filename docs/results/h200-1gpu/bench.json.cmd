# 2026-12-01T22:15:57Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu), from /work/main
mpirun --oversubscribe --bind-to none -np 4 /work/main/carry/bench --compare nccl --json /work/main/docs/results/h200-1gpu/bench.json
