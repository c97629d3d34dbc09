// Every collective of the C++ API (hoccl.hpp) under MPI, checked against expectations
// computed here: all data types, zero/odd/multi-chunk counts, misaligned buffers, in-place
// variants, every root, groups of sends and receives, stream ordering with other work, and a
// communicator over a split MPI communicator. Guard bytes around every buffer catch stray
// writes. Exits non-zero on any wrong element.
#include <cstring>
#include <functional>
#include <numeric>
#include <type_traits>

#include "test_util.hpp"

namespace {

using hoccl::DataType;
using test::Bytes;
using test::DevBuf;

struct Ctx {
  hoccl::Communicator& comm;
  const hoccl::Device& dev;
  hoccl::Stream s;
  test::Checker& ck;
  int rank, size;
};

std::string label(const char* op, DataType t, std::size_t count, const std::string& extra = "") {
  return std::string(op) + " dtype " + std::to_string(static_cast<int>(t)) + " count " + std::to_string(count) + extra;
}

void expectBuf(Ctx& c, const std::string& what, const DevBuf& b, const Bytes& want, std::size_t elem) {
  bool guards = false;
  c.ck.compare(what, b.download(&guards), want, elem);
  c.ck.expect(guards, what + ": a guard byte was overwritten");
}

Bytes concat(int n, const std::function<Bytes(int)>& block) {
  Bytes out;
  for (int p = 0; p < n; ++p) {
    Bytes b = block(p);
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}

void allGather(Ctx& c, DataType t, std::size_t count, bool inPlace, std::uint64_t seed) {
  const std::size_t len = count * hoccl::sizeOf(t);
  DevBuf recv(c.dev, len * c.size, count % 2 == 1), send(c.dev, len, count % 3 == 1);
  const void* src = send.ptr();
  if (inPlace) {
    recv.upload(test::data(seed, c.rank, len), c.rank * len);
    src = recv.ptr(c.rank * len);
  } else {
    send.upload(test::data(seed, c.rank, len));
  }
  c.comm.allGather(src, recv.ptr(), count, t, c.s);
  c.dev.synchronize(c.s);
  expectBuf(c, label("allGather", t, count, inPlace ? " in place" : ""), recv,
            concat(c.size, [&](int p) { return test::data(seed, p, len); }), hoccl::sizeOf(t));
}

void allToAll(Ctx& c, DataType t, std::size_t count, std::uint64_t seed) {
  const std::size_t len = count * hoccl::sizeOf(t);
  DevBuf send(c.dev, len * c.size, count % 2 == 0), recv(c.dev, len * c.size, count % 2 == 1);
  send.upload(test::data(seed, c.rank, len * c.size));
  c.comm.allToAll(send.ptr(), recv.ptr(), count, t, c.s);
  c.dev.synchronize(c.s);
  // Block p of recv is block `rank` of rank p's send buffer.
  expectBuf(c, label("allToAll", t, count), recv,
            concat(c.size, [&](int p) { return test::data(seed, p, len, c.rank * len); }), hoccl::sizeOf(t));
}

// Elements rank `from` sends to rank `to` in the variable-count tests (some are zero).
std::size_t pairCount(int from, int to, std::size_t base) {
  return static_cast<std::size_t>((from * 5 + to * 3) % 7) * base + static_cast<std::size_t>((from + to) % 3);
}

// Displacements of consecutive blocks with `gap` unused elements after each.
std::vector<std::size_t> displs(const std::vector<std::size_t>& counts, std::size_t gap) {
  std::vector<std::size_t> d(counts.size());
  for (std::size_t i = 1; i < counts.size(); ++i) d[i] = d[i - 1] + counts[i - 1] + gap;
  return d;
}

// The layout of a variable exchange from this rank's point of view: what it sends to each
// rank and receives from each, with gaps in both buffers.
struct Layout {
  std::vector<std::size_t> sendCounts, sendDispls, recvCounts, recvDispls;
  std::size_t sendElems = 0, recvElems = 0;
  Layout(int rank, int size, std::size_t base) {
    for (int p = 0; p < size; ++p) {
      sendCounts.push_back(pairCount(rank, p, base));
      recvCounts.push_back(pairCount(p, rank, base));
    }
    sendDispls = displs(sendCounts, 2);
    recvDispls = displs(recvCounts, 1);
    sendElems = sendDispls.back() + sendCounts.back() + 2;
    recvElems = recvDispls.back() + recvCounts.back() + 1;
  }
};

// What `recv` holds after rank p sent this rank `recvCounts[p]` elements from its own send
// buffer (data of (seed, p)) at its displacement for this rank; the gaps stay poison.
Bytes variableExpectation(const Ctx& c, const Layout& me, std::size_t base, std::size_t es, std::uint64_t seed) {
  Bytes want(me.recvElems * es, test::kPoison);
  for (int p = 0; p < c.size; ++p) {
    Layout theirs(p, c.size, base);
    Bytes d = test::data(seed, p, me.recvCounts[p] * es, theirs.sendDispls[c.rank] * es);
    std::copy(d.begin(), d.end(), want.begin() + static_cast<std::ptrdiff_t>(me.recvDispls[p] * es));
  }
  return want;
}

void allToAllv(Ctx& c, DataType t, std::size_t base, std::uint64_t seed) {
  const std::size_t es = hoccl::sizeOf(t);
  Layout l(c.rank, c.size, base);
  DevBuf send(c.dev, l.sendElems * es, base % 2 == 1), recv(c.dev, l.recvElems * es);
  send.upload(test::data(seed, c.rank, l.sendElems * es));
  c.comm.allToAllv(send.ptr(), l.sendCounts, l.sendDispls, recv.ptr(), l.recvCounts, l.recvDispls, t, c.s);
  c.dev.synchronize(c.s);
  expectBuf(c, label("allToAllv", t, base), recv, variableExpectation(c, l, base, es, seed), es);
}

// The same exchange as allToAllv, as one group of sends and receives (self included).
void groupedPairs(Ctx& c, DataType t, std::size_t base, std::uint64_t seed) {
  const std::size_t es = hoccl::sizeOf(t);
  Layout l(c.rank, c.size, base);
  DevBuf send(c.dev, l.sendElems * es), recv(c.dev, l.recvElems * es, true);
  send.upload(test::data(seed, c.rank, l.sendElems * es));
  {
    hoccl::Group g(c.comm);
    for (int p = 0; p < c.size; ++p) {
      c.comm.send(send.ptr(l.sendDispls[p] * es), l.sendCounts[p], t, p, c.s);
      c.comm.recv(recv.ptr(l.recvDispls[p] * es), l.recvCounts[p], t, p, c.s);
    }
    g.end();
  }
  c.dev.synchronize(c.s);
  expectBuf(c, label("grouped send/recv", t, base), recv, variableExpectation(c, l, base, es, seed), es);
}

void ring(Ctx& c, DataType t, std::size_t count, std::uint64_t seed) {
  const std::size_t len = count * hoccl::sizeOf(t);
  const int next = (c.rank + 1) % c.size, prev = (c.rank + c.size - 1) % c.size;
  DevBuf send(c.dev, len), recv(c.dev, len);
  send.upload(test::data(seed, c.rank, len));
  {
    hoccl::Group g(c.comm);  // ended by the destructor
    c.comm.send(send.ptr(), count, t, next, c.s);
    c.comm.recv(recv.ptr(), count, t, prev, c.s);
  }
  c.dev.synchronize(c.s);
  expectBuf(c, label("ring send/recv", t, count), recv, test::data(seed, prev, len), hoccl::sizeOf(t));
}

void broadcast(Ctx& c, DataType t, std::size_t count, int root, bool inPlace, std::uint64_t seed) {
  const std::size_t len = count * hoccl::sizeOf(t);
  DevBuf send(c.dev, len), recv(c.dev, len, root % 2 == 1);
  const void* src = nullptr;  // only read on the root
  if (c.rank == root && inPlace) {
    recv.upload(test::data(seed, root, len));
    src = recv.ptr();
  } else if (c.rank == root) {
    send.upload(test::data(seed, root, len));
    src = send.ptr();
  }
  c.comm.broadcast(src, recv.ptr(), count, t, root, c.s);
  c.dev.synchronize(c.s);
  expectBuf(c, label("broadcast", t, count, " root " + std::to_string(root) + (inPlace ? " in place" : "")), recv,
            test::data(seed, root, len), hoccl::sizeOf(t));
}

void gather(Ctx& c, DataType t, std::size_t count, int root, bool inPlace, std::uint64_t seed) {
  const std::size_t len = count * hoccl::sizeOf(t);
  DevBuf send(c.dev, len, true), recv(c.dev, len * c.size);
  const void* src = send.ptr();
  void* dst = c.rank == root ? recv.ptr() : nullptr;  // only used on the root
  if (c.rank == root && inPlace) {
    recv.upload(test::data(seed, root, len), root * len);
    src = recv.ptr(root * len);
  } else {
    send.upload(test::data(seed, c.rank, len));
  }
  c.comm.gather(src, dst, count, t, root, c.s);
  c.dev.synchronize(c.s);
  std::string what = label("gather", t, count, " root " + std::to_string(root) + (inPlace ? " in place" : ""));
  Bytes want = c.rank == root ? concat(c.size, [&](int p) { return test::data(seed, p, len); })
                              : Bytes(len * c.size, test::kPoison);
  expectBuf(c, what, recv, want, hoccl::sizeOf(t));
}

void scatter(Ctx& c, DataType t, std::size_t count, int root, bool inPlace, std::uint64_t seed) {
  const std::size_t len = count * hoccl::sizeOf(t);
  DevBuf send(c.dev, len * c.size), recv(c.dev, len, true);
  const void* src = nullptr;  // only read on the root
  void* dst = recv.ptr();
  if (c.rank == root) {
    send.upload(test::data(seed, root, len * c.size));
    src = send.ptr();
    if (inPlace) dst = send.ptr(root * len);
  }
  c.comm.scatter(src, dst, count, t, root, c.s);
  c.dev.synchronize(c.s);
  std::string what = label("scatter", t, count, " root " + std::to_string(root) + (inPlace ? " in place" : ""));
  if (c.rank == root && inPlace) {
    expectBuf(c, what, send, test::data(seed, root, len * c.size), hoccl::sizeOf(t));
  } else {
    expectBuf(c, what, recv, test::data(seed, root, len, c.rank * len), hoccl::sizeOf(t));
  }
}

// ---- reductions: a fold in rank order computed here, for types whose arithmetic C++ fixes
// exactly (integers wrap through their unsigned type; floats hold small integers, so every
// sum and product is exact and Avg rounds once, as hoccl's).
template <class T> T elem(std::uint64_t seed, int rank, std::size_t i) {
  if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(static_cast<int>(test::value(seed, rank, i) % 9) - 4);
  } else {
    std::uint64_t u = 0;  // little-endian bytes of the pattern
    for (std::size_t b = 0; b < sizeof(T); ++b) u |= std::uint64_t{test::value(seed, rank, i * sizeof(T) + b)} << (8 * b);
    T v;
    std::memcpy(&v, &u, sizeof(T));
    return v;
  }
}

// The type the arithmetic runs in: T itself for floats, its unsigned type for integers.
template <class T, bool = std::is_floating_point_v<T>> struct Arith { using type = T; };
template <class T> struct Arith<T, false> { using type = std::make_unsigned_t<T>; };

template <class T> T step(hoccl::RedOp op, T a, T b) {
  using U = typename Arith<T>::type;
  switch (op) {
    case hoccl::RedOp::Sum: case hoccl::RedOp::Avg: return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
    case hoccl::RedOp::Prod: return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
    case hoccl::RedOp::Max: return b > a ? b : a;
    case hoccl::RedOp::Min: return b < a ? b : a;
  }
  return a;
}

template <class T> Bytes folded(hoccl::RedOp op, std::uint64_t seed, int n, std::size_t from, std::size_t count) {
  std::vector<T> out(count);
  for (std::size_t i = 0; i < count; ++i) {
    T acc = elem<T>(seed, 0, from + i);
    for (int p = 1; p < n; ++p) acc = step(op, acc, elem<T>(seed, p, from + i));
    if (op == hoccl::RedOp::Avg) {
      if constexpr (std::is_floating_point_v<T>) acc = acc / static_cast<T>(n);
      else acc = static_cast<T>(acc / static_cast<T>(n));
    }
    out[i] = acc;
  }
  Bytes b(count * sizeof(T));
  if (count) std::memcpy(b.data(), out.data(), b.size());
  return b;
}

template <class T> Bytes inputOf(std::uint64_t seed, int rank, std::size_t count) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = elem<T>(seed, rank, i);
  Bytes b(count * sizeof(T));
  if (count) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

const char* opName(hoccl::RedOp op) {
  static const char* names[] = {"sum", "prod", "max", "min", "avg"};
  return names[static_cast<int>(op)];
}

// AllReduce, ReduceScatter and Reduce (every root) of type T with `op`, in place or not.
template <class T> void reductions(Ctx& c, hoccl::RedOp op, std::size_t count, bool inPlace, std::uint64_t seed) {
  const DataType t = hoccl::dataTypeOf<T>();
  const std::size_t len = count * sizeof(T);
  const std::string sfx = std::string(" ") + opName(op) + (inPlace ? " in place" : "");
  {
    DevBuf send(c.dev, len, true), recv(c.dev, len, count % 2 == 0);
    DevBuf& in = inPlace ? recv : send;
    in.upload(inputOf<T>(seed, c.rank, count));
    c.comm.allReduce(in.ptr(), recv.ptr(), count, t, op, c.s);
    c.dev.synchronize(c.s);
    expectBuf(c, label("allReduce", t, count, sfx), recv, folded<T>(op, seed, c.size, 0, count), sizeof(T));
  }
  {
    DevBuf send(c.dev, len * c.size, count % 2 == 1), recv(c.dev, len);
    send.upload(inputOf<T>(seed + 1, c.rank, count * c.size));
    void* dst = inPlace ? send.ptr(c.rank * len) : recv.ptr();
    c.comm.reduceScatter(send.ptr(), dst, count, t, op, c.s);
    c.dev.synchronize(c.s);
    Bytes want = folded<T>(op, seed + 1, c.size, c.rank * count, count);
    if (inPlace) {
      Bytes all = inputOf<T>(seed + 1, c.rank, count * c.size);
      std::copy(want.begin(), want.end(), all.begin() + static_cast<std::ptrdiff_t>(c.rank * len));
      expectBuf(c, label("reduceScatter", t, count, sfx), send, all, sizeof(T));
    } else {
      expectBuf(c, label("reduceScatter", t, count, sfx), recv, want, sizeof(T));
    }
  }
  for (int root = 0; root < c.size; ++root) {
    DevBuf send(c.dev, len), recv(c.dev, len, true);
    DevBuf& in = inPlace && c.rank == root ? recv : send;
    in.upload(inputOf<T>(seed + 2, c.rank, count));
    c.comm.reduce(in.ptr(), recv.ptr(), count, t, op, root, c.s);
    c.dev.synchronize(c.s);
    std::string what = label("reduce", t, count, sfx + " root " + std::to_string(root));
    if (c.rank == root) {
      expectBuf(c, what, recv, folded<T>(op, seed + 2, c.size, 0, count), sizeof(T));
    } else {
      expectBuf(c, what, recv, Bytes(len, test::kPoison), sizeof(T));
    }
  }
}

template <class T> void allReductions(Ctx& c, std::size_t count, std::uint64_t& seed) {
  for (hoccl::RedOp op : {hoccl::RedOp::Sum, hoccl::RedOp::Prod, hoccl::RedOp::Max, hoccl::RedOp::Min,
                          hoccl::RedOp::Avg}) {
    reductions<T>(c, op, count, false, seed += 3);
    reductions<T>(c, op, count, true, seed += 3);
  }
}

// Bad reduction arguments are hoccl::Error(InvalidArgument) and leave the communicator usable.
void badReductions(Ctx& c) {
  DevBuf b(c.dev, 64);
  auto code = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const hoccl::Error& e) {
      return e.code();
    }
    return hoccl::ErrorCode::Success;
  };
  c.ck.expect(code([&] { c.comm.allReduce(b.ptr(), b.ptr(), 4, DataType::Int32, static_cast<hoccl::RedOp>(9), c.s); }) ==
                  hoccl::ErrorCode::InvalidArgument,
              "allReduce with operator 9 is InvalidArgument");
  c.ck.expect(code([&] { c.comm.reduce(b.ptr(), b.ptr(), 4, DataType::Int32, hoccl::RedOp::Sum, c.size, c.s); }) ==
                  hoccl::ErrorCode::InvalidArgument,
              "reduce with root == size is InvalidArgument");
}

// Work before and after a collective on the same stream, one synchronize at the end: the
// collective must wait for the copy before it, and the copy after it must see its result.
void streamOrder(Ctx& c, std::size_t count, std::uint64_t seed) {
  const std::size_t len = count * 4;
  DevBuf staged(c.dev, len), send(c.dev, len), recv(c.dev, len * c.size), out(c.dev, len * c.size);
  staged.upload(test::data(seed, c.rank, len));
  c.dev.memcpyAsync(send.ptr(), staged.ptr(), len, c.s);
  c.comm.allGather(send.ptr(), recv.ptr(), count, DataType::Float32, c.s);
  c.dev.memcpyAsync(out.ptr(), recv.ptr(), len * c.size, c.s);
  c.dev.synchronize(c.s);
  expectBuf(c, "stream order (copy, allGather, copy)", out,
            concat(c.size, [&](int p) { return test::data(seed, p, len); }), 4);
}

// A communicator over MPI_Comm_split(parity): ranks, size, one AllGather on its own stream.
void splitCommunicator(test::Checker& ck, int worldRank, std::uint64_t seed) {
  MPI_Comm sub;
  MPI_Comm_split(MPI_COMM_WORLD, worldRank % 2, worldRank, &sub);
  int r = 0, n = 0;
  MPI_Comm_rank(sub, &r);
  MPI_Comm_size(sub, &n);
  {
    hoccl::Communicator comm(sub);
    ck.expect(comm.rank() == r && comm.size() == n, "split communicator: rank/size differ from MPI's");
    hoccl::Device dev = comm.device();
    hoccl::Stream s = dev.createStream();
    Ctx c{comm, dev, s, ck, r, n};
    allGather(c, DataType::Int32, 513, false, seed);
    comm.destroy();
    dev.destroyStream(s);
  }
  MPI_Comm_free(&sub);
}

void run(Ctx& c) {
  const DataType all[] = {DataType::Int8,    DataType::Uint8,   DataType::Int32,    DataType::Uint32,
                          DataType::Int64,   DataType::Uint64,  DataType::Float16,  DataType::Float32,
                          DataType::Float64, DataType::Bfloat16, DataType::Float8e4m3, DataType::Float8e5m2};
  std::uint64_t seed = 1000;
  for (DataType t : all) {
    allGather(c, t, 37, false, ++seed);
    allToAll(c, t, 37, ++seed);
    allToAllv(c, t, 5, ++seed);
    broadcast(c, t, 37, c.size - 1, false, ++seed);
  }
  // Zero, one, odd and many-chunk counts (tests run with 64 KiB chunks).
  for (DataType t : {DataType::Uint8, DataType::Float32}) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{4099}, std::size_t{70001}}) {
      allGather(c, t, count, false, ++seed);
      allGather(c, t, count, true, ++seed);
      allToAll(c, t, count, ++seed);
      allToAllv(c, t, count / 3, ++seed);
      groupedPairs(c, t, count / 3, ++seed);
      ring(c, t, count, ++seed);
      for (int root = 0; root < c.size; ++root) {
        broadcast(c, t, count, root, false, ++seed);
        gather(c, t, count, root, false, ++seed);
        scatter(c, t, count, root, false, ++seed);
      }
      broadcast(c, t, count, 0, true, ++seed);
      gather(c, t, count, c.size - 1, true, ++seed);
      scatter(c, t, count, c.size / 2, true, ++seed);
    }
  }
  streamOrder(c, 100003, ++seed);
  // Reductions: every operator, zero/one/odd/multi-chunk counts, in place and out of place.
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{4099}, std::size_t{70001}}) {
    allReductions<std::int32_t>(c, count, seed);
    allReductions<float>(c, count, seed);
  }
  for (std::size_t count : {std::size_t{1}, std::size_t{777}}) {
    allReductions<std::int8_t>(c, count, seed);
    allReductions<std::uint8_t>(c, count, seed);
    allReductions<std::uint32_t>(c, count, seed);
    allReductions<std::int64_t>(c, count, seed);
    allReductions<std::uint64_t>(c, count, seed);
    allReductions<double>(c, count, seed);
  }
  badReductions(c);
}

}  // namespace

int main(int argc, char** argv) {
  int rank = 0, size = 0;
  test::init(&argc, &argv, &rank, &size);
  test::Checker ck("collectives_check", rank);
  try {
    hoccl::Communicator comm(MPI_COMM_WORLD);
    ck.expect(comm.rank() == rank && comm.size() == size, "rank/size differ from MPI's");
    hoccl::Device dev = comm.device();
    hoccl::Stream s = dev.createStream();
    Ctx c{comm, dev, s, ck, rank, size};
    run(c);
    if (auto e = comm.asyncError()) ck.fail(std::string("unexpected async error: ") + e->what());
    comm.destroy();
    dev.destroyStream(s);
    splitCommunicator(ck, rank, 77);
  } catch (const hoccl::Error& e) {
    ck.fail("hoccl::Error " + std::to_string(static_cast<int>(e.code())) + ": " + e.what());
  }
  int rc = ck.finish(MPI_COMM_WORLD);
  MPI_Finalize();
  return rc;
}
