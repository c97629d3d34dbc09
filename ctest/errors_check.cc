// Error handling of the C++ API under MPI: bad arguments throw hoccl::Error with
// InvalidArgument and leave the communicator usable; bad call sequences are InvalidUsage;
// ranks that disagree on a count get an asynchronous error instead of a hang; after abort
// every call throws Aborted, after destroy (or a move) InvalidUsage. Also checks that the C
// and C++ headers agree on every code and data type, in one translation unit.
#include <chrono>
#include <type_traits>

#include "hoccl/hoccl.h"
#include "test_util.hpp"

namespace {

using hoccl::DataType;
using hoccl::ErrorCode;

#define SAME(cpp, c) static_assert(static_cast<int>(cpp) == static_cast<int>(c), #cpp " != " #c)
SAME(ErrorCode::Success, hocclSuccess);
SAME(ErrorCode::Cuda, hocclCudaError);
SAME(ErrorCode::System, hocclSystemError);
SAME(ErrorCode::Internal, hocclInternalError);
SAME(ErrorCode::InvalidArgument, hocclInvalidArgument);
SAME(ErrorCode::InvalidUsage, hocclInvalidUsage);
SAME(ErrorCode::Remote, hocclRemoteError);
SAME(ErrorCode::InProgress, hocclInProgress);
SAME(ErrorCode::Timeout, hocclTimeout);
SAME(ErrorCode::CorruptData, hocclCorruptData);
SAME(ErrorCode::Aborted, hocclAborted);
SAME(ErrorCode::Mpi, hocclMpiError);
SAME(ErrorCode::NoDevice, hocclNoDevice);
SAME(DataType::Int8, hocclInt8);
SAME(DataType::Uint8, hocclUint8);
SAME(DataType::Int32, hocclInt32);
SAME(DataType::Uint32, hocclUint32);
SAME(DataType::Int64, hocclInt64);
SAME(DataType::Uint64, hocclUint64);
SAME(DataType::Float16, hocclFloat16);
SAME(DataType::Float32, hocclFloat32);
SAME(DataType::Float64, hocclFloat64);
SAME(DataType::Bfloat16, hocclBfloat16);
SAME(DataType::Float8e4m3, hocclFloat8e4m3);
SAME(DataType::Float8e5m2, hocclFloat8e5m2);
#undef SAME
// CUDA's cudaStream_t and CUstream are both `struct CUstream_st*`.
static_assert(std::is_same<hoccl::Stream, CUstream_st*>::value, "hoccl::Stream is cudaStream_t");

void badArguments(test::Checker& ck, hoccl::Communicator& comm, const hoccl::Device& dev, hoccl::Stream s) {
  const int rank = comm.rank(), size = comm.size();
  void* buf = dev.alloc(1000);
  auto arg = [&](const char* what, auto f) { ck.expectThrows(what, ErrorCode::InvalidArgument, f); };
  arg("null receive buffer", [&] { comm.allGather(buf, nullptr, 10, DataType::Uint8, s); });
  arg("null send buffer", [&] { comm.send(nullptr, 10, DataType::Uint8, (rank + 1) % size, s); });
  arg("unknown data type", [&] { comm.allGather(buf, buf, 10, static_cast<DataType>(42), s); });
  arg("peer out of range", [&] { comm.send(buf, 10, DataType::Uint8, size, s); });
  arg("negative peer", [&] { comm.recv(buf, 10, DataType::Uint8, -1, s); });
  arg("negative root", [&] { comm.broadcast(buf, buf, 10, DataType::Uint8, -1, s); });
  arg("root out of range", [&] { comm.gather(buf, buf, 1, DataType::Uint8, size, s); });
  std::vector<std::uint8_t> host(100);
  arg("host memory is not device memory", [&] { comm.broadcast(host.data(), host.data(), 10, DataType::Uint8, 0, s); });
  arg("receive buffer too short", [&] {
    comm.allGather(static_cast<char*>(buf) + 500, static_cast<char*>(buf) + 500, 300, DataType::Uint8, s);
  });
  arg("in-place allToAll", [&] { comm.allToAll(buf, buf, 10, DataType::Uint8, s); });
  std::vector<std::size_t> few(static_cast<std::size_t>(size) + 1, 1);
  arg("allToAllv counts of the wrong length",
      [&] { comm.allToAllv(buf, few, few, static_cast<char*>(buf) + 500, few, few, DataType::Uint8, s); });
  arg("copyToHost to null", [&] { dev.copyToHost(nullptr, buf, 8); });
  try {
    comm.allGather(buf, nullptr, 10, DataType::Uint8, s);
  } catch (const hoccl::Error& e) {
    ck.expect(std::string(e.what()).find("all_gather") != std::string::npos, std::string("what() names the call: ") + e.what());
  }
  ck.expectThrows("groupEnd without groupStart", ErrorCode::InvalidUsage, [&] { comm.groupEnd(); });
  hoccl::Group g(comm);
  g.end();
  ck.expectThrows("Group::end twice", ErrorCode::InvalidUsage, [&] { g.end(); });
  // None of that disturbed the communicator.
  char* b = static_cast<char*>(buf);
  comm.allGather(b + rank * 10, b, 10, DataType::Uint8, s);
  dev.synchronize(s);
  ck.expect(!comm.asyncError().has_value(), "an async error after synchronous argument errors");
  dev.free(buf);
  try {  // the host backend knows its allocations; CUDA reports what cuMemFree says
    dev.free(buf);
    ck.fail("double free: no exception");
  } catch (const hoccl::Error& e) {
    ck.expect(e.code() == ErrorCode::InvalidArgument || (dev.backend() == "cuda" && e.code() == ErrorCode::Cuda),
              std::string("double free: ") + e.what());
  }
}

// Moves leave an empty object that throws InvalidUsage; destroy makes every call throw
// InvalidUsage; the Device outlives its communicator.
void moveAndDestroy(test::Checker& ck) {
  auto usage = [&](const char* what, auto f) { ck.expectThrows(what, ErrorCode::InvalidUsage, f); };
  hoccl::Communicator a(MPI_COMM_WORLD);
  hoccl::Communicator b(std::move(a));
  usage("rank() of a moved-from communicator", [&] { a.rank(); });
  ck.expect(b.size() > 0, "moved-to communicator works");
  a = std::move(b);
  usage("size() of a moved-from communicator", [&] { b.size(); });
  hoccl::Device dev = a.device();
  hoccl::Stream s = dev.createStream();
  void* buf = dev.alloc(64);
  a.destroy();
  usage("allGather after destroy", [&] { a.allGather(buf, buf, 1, DataType::Uint8, s); });
  usage("rank after destroy", [&] { a.rank(); });
  usage("asyncError after destroy", [&] { a.asyncError(); });
  usage("groupStart after destroy", [&] { a.groupStart(); });
  usage("device after destroy", [&] { a.device(); });
  usage("abort after destroy", [&] { a.abort(); });
  usage("destroy twice", [&] { a.destroy(); });
  dev.free(buf);  // the device outlives its communicator
  dev.destroyStream(s);
  hoccl::Device moved(std::move(dev));
  usage("a moved-from Device", [&] { dev.alloc(1); });
}

// Rank 0 gathers 100 elements, the others 120: every rank gets an asynchronous error
// (InvalidUsage or Remote) promptly, the stream is released, later calls fail with it; after
// abort they fail with Aborted.
void mismatchedCounts(test::Checker& ck) {
  hoccl::Communicator comm(MPI_COMM_WORLD);
  const int rank = comm.rank();
  hoccl::Device dev = comm.device();
  hoccl::Stream s = dev.createStream();
  void* buf = dev.alloc(1000);
  const std::size_t count = rank == 0 ? 100 : 120;
  auto t0 = std::chrono::steady_clock::now();
  comm.allGather(static_cast<char*>(buf) + rank * count, buf, count, DataType::Uint8, s);
  dev.synchronize(s);  // must return: the failed operation releases the stream
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ck.expect(secs < 20, "mismatch took " + std::to_string(secs) + " s to surface (timeout is 30 s)");
  std::optional<hoccl::Error> e = comm.asyncError();
  ck.expect(e.has_value(), "no async error after mismatched counts");
  if (e) {
    ck.expect(e->code() == ErrorCode::InvalidUsage || e->code() == ErrorCode::Remote,
              std::string("async error code ") + std::to_string(static_cast<int>(e->code())) + ": " + e->what());
    ck.expectThrows("a call after the async error", e->code(),
                    [&] { comm.allGather(static_cast<char*>(buf) + rank, buf, 1, DataType::Uint8, s); });
  }
  comm.abort();
  auto aborted = [&](const char* what, auto f) { ck.expectThrows(what, ErrorCode::Aborted, f); };
  aborted("allGather after abort", [&] { comm.allGather(static_cast<char*>(buf) + rank, buf, 1, DataType::Uint8, s); });
  aborted("rank after abort", [&] { comm.rank(); });
  aborted("asyncError after abort", [&] { comm.asyncError(); });
  comm.abort();    // again: nothing to do
  comm.destroy();  // after abort: releases quietly
  ck.expectThrows("rank after abort and destroy", ErrorCode::InvalidUsage, [&] { comm.rank(); });
  dev.free(buf);
  dev.destroyStream(s);
}

}  // namespace

int main(int argc, char** argv) {
  int rank = 0, size = 0;
  test::init(&argc, &argv, &rank, &size);
  test::Checker ck("errors_check", rank);
  try {
    hoccl::Communicator comm(MPI_COMM_WORLD);
    hoccl::Device dev = comm.device();
    hoccl::Stream s = dev.createStream();
    badArguments(ck, comm, dev, s);
    comm.destroy();
    dev.destroyStream(s);
    moveAndDestroy(ck);
    mismatchedCounts(ck);
    ck.expectThrows("MPI_COMM_NULL", ErrorCode::InvalidArgument, [] { hoccl::Communicator bad(MPI_COMM_NULL); });
    hoccl::Error err(ErrorCode::Remote, "x");
    const std::runtime_error& base = err;  // an Error is a runtime_error
    ck.expect(std::string(base.what()) == "x" && err.code() == ErrorCode::Remote, "hoccl::Error");
  } catch (const hoccl::Error& e) {
    ck.fail("hoccl::Error " + std::to_string(static_cast<int>(e.code())) + ": " + e.what());
  }
  int rc = ck.finish(MPI_COMM_WORLD);
  MPI_Finalize();
  return rc;
}
