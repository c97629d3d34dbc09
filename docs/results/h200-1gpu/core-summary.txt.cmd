# 2026-12-01T22:55:43Z, binaries of commit fcf094d, 1 GPU(s) (h200-1gpu)
bash scripts/gpu/core.sh
