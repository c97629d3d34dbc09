# 2026-12-02T06:55:49Z, binaries of commit 93210a5, 1 GPU(s) (h200-1gpu); the part ran under a 250 s limit, which stopped it after reduce_kernels (reductions' CUDA bodies: reductions-cuda.log)
CORE_MODES=cuda TEST_LIMIT=90 LIMIT_core=250 bash scripts/gpu/all.sh core
