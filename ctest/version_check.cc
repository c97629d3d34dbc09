// C++ check of the bridge under MPI: every rank gets hoccl::version() through the cxx
// bridge, the version is the one CMake was configured with, and all ranks agree;
// hoccl::Error carries its code. Prints "version_check: OK" on rank 0 or exits 1.
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "hoccl/hoccl.hpp"

int main(int argc, char** argv) {
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) return 1;
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int failures = 0;
  auto fail = [&](const std::string& what) {
    std::fprintf(stderr, "version_check: rank %d: FAILED: %s\n", rank, what.c_str());
    ++failures;
  };

  std::string v;
  try {
    v = hoccl::version();
  } catch (const std::exception& e) {
    fail(std::string("hoccl::version threw: ") + e.what());
  }
  if (v != HOCCL_EXPECTED_VERSION) fail("version '" + v + "', expected '" HOCCL_EXPECTED_VERSION "'");

  unsigned long long mine = std::hash<std::string>{}(v);
  std::vector<unsigned long long> all(static_cast<size_t>(size));
  if (MPI_Allgather(&mine, 1, MPI_UNSIGNED_LONG_LONG, all.data(), 1, MPI_UNSIGNED_LONG_LONG, MPI_COMM_WORLD) !=
      MPI_SUCCESS) {
    fail("MPI_Allgather");
  }
  for (int r = 0; r < size; ++r)
    if (all[static_cast<size_t>(r)] != mine) fail("rank " + std::to_string(r) + " reports another version");

  try {
    throw hoccl::Error(hoccl::ErrorCode::InvalidArgument, "bad argument");
  } catch (const std::runtime_error& e) {  // an Error is a runtime_error
    const auto* he = dynamic_cast<const hoccl::Error*>(&e);
    if (he == nullptr || he->code() != hoccl::ErrorCode::InvalidArgument || static_cast<int>(he->code()) != 4 || std::strcmp(e.what(), "bad argument") != 0) fail("hoccl::Error");
  }

  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) {
    if (total == 0)
      std::printf("version_check: OK (hoccl %s, %d ranks)\n", v.c_str(), size);
    else
      std::printf("version_check: FAILED (%d failures)\n", total);
  }
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
