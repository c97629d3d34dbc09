# 2026-12-02, binaries of commit 5cd5740, 1 GPU (h200-1gpu)
HOCCL_LOG=warn build/gpu-bin/tests/reductions --ignored --test-threads=1
