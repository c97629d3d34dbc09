// The codec through hoccl.hpp (hoccl::codec) under MPI, every rank on its own data: host
// round trips of generated bf16/fp16/fp32 values, corrupt streams rejected with CorruptData,
// bad arguments with InvalidArgument, and the stream-ordered device calls on the
// communicator's device (the host backend in CI, CUDA on a GPU) and on Device::open("host").
#include <cmath>
#include <cstring>

#include "test_util.hpp"

namespace {

using hoccl::DataType;
using hoccl::ErrorCode;
namespace codec = hoccl::codec;

// `n` bf16 values drawn like trained weights (a normal of std 0.02, rounded to nearest even).
test::Bytes bf16Values(std::size_t n, std::uint64_t seed) {
  test::Bytes out(2 * n);
  std::uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  auto uniform = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return (static_cast<double>(s >> 11) + 0.5) / 9007199254740992.0;
  };
  for (std::size_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(0.02 * std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform()));
    std::uint32_t u = 0;
    std::memcpy(&u, &x, 4);
    const std::uint16_t b = static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    out[2 * i] = static_cast<std::uint8_t>(b);
    out[2 * i + 1] = static_cast<std::uint8_t>(b >> 8);
  }
  return out;
}

void hostRoundTrips(test::Checker& ck, int rank) {
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{1000}, std::size_t{16384 * 3 + 77}}) {
    const test::Bytes data = bf16Values(n, 100 + static_cast<std::uint64_t>(rank) + n);
    const std::string what = "bf16 n=" + std::to_string(n);
    for (std::uint8_t tiers : {std::uint8_t{1}, std::uint8_t{2}}) {
      const codec::Params p{0, tiers};
      const std::vector<std::uint8_t> s = codec::compress(DataType::Bfloat16, data.data(), n, p);
      ck.expect(s.size() <= codec::maxCompressedLen(DataType::Bfloat16, n, p), what + ": within maxCompressedLen");
      if (n > 1000) ck.expect(s.size() < data.size() * 3 / 4, what + ": normal bf16 compresses below 0.75");
      ck.compare(what + " tiers=" + std::to_string(tiers), codec::decompress(DataType::Bfloat16, s, n), data, 2);
    }
  }
  // fp16 and fp32 bit patterns, whatever they are, come back exactly.
  const test::Bytes raw = test::data(7, rank, 4 * 5000);
  ck.compare("f32 patterns", codec::decompress(DataType::Float32, codec::compress(DataType::Float32, raw.data(), 5000), 5000), raw, 4);
  ck.compare("f16 patterns", codec::decompress(DataType::Float16, codec::compress(DataType::Float16, raw.data(), 10000), 10000), raw, 2);
}

void hostErrors(test::Checker& ck, int rank) {
  const std::size_t n = 40000;
  const test::Bytes data = bf16Values(n, 7 + static_cast<std::uint64_t>(rank));
  const std::vector<std::uint8_t> good = codec::compress(DataType::Bfloat16, data.data(), n);
  std::vector<std::uint8_t> out(2 * n);
  auto corrupt = [&](const std::string& what, std::vector<std::uint8_t> s) {
    ck.expectThrows(what, ErrorCode::CorruptData, [&] { codec::decompress(DataType::Bfloat16, s.data(), s.size(), out.data(), n); });
  };
  std::vector<std::uint8_t> s = good;
  s[0] ^= 1;
  corrupt("wrong magic", s);
  s = good;
  s.resize(s.size() / 2);
  corrupt("truncated stream", s);
  s = good;
  s[24] = 0xff;  // block 0's size
  s[25] = 0xff;
  corrupt("bad block size", s);
  s = good;
  s[24 + 4 * 3 + 1] ^= 0xc0;  // block 0's header word: reserved bits
  corrupt("bad block header", s);
  ck.expectThrows("stream of another dtype", ErrorCode::CorruptData,
                  [&] { codec::decompress(DataType::Float16, good.data(), good.size(), out.data(), 2 * n); });
  ck.expectThrows("wrong count", ErrorCode::InvalidArgument, [&] { codec::decompress(DataType::Bfloat16, good, n - 1); });
  ck.expectThrows("int32 is not a codec type", ErrorCode::InvalidArgument,
                  [&] { codec::compress(DataType::Int32, data.data(), 100); });
  ck.expectThrows("three tiers", ErrorCode::InvalidArgument,
                  [&] { codec::compress(DataType::Bfloat16, data.data(), 100, codec::Params{0, 3}); });
  ck.expectThrows("block not a multiple of 32", ErrorCode::InvalidArgument,
                  [&] { codec::maxCompressedLen(DataType::Bfloat16, 100, codec::Params{100, 2}); });
  ck.expectThrows("null input", ErrorCode::InvalidArgument, [&] { codec::compress(DataType::Bfloat16, nullptr, 10); });
  ck.expect(codec::decompress(DataType::Bfloat16, good, n) == data, "the good stream still decodes");
}

// compressAsync then decompressAsync on one stream, one synchronization; then a corrupt
// stream on the device: the status word names it, checkStatus throws CorruptData.
void deviceRoundTrip(test::Checker& ck, const hoccl::Device& dev, int rank, const std::string& tag) {
  const std::size_t n = 100000;
  const test::Bytes data = bf16Values(n, 1000 + static_cast<std::uint64_t>(rank));
  const std::size_t cap = codec::maxCompressedLen(DataType::Bfloat16, n);
  test::DevBuf in(dev, 2 * n), packed(dev, cap), out(dev, 2 * n), words(dev, 16);
  in.upload(data);
  hoccl::Stream s = dev.createStream();
  auto* len = static_cast<std::uint64_t*>(words.ptr());
  auto* status = static_cast<std::uint32_t*>(words.ptr(8));
  codec::compressAsync(dev, DataType::Bfloat16, in.ptr(), n, packed.ptr(), cap, len, s);
  codec::decompressAsync(dev, DataType::Bfloat16, packed.ptr(), cap, out.ptr(), n, status, s);
  dev.synchronize(s);
  test::Bytes w = words.download();
  std::uint64_t streamLen = 0;
  std::uint32_t st = 0;
  std::memcpy(&streamLen, w.data(), 8);
  std::memcpy(&st, w.data() + 8, 4);
  ck.expect(streamLen > 0 && streamLen < 2 * n, tag + ": compressed length " + std::to_string(streamLen));
  ck.expect(st == 0, tag + ": status " + std::to_string(st));
  ck.compare(tag + ": device round trip", out.download(), data, 2);
  // The device stream equals the host one.
  test::Bytes dstream = packed.download();
  dstream.resize(static_cast<std::size_t>(streamLen));
  const std::vector<std::uint8_t> hstream = codec::compress(DataType::Bfloat16, data.data(), n);
  ck.expect(dstream == test::Bytes(hstream.begin(), hstream.end()), tag + ": device bytes == host bytes");
  // Corrupt the first block's header on the device.
  test::Bytes bad = dstream;
  bad[24 + 4 * ((n + 16383) / 16384) + 3] = 0xff;
  packed.upload(bad);
  codec::decompressAsync(dev, DataType::Bfloat16, packed.ptr(), bad.size(), out.ptr(), n, status, s);
  dev.synchronize(s);
  w = words.download();
  std::memcpy(&st, w.data() + 8, 4);
  ck.expect(st != 0, tag + ": corrupt stream accepted on the device");
  ck.expectThrows(tag + ": checkStatus", ErrorCode::CorruptData, [&] { codec::checkStatus(st); });
  ck.expectThrows(tag + ": output too small", ErrorCode::InvalidArgument,
                  [&] { codec::compressAsync(dev, DataType::Bfloat16, in.ptr(), n, packed.ptr(), cap - 1, len, s); });
  dev.destroyStream(s);
}

}  // namespace

int main(int argc, char** argv) {
  int rank = 0, size = 0;
  test::init(&argc, &argv, &rank, &size);
  test::Checker ck("codec_check", rank);
  try {
    hostRoundTrips(ck, rank);
    hostErrors(ck, rank);
    hoccl::Communicator comm(MPI_COMM_WORLD);
    const hoccl::Device dev = comm.device();
    deviceRoundTrip(ck, dev, rank, dev.backend() + " device");
    if (dev.backend() != "host") deviceRoundTrip(ck, hoccl::Device::open("host"), rank, "Device::open(host)");
    ck.expectThrows("Device::open(tpu)", ErrorCode::InvalidArgument, [] { hoccl::Device::open("tpu"); });
    comm.destroy();
  } catch (const std::exception& e) {
    ck.fail(std::string("unexpected exception: ") + e.what());
  }
  return [&] {
    const int r = ck.finish(MPI_COMM_WORLD);
    MPI_Finalize();
    return r;
  }();
}
