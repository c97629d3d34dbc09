# 2026-12-02T01:06:46Z, binaries of commit cdc0e54, 1 GPU(s) (h200-1gpu)
bash scripts/gpu/core.sh
