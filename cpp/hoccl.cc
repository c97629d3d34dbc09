// The C++ API of include/hoccl/hoccl.hpp, on the cxx bridge (src/ffi/bridge.rs). Compiled
// into the static library by build.rs. Every bridge call returns a bridge::Status, which
// check() turns into hoccl::Error; every operation fills one bridge::OpArgs and goes
// through Comm::enqueue, the descriptor the C ABI fills too.
#include "hoccl/hoccl.hpp"

#include <algorithm>
#include <cstdint>

namespace hoccl {
namespace detail {

struct DevAccess {
  static const bridge::Dev& of(const Device& d, const char* what) { return d.d(what); }
};

}  // namespace detail

namespace {

void check(const bridge::Status& s) {
  if (s.code != 0) throw Error(static_cast<ErrorCode>(s.code), std::string(s.message));
}
const std::uint8_t* bytes(const void* p) noexcept { return static_cast<const std::uint8_t*>(p); }
std::uint8_t* bytes(void* p) noexcept { return static_cast<std::uint8_t*>(p); }
std::int32_t raw(DataType t) noexcept { return static_cast<std::int32_t>(t); }
rust::Slice<const std::size_t> slice(const std::vector<std::size_t>& v) noexcept {
  return rust::Slice<const std::size_t>(v.data(), v.size());
}
void hostCheck(const char* what, const void* p, std::size_t bytes) {
  if (p == nullptr && bytes > 0) throw Error(ErrorCode::InvalidArgument, std::string(what) + ": host pointer is null");
}
// Bytes of `count` values of `t`; InvalidArgument when that overflows what a buffer can hold
// (so that no size wraps around before it reaches the bridge).
std::size_t byteSize(const char* what, DataType t, std::size_t count) {
  const std::size_t es = sizeOf(t);
  if (es != 0 && count > static_cast<std::size_t>(PTRDIFF_MAX) / es)
    throw Error(ErrorCode::InvalidArgument, std::string(what) + ": " + std::to_string(count) + " values overflow the address space");
  return count * es;
}
// A rust::Str of `s`; cxx refuses text that is not UTF-8 with std::invalid_argument, which
// must reach the caller as a hoccl::Error like every other failure.
rust::Str str(const char* what, const std::string& s) {
  try {
    return rust::Str(s);
  } catch (const std::invalid_argument&) {
    throw Error(ErrorCode::InvalidArgument, std::string(what) + ": the name is not UTF-8");
  }
}

// The descriptor of an operation without per-peer counts; `root` is the peer or root where
// `kind` has one.
bridge::OpArgs op(bridge::OpKind kind, const void* send, void* recv, std::size_t count, DataType t, int root,
                  Stream s) {
  bridge::OpArgs a{};
  a.kind = kind;
  a.send = bytes(send);
  a.recv = bytes(recv);
  a.count = count;
  a.dtype = raw(t);
  a.root = root;
  a.stream = s;
  return a;
}

}  // namespace

std::string version() { return std::string(bridge::version()); }

// ---------------------------------------------------------------- Device -----------------

Device Device::open(const std::string& backend, int ordinal) {
  if (ordinal < 0) throw Error(ErrorCode::InvalidArgument, "Device::open: negative ordinal");
  bridge::Status st;
  rust::Box<bridge::Dev> d = bridge::device_open(str("Device::open", backend), static_cast<std::size_t>(ordinal), st);
  check(st);
  return Device(std::move(d));
}
std::string Device::backend() const { return std::string(d("backend").backend()); }
std::string Device::name() const { return std::string(d("name").name()); }
int Device::ordinal() const { return static_cast<int>(d("ordinal").ordinal()); }

void* Device::alloc(std::size_t bytes) const {
  bridge::Status st;
  void* p = d("Device::alloc").alloc(bytes, st);
  check(st);
  return p;
}
void Device::free(void* p) const { check(d("Device::free").free(bytes(p))); }
Stream Device::createStream() const {
  bridge::Status st;
  Stream s = d("Device::createStream").create_stream(st);
  check(st);
  return s;
}
void Device::destroyStream(Stream s) const { check(d("Device::destroyStream").destroy_stream(s)); }
void Device::synchronize(Stream s) const { check(d("Device::synchronize").synchronize(s)); }
void Device::copyToHost(void* dstHost, const void* srcDev, std::size_t n) const {
  hostCheck("Device::copyToHost", dstHost, n);
  rust::Slice<std::uint8_t> dst(dstHost ? bytes(dstHost) : nullptr, dstHost ? n : 0);
  check(d("Device::copyToHost").copy_to_host(dst, bytes(srcDev)));
}
void Device::copyFromHost(void* dstDev, const void* srcHost, std::size_t n) const {
  hostCheck("Device::copyFromHost", srcHost, n);
  rust::Slice<const std::uint8_t> src(srcHost ? bytes(srcHost) : nullptr, srcHost ? n : 0);
  check(d("Device::copyFromHost").copy_from_host(bytes(dstDev), src));
}
void Device::memcpyAsync(void* dst, const void* src, std::size_t n, Stream s) const {
  check(d("Device::memcpyAsync").memcpy_async(bytes(dst), bytes(src), n, s));
}

// ---------------------------------------------------------------- codec ------------------

namespace codec {

std::size_t maxCompressedLen(DataType t, std::size_t count, Params p) {
  bridge::Status st;
  std::size_t n = bridge::codec_max_compressed_len(raw(t), count, p.block, p.tiers, st);
  check(st);
  return n;
}

std::vector<std::uint8_t> compress(DataType t, const void* host, std::size_t count, Params p) {
  const std::size_t n = byteSize("codec::compress", t, count);
  if (host == nullptr && count > 0) throw Error(ErrorCode::InvalidArgument, "codec::compress: host pointer is null");
  bridge::Status st;
  rust::Vec<std::uint8_t> v = bridge::codec_compress(
      raw(t), rust::Slice<const std::uint8_t>(host ? bytes(host) : nullptr, host ? n : 0), p.block, p.tiers, st);
  check(st);
  return std::vector<std::uint8_t>(v.begin(), v.end());
}

void decompress(DataType t, const void* stream, std::size_t streamBytes, void* host, std::size_t count) {
  if ((stream == nullptr && streamBytes > 0) || (host == nullptr && count > 0))
    throw Error(ErrorCode::InvalidArgument, "codec::decompress: null pointer");
  rust::Slice<const std::uint8_t> in(stream ? bytes(stream) : nullptr, stream ? streamBytes : 0);
  rust::Slice<std::uint8_t> out(host ? bytes(host) : nullptr, host ? byteSize("codec::decompress", t, count) : 0);
  check(bridge::codec_decompress(raw(t), in, out));
}
std::vector<std::uint8_t> decompress(DataType t, const std::vector<std::uint8_t>& stream, std::size_t count) {
  const std::size_t n = byteSize("codec::decompress", t, count);
  std::vector<std::uint8_t> out;
  try {
    out.resize(n);
  } catch (const std::exception&) {  // std::bad_alloc, std::length_error
    throw Error(ErrorCode::System, "codec::decompress: cannot allocate " + std::to_string(n) + " bytes for the output");
  }
  decompress(t, stream.data(), stream.size(), out.data(), count);
  return out;
}

void compressAsync(const Device& dev, DataType t, const void* input, std::size_t count, void* output,
                   std::size_t outputCap, std::uint64_t* outLen, Stream s, Params p) {
  check(detail::DevAccess::of(dev, "codec::compressAsync")
            .compress_async(raw(t), bytes(input), count, bytes(output), outputCap, outLen, p.block, p.tiers, s));
}

void decompressAsync(const Device& dev, DataType t, const void* input, std::size_t inputLen, void* output,
                     std::size_t count, std::uint32_t* status, Stream s) {
  check(detail::DevAccess::of(dev, "codec::decompressAsync")
            .decompress_async(raw(t), bytes(input), inputLen, bytes(output), count, status, s));
}

void checkStatus(std::uint32_t statusWord) { check(bridge::codec_status(statusWord)); }

}  // namespace codec

// ---------------------------------------------------------------- Communicator -----------

rust::Box<bridge::Comm> Communicator::create(std::int32_t mpiCommF) {
  bridge::Status st;
  rust::Box<bridge::Comm> b = bridge::comm_init_mpi(mpiCommF, st);
  check(st);
  return b;
}

UniqueId UniqueId::create() {
  bridge::Status st;
  rust::Vec<std::uint8_t> v = bridge::unique_id(st);
  check(st);
  if (v.size() != kBytes) throw Error(ErrorCode::Internal, "UniqueId::create: the id is not 128 bytes");
  UniqueId id;
  std::copy(v.begin(), v.end(), id.bytes.begin());
  return id;
}

Communicator Communicator::fromUniqueId(const UniqueId& id, int nranks, int rank) {
  bridge::Status st;
  rust::Box<bridge::Comm> b =
      bridge::comm_init_unique_id(rust::Slice<const std::uint8_t>(id.bytes.data(), id.bytes.size()), nranks, rank, st);
  check(st);
  return Communicator(std::move(b));
}

Communicator& Communicator::operator=(Communicator&& o) noexcept {
  if (this != &o) {
    release();
    impl_ = std::move(o.impl_);
  }
  return *this;
}
Communicator::~Communicator() { release(); }
void Communicator::release() noexcept {
  if (const bridge::Comm* p = impl_.get()) (void)p->release();  // logs its own failure
}

void Communicator::destroy() { check(c("destroy").destroy()); }
void Communicator::abort() { check(c("abort").abort()); }
std::optional<Error> Communicator::asyncError() const {
  bridge::Status call;
  bridge::Status e = c("asyncError").async_error(call);
  check(call);
  if (e.code == 0) return std::nullopt;
  return Error(static_cast<ErrorCode>(e.code), std::string(e.message));
}
void Communicator::waitIdle() const { check(c("waitIdle").wait_idle()); }

int Communicator::rank() const {
  bridge::Status st;
  int r = c("rank").rank(st);
  check(st);
  return r;
}
int Communicator::size() const {
  bridge::Status st;
  int n = c("size").size(st);
  check(st);
  return n;
}
Device Communicator::device() const {
  bridge::Status st;
  rust::Box<bridge::Dev> d = c("device").device(st);
  check(st);
  return Device(std::move(d));
}

void Communicator::groupStart() { check(c("groupStart").group_start()); }
void Communicator::groupEnd() { check(c("groupEnd").group_end()); }

void Communicator::enqueue(const char* what, const bridge::OpArgs& a) const { check(c(what).enqueue(a)); }

void Communicator::send(const void* buf, std::size_t count, DataType t, int peer, Stream s) {
  enqueue("send", op(bridge::OpKind::Send, buf, nullptr, count, t, peer, s));
}
void Communicator::recv(void* buf, std::size_t count, DataType t, int peer, Stream s) {
  enqueue("recv", op(bridge::OpKind::Recv, nullptr, buf, count, t, peer, s));
}
void Communicator::allGather(const void* send, void* recv, std::size_t count, DataType t, Stream s) {
  enqueue("allGather", op(bridge::OpKind::AllGather, send, recv, count, t, 0, s));
}
void Communicator::allToAll(const void* send, void* recv, std::size_t count, DataType t, Stream s) {
  enqueue("allToAll", op(bridge::OpKind::AllToAll, send, recv, count, t, 0, s));
}
void Communicator::allToAllv(const void* send, const std::vector<std::size_t>& sendCounts,
                             const std::vector<std::size_t>& sendDispls, void* recv,
                             const std::vector<std::size_t>& recvCounts, const std::vector<std::size_t>& recvDispls,
                             DataType t, Stream s) {
  bridge::OpArgs a = op(bridge::OpKind::AllToAllV, send, recv, 0, t, 0, s);
  a.send_counts = slice(sendCounts);
  a.send_displs = slice(sendDispls);
  a.recv_counts = slice(recvCounts);
  a.recv_displs = slice(recvDispls);
  enqueue("allToAllv", a);
}
void Communicator::broadcast(const void* send, void* recv, std::size_t count, DataType t, int root, Stream s) {
  enqueue("broadcast", op(bridge::OpKind::Broadcast, send, recv, count, t, root, s));
}
void Communicator::gather(const void* send, void* recv, std::size_t count, DataType t, int root, Stream s) {
  enqueue("gather", op(bridge::OpKind::Gather, send, recv, count, t, root, s));
}
void Communicator::scatter(const void* send, void* recv, std::size_t count, DataType t, int root, Stream s) {
  enqueue("scatter", op(bridge::OpKind::Scatter, send, recv, count, t, root, s));
}
void Communicator::allReduce(const void* send, void* recv, std::size_t count, DataType t, RedOp o, Stream s) {
  bridge::OpArgs a = op(bridge::OpKind::AllReduce, send, recv, count, t, 0, s);
  a.red_op = static_cast<std::int32_t>(o);
  enqueue("allReduce", a);
}
void Communicator::reduceScatter(const void* send, void* recv, std::size_t recvCount, DataType t, RedOp o, Stream s) {
  bridge::OpArgs a = op(bridge::OpKind::ReduceScatter, send, recv, recvCount, t, 0, s);
  a.red_op = static_cast<std::int32_t>(o);
  enqueue("reduceScatter", a);
}
void Communicator::reduce(const void* send, void* recv, std::size_t count, DataType t, RedOp o, int root, Stream s) {
  bridge::OpArgs a = op(bridge::OpKind::Reduce, send, recv, count, t, root, s);
  a.red_op = static_cast<std::int32_t>(o);
  enqueue("reduce", a);
}

// ---------------------------------------------------------------- Group ------------------

Group::~Group() {
  if (comm_ == nullptr) return;
  try {
    comm_->groupEnd();
  } catch (const std::exception& e) {
    try {
      bridge::log_error(std::string("~Group: ") + e.what());
    } catch (...) {  // a message that is not UTF-8: a destructor must not throw
    }
  }
}
void Group::end() {
  Communicator* c = comm_;
  comm_ = nullptr;
  if (c == nullptr) throw Error(ErrorCode::InvalidUsage, "Group::end: the group was already ended");
  c->groupEnd();
}

}  // namespace hoccl
