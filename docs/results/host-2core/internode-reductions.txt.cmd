# 2026-12-02T15:57:32Z, commit 9a8e283, HOCCL_NO_CUDA=1 cargo build --release --example net_bench
source scripts/mpi-env.sh
for peers in '' 0,0; do for g in 0.25 0.05; do env HOCCL_VIRTUAL_NODES=2 HOCCL_NET_GBPS=$g HOCCL_ENGINE=ce HOCCL_BACKEND=host HOCCL_FORWARDING=1 HOCCL_FORWARDING_PEERS=$peers HOCCL_LOG=warn "${HOCCL_MPIRUN[@]}" -np 4 target/release/examples/net_bench --iters 5 --ops allreduce,allreduce-flat --sizes 4M,16M; done; done
for rep in 1 2 3; do for peers in '' 0,0; do env HOCCL_VIRTUAL_NODES=2 HOCCL_NET_GBPS=0.05 HOCCL_ENGINE=ce HOCCL_BACKEND=host HOCCL_FORWARDING=1 HOCCL_FORWARDING_PEERS=$peers HOCCL_LOG=warn "${HOCCL_MPIRUN[@]}" -np 4 target/release/examples/net_bench --iters 5 --ops allreduce --sizes 4M,16M; done; done
