# 2026-12-01T23:00:02Z, binaries of commit fcf094d, 1 GPU(s) (h200-1gpu)
nvidia-smi --query-gpu=index,name,pci.bus_id,clocks.sm,clocks.max.sm --format=csv; nvidia-smi topo -m
