# 2026-12-01T22:11:16Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu)
bash scripts/gpu/core.sh
