# 2026-12-02T09:41:15Z, probes compiled from scripts/gpu/*_probe.c as committed with this file, 1 GPU(s) (h200-1gpu)
bash scripts/gpu/driverlock.sh (driver_lock_probe MODE [ctx2] for each mode, without and with MPS)
