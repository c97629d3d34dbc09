// BFX1/HFX1/FFX1 codec: dtype traits and warp-level building blocks shared by the
// single-pass compressor in bfx.cu and the decompressor in bfx_decode.cu. The format and the encoder's
// choice are specified in src/compress/format.rs and src/compress/select.rs; this file and
// the Rust reference must stay step-for-step identical (GPU bytes == CPU bytes).
//
// Thread layout (both kernels): 256 threads per CTA; thread t owns "chunks" of 8
// consecutive values (16 bytes of bf16/fp16, 32 of fp32). Chunk c covers values 8c..8c+7,
// so the 4 lanes of a quad (c & 3 = q) hold one 32-value group g = c >> 2 and lane q
// holds bits 8q..8q+7 of every bit-plane word of that group. Codes of a chunk live packed
// in two u32: in the decoder and for fp32 in the compressor as code bytes (byte k of .x =
// value k, byte k of .y = value 4+k; a plane byte is gathered with one multiply, SWAR),
// in the 16-bit compressors as plane bytes straight from their lookups (bfx.cu
// chunk_codes); the quad assembles whole plane words with two shuffles.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifndef BFX_EMU
#define BFX_EMU_POISON(smem)
// A kernel's shared state in dynamic shared memory (allowed above the 48 KB static limit by
// the launcher); the emulator keeps it static like any __shared__ variable.
#define BFX_DYN_SMEM(T, name)                                \
    extern __shared__ __align__(16) uint8_t bfx_dyn_smem_[]; \
    T& name = *reinterpret_cast<T*>(bfx_dyn_smem_)
#else
#define BFX_DYN_SMEM(T, name) __shared__ T name
#endif

namespace bfx {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr int TILE = THREADS * 8;  // values per CTA step
constexpr uint32_t FULL = 0xffffffffu;
constexpr int MAX_TABLE = 31;
constexpr int NCAND = 21;

// Status codes of the decoder (low 8 bits; block index in bits 8..31). Mirror of
// `compress::gpu::Status` in Rust.
enum Status : uint32_t {
    ST_OK = 0,
    ST_MAGIC = 1,
    ST_VERSION = 2,
    ST_COUNT = 3,
    ST_GEOMETRY = 4,
    ST_TRUNCATED = 5,
    ST_BLOCK_SIZE = 6,
    ST_BLOCK_HEADER = 7,
    ST_SYMBOL = 8,
    ST_ESCAPES = 9,
    ST_RAWS = 10,
};

// Lookup entry of a symbol: tier-1 code in bits 0..4, escape flag, raw flag.
constexpr uint32_t LUT_ESC = 0x40;
constexpr uint32_t LUT_RAW = 0x80;

// Look-back status word: flag in bits 62..63, byte count below.
constexpr uint64_t LB_AGG = 1ull << 62;
constexpr uint64_t LB_INC = 2ull << 62;
constexpr uint64_t LB_VAL = (1ull << 62) - 1;

// Candidate (k1, k2) pairs in the order of select.rs `candidates()`.
__device__ __forceinline__ uint32_t cand_k1(int i) { return i < 20 ? 1 + i / 5 : 5; }
__device__ __forceinline__ uint32_t cand_k2(int i) { return i < 20 ? i % 5 : 0; }

// Byte k of w, zero-extended: one permute (shift + mask is two instructions). For table
// indices.
__device__ __forceinline__ uint32_t byte_at(uint32_t w, int k) { return __byte_perm(w, 0, 0x4440u | (uint32_t)k); }

// A byte permute with a selector known only at run time whose nibbles are all < 8: the PRMT
// instruction itself. __byte_perm is defined on the low 3 bits of each selector nibble, so
// for a run-time selector the compiler first masks it with 0x7777 (one more ALU instruction
// per permute: 2-3 % of the decoder's throughput on the H200). A nibble with bit 3 set
// would replicate a sign bit instead; the emulator faults on one.
__device__ __forceinline__ uint32_t prmt(uint32_t x, uint32_t y, uint32_t s) {
#ifdef BFX_EMU
    if (s & 0x8888u) emu_fault("prmt selector nibble >= 8");
    return __byte_perm(x, y, s);
#else
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(y), "r"(s));
    return r;
#endif
}

// (a & ~m) | (b & m): the bits of b where m is set, of a elsewhere, as one LOP3 (written
// with & | ~ the compiler splits it around an immediate mask: two or three instructions).
__device__ __forceinline__ uint32_t bitsel(uint32_t a, uint32_t b, uint32_t m) {
#ifdef BFX_EMU
    return (a & ~m) | (b & m);
#else
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xca;" : "=r"(r) : "r"(m), "r"(b), "r"(a));  // m ? b : a (0xf0 & 0xcc | ~0xf0 & 0xaa)
    return r;
#endif
}

__device__ __forceinline__ uint32_t pad4(uint32_t x) { return (x + 3u) & ~3u; }
__device__ __forceinline__ uint32_t tier(uint32_t k) { return (1u << k) - 1u; }
__device__ __forceinline__ uint32_t lanemask_lt(int lane) { return (1u << lane) - 1u; }

// ------------------------------------------------------------------ dtype traits -------

// A 16-bit pair word p holds value 2i in its low half and 2i+1 in its high half.
struct Bf16T {
    static constexpr int SIZE = 2, WORDS = 4, NSYM = 256;
    static constexpr uint32_t MAGIC = 0x31584642u;
    static constexpr int ESHIFT = 7;
    static constexpr uint32_t EMASK2 = 0x00ff00ffu;
};
struct F16T {
    static constexpr int SIZE = 2, WORDS = 4, NSYM = 32;
    static constexpr uint32_t MAGIC = 0x31584648u;
    static constexpr int ESHIFT = 10;
    static constexpr uint32_t EMASK2 = 0x001f001fu;
};
struct F32T {  // the top halves are coded as bf16 would be, the low halves stored raw
    static constexpr int SIZE = 4, WORDS = 8, NSYM = 256;
    static constexpr uint32_t MAGIC = 0x31584646u;
    static constexpr int ESHIFT = 7;
    static constexpr uint32_t EMASK2 = 0x00ff00ffu;
};

template <class D>
struct Chunk {
    uint32_t w[D::WORDS];
};

// Pair word i (i < 4) of the coded 16-bit view: the value itself for 16-bit types, the
// top halves of two fp32 values for fp32.
template <class D>
__device__ __forceinline__ uint32_t top_pair(const Chunk<D>& c, int i) {
    if constexpr (D::SIZE == 4) return __byte_perm(c.w[2 * i], c.w[2 * i + 1], 0x7632);
    else return c.w[i];
}
// Low halves of two fp32 values (fp32 only).
template <class D>
__device__ __forceinline__ uint32_t low_pair(const Chunk<D>& c, int i) {
    return __byte_perm(c.w[2 * i], c.w[2 * i + 1], 0x5410);
}

// The 8 exponents of a chunk, packed (byte k of .x = value k, of .y = value 4 + k).
template <class D>
__device__ __forceinline__ uint2 chunk_exps(const Chunk<D>& c) {
    uint32_t t[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) t[i] = (top_pair<D>(c, i) >> D::ESHIFT) & D::EMASK2;
    return make_uint2(__byte_perm(t[0], t[1], 0x6420), __byte_perm(t[2], t[3], 0x6420));
}

// The same exponents by byte permutes (high bytes, low bytes). Written differently on
// purpose: compact_lists (after the block scan) calls this one, so the compiler does not
// keep chunk_exps' results alive across the scan (that spilled).
template <class D>
__device__ __forceinline__ uint2 chunk_exps_again(const Chunk<D>& c) {
    uint32_t r[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint32_t a = top_pair<D>(c, 2 * h), b = top_pair<D>(c, 2 * h + 1);
        const uint32_t hi = __byte_perm(a, b, 0x7531), lo = __byte_perm(a, b, 0x6420);
        if constexpr (D::NSYM == 32) r[h] = (hi >> 2) & 0x1f1f1f1fu;
        else r[h] = bitsel(lo >> 7, hi << 1, 0xfefefefeu);  // exponent bits 7-1 from hi, bit 0 from lo
    }
    return make_uint2(r[0], r[1]);
}

// (sign << 7) | mantissa7 of 4 values from two bf16 pair words: the sign from each high
// byte, the mantissa from each low byte (the same two permutes as chunk_exps_again, which
// the compiler shares when both run on one chunk).
__device__ __forceinline__ uint32_t sm_bytes(uint32_t p0, uint32_t p1) {
    const uint32_t hi = __byte_perm(p0, p1, 0x7531), lo = __byte_perm(p0, p1, 0x6420);
    return bitsel(lo, hi, 0x80808080u);
}

// fp16: (sign << 2) | (mantissa >> 8) of 4 values from two pair words.
__device__ __forceinline__ uint32_t f16_top3(uint32_t p0, uint32_t p1) {
    uint32_t t0 = ((p0 >> 13) & 0x00040004u) | ((p0 >> 8) & 0x00030003u);
    uint32_t t1 = ((p1 >> 13) & 0x00040004u) | ((p1 >> 8) & 0x00030003u);
    return __byte_perm(t0, t1, 0x6420);
}

// ------------------------------------------------------------------ bit planes ---------

// Byte whose bit j is bit b of code j (codes packed as in chunk_exps).
__device__ __forceinline__ uint32_t gather_plane(uint32_t x, uint32_t y, int b) {
    uint32_t z = ((x >> b) & 0x01010101u) | (((y >> b) << 4) & 0x10101010u);
    return (z * 0x01020408u) >> 24;
}

// Inverse: bit j of `byte` moved to bit 0 of byte j (j < 4 in .x, j >= 4 in .y).
__device__ __forceinline__ uint2 scatter_plane(uint32_t byte) {
    return make_uint2(((byte & 0xfu) * 0x00204081u) & 0x01010101u,
                      (((byte >> 4) & 0xfu) * 0x00204081u) & 0x01010101u);
}

// Quad transpose: lane q holds X (byte b = its plane-b byte); returns plane word q of the
// quad's group (byte i = lane i's byte). Every lane of the warp must call it.
__device__ __forceinline__ uint32_t quad_transpose(uint32_t x, int q) {
    uint32_t y = __shfl_xor_sync(FULL, x, 1);
    uint32_t a = prmt(x, y, (q & 1) ? 0x3715 : 0x6240);  // run-time selectors: prmt, not __byte_perm
    uint32_t z = __shfl_xor_sync(FULL, a, 2);
    return prmt(a, z, (q & 2) ? 0x3276 : 0x5410);
}

// Bytes of planes 0..min(K,4)-1 of a chunk's codes packed into one word (byte b = plane b).
template <int K>
__device__ __forceinline__ uint32_t plane_bytes4(uint2 codes) {
    uint32_t w = 0;
#pragma unroll
    for (int b = 0; b < (K < 4 ? K : 4); ++b) w |= gather_plane(codes.x, codes.y, b) << (8 * b);
    return w;
}

// Byte mask of the valid values of a chunk (valid in 0..8), as two words.
__device__ __forceinline__ uint2 valid_mask(int valid) {
    uint32_t lo = valid >= 4 ? FULL : (valid <= 0 ? 0u : (1u << (8 * valid)) - 1u);
    uint32_t hi = valid >= 8 ? FULL : (valid <= 4 ? 0u : (1u << (8 * (valid - 4))) - 1u);
    return make_uint2(lo, hi);
}


// Size of a raw block of nb values: its two zero header words, then the values padded to a
// multiple of 4 bytes (format.rs).
template <class D>
__device__ __forceinline__ uint32_t raw_block_size(uint32_t nb) {
    return 8 + pad4(D::SIZE * nb);
}

// Exact coded size from the exact counts (format.rs `Layout`).
template <class D>
__device__ __forceinline__ uint32_t coded_size(int nb, uint32_t k1, uint32_t k2, uint32_t n_esc1, uint32_t n_raw) {
    const uint32_t G = ((uint32_t)nb + 31) / 32;
    uint32_t s = 8 + pad4(tier(k1) + tier(k2)) + 4 * G * k1 + 4 * ((n_esc1 + 31) / 32) * k2 + pad4(n_raw);
    if constexpr (D::NSYM == 32) s += 12 * G + pad4(nb);
    else if constexpr (D::SIZE == 4) s += pad4(nb) + pad4(2 * nb);
    else s += pad4(nb);
    return s;
}

// ------------------------------------------------------------------ warp / block -------

__device__ __forceinline__ uint32_t warp_incl_scan(uint32_t v, int lane) {
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        uint32_t o = __shfl_up_sync(FULL, v, d);
        if (lane >= d) v += o;
    }
    return v;
}

__device__ __forceinline__ uint64_t warp_sum64(uint64_t v) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(FULL, v, d);
    return v;
}

__device__ __forceinline__ uint32_t warp_sum32(uint32_t v) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(FULL, v, d);
    return v;
}

// Of NW per-warp totals in `tmp` (shared memory, 16-byte aligned): the sum of those before
// `warp` and the sum of all, four per 16-byte load (a loop of 4-byte loads is 1-2 % of the
// compressor's instructions).
template <int NW>
__device__ __forceinline__ void warp_totals(const uint32_t* tmp, int warp, uint32_t& before, uint32_t& all) {
    static_assert(NW % 4 == 0, "whole 16-byte loads");
    before = 0;
    all = 0;
#pragma unroll
    for (int w = 0; w < NW; w += 4) {
        const uint4 t = reinterpret_cast<const uint4*>(tmp)[w / 4];
        before += (w < warp ? t.x : 0u) + (w + 1 < warp ? t.y : 0u) + (w + 2 < warp ? t.z : 0u) + (w + 3 < warp ? t.w : 0u);
        all += t.x + t.y + t.z + t.w;
    }
}

// Exclusive scan of `a[0 .. NT*per)` (u32, in shared memory; 16-byte aligned when PER is a
// multiple of 4) in place; returns the total. `tmp` holds NT/32 words (16-byte aligned).
// Every thread of the CTA (NT threads) must call it.
template <int PER, int NT = THREADS>
__device__ uint32_t block_scan(uint32_t* a, uint32_t* tmp) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    uint32_t loc[PER];
    uint32_t sum = 0;
    uint32_t v[PER];
    if constexpr (PER % 4 == 0) {  // a thread's PER words by 16-byte loads (a is 16-byte aligned):
                                   // 4-byte loads at a PER-word stride conflict PER-way in the banks
#pragma unroll
        for (int k = 0; k < PER / 4; ++k) {
            const uint4 t = reinterpret_cast<const uint4*>(a + tid * PER)[k];
            v[4 * k] = t.x;
            v[4 * k + 1] = t.y;
            v[4 * k + 2] = t.z;
            v[4 * k + 3] = t.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < PER; ++i) v[i] = a[tid * PER + i];
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        loc[i] = sum;
        sum += v[i];
    }
    uint32_t incl = warp_incl_scan(sum, lane);
    if (lane == 31) tmp[warp] = incl;
    __syncthreads();
    uint32_t base, total;
    warp_totals<NT / 32>(tmp, warp, base, total);
    base += incl - sum;
    if constexpr (PER % 4 == 0) {
#pragma unroll
        for (int k = 0; k < PER / 4; ++k)
            reinterpret_cast<uint4*>(a + tid * PER)[k] =
                make_uint4(base + loc[4 * k], base + loc[4 * k + 1], base + loc[4 * k + 2], base + loc[4 * k + 3]);
    } else {
#pragma unroll
        for (int i = 0; i < PER; ++i) a[tid * PER + i] = base + loc[i];
    }
    __syncthreads();
    return total;
}

// Sum of a u64 over the CTA (every thread of the NT calls; tmp holds NT/32 u64).
template <int NT = THREADS>
__device__ __forceinline__ uint64_t block_sum64(uint64_t v, uint64_t* tmp) {
    const int tid = threadIdx.x;
    v = warp_sum64(v);
    if ((tid & 31) == 0) tmp[tid >> 5] = v;
    __syncthreads();
    uint64_t s = 0;
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) s += tmp[w];
    __syncthreads();
    return s;
}

// A 16-byte global load of data read once (the compressor's input), with a cache hint: no
// L1 allocation, the read-only path, and L2 fetching 256-byte sectors (sm_80 and up). The
// emulator loads plainly.
__device__ __forceinline__ uint4 ld128_once(const uint4* p) {
#ifdef BFX_EMU
    return *p;
#else
    uint4 a;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a.x), "=r"(a.y), "=r"(a.z), "=r"(a.w) : "l"(p));
    return a;
#endif
}

#ifdef BFX_EMU
// The emulator checks what the GPU would fault on.
__device__ __forceinline__ uint32_t ld32(const uint8_t* p) {
    if (reinterpret_cast<uintptr_t>(p) & 3) emu_fault("misaligned 4-byte load");
    return *reinterpret_cast<const uint32_t*>(p);
}
__device__ __forceinline__ void st32(uint8_t* p, uint32_t v) {
    if (reinterpret_cast<uintptr_t>(p) & 3) emu_fault("misaligned 4-byte store");
    *reinterpret_cast<uint32_t*>(p) = v;
}
__device__ __forceinline__ void st128(uint8_t* p, uint4 v) {
    if (reinterpret_cast<uintptr_t>(p) & 15) emu_fault("misaligned 16-byte store");
    *reinterpret_cast<uint4*>(p) = v;
}
#else
__device__ __forceinline__ uint32_t ld32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ void st32(uint8_t* p, uint32_t v) { *reinterpret_cast<uint32_t*>(p) = v; }
__device__ __forceinline__ void st128(uint8_t* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }
#endif

// Four words that straddle two 16-byte units p, q (shared memory) by sw words (0-3): the
// last sw words of p, then the first 4 - sw of q (sw = 0: q). How a block that is only
// 4-byte aligned is moved in 16-byte units.
__device__ __forceinline__ uint4 shift_words(uint4 p, uint4 q, uint32_t sw) {
    switch (sw) {
        case 0: return q;
        case 1: return make_uint4(p.w, q.x, q.y, q.z);
        case 2: return make_uint4(p.z, p.w, q.x, q.y);
        default: return make_uint4(p.y, p.z, p.w, q.x);
    }
}

// The 8 bytes at p + pos (p 4-byte aligned and readable up to 12 bytes past pos & ~3):
// three aligned loads and two funnel shifts.
__device__ __forceinline__ uint2 bytes8_at(const uint8_t* p, uint32_t pos) {
    const uint32_t a = pos & ~3u, s = 8 * (pos & 3u);
    const uint32_t w0 = ld32(p + a), w1 = ld32(p + a + 4), w2 = ld32(p + a + 8);
    return make_uint2(__funnelshift_r(w0, w1, s), __funnelshift_r(w1, w2, s));
}

// 16 bytes global -> shared without registers (cp.async; sm_80+), with L2 fetching 128-byte
// lines (the decoder reads whole blocks: 0.5-2 % faster on the H200 than without the hint).
// Both 16-byte aligned. The emulator copies only the bytes of [lo, hi) (the GPU reads whole
// lines, see stage_block).
__device__ __forceinline__ void cp_async16(uint8_t* smem, const uint8_t* gmem, const uint8_t* lo, const uint8_t* hi) {
#ifdef BFX_EMU
    if ((reinterpret_cast<uintptr_t>(smem) | reinterpret_cast<uintptr_t>(gmem)) & 15) emu_fault("misaligned 16-byte cp.async");
    for (int i = 0; i < 16; ++i)
        if (gmem + i >= lo && gmem + i < hi) smem[i] = gmem[i];
#else
    (void)lo;
    (void)hi;
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#endif
}

// 4 bytes global -> shared without registers (cp.async; sm_80+). Both 4-byte aligned.
__device__ __forceinline__ void cp_async4(uint32_t* smem, const uint8_t* gmem) {
#ifdef BFX_EMU
    if ((reinterpret_cast<uintptr_t>(smem) | reinterpret_cast<uintptr_t>(gmem)) & 3) emu_fault("misaligned 4-byte cp.async");
    *smem = *reinterpret_cast<const uint32_t*>(gmem);
#else
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
#endif
}

// Programmatic dependent launch (sm_90). The launcher starts every codec kernel with it
// when the module says so (hoccl_bfx_pdl, bfx.cu): a kernel may then be scheduled while
// the stream's previous kernel is still running, once every CTA of that one has started
// and triggered. So each codec kernel first triggers its own dependents, then waits until
// everything before it on the stream has completed and its memory is visible, before it
// touches any memory: the next kernel's CTAs become resident in this one's tail, and there
// is no launch gap between kernels. In the emulator both are no-ops. (sm_90 and later only:
// an sm_80 build of the same file neither waits nor says it does.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(BFX_EMU)
#define BFX_GRIDDEP 1
#else
#define BFX_GRIDDEP 0
#endif
__device__ __forceinline__ void pdl_enter() {
#if BFX_GRIDDEP
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Wait for this thread's cp.async copies (a barrier then publishes them to the CTA).
__device__ __forceinline__ void cp_async_wait_all() {
#ifndef BFX_EMU
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// The GPU's nanosecond clock (%globaltimer; the emulator has none: 0).
__device__ __forceinline__ uint64_t clock_ns() {
#ifdef BFX_EMU
    return 0;
#else
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#endif
}
// The grid's shape in a kernel's flags, as the launcher packs it (gpu.rs grid_shape): bits
// 8..19 the SMs, 20..23 the CTAs per SM; 0 when not given.
__device__ __forceinline__ uint32_t shape_sms(uint32_t flags) { return (flags >> 8) & 0xfffu; }
__device__ __forceinline__ uint32_t shape_per_sm(uint32_t flags) { return (flags >> 20) & 0xfu; }
// A staggered first wave (bfx.cu stagger_start): CTA `i` in start order of a grid whose
// shape flags bits 8..19 (SMs) and 20..23 (CTAs per SM) give waits, when it is in the
// first wave, i * step / SMs ns from now: one SM's worth of CTAs per `step`, a start every
// step / SMs ns. Timing only (the emulator skips it).
__device__ __forceinline__ void wait_slot(uint64_t i, uint32_t flags, uint32_t step) {
#ifndef BFX_EMU
    const uint32_t sms = shape_sms(flags), per_sm = shape_per_sm(flags);
    if (step == 0 || sms == 0 || i >= (uint64_t)sms * per_sm) return;
    // 32-bit: i < sms * per_sm < 2^16 (gpu.rs grid_shape), step < 2^16 (the callers assert it)
    const uint32_t wait = (uint32_t)i * step / sms;
    if (wait == 0) return;
    const uint64_t until = clock_ns() + wait;
    while (clock_ns() < until) __nanosleep(100);
#endif
}
__device__ __forceinline__ void spin_pause() {
#ifdef BFX_EMU
    emu_yield();
#else
    __nanosleep(64);
#endif
}

}  // namespace bfx
