# 2026-12-01T22:16:23Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu), from /work/main
mpirun --oversubscribe --bind-to none -np 1 /work/main/carry/bench --no-table --interference --no-check --json /work/main/docs/results/h200-1gpu/interference_1rank.json
