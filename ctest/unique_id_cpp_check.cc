// Communicators from a unique id through the C++ API (hoccl::UniqueId,
// hoccl::Communicator::fromUniqueId), without MPI: ranks are processes forked before any
// hoccl call, the id passed through pipes (ctest/spawn_ranks.h). Rank 1 first presents the id
// with its secret altered and must get hoccl::Error InvalidArgument within seconds; then every
// rank joins and an AllReduce (max, float) and an AllGather (int64) are checked against values
// computed here.   unique_id_cpp_check NRANKS
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "hoccl/hoccl.hpp"
#include "spawn_ranks.hpp"

namespace {

// Where hoccl's TCP bootstrap keeps the secret in the id (src/bootstrap/tcp.rs).
constexpr std::size_t kSecretAt = 24, kSecretLen = 16;
constexpr std::size_t kCount = 4099;

int failures = 0;

void expect(int rank, bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "unique_id_cpp_check: rank %d: FAILED: %s\n", rank, what.c_str());
  }
}

float fval(int r, std::size_t i) { return static_cast<float>((static_cast<int>(i) * 7 + r * 13) % 101) - 50.0f; }
std::int64_t lval(int r, std::size_t i) { return (static_cast<std::int64_t>(r) << 40) + static_cast<std::int64_t>(i); }

int rankMain(int rank, int nranks, const void* idp, void*) {
  hoccl::UniqueId id;
  std::memcpy(id.bytes.data(), idp, id.bytes.size());
  try {
    if (rank == 1) {
      hoccl::UniqueId bad = id;
      for (std::size_t i = kSecretAt; i < kSecretAt + kSecretLen; ++i) bad.bytes[i] ^= 0x5a;
      auto t0 = std::chrono::steady_clock::now();
      try {
        hoccl::Communicator::fromUniqueId(bad, nranks, rank);
        expect(rank, false, "a wrong secret was accepted");
      } catch (const hoccl::Error& e) {
        expect(rank, e.code() == hoccl::ErrorCode::InvalidArgument, std::string("wrong secret: code of ") + e.what());
        expect(rank, std::strstr(e.what(), "wrong secret") != nullptr, std::string("wrong secret: message ") + e.what());
      }
      expect(rank, std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10), "the refusal comes within 10 s");
    }
    try {
      hoccl::Communicator::fromUniqueId(id, nranks, -1);
      expect(rank, false, "rank -1 was accepted");
    } catch (const hoccl::Error& e) {
      expect(rank, e.code() == hoccl::ErrorCode::InvalidArgument, std::string("rank -1: ") + e.what());
    }

    hoccl::Communicator comm = hoccl::Communicator::fromUniqueId(id, nranks, rank);
    expect(rank, comm.rank() == rank && comm.size() == nranks, "rank() and size()");
    hoccl::Device dev = comm.device();
    hoccl::Stream s = dev.createStream();

    std::vector<float> f(kCount);
    for (std::size_t i = 0; i < kCount; ++i) f[i] = fval(rank, i);
    void* a = dev.alloc(kCount * sizeof(float));
    void* b = dev.alloc(kCount * sizeof(float));
    dev.copyFromHost(a, f.data(), kCount * sizeof(float));
    comm.allReduce(a, b, kCount, hoccl::DataType::Float32, hoccl::RedOp::Max, s);
    dev.synchronize(s);
    dev.copyToHost(f.data(), b, kCount * sizeof(float));
    std::size_t bad = 0;
    for (std::size_t i = 0; i < kCount; ++i) {
      float m = fval(0, i);
      for (int p = 1; p < nranks; ++p) m = fval(p, i) > m ? fval(p, i) : m;
      bad += f[i] != m;
    }
    expect(rank, bad == 0, "allReduce max: " + std::to_string(bad) + " wrong elements");

    std::vector<std::int64_t> l(kCount * nranks);
    for (std::size_t i = 0; i < kCount; ++i) l[i] = lval(rank, i);
    void* g = dev.alloc(l.size() * sizeof(std::int64_t));
    void* c = dev.alloc(kCount * sizeof(std::int64_t));
    dev.copyFromHost(c, l.data(), kCount * sizeof(std::int64_t));
    comm.allGather(c, g, kCount, hoccl::DataType::Int64, s);
    dev.synchronize(s);
    dev.copyToHost(l.data(), g, l.size() * sizeof(std::int64_t));
    bad = 0;
    for (int p = 0; p < nranks; ++p)
      for (std::size_t i = 0; i < kCount; ++i) bad += l[p * kCount + i] != lval(p, i);
    expect(rank, bad == 0, "allGather: " + std::to_string(bad) + " wrong elements");

    expect(rank, !comm.asyncError().has_value(), "no asynchronous error");
    dev.free(a);
    dev.free(b);
    dev.free(c);
    dev.free(g);
    dev.destroyStream(s);
    comm.destroy();
  } catch (const std::exception& e) {
    expect(rank, false, std::string("exception: ") + e.what());
  }
  return failures != 0;
}

}  // namespace

int main(int argc, char** argv) {
  int nranks = argc > 1 ? std::atoi(argv[1]) : 2;
  setenv("HOCCL_TIMEOUT_MS", "30000", 0);
  int rc = spawn_ranks(nranks, hoccl::UniqueId::kBytes, makeUniqueId, rankMain, const_cast<char*>("unique_id_cpp_check"));
  std::printf("unique_id_cpp_check: %s (%d ranks)\n", rc == 0 ? "OK" : "FAILED", nranks);
  return rc;
}
