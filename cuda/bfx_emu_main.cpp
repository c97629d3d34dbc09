// Command-line driver of the bfx kernels under the CPU emulator (bfx_emu.hpp). Built and
// run by tests/codec_emu.rs; it launches the kernels exactly as src/compress/gpu.rs does.
//
//   bfx_emu compress DTYPE B TIERS IN OUT [MISALIGN]   -> writes the stream to OUT
//   bfx_emu decompress DTYPE N IN OUT [CTAS] [MISALIGN] [WAVE] -> prints the status word
//   (WAVE: the wave of the grid's tail, as gpu.rs passes it in flags; 0: none)
//   bfx_emu lookback CASES SEED                         -> prints "lookback ok N" or fails
//   bfx_emu drc DTYPE OP POS TIERS B MISALIGN INPLACE LOCAL DST OUT [STREAM...]
//       -> decompress + reduce + compress (bfx_fused.cu) of the STREAMs with the raw LOCAL
//          input at position POS of the fold: the reduced values to DST, the output stream
//          to OUT; prints the status word (tests/fused_drc.rs)
//   bfx_emu chain DTYPE B TIERS CHUNK IN OUT            -> IN coded by the drc kernel without
//          streams, CHUNK values per launch, into one stream (the look-back across launches)
//
// DTYPE is bf16, f16 or f32; MISALIGN (bytes) shifts the value buffer off 16-byte alignment.
#include "bfx_emu.hpp"
#include "bfx.cu"
#include "bfx_decode.cu"
#include "bfx_fused.cu"

#include <string>

static std::vector<uint8_t> read_file(const char* p) {
    std::vector<uint8_t> v;
    FILE* f = std::fopen(p, "rb");
    if (!f) {
        std::perror(p);
        std::exit(2);
    }
    uint8_t buf[1 << 16];
    size_t r;
    while ((r = std::fread(buf, 1, sizeof buf, f)) > 0) v.insert(v.end(), buf, buf + r);
    std::fclose(f);
    return v;
}

static void write_file(const char* p, const uint8_t* d, size_t n) {
    FILE* f = std::fopen(p, "wb");
    if (!f || std::fwrite(d, 1, n, f) != n) {
        std::perror(p);
        std::exit(2);
    }
    std::fclose(f);
}

static int size_of(const std::string& dt) { return dt == "f32" ? 4 : 2; }
static uint32_t magic_of(const std::string& dt) {
    return dt == "bf16" ? 0x31584642u : dt == "f16" ? 0x31584648u : 0x31584646u;
}

// A 256-byte aligned buffer with `len` usable bytes starting `shift` bytes in.
struct Buf {
    std::vector<uint8_t> mem;
    uint8_t* p;
    Buf(size_t len, size_t shift, uint8_t fill) : mem(len + shift + 512, fill) {
        uintptr_t a = (reinterpret_cast<uintptr_t>(mem.data()) + 255) & ~(uintptr_t)255;
        p = reinterpret_cast<uint8_t*>(a) + shift;
    }
};

// A stream of `len` bytes at dst.p (a buffer of `cap` usable bytes filled with 0xEE before)
// to `path`, after checking its length and that nothing past its end was written: a
// block's last 16-byte unit must not spill into its successor's bytes (written first on
// the GPU, possibly) or past the stream's end.
static int write_stream(const Buf& dst, uint64_t len, uint64_t cap, const char* path) {
    if (len == 0 || len > cap) {
        std::fprintf(stderr, "bad out_len %llu\n", (unsigned long long)len);
        return 1;
    }
    for (const uint8_t* q = dst.p + len; q < dst.mem.data() + dst.mem.size(); ++q) {
        if (*q != 0xEE) {
            std::fprintf(stderr, "byte %lld past the stream's end (%llu bytes) written\n", (long long)(q - dst.p),
                         (unsigned long long)len);
            return 1;
        }
    }
    write_file(path, dst.p, len);
    return 0;
}

static int compress(const std::string& dt, uint32_t B, uint32_t tiers, const char* in, const char* out, size_t mis) {
    const std::vector<uint8_t> data = read_file(in);
    const int size = size_of(dt);
    const uint64_t n = data.size() / size;
    const uint64_t nblocks = (n + B - 1) / B;
    const uint32_t cpt = (B + bfx::TILE - 1) / bfx::TILE;
    const uint32_t cpt2 = cpt <= 1 ? 1 : cpt <= 2 ? 2 : cpt <= 4 ? 4 : 8;
    Buf src(data.size(), mis, 0);
    std::memcpy(src.p, data.data(), data.size());
    const size_t cap = 24 + 4 * nblocks + n * size + nblocks * 11;
    Buf dst(cap, 0, 0xEE);  // garbage: every stream byte must be written
    std::vector<uint64_t> scratch(nblocks + 1, 0xDEADBEEFull);
    uint64_t out_len = 0;
    emu::launch(1, 256, [&] {
        hoccl_bfx_compress_begin(dst.p, n, B, (uint32_t)nblocks, magic_of(dt), scratch.data(), nblocks + 1, &out_len);
    });
    // BFX_EMU_TICKETS=1: blocks by atomic tickets (kEncTickets), CTAs in any order; else by
    // CTA index, CTAs in index order (as the GPU starts them)
    const char* tk = std::getenv("BFX_EMU_TICKETS");
    const bool tickets = tk && std::string(tk) == "1";
    const uint32_t flags = ((reinterpret_cast<uintptr_t>(src.p) % 16 == 0) ? 1u : 0u) | (tickets ? bfx::kEncTickets : 0u);
    auto body = [&] {
#define BFX_CALL(DT, C, NAME) \
    if (dt == DT && cpt2 == C && tiers != 1) NAME(src.p, n, B, tiers, dst.p, scratch.data(), &out_len, flags); \
    if (dt == DT && cpt2 == C && tiers == 1) NAME##_t1(src.p, n, B, tiers, dst.p, scratch.data(), &out_len, flags);
        BFX_CALL("bf16", 1, hoccl_bfx_compress_bf16_1)
        BFX_CALL("bf16", 2, hoccl_bfx_compress_bf16_2)
        BFX_CALL("bf16", 4, hoccl_bfx_compress_bf16_4)
        BFX_CALL("bf16", 8, hoccl_bfx_compress_bf16_8)
        BFX_CALL("f16", 1, hoccl_bfx_compress_f16_1)
        BFX_CALL("f16", 2, hoccl_bfx_compress_f16_2)
        BFX_CALL("f16", 4, hoccl_bfx_compress_f16_4)
        BFX_CALL("f16", 8, hoccl_bfx_compress_f16_8)
        BFX_CALL("f32", 1, hoccl_bfx_compress_f32_1)
        BFX_CALL("f32", 2, hoccl_bfx_compress_f32_2)
        BFX_CALL("f32", 4, hoccl_bfx_compress_f32_4)
#undef BFX_CALL
    };
    if (nblocks > 0) emu::launch((unsigned)nblocks, bfx::ET, body, !tickets);
    return write_stream(dst, out_len, cap, out);
}

static int decompress(const std::string& dt, uint64_t n, const char* in, const char* out, unsigned ctas, size_t mis,
                      uint32_t wave) {
    const std::vector<uint8_t> stream = read_file(in);
    const int size = size_of(dt);
    Buf src(stream.size(), 0, 0xEE);
    std::memcpy(src.p, stream.data(), stream.size());
    Buf dst(n * size, mis, 0xEE);
    uint32_t status = 0xFFFFFFFFu;
    emu::launch(1, 32, [&] { hoccl_bfx_decompress_begin(&status); });
    const uintptr_t a = reinterpret_cast<uintptr_t>(dst.p);
    // wave: the grid's tail, as wave "SMs" of one CTA each (gpu.rs: SMs, CTAs per SM, tail bit)
    const uint32_t flags = (a % 16 == 0 ? 1u : 0u) | (a % 4 == 0 ? 2u : 0u) | (wave ? (wave << 8) | (1u << 20) | (1u << 24) : 0u);
    auto body = [&] {
        if (dt == "bf16") hoccl_bfx_decompress_bf16(src.p, stream.size(), dst.p, n, &status, flags);
        if (dt == "f16") hoccl_bfx_decompress_f16(src.p, stream.size(), dst.p, n, &status, flags);
        if (dt == "f32") hoccl_bfx_decompress_f32(src.p, stream.size(), dst.p, n, &status, flags);
    };
    emu::launch(ctas, bfx::DT, body);
    std::printf("status %u\n", status);
    write_file(out, dst.p, n * size);
    return 0;
}

// The decoupled look-back against predecessors in every state: inclusive prefixes far back,
// runs of aggregates longer than a 32-wide window, and statuses that appear only while the
// look-back is spinning (written by a second warp of the same CTA between its yields).
static int lookback_cases(unsigned cases, uint64_t seed) {
    uint64_t s = seed;
    auto rnd = [&s](uint64_t n) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        return (s >> 33) % n;
    };
    for (unsigned k = 0; k < cases; ++k) {
        const uint64_t j = rnd(4) == 0 ? rnd(4) : rnd(300);
        std::vector<uint64_t> st(j + 1, 0), agg(j + 1), late;
        uint64_t incl = 0;
        for (uint64_t i = 0; i <= j; ++i) {
            agg[i] = i == 0 ? 5000000008ull : 8 + 4 * rnd(9000);  // prefixes past 2^32
            incl += agg[i];
            if (i == j) break;
            const uint64_t kind = i == 0 ? 0 : rnd(10);  // block 0 always publishes its prefix
            if (kind < 2) st[i] = bfx::LB_INC | incl;
            else if (kind < 8) st[i] = bfx::LB_AGG | agg[i];
            else late.push_back(i);  // published while the look-back waits
        }
        uint64_t got = ~0ull;
        emu::launch(1, 64, [&] {
            const unsigned tid = threadIdx.x;
            if (tid < 32) {
                if (tid == 0) bfx::publish_size(st.data(), j, agg[j]);
                const uint64_t e = bfx::lookback(st.data(), j, agg[j], (int)tid);
                if (tid == 0) got = e;
            } else if (tid == 32) {
                for (uint64_t i : late) {
                    for (uint64_t y = rnd(5); y > 0; --y) emu_yield();
                    st[i] = bfx::LB_AGG | agg[i];
                }
            }
        });
        const uint64_t want = incl - agg[j];
        if (got != want || st[j] != (bfx::LB_INC | incl)) {
            std::fprintf(stderr, "lookback case %u: j %llu got %llu want %llu\n", k, (unsigned long long)j,
                         (unsigned long long)got, (unsigned long long)want);
            return 1;
        }
    }
    std::printf("lookback ok %u\n", cases);
    return 0;
}

static void hoccl_bfx_drc_offsets_call(const std::string& dt, bfx::DrcArgs a) {
    if (dt == "bf16") hoccl_bfx_drc_offsets_bf16(a);
    if (dt == "f16") hoccl_bfx_drc_offsets_f16(a);
    if (dt == "f32") hoccl_bfx_drc_offsets_f32(a);
}

// The drc kernels by dtype and operator name.
static void drc_call(const std::string& dt, const std::string& op, bfx::DrcArgs a) {
#define BFX_DRC_CALL(DT, OP) \
    if (dt == #DT && op == #OP) hoccl_bfx_drc_##DT##_##OP(a);
#define BFX_DRC_CALLS(DT) BFX_DRC_CALL(DT, sum) BFX_DRC_CALL(DT, prod) BFX_DRC_CALL(DT, max) BFX_DRC_CALL(DT, min) BFX_DRC_CALL(DT, avg)
    BFX_DRC_CALLS(bf16)
    BFX_DRC_CALLS(f16)
    BFX_DRC_CALLS(f32)
#undef BFX_DRC_CALLS
#undef BFX_DRC_CALL
}

// An output stream of n values in blocks of B, as gpu.rs sets one up: its buffer (garbage
// beyond what the kernels write), the look-back scratch, and the fixed header written by
// hoccl_bfx_compress_begin.
struct OutStream {
    uint64_t n, nblocks, cap, len = 0;
    Buf buf;
    std::vector<uint64_t> scratch;
    OutStream(const std::string& dt, uint64_t n_, uint32_t B)
        : n(n_), nblocks((n_ + B - 1) / B), cap(24 + 4 * nblocks + n_ * size_of(dt) + nblocks * 11), buf(cap, 0, 0xEE),
          scratch(nblocks + 1, 0xDEADBEEFull) {
        emu::launch(1, 256, [&] {
            hoccl_bfx_compress_begin(buf.p, n, B, (uint32_t)nblocks, magic_of(dt), scratch.data(), nblocks + 1, &len);
        });
    }
    int write(const char* path) const { return write_stream(buf, len, cap, path); }
};

static uint32_t dst_flags(const uint8_t* p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    return (a % 16 == 0 ? 1u : 0u) | (a % 4 == 0 ? 2u : 0u);
}

static int drc(const std::string& dt, const std::string& op, uint32_t pos, uint32_t tiers, uint32_t B, size_t mis,
               bool in_place, const char* local_path, const char* dst_path, const char* out_path,
               const std::vector<const char*>& stream_paths) {
    const std::vector<uint8_t> local = read_file(local_path);
    const int size = size_of(dt);
    const uint64_t n = local.size() / size;
    const uint32_t m = (uint32_t)stream_paths.size();
    std::vector<std::vector<uint8_t>> data;
    std::vector<Buf> streams;
    streams.reserve(m);
    for (const char* p : stream_paths) {
        data.push_back(read_file(p));
        streams.emplace_back(data.back().size(), 0, 0xEE);
        std::memcpy(streams.back().p, data.back().data(), data.back().size());
    }
    Buf loc(local.size(), mis, 0);
    std::memcpy(loc.p, local.data(), local.size());
    Buf dst(local.size(), mis, 0xEE);
    OutStream out(dt, n, B);
    std::vector<uint64_t> offs(m * out.nblocks + 1, 0xDEADBEEFull);
    uint32_t status = 0xFFFFFFFFu;
    emu::launch(1, 32, [&] { hoccl_bfx_decompress_begin(&status); });
    bfx::DrcArgs a{};
    for (uint32_t k = 0; k < m; ++k) {
        a.f.in[k] = streams[k].p;
        a.f.in_len[k] = data[k].size();
    }
    a.f.local = loc.p;
    a.f.dst = in_place ? loc.p : dst.p;
    a.f.n = n;
    a.f.status = &status;
    a.f.m = m;
    a.f.local_pos = pos;
    a.f.flags = dst_flags(a.f.dst);
    a.out = out.buf.p;
    a.scratch = out.scratch.data();
    a.out_len = &out.len;
    a.offs = offs.data();
    a.block0 = 0;
    a.blocks = out.nblocks;
    a.B = B;
    a.tiers = tiers;
    if (m > 0) emu::launch(m, bfx::DT, [&] { hoccl_bfx_drc_offsets_call(dt, a); });
    if (out.nblocks > 0) emu::launch((unsigned)out.nblocks, bfx::DT, [&] { drc_call(dt, op, a); }, true);
    std::printf("status %u\n", status);
    write_file(dst_path, a.f.dst, local.size());
    if (status != 0) return 0;
    return out.write(out_path);
}

static int chain(const std::string& dt, uint32_t B, uint32_t tiers, uint64_t chunk, const char* in, const char* out_path) {
    const std::vector<uint8_t> data = read_file(in);
    const int size = size_of(dt);
    const uint64_t n = data.size() / size;
    Buf src(data.size(), 0, 0);
    std::memcpy(src.p, data.data(), data.size());
    OutStream out(dt, n, B);
    for (uint64_t v0 = 0; v0 < n; v0 += chunk) {
        bfx::DrcArgs a{};
        a.f.local = a.f.dst = src.p + v0 * size;
        a.f.n = n - v0 < chunk ? n - v0 : chunk;
        a.f.flags = dst_flags(a.f.dst);
        a.out = out.buf.p;
        a.scratch = out.scratch.data();
        a.out_len = &out.len;
        a.block0 = v0 / B;
        a.blocks = out.nblocks;
        a.B = B;
        a.tiers = tiers;
        emu::launch((unsigned)((a.f.n + B - 1) / B), bfx::DT, [&] { drc_call(dt, "sum", a); }, true);
    }
    return out.write(out_path);
}

int main(int argc, char** argv) {
    if (argc >= 4 && std::string(argv[1]) == "lookback")
        return lookback_cases((unsigned)std::stoul(argv[2]), std::stoull(argv[3]));
    if (argc >= 7 && std::string(argv[1]) == "compress")
        return compress(argv[2], (uint32_t)std::stoul(argv[3]), (uint32_t)std::stoul(argv[4]), argv[5], argv[6],
                        argc > 7 ? std::stoul(argv[7]) : 0);
    if (argc >= 6 && std::string(argv[1]) == "decompress")
        return decompress(argv[2], std::stoull(argv[3]), argv[4], argv[5], argc > 6 ? (unsigned)std::stoul(argv[6]) : 4,
                          argc > 7 ? std::stoul(argv[7]) : 0, argc > 8 ? (uint32_t)std::stoul(argv[8]) : 0);
    if (argc >= 12 && std::string(argv[1]) == "drc")
        return drc(argv[2], argv[3], (uint32_t)std::stoul(argv[4]), (uint32_t)std::stoul(argv[5]), (uint32_t)std::stoul(argv[6]),
                   std::stoul(argv[7]), std::string(argv[8]) == "1", argv[9], argv[10], argv[11],
                   std::vector<const char*>(argv + 12, argv + argc));
    if (argc >= 8 && std::string(argv[1]) == "chain")
        return chain(argv[2], (uint32_t)std::stoul(argv[3]), (uint32_t)std::stoul(argv[4]), std::stoull(argv[5]), argv[6], argv[7]);
    std::fprintf(stderr, "usage: bfx_emu compress DTYPE B TIERS IN OUT [MISALIGN] | decompress DTYPE N IN OUT [CTAS] [MISALIGN] [WAVE]\n");
    return 2;
}
