// What an engine linking the installed hoccl does first: initialize MPI, call into hoccl.
#include <mpi.h>

#include <cstdio>
#include <string>

#include <hoccl/hoccl.hpp>

int main(int argc, char** argv) {
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) return 1;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int ok = 0;
  try {
    ok = hoccl::version() == HOCCL_EXPECTED_VERSION ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: rank %d: %s\n", rank, e.what());
  }
  int all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0) std::printf("consumer: %s (hoccl %s)\n", all_ok ? "OK" : "FAILED", hoccl::version().c_str());
  MPI_Finalize();
  return all_ok ? 0 : 1;
}
