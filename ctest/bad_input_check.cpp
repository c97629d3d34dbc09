// Bad input through the C++ API (hoccl.hpp), table-driven: the classes of docs/design.md,
// "Errors", as a C++ caller can express them (ctest/bad_input_check.c drives the C ABI,
// tests/bad_input.rs the Rust API). Every refused call must throw hoccl::Error (never another
// exception, a crash or a hang) with its documented code and a message naming the method,
// on every rank alike (a buffer fault goes into the buffer every rank uses), and a good
// AllReduce afterwards must give the right sum. Ranks are forked processes joined through a
// unique id (ctest/spawn_ranks.h); HOCCL_BACKEND=cuda runs the same program on a GPU, where
// an unknown stream is not a case (the driver's pointer is not checked, as with NCCL).
// Two cases would overflow address arithmetic inside the Rust validation if it were unchecked
// (allToAll with a receive address near 2^64, allToAllv with an empty block at an
// overflowing displacement): a panic in builds with overflow checks, which the bridge's guard
// would turn into Internal, a silent wrap in others; both must be InvalidArgument.
//   bad_input_cpp_check NRANKS
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "hoccl/hoccl.hpp"
#include "spawn_ranks.hpp"

namespace {

using hoccl::DataType;
using hoccl::ErrorCode;
using hoccl::RedOp;

constexpr std::size_t kBytes = 4096;  // each of the two buffers
constexpr std::size_t kCount = 16;    // elements of the good calls
// Where hoccl's TCP bootstrap keeps the secret in the id (src/bootstrap/tcp.rs).
constexpr std::size_t kSecretAt = 24, kSecretLen = 16;

int failures = 0;
int checked = 0;
int myRank = -1;

void fail(const std::string& what) {
  ++failures;
  if (failures <= 40) std::fprintf(stderr, "bad_input_cpp_check: rank %d: FAILED: %s\n", myRank, what.c_str());
}
void expect(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

// `s` lower-cased without '_': "all_reduce" and "allReduce" both become "allreduce".
std::string normalized(const std::string& s) {
  std::string out;
  for (char c : s)
    if (c != '_') out += static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return out;
}

// `f` must throw hoccl::Error with `want` and a message; when `names` is given, the message
// names it (as the C++ method or as the Rust operation: compared normalized).
template <class F>
void expectError(const std::string& what, ErrorCode want, F&& f, const char* names = nullptr) {
  ++checked;
  try {
    f();
    fail(what + ": accepted");
  } catch (const hoccl::Error& e) {
    const std::string msg = e.what();
    if (e.code() != want)
      fail(what + ": code " + std::to_string(static_cast<int>(e.code())) + ", want " +
           std::to_string(static_cast<int>(want)) + " (" + msg + ")");
    else if (msg.empty())
      fail(what + ": no message");
    else if (names != nullptr && normalized(msg).find(normalized(names)) == std::string::npos)
      fail(what + ": the message does not name " + names + ": " + msg);
  } catch (const std::exception& e) {
    fail(what + ": not a hoccl::Error: " + e.what());
  } catch (...) {
    fail(what + ": not a std::exception");
  }
}

enum Op { AllGather, AllToAll, AllToAllV, Broadcast, Gather, Scatter, AllReduce, ReduceScatter, Reduce, Send, Recv, NOps };
const char* const kOpNames[NOps] = {"allGather", "allToAll",      "allToAllv", "broadcast", "gather", "scatter",
                                    "allReduce", "reduceScatter", "reduce",    "send",      "recv"};

enum Fault {
  NullBuffer,
  HostPointer,
  FreedPointer,
  ShortBuffer,
  CountOverflows,
  DtypeNegative,
  DtypePastLast,
  RedOpPastLast,
  RedOpNegative,
  RootIsSize,
  RootNegative,
  PeerIsSize,
  PeerNegative,
  UnknownStream,
  InPlace,
  CountsTooFew,
  CountsTooMany,
  DisplacementOverflows,
  EmptyBlockFarAway,
  TopOfAddressSpace,
  MovedFrom,
  Destroyed,
  Aborted,
  NFaults
};
const struct {
  const char* name;
  ErrorCode want;
} kFaults[NFaults] = {
    {"null buffer", ErrorCode::InvalidArgument},
    {"host pointer", ErrorCode::InvalidArgument},
    {"freed pointer", ErrorCode::InvalidArgument},
    {"buffer shorter than the count", ErrorCode::InvalidArgument},
    {"byte size overflows", ErrorCode::InvalidArgument},
    {"dtype -1", ErrorCode::InvalidArgument},
    {"dtype past the last", ErrorCode::InvalidArgument},
    {"reduction operator past the last", ErrorCode::InvalidArgument},
    {"reduction operator -1", ErrorCode::InvalidArgument},
    {"root = size", ErrorCode::InvalidArgument},
    {"root -1", ErrorCode::InvalidArgument},
    {"peer = size", ErrorCode::InvalidArgument},
    {"peer -1", ErrorCode::InvalidArgument},
    {"unknown stream", ErrorCode::InvalidArgument},
    {"in place", ErrorCode::InvalidArgument},
    {"count vectors one entry short", ErrorCode::InvalidArgument},
    {"count vectors one entry long", ErrorCode::InvalidArgument},
    {"count + displacement overflows", ErrorCode::InvalidArgument},
    {"an empty block whose displacement in bytes overflows", ErrorCode::InvalidArgument},
    {"pointer at the top of the address space", ErrorCode::InvalidArgument},
    {"moved-from communicator", ErrorCode::InvalidUsage},
    {"destroyed communicator", ErrorCode::InvalidUsage},
    {"aborted communicator", ErrorCode::Aborted},
};

bool applies(Fault f, Op op, bool cuda) {
  const bool reduces = op == AllReduce || op == ReduceScatter || op == Reduce;
  const bool rooted = op == Broadcast || op == Gather || op == Scatter || op == Reduce;
  const bool p2p = op == Send || op == Recv;
  switch (f) {
    case RedOpPastLast: case RedOpNegative: return reduces;
    case RootIsSize: case RootNegative: return rooted;
    case PeerIsSize: case PeerNegative: return p2p;
    // On CUDA a stream is the driver's pointer: a bogus one is undefined behaviour there.
    case UnknownStream: return !cuda;
    case InPlace: return op == AllToAll || op == AllToAllV;
    case CountsTooFew: case CountsTooMany: case DisplacementOverflows: case EmptyBlockFarAway: return op == AllToAllV;
    case TopOfAddressSpace: return op == AllToAll || op == AllGather;
    default: return true;
  }
}

// What a rank holds: its communicator, device buffers, a stream, host memory, the address of
// a freed allocation, and the communicators of the handle faults.
struct Rank {
  hoccl::Communicator& comm;
  hoccl::Device& dev;
  hoccl::Stream s;
  void* a;
  void* b;
  void* freed;
  std::vector<std::uint8_t> host;
  hoccl::Communicator& moved;
  hoccl::Communicator& destroyed;
  hoccl::Communicator& aborted;
  int rank, nranks;
};

void call(Rank& r, Op op, Fault f) {
  const void* sb = r.a;
  void* rb = r.b;
  std::size_t n = kCount;
  DataType dt = DataType::Float32;
  RedOp red = RedOp::Sum;
  int root = (op == Send || op == Recv) ? (r.rank + 1) % r.nranks : 0;
  hoccl::Stream s = r.s;
  hoccl::Communicator* c = &r.comm;
  // The buffer every rank uses: the receive buffer of Broadcast, Scatter and Recv.
  const bool recvSide = op == Broadcast || op == Scatter || op == Recv;
  void* bad = nullptr;
  const std::size_t nr = static_cast<std::size_t>(r.nranks);
  std::size_t vlen = nr;  // entries of allToAllv's vectors
  std::size_t lastDispl = 0;
  switch (f) {
    case NullBuffer: bad = nullptr; break;
    case HostPointer: bad = r.host.data(); break;
    case FreedPointer: bad = r.freed; break;
    case ShortBuffer: n = kBytes / 4 + 1; break;
    case CountOverflows: n = SIZE_MAX / 2; break;
    case DtypeNegative: dt = static_cast<DataType>(-1); break;
    case DtypePastLast: dt = static_cast<DataType>(static_cast<int>(DataType::Float8e5m2) + 1); break;
    case RedOpPastLast: red = static_cast<RedOp>(static_cast<int>(RedOp::Avg) + 1); break;
    case RedOpNegative: red = static_cast<RedOp>(-1); break;
    case RootIsSize: case PeerIsSize: root = r.nranks; break;
    case RootNegative: case PeerNegative: root = -1; break;
    case UnknownStream: s = reinterpret_cast<hoccl::Stream>(static_cast<std::uintptr_t>(0x7fff0000)); break;
    case InPlace: rb = r.a; break;
    case CountsTooFew: vlen = nr - 1; break;
    case CountsTooMany: vlen = nr + 1; break;
    case DisplacementOverflows: lastDispl = SIZE_MAX; break;
    // A receive buffer whose end wraps past 2^64: allToAll's overlap test sees it before its
    // allocation is looked up, and must not overflow computing its end.
    case TopOfAddressSpace: rb = reinterpret_cast<void*>(UINTPTR_MAX - 15); break;
    case MovedFrom: c = &r.moved; break;
    case Destroyed: c = &r.destroyed; break;
    case Aborted: c = &r.aborted; break;
    default: break;
  }
  if (f == NullBuffer || f == HostPointer || f == FreedPointer) {
    if (recvSide) rb = bad;
    else sb = bad;
  }
  switch (op) {
    case AllGather: return c->allGather(sb, rb, n, dt, s);
    case AllToAll: return c->allToAll(sb, rb, n, dt, s);
    case AllToAllV: {
      std::vector<std::size_t> counts(vlen, n), displs(vlen);
      for (std::size_t j = 0; j < vlen; ++j) displs[j] = j * n;  // wraps for CountOverflows: still refused
      if (f == DisplacementOverflows) displs[vlen - 1] = lastDispl;
      if (f == EmptyBlockFarAway) counts[vlen - 1] = 0, displs[vlen - 1] = SIZE_MAX / 2;
      return c->allToAllv(sb, counts, displs, rb, counts, displs, dt, s);
    }
    case Broadcast: return c->broadcast(sb, rb, n, dt, root, s);
    case Gather: return c->gather(sb, rb, n, dt, root, s);
    case Scatter: return c->scatter(sb, rb, n, dt, root, s);
    case AllReduce: return c->allReduce(sb, rb, n, dt, red, s);
    case ReduceScatter: return c->reduceScatter(sb, rb, n, dt, red, s);
    case Reduce: return c->reduce(sb, rb, n, dt, red, root, s);
    case Send: return c->send(sb, n, dt, root, s);
    default: return c->recv(rb, n, dt, root, s);
  }
}

float val(int rank, int ci, std::size_t k) { return static_cast<float>(rank * 1000 + ci * 10 + static_cast<int>(k)); }

// A good AllReduce (sum) after case `ci`, checked: the communicator is still usable.
void good(Rank& r, int ci, const std::string& after) {
  try {
    std::vector<float> in(kCount), out(kCount);
    for (std::size_t k = 0; k < kCount; ++k) in[k] = val(r.rank, ci, k);
    r.dev.copyFromHost(r.a, in.data(), sizeof(float) * kCount);
    r.comm.allReduce(r.a, r.b, kCount, DataType::Float32, RedOp::Sum, r.s);
    r.dev.synchronize(r.s);
    r.dev.copyToHost(out.data(), r.b, sizeof(float) * kCount);
    for (std::size_t k = 0; k < kCount; ++k) {
      float want = 0;
      for (int p = 0; p < r.nranks; ++p) want += val(p, ci, k);
      if (out[k] != want) return fail("good allReduce after " + after + ": wrong sum at " + std::to_string(k));
    }
  } catch (const std::exception& e) {
    fail("good allReduce after " + after + ": " + e.what());
  }
}

// A fresh freed address: nothing allocates between this free and the call that uses it.
void freshFreed(Rank& r) {
  r.freed = r.dev.alloc(kBytes);
  r.dev.free(r.freed);
}

// The table: every operation with every fault that applies to it.
int table(Rank& r, bool cuda) {
  int ci = 0;
  for (int op = 0; op < NOps; ++op) {
    for (int f = 0; f < NFaults; ++f) {
      if (!applies(static_cast<Fault>(f), static_cast<Op>(op), cuda)) continue;
      if (f == FreedPointer) freshFreed(r);
      const std::string what = std::string(kOpNames[op]) + " with " + kFaults[f].name;
      expectError(what, kFaults[f].want, [&] { call(r, static_cast<Op>(op), static_cast<Fault>(f)); }, kOpNames[op]);
      good(r, ci++, what);
    }
  }
  return ci;
}

// Every other method of a moved-from, a destroyed and an aborted communicator.
void handles(Rank& r) {
  struct {
    hoccl::Communicator* c;
    const char* name;
    ErrorCode want;
  } const hs[] = {{&r.moved, "moved-from", ErrorCode::InvalidUsage},
                  {&r.destroyed, "destroyed", ErrorCode::InvalidUsage},
                  {&r.aborted, "aborted", ErrorCode::Aborted}};
  for (const auto& h : hs) {
    hoccl::Communicator& c = *h.c;
    const std::string w = std::string(h.name) + " communicator: ";
    expectError(w + "rank()", h.want, [&] { c.rank(); }, "rank");
    expectError(w + "size()", h.want, [&] { c.size(); }, "size");
    expectError(w + "device()", h.want, [&] { c.device(); }, "device");
    expectError(w + "asyncError()", h.want, [&] { c.asyncError(); });
    expectError(w + "waitIdle()", h.want, [&] { c.waitIdle(); });
    expectError(w + "groupStart()", h.want, [&] { c.groupStart(); });
    expectError(w + "groupEnd()", h.want, [&] { c.groupEnd(); });
    expectError(w + "hoccl::Group", h.want, [&] { hoccl::Group g(c); });
  }
  // abort() and destroy(): an aborted communicator aborts again and destroys quietly; a
  // destroyed or moved-from one refuses both.
  expectError("moved-from communicator: abort()", ErrorCode::InvalidUsage, [&] { r.moved.abort(); }, "abort");
  expectError("moved-from communicator: destroy()", ErrorCode::InvalidUsage, [&] { r.moved.destroy(); }, "destroy");
  expectError("destroyed communicator: abort()", ErrorCode::InvalidUsage, [&] { r.destroyed.abort(); }, "abort");
  expectError("destroyed communicator: destroy()", ErrorCode::InvalidUsage, [&] { r.destroyed.destroy(); }, "destroy");
  try {
    r.aborted.abort();
    r.aborted.destroy();
  } catch (const std::exception& e) {
    fail(std::string("abort() and destroy() of an aborted communicator: ") + e.what());
  }
  expectError("aborted, then destroyed communicator: rank()", ErrorCode::InvalidUsage, [&] { r.aborted.rank(); });
  // A moved-from Device.
  hoccl::Device d = r.comm.device();
  hoccl::Device taken(std::move(d));
  expectError("moved-from Device: alloc()", ErrorCode::InvalidUsage, [&] { d.alloc(64); }, "alloc");
  expectError("moved-from Device: createStream()", ErrorCode::InvalidUsage, [&] { d.createStream(); }, "createStream");
}

// allToAllv's count vectors, and the group rules.
void groups(Rank& r, int ci) {
  expectError("groupEnd() without groupStart()", ErrorCode::InvalidUsage, [&] { r.comm.groupEnd(); }, "group");
  {
    hoccl::Group g(r.comm);
    g.end();
    expectError("Group::end() twice", ErrorCode::InvalidUsage, [&] { g.end(); }, "Group::end");
  }
  good(r, ci++, "group ends without a start");
  // Nested groups balance; a refused call inside a group leaves the group intact, and a call
  // on another stream than the group's is refused: the group's good allReduce still runs.
  hoccl::Stream other = r.dev.createStream();
  try {
    std::vector<float> in(kCount), out(kCount);
    for (std::size_t k = 0; k < kCount; ++k) in[k] = val(r.rank, ci, k);
    r.dev.copyFromHost(r.a, in.data(), sizeof(float) * kCount);
    r.comm.groupStart();
    {
      hoccl::Group g(r.comm);
      r.comm.allReduce(r.a, r.b, kCount, DataType::Float32, RedOp::Sum, r.s);
      expectError("allReduce in a group with a bad dtype", ErrorCode::InvalidArgument,
                  [&] { r.comm.allReduce(r.a, r.b, kCount, static_cast<DataType>(99), RedOp::Sum, r.s); }, "allReduce");
      expectError("allGather on another stream than its group's", ErrorCode::InvalidUsage,
                  [&] { r.comm.allGather(r.a, r.b, 1, DataType::Float32, other); }, "allGather");
      g.end();
    }
    r.comm.groupEnd();
    expectError("one groupEnd() too many", ErrorCode::InvalidUsage, [&] { r.comm.groupEnd(); }, "group");
    r.dev.synchronize(r.s);
    r.dev.copyToHost(out.data(), r.b, sizeof(float) * kCount);
    for (std::size_t k = 0; k < kCount; ++k) {
      float want = 0;
      for (int p = 0; p < r.nranks; ++p) want += val(p, ci, k);
      if (out[k] != want) {
        fail("the group's allReduce: wrong sum at " + std::to_string(k));
        break;
      }
    }
  } catch (const std::exception& e) {
    fail(std::string("group with refused calls: ") + e.what());
  }
  r.dev.destroyStream(other);
  good(r, ci + 1, "group misuse");
}

// The device calls of the table: freeing a host or freed pointer, copies from and to bad
// addresses, an unknown stream, a bad backend.
void device(Rank& r, bool cuda, int ci) {
  freshFreed(r);
  void* const top = reinterpret_cast<void*>(UINTPTR_MAX - 15);
  expectError("Device::free of a freed pointer", ErrorCode::InvalidArgument, [&] { r.dev.free(r.freed); });
  expectError("Device::free of a host pointer", ErrorCode::InvalidArgument, [&] { r.dev.free(r.host.data()); });
  expectError("Device::copyToHost to null", ErrorCode::InvalidArgument, [&] { r.dev.copyToHost(nullptr, r.a, 8); });
  if (!cuda) {
    // The host backend checks every address against its allocations; on CUDA the driver
    // validates copies (and reaches host memory through unified addressing), so these are
    // not refusals there.
    const hoccl::Stream unknown = reinterpret_cast<hoccl::Stream>(static_cast<std::uintptr_t>(0x7fff0000));
    expectError("Device::copyToHost from a freed pointer", ErrorCode::InvalidArgument,
                [&] { r.dev.copyToHost(r.host.data(), r.freed, 8); });
    expectError("Device::copyFromHost past the allocation", ErrorCode::InvalidArgument,
                [&] { r.dev.copyFromHost(r.a, r.host.data(), kBytes + 1); });
    expectError("Device::copyFromHost to the top of the address space", ErrorCode::InvalidArgument,
                [&] { r.dev.copyFromHost(top, r.host.data(), 64); });
    expectError("Device::memcpyAsync from a host pointer", ErrorCode::InvalidArgument,
                [&] { r.dev.memcpyAsync(r.a, r.host.data(), 64, r.s); });
    expectError("Device::synchronize of an unknown stream", ErrorCode::InvalidArgument, [&] { r.dev.synchronize(unknown); });
    expectError("Device::destroyStream of an unknown stream", ErrorCode::InvalidArgument,
                [&] { r.dev.destroyStream(unknown); });
  }
  expectError("Device::open(\"tpu\")", ErrorCode::InvalidArgument, [] { hoccl::Device::open("tpu"); }, "Device::open");
  expectError("Device::open with a negative ordinal", ErrorCode::InvalidArgument, [] { hoccl::Device::open("host", -1); });
  // A backend name that is not UTF-8: the bridge's string conversion must not escape as
  // another exception type.
  expectError("Device::open with a name that is not UTF-8", ErrorCode::InvalidArgument,
              [] { hoccl::Device::open(std::string("\xff\xfe", 2)); }, "Device::open");
  // The codec's host calls with sizes that overflow or a type it does not encode.
  expectError("codec::decompress of SIZE_MAX / 2 values", ErrorCode::InvalidArgument,
              [] { hoccl::codec::decompress(DataType::Bfloat16, std::vector<std::uint8_t>(64), SIZE_MAX / 2); }, "decompress");
  expectError("codec::compress of int32", ErrorCode::InvalidArgument,
              [&] { hoccl::codec::compress(DataType::Int32, r.host.data(), 16); }, "compress");
  expectError("codec::maxCompressedLen of SIZE_MAX values", ErrorCode::InvalidArgument,
              [] { hoccl::codec::maxCompressedLen(DataType::Bfloat16, SIZE_MAX); });
  good(r, ci, "device calls");
}

// Creation from bad unique ids and ranks: each refused at once with InvalidArgument; the id
// still works afterwards.
void creation() {
  hoccl::UniqueId id = hoccl::UniqueId::create();
  hoccl::UniqueId zero, random = id, magic = id, secret = id;
  std::uint64_t x = 0x243F6A8885A308D3ull;
  for (auto& b : random.bytes) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<std::uint8_t>(x);
  }
  magic.bytes[0] ^= 0xff;
  for (std::size_t i = kSecretAt; i < kSecretAt + kSecretLen; ++i) secret.bytes[i] ^= 0x5a;
  // A bad rank is named by the method; a bad id by the bootstrap, which says what is wrong
  // with the id.
  const struct {
    const char* what;
    const hoccl::UniqueId* id;
    int nranks, rank;
    const char* names;
  } cases[] = {
      {"nranks 0", &id, 0, 0, "fromUniqueId"},
      {"nranks -1", &id, -1, 0, "fromUniqueId"},
      {"rank -1", &id, 2, -1, "fromUniqueId"},
      {"rank = nranks", &id, 2, 2, "fromUniqueId"},
      {"rank INT_MAX", &id, 2, INT_MAX, "fromUniqueId"},
      {"a zero id", &zero, 1, 0, "not a hoccl unique id"},
      {"a random id", &random, 1, 0, "not a hoccl unique id"},
      {"an id with a flipped magic", &magic, 1, 0, "not a hoccl unique id"},
      {"a wrong secret", &secret, 2, 1, "wrong secret"},
  };
  for (const auto& c : cases) {
    const auto t0 = std::chrono::steady_clock::now();
    expectError(std::string("fromUniqueId with ") + c.what, ErrorCode::InvalidArgument,
                [&] { hoccl::Communicator::fromUniqueId(*c.id, c.nranks, c.rank); }, c.names);
    // Generous for a loaded machine: a refusal needs no peer, so no wait at all.
    expect(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5), std::string(c.what) + ": refused after 5 s or more");
  }
  try {
    hoccl::Communicator c = hoccl::Communicator::fromUniqueId(id, 1, 0);
    expect(c.rank() == 0 && c.size() == 1, "the id after the refusals: rank() and size()");
    c.destroy();
  } catch (const std::exception& e) {
    fail(std::string("the id after the refusals: ") + e.what());
  }
}

hoccl::Communicator solo() { return hoccl::Communicator::fromUniqueId(hoccl::UniqueId::create(), 1, 0); }

int rankMain(int rank, int nranks, const void* idp, void*) {
  myRank = rank;
  hoccl::UniqueId id;
  std::memcpy(id.bytes.data(), idp, id.bytes.size());
  int cases = 0;
  try {
    hoccl::Communicator comm = hoccl::Communicator::fromUniqueId(id, nranks, rank);
    hoccl::Device dev = comm.device();
    const bool cuda = dev.backend() == "cuda";
    // The handle faults' communicators, each its own rank 0 of 1.
    hoccl::Communicator movedFrom = solo(), destroyed = solo(), aborted = solo();
    hoccl::Communicator movedTo(std::move(movedFrom));
    destroyed.destroy();
    aborted.abort();
    Rank r{comm, dev, dev.createStream(), dev.alloc(kBytes), dev.alloc(kBytes), nullptr,
           std::vector<std::uint8_t>(kBytes), movedFrom, destroyed, aborted, rank, nranks};
    cases = table(r, cuda);
    handles(r);
    groups(r, cases);
    device(r, cuda, cases + 2);
    creation();
    good(r, cases + 3, "creation with bad arguments");
    expect(!comm.asyncError().has_value(), "no asynchronous error after the refused calls");
    movedTo.destroy();
    dev.free(r.a);
    dev.free(r.b);
    dev.destroyStream(r.s);
    comm.destroy();
  } catch (const std::exception& e) {
    fail(std::string("unexpected exception: ") + e.what());
  }
  std::printf("bad_input_cpp_check: rank %d: %d table cases, %d refusals checked, %d failures\n", rank, cases, checked,
              failures);
  return failures != 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int nranks = argc > 1 ? std::atoi(argv[1]) : 2;
  setenv("HOCCL_TIMEOUT_MS", "30000", 0);
  const int rc = spawn_ranks(nranks, hoccl::UniqueId::kBytes, makeUniqueId, rankMain, const_cast<char*>("bad_input_cpp_check"));
  std::printf("bad_input_cpp_check: %s (%d ranks)\n", rc == 0 ? "OK" : "FAILED", nranks);
  return rc;
}
