// What an engine linking the installed hoccl does: initialize MPI, create a communicator
// over MPI_COMM_WORLD, run a real AllGather on a stream of the communicator's device, check
// it, destroy. Built through find_package (consumer) and pkg-config (consumer_pc).
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <hoccl/hoccl.hpp>

namespace {

std::int32_t element(int rank, std::size_t i) { return rank * 1000003 + static_cast<std::int32_t>(i); }

// Wrong elements of an AllGather of `count` int32 per rank.
long allGather(hoccl::Communicator& comm, std::size_t count) {
  const int rank = comm.rank(), size = comm.size();
  hoccl::Device dev = comm.device();
  hoccl::Stream s = dev.createStream();
  void* send = dev.alloc(count * 4);
  void* recv = dev.alloc(count * 4 * size);
  std::vector<std::int32_t> host(count * size);
  for (std::size_t i = 0; i < count; ++i) host[i] = element(rank, i);
  dev.copyFromHost(send, host.data(), count * 4);
  comm.allGather(send, recv, count, hoccl::dataTypeOf<std::int32_t>(), s);
  dev.synchronize(s);
  dev.copyToHost(host.data(), recv, count * 4 * size);
  long wrong = 0;
  for (int p = 0; p < size; ++p)
    for (std::size_t i = 0; i < count; ++i) wrong += host[p * count + i] != element(p, i);
  dev.free(send);
  dev.free(recv);
  dev.destroyStream(s);
  return wrong;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) return 1;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int ok = 0;
  try {
    hoccl::Communicator comm(MPI_COMM_WORLD);
    long wrong = allGather(comm, 100003);
    comm.destroy();
    ok = hoccl::version() == HOCCL_EXPECTED_VERSION && wrong == 0 ? 1 : 0;
    if (wrong != 0) std::fprintf(stderr, "consumer: rank %d: %ld wrong elements\n", rank, wrong);
  } catch (const hoccl::Error& e) {
    std::fprintf(stderr, "consumer: rank %d: hoccl error %d: %s\n", rank, static_cast<int>(e.code()), e.what());
  }
  int all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0) std::printf("consumer: %s (hoccl %s, AllGather checked)\n", all_ok ? "OK" : "FAILED", hoccl::version().c_str());
  MPI_Finalize();
  return all_ok ? 0 : 1;
}
