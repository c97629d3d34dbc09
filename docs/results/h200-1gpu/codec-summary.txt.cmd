# 2026-12-02T02:56:52Z, binaries of commit 6f9ac7d, 1 GPU(s) (h200-1gpu)
bash scripts/gpu/codec.sh
