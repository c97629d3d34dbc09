# 2026-12-01T22:15:57Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu)
nvidia-smi --query-gpu=index,name,pci.bus_id,clocks.sm,clocks.max.sm --format=csv; nvidia-smi topo -m
