# 2026-12-01T22:15:57Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu)
bash scripts/gpu/codec.sh
