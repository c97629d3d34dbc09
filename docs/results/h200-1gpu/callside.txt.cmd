# 2026-12-02T09:41:59Z, probes compiled from scripts/gpu/*_probe.c as committed with this file, 1 GPU(s) (h200-1gpu)
bash scripts/gpu/driverlock.sh (under MPS: callside_probe staged|direct BYTES N 4)
