# 2026-12-02T09:11:48Z, binaries of commit fcea19c, 1 GPU(s) (h200-1gpu)
CORE_SKIP="<every test binary but shrink tcp_bootstrap watchdog zero_sm> collectives" CORE_MODES=cuda TEST_LIMIT=90 bash scripts/gpu/all.sh core   (the parts of core that the run in core-summary.txt did not reach)
