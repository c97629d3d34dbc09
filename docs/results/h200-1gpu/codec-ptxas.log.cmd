# 2026-12-02T02:55:51Z, binaries of commit 6f9ac7d, 1 GPU(s) (h200-1gpu)
bash scripts/gpu/build.sh (ptxas.log of the kernels' build, copied)
