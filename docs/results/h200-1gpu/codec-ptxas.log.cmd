# 2026-12-01T22:14:59Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu)
bash scripts/gpu/build.sh (ptxas.log of the kernels' build, copied)
