// Shared by the C++ tests: verifiable data, device buffers with guard bytes, failure counting
// across ranks. Expected values are computed here, independently of hoccl: data is a
// function of (seed, rank, byte index), and every check counts wrong elements instead of
// stopping at the first.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "hoccl/hoccl.hpp"

namespace test {

using Bytes = std::vector<std::uint8_t>;

// Byte i of rank r's data for `seed`: a splitmix64 finalizer over (seed, rank, i).
inline std::uint8_t value(std::uint64_t seed, int rank, std::uint64_t i) {
  std::uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(rank) * 0xD1B54A32D192ED03ull +
                    i * 0xA24BAED4963EE407ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<std::uint8_t>(z ^ (z >> 31));
}

// `bytes` bytes of rank r's data starting at byte index `from`.
inline Bytes data(std::uint64_t seed, int rank, std::size_t bytes, std::size_t from = 0) {
  Bytes v(bytes);
  for (std::size_t i = 0; i < bytes; ++i) v[i] = value(seed, rank, from + i);
  return v;
}

// Bytes that no collective writes: left over in a guard or an untouched block means a stray
// or missing write.
constexpr std::uint8_t kPoison = 0xE7;

// Device memory with `kGuard` poisoned bytes before and after the `bytes` under test; `ptr()`
// is at an odd offset when `misalign` (hoccl accepts any alignment).
class DevBuf {
 public:
  static constexpr std::size_t kGuard = 64;
  DevBuf(const hoccl::Device& dev, std::size_t bytes, bool misalign = false)
      : dev_(&dev), bytes_(bytes), front_(kGuard + (misalign ? 3 : 0)) {
    base_ = dev.alloc(total());
    dev.copyFromHost(base_, Bytes(total(), kPoison).data(), total());
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() {
    try {
      dev_->free(base_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "DevBuf: free failed: %s\n", e.what());
    }
  }
  void* ptr(std::size_t offset = 0) const { return static_cast<std::uint8_t*>(base_) + front_ + offset; }
  std::size_t bytes() const { return bytes_; }
  // Write `v` at byte `offset` of the region under test.
  void upload(const Bytes& v, std::size_t offset = 0) const {
    if (!v.empty()) dev_->copyFromHost(ptr(offset), v.data(), v.size());
  }
  // The region under test; `guards_ok` tells whether both guards are still poison.
  Bytes download(bool* guards_ok = nullptr) const {
    Bytes all(total());
    dev_->copyToHost(all.data(), base_, total());
    if (guards_ok != nullptr) {
      *guards_ok = true;
      for (std::size_t i = 0; i < total(); ++i)
        if ((i < front_ || i >= front_ + bytes_) && all[i] != kPoison) *guards_ok = false;
    }
    return Bytes(all.begin() + static_cast<std::ptrdiff_t>(front_),
                 all.begin() + static_cast<std::ptrdiff_t>(front_ + bytes_));
  }

 private:
  std::size_t total() const { return front_ + bytes_ + kGuard; }
  const hoccl::Device* dev_;
  void* base_ = nullptr;
  std::size_t bytes_, front_;
};

class Checker {
 public:
  Checker(const char* name, int rank) : name_(name), rank_(rank) {}

  void fail(const std::string& what) {
    ++failures_;
    if (failures_ <= 20) std::fprintf(stderr, "%s: rank %d: FAILED: %s\n", name_, rank_, what.c_str());
  }
  void expect(bool ok, const std::string& what) {
    ++checks_;
    if (!ok) fail(what);
  }
  // Compare element-wise (`elem` bytes per element); reports the count and the first few.
  void compare(const std::string& what, const Bytes& got, const Bytes& want, std::size_t elem) {
    ++checks_;
    if (got.size() != want.size()) return fail(what + ": size " + std::to_string(got.size()) + " vs " +
                                               std::to_string(want.size()));
    std::size_t wrong = 0, first = 0;
    for (std::size_t e = 0; e * elem < got.size(); ++e) {
      bool ok = true;
      for (std::size_t b = e * elem; b < (e + 1) * elem && b < got.size(); ++b) ok = ok && got[b] == want[b];
      if (!ok && wrong++ == 0) first = e;
    }
    if (wrong > 0)
      fail(what + ": " + std::to_string(wrong) + " wrong elements of " + std::to_string(got.size() / elem) +
           " (first at element " + std::to_string(first) + ")");
  }
  // `f` must throw hoccl::Error with `code`.
  template <class F>
  void expectThrows(const std::string& what, hoccl::ErrorCode code, F&& f) {
    ++checks_;
    try {
      f();
      fail(what + ": no exception");
    } catch (const hoccl::Error& e) {
      if (e.code() != code)
        fail(what + ": code " + std::to_string(static_cast<int>(e.code())) + ", expected " +
             std::to_string(static_cast<int>(code)) + " (" + e.what() + ")");
    } catch (const std::exception& e) {
      fail(what + ": not a hoccl::Error: " + e.what());
    }
  }
  // Sum failures over `comm`; rank 0 prints the verdict. The process exit code.
  int finish(MPI_Comm comm) {
    long total = 0, checks = 0;
    MPI_Allreduce(&failures_, &total, 1, MPI_LONG, MPI_SUM, comm);
    MPI_Allreduce(&checks_, &checks, 1, MPI_LONG, MPI_SUM, comm);
    int rank = 0, size = 0;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    if (rank == 0) {
      if (total == 0 && checks > 0)
        std::printf("%s: OK (%ld checks on %d ranks)\n", name_, checks, size);
      else
        std::printf("%s: FAILED (%ld failures, %ld checks on %d ranks)\n", name_, total, checks, size);
    }
    return total == 0 && checks > 0 ? 0 : 1;
  }

 private:
  const char* name_;
  int rank_;
  long failures_ = 0, checks_ = 0;
};

// MPI_Init_thread at MPI_THREAD_MULTIPLE (what hoccl wants) and small test defaults for
// hoccl's configuration unless the environment already sets them: a short timeout so that a
// broken run fails instead of waiting two minutes, small chunks so that modest buffers are
// split into many chunks.
inline void init(int* argc, char*** argv, int* rank, int* size) {
  int provided = 0;
  if (MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) std::exit(2);
  MPI_Comm_rank(MPI_COMM_WORLD, rank);
  MPI_Comm_size(MPI_COMM_WORLD, size);
  setenv("HOCCL_TIMEOUT_MS", "30000", 0);
  setenv("HOCCL_CHUNK_BYTES", "65536", 0);
}

}  // namespace test
