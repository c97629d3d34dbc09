// allgather_demo: what a C++ engine does with hoccl. One communicator over MPI_COMM_WORLD,
// buffers and a stream from its device, then AllGather of bf16 data (as raw 16-bit patterns)
// over a range of sizes; every result is checked on every rank and rank 0 prints times in
// nccl-tests' terms. Exits non-zero on any wrong element or error.
//
//   mpirun -np 4 ./allgather_demo [max_bytes_per_rank]      (default 4 MiB)
//
// HOCCL_BACKEND=host runs it without a GPU; with CUDA the same code drives the GPUs.
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <hoccl/hoccl.hpp>

namespace {

// The bf16 bit pattern rank r contributes at element i (any function of (r, i) will do).
std::uint16_t element(int rank, std::size_t i) {
  return static_cast<std::uint16_t>(0x3F80u + ((static_cast<std::uint32_t>(rank) * 7919u + i * 31u) & 0x7Fu));
}

struct Result {
  double seconds = 0;
  long wrong = 0;
};

// One size: upload this rank's block, AllGather `iters` times, check the last result.
Result run(hoccl::Communicator& comm, const hoccl::Device& dev, hoccl::Stream s, std::size_t count, int iters) {
  const int rank = comm.rank(), size = comm.size();
  const std::size_t bytes = count * sizeof(std::uint16_t);
  void* send = dev.alloc(bytes);
  void* recv = dev.alloc(bytes * size);
  std::vector<std::uint16_t> host(count * size);
  for (std::size_t i = 0; i < count; ++i) host[i] = element(rank, i);
  dev.copyFromHost(send, host.data(), bytes);

  Result r;
  MPI_Barrier(MPI_COMM_WORLD);
  auto t0 = std::chrono::steady_clock::now();
  for (int it = 0; it < iters; ++it) comm.allGather(send, recv, count, hoccl::DataType::Bfloat16, s);
  dev.synchronize(s);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;

  dev.copyToHost(host.data(), recv, bytes * size);
  for (int p = 0; p < size; ++p)
    for (std::size_t i = 0; i < count; ++i) r.wrong += host[p * count + i] != element(p, i);
  dev.free(send);
  dev.free(recv);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0, rank = 0, size = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) return 2;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const std::size_t max_bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 0) : (std::size_t{4} << 20);
  long wrong = 0;
  int failed = 0;
  try {
    hoccl::Communicator comm(MPI_COMM_WORLD);
    hoccl::Device dev = comm.device();
    hoccl::Stream s = dev.createStream();
    if (rank == 0)
      std::printf("hoccl %s allgather_demo: %d ranks, %s backend (%s)\n%12s %12s %12s %12s %12s\n",
                  hoccl::version().c_str(), size, dev.backend().c_str(), dev.name().c_str(), "bytes/rank", "count",
                  "time(us)", "algbw(GB/s)", "busbw(GB/s)");
    for (std::size_t bytes = 1024; bytes <= max_bytes; bytes *= 4) {
      Result r = run(comm, dev, s, bytes / 2, 5);
      double slowest = 0;
      MPI_Allreduce(&r.seconds, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      wrong += r.wrong;
      double algbw = static_cast<double>(bytes) * size / slowest / 1e9;
      if (rank == 0)
        std::printf("%12zu %12zu %12.1f %12.2f %12.2f\n", bytes, bytes / 2, slowest * 1e6, algbw,
                    algbw * (size - 1) / size);
    }
    if (auto e = comm.asyncError()) throw *e;
    comm.destroy();
    dev.destroyStream(s);
  } catch (const hoccl::Error& e) {
    std::fprintf(stderr, "allgather_demo: rank %d: hoccl error %d: %s\n", rank, static_cast<int>(e.code()), e.what());
    failed = 1;
  }
  long total_wrong = 0;
  int total_failed = 0;
  MPI_Allreduce(&wrong, &total_wrong, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(&failed, &total_failed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0)
    std::printf("allgather_demo: %s (%ld wrong elements, %d ranks with errors)\n",
                total_wrong == 0 && total_failed == 0 ? "OK" : "FAILED", total_wrong, total_failed);
  MPI_Finalize();
  return total_wrong == 0 && total_failed == 0 ? 0 : 1;
}
