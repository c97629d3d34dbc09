// BFX1/HFX1/FFX1 decompressor (format: src/compress/format.rs; thread layout: bfx.cuh).
//
// CTA c decodes the contiguous range of blocks [c·n/G, (c+1)·n/G) of the n blocks, starting
// at the offset it sums from block_bytes; a block is decoded in tiles of 2048 values (any B
// works). Every header field is validated; corrupt input stops the CTA and sets *status.
//
// Where decoded values go is a template parameter `O` of the decoding functions (PlainOut:
// at their place in the output); the fused kernels of bfx_fused.cu, which include this
// file, pass one that folds them into an accumulator instead.
#pragma once
#include "bfx.cuh"

#include <type_traits>

namespace bfx {

// Threads per decoder CTA (gpu.rs reads it from hoccl_bfx_decode_threads, below; 64
// registers each, 1024 / DT CTAs per SM fill the register file). 512 (2 CTAs per SM, the
// same 32 warps) runs 24 % slower on the H200, 19 % with the freed shared memory spent on a
// second stage (block j+1 copied while j decodes).
constexpr int DT = 256;
constexpr int DWARPS = DT / 32;
constexpr int DTILE = DT * 8;  // values per step of the tile path
// A coded block of up to STAGE_WORDS words is copied to shared memory before it is decoded
// (every block of the default B: a coded block is smaller than the raw 8 + 2·16384 bytes).
constexpr uint32_t STAGE_WORDS = (8 + 2 * 16384) / 4;
// Staged blocks of at most this many values take the per-block path (decode_staged).
constexpr uint32_t STAGED_MAX_NB = 16384;
static_assert(DT % 256 == 0 && (STAGED_MAX_NB / 32) % DT == 0, "phase 1 takes whole groups per thread");

// Dynamic shared memory: compress/gpu.rs reads its size from hoccl_bfx_decode_smem (below)
// and sizes the grid with the occupancy calculator.
struct DecSmem {
    uint32_t stage[STAGE_WORDS + 8];  // + the 16-byte lines around a 4-byte aligned block
    alignas(16) uint8_t esc[STAGED_MAX_NB + 16];  // exponent by escape ordinal (tile path: of the tile); +16: read past
    uint2 mg[256];  // merge_spread's selectors for each 8-bit mask
    uint32_t nsp[256];  // nibble k of nsp[p] = bit k of p: a plane byte as part of a permute selector
    uint32_t pre[STAGED_MAX_NB / 32 > DT ? STAGED_MAX_NB / 32 : DT];  // per-group prefixes (tile path: per-thread counts)
    alignas(8) uint8_t table[32];
    uint32_t g2[DTILE / 32 + 2];
    alignas(16) uint32_t wtmp[DWARPS];
    uint64_t wtmp64[DWARPS];
    uint32_t next[2][3];  // the next block's size and header words (decompress_kernel)
    uint32_t rt;
    uint32_t err;
};

struct BlockDesc {
    const uint8_t* blk;
    uint8_t* out;
    int nb;
    uint32_t k1, k2, t1, t2, n_esc1, n_raw;
    const uint8_t *p1, *p2, *raw, *pay;
};

__device__ __forceinline__ void report(uint32_t* status, uint32_t code, uint64_t j) {
    if (status) atomicCAS(status, 0u, code | ((uint32_t)(j < 0xffffffull ? j : 0xffffffull) << 8));
}

// Everything a block's header words (w0, w1: its first 8 bytes) and size must satisfy
// (format.rs BlockHeader::parse).
template <class D>
__device__ uint32_t parse_block(BlockDesc& d, uint32_t bytes, uint32_t w0, uint32_t w1) {
    d.k1 = w0 & 7;
    d.k2 = (w0 >> 3) & 7;
    d.n_raw = w0 >> 8;
    d.n_esc1 = w1 & 0xffffffu;
    if ((w0 & 0xc0u) || (w1 >> 24)) return ST_BLOCK_HEADER;
    const uint32_t nb = (uint32_t)d.nb;
    if (d.k1 == 0) {
        if (w0 || w1) return ST_BLOCK_HEADER;
        return bytes == raw_block_size<D>(nb) ? ST_OK : ST_BLOCK_SIZE;
    }
    d.t1 = tier(d.k1);
    d.t2 = tier(d.k2);
    if (d.t1 + d.t2 > MAX_TABLE) return ST_BLOCK_HEADER;
    if (d.n_esc1 > nb || d.n_raw > d.n_esc1 || (d.k2 == 0 && d.n_raw != d.n_esc1)) return ST_BLOCK_HEADER;
    if (coded_size<D>(d.nb, d.k1, d.k2, d.n_esc1, d.n_raw) != bytes) return ST_BLOCK_SIZE;
    const uint32_t G = (nb + 31) / 32;
    d.p1 = d.blk + 8 + pad4(d.t1 + d.t2);
    d.p2 = d.p1 + 4 * G * d.k1;
    d.raw = d.p2 + 4 * ((d.n_esc1 + 31) / 32) * d.k2;
    d.pay = d.raw + pad4(d.n_raw);
    return ST_OK;
}

// Exponents of the tile's escapes (ordinals [run, run + cnt)) into sm.esc.
template <class D>
__device__ uint32_t fill_escapes(DecSmem& sm, const BlockDesc& d, uint32_t run, uint32_t cnt, uint32_t& raw_run) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (d.k2 == 0) {
        for (uint32_t i = tid; i < cnt; i += DT) {
            const uint32_t e = d.raw[run + i];
            if (e >= (uint32_t)D::NSYM) sm.err = ST_SYMBOL;
            sm.esc[i] = (uint8_t)e;
        }
        __syncthreads();
        return sm.err;
    }
    const uint32_t ga = run / 32, ng = (run + cnt - 1) / 32 - ga + 1;
    for (int pass = 0; pass < 2; ++pass) {
        for (uint32_t gi = warp; gi < ng; gi += DWARPS) {
            const uint32_t o = 32 * (ga + gi) + lane;
            const bool inr = o >= run && o < run + cnt;
            uint32_t c2 = 0;
            for (uint32_t b = 0; b < d.k2; ++b) c2 |= ((ld32(d.p2 + 4 * ((ga + gi) * d.k2 + b)) >> lane) & 1u) << b;
            const bool isr = inr && c2 == d.t2;
            const uint32_t m = __ballot_sync(FULL, isr);
            if (pass == 0) {
                if (lane == 0) sm.g2[gi] = __popc(m);
            } else if (inr) {
                const uint32_t e = isr ? d.raw[raw_run + sm.g2[gi] + __popc(m & lanemask_lt(lane))] : sm.table[d.t1 + c2];
                if (e >= (uint32_t)D::NSYM) sm.err = ST_SYMBOL;
                sm.esc[o - run] = (uint8_t)e;
            }
        }
        __syncthreads();
        if (pass == 0) {
            if (warp == 0) {
                uint32_t carry = 0;
                for (uint32_t b = 0; b < ng; b += 32) {
                    const uint32_t v = b + lane < ng ? sm.g2[b + lane] : 0u;
                    const uint32_t inc = warp_incl_scan(v, lane);
                    if (b + lane < ng) sm.g2[b + lane] = carry + inc - v;
                    carry += __shfl_sync(FULL, inc, 31);
                }
                if (lane == 0) sm.rt = carry;
            }
            __syncthreads();
            if (raw_run + sm.rt > d.n_raw) return ST_RAWS;
        }
    }
    raw_run += sm.rt;
    return sm.err;
}

// The decoder's stores of values at o (an address inside the block's output d.out; put128:
// 16-byte aligned, 8 bf16/fp16 or 4 fp32 values; put32: 4-byte aligned; put16: one 16-bit
// value).
struct PlainOut {
    static __device__ __forceinline__ void put128(uint8_t* o, uint4 v) { st128(o, v); }
    static __device__ __forceinline__ void put32(uint8_t* o, uint32_t v) { st32(o, v); }
    static __device__ __forceinline__ void put16(uint8_t* o, uint16_t v) { *reinterpret_cast<uint16_t*>(o) = v; }
};

// The payload words of one chunk, loaded at the start of its tile so that their latency
// overlaps the tile's scans and escape decoding.
template <class D>
struct Payload {
    uint32_t b0, b1;                         // 8 payload bytes: sign+mantissa / low / high bytes
    uint32_t top[D::NSYM == 32 ? 3 : 1];     // fp16: the chunk's byte of each top plane
};  // (fp32's 4 words of low halves are loaded late: prefetching them spilled)

// WHOLE: the chunk is whole (a full block's), no bounds to check.
template <class D, bool WHOLE = false>
__device__ __forceinline__ Payload<D> load_payload(const BlockDesc& d, int c, int v0) {
    Payload<D> p;
    const uint32_t nb = (uint32_t)d.nb, G = (nb + 31) / 32;
    const uint8_t* bytes = D::NSYM == 32 ? d.pay + 12 * G : d.pay;
    p.b0 = ld32(bytes + v0);
    p.b1 = WHOLE || v0 + 4 < d.nb ? ld32(bytes + v0 + 4) : 0u;
    if constexpr (D::NSYM == 32) {
#pragma unroll
        for (int b = 0; b < 3; ++b) p.top[b] = (ld32(d.pay + 4 * (3 * (v0 >> 5) + b)) >> (8 * (c & 3))) & 0xffu;
    }
    return p;
}

// Values of one chunk from its exponents `ex` (packed) and its payload.
template <class D, bool WHOLE = false, class O = PlainOut>
__device__ __forceinline__ void put_values(const BlockDesc& d, int v0, int valid, uint2 ex, const Payload<D>& p,
                                           bool aligned) {
    uint32_t pair[4];
    const uint32_t b0 = p.b0, b1 = p.b1;
    if constexpr (D::NSYM == 32) {
        uint2 t = make_uint2(0, 0);
#pragma unroll
        for (int b = 0; b < 3; ++b) {
            const uint2 s = scatter_plane(p.top[b]);
            t.x |= s.x << b;
            t.y |= s.y << b;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t sel = i & 1 ? 0x4342 : 0x4140;
            const uint32_t T = __byte_perm(i < 2 ? t.x : t.y, 0, sel), L = __byte_perm(i < 2 ? b0 : b1, 0, sel);
            const uint32_t E = __byte_perm(i < 2 ? ex.x : ex.y, 0, sel);
            pair[i] = ((T & 0x00040004u) << 13) | ((T & 0x00030003u) << 8) | L | (E << 10);
        }
    } else {  // bf16 (and fp32's top halves), 4 values per word: low bytes (e & 1) << 7 | mantissa,
              // high bytes sign << 7 | e >> 1, then interleaved
        constexpr uint32_t C = 0x80808080u;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t b = h ? b1 : b0, x = h ? ex.y : ex.x;
            const uint32_t lo = bitsel(b, x << 7, C), hi = bitsel(x >> 1, b, C);
            pair[2 * h] = __byte_perm(lo, hi, 0x5140);
            pair[2 * h + 1] = __byte_perm(lo, hi, 0x7362);
        }
    }
    uint8_t* o = d.out + (size_t)v0 * D::SIZE;
    if constexpr (D::SIZE == 4) {
        const uint8_t* lo = d.pay + pad4((uint32_t)d.nb) + 2 * v0;
        uint32_t f[8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint32_t l = WHOLE || v0 + 2 * k < d.nb ? ld32(lo + 4 * k) : 0u;
            f[2 * k] = __byte_perm(l, pair[k], 0x5410);
            f[2 * k + 1] = __byte_perm(l, pair[k], 0x7632);
        }
        if (aligned && valid == 8) {
            O::put128(o, make_uint4(f[0], f[1], f[2], f[3]));
            O::put128(o + 16, make_uint4(f[4], f[5], f[6], f[7]));
        } else {
#pragma unroll
            for (int v = 0; v < 8; ++v)
                if (v < valid) O::put32(o + 4 * v, f[v]);
        }
    } else {
        if (aligned && valid == 8) {
            O::put128(o, make_uint4(pair[0], pair[1], pair[2], pair[3]));
        } else {
#pragma unroll
            for (int v = 0; v < 8; ++v)
                if (v < valid) O::put16(o + 2 * v, (uint16_t)(pair[v >> 1] >> (16 * (v & 1))));
        }
    }
}

// One tile of a coded block: codes, escape ordinals, escapes, values. K1 = d.k1.
template <class D, int K1, class O>
__device__ uint32_t decode_tile(DecSmem& sm, const BlockDesc& d, int t0, uint32_t& esc_run, uint32_t& raw_run, bool aligned) {
    const int tid = threadIdx.x, v0 = t0 + 8 * tid;
    const int valid = d.nb - v0 < 0 ? 0 : (d.nb - v0 > 8 ? 8 : d.nb - v0);
    const uint32_t g = (uint32_t)v0 >> 5, q = tid & 3;
    uint2 codes = make_uint2(0, 0);
    uint32_t e8 = 0;
    Payload<D> pl;
    if (valid > 0) {
        pl = load_payload<D>(d, tid, v0);
        uint32_t all = 0xffu;
#pragma unroll
        for (uint32_t b = 0; b < K1; ++b) {
            const uint32_t byte = (ld32(d.p1 + 4 * (g * K1 + b)) >> (8 * q)) & 0xffu;
            const uint2 s = scatter_plane(byte);
            codes.x |= s.x << b;
            codes.y |= s.y << b;
            all &= byte;
        }
        e8 = all & ((1u << valid) - 1u);
    }
    sm.pre[tid] = __popc(e8);
    __syncthreads();
    const uint32_t cnt = block_scan<1, DT>(sm.pre, sm.wtmp);
    if (esc_run + cnt > d.n_esc1) return ST_ESCAPES;
    if (cnt) {
        const uint32_t st = fill_escapes<D>(sm, d, esc_run, cnt, raw_run);
        if (st) return st;
    }
    if (valid > 0) {
        uint2 ex = make_uint2(0, 0);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            ex.x |= (uint32_t)sm.table[byte_at(codes.x, k)] << (8 * k);  // code bytes < 2^K1
            ex.y |= (uint32_t)sm.table[byte_at(codes.y, k)] << (8 * k);
        }
        if (e8) {  // predicated over the 8 values, not a loop over escapes
            const uint32_t o = sm.pre[tid];
#pragma unroll
            for (int jb = 0; jb < 8; ++jb) {
                if ((e8 >> jb) & 1u) {
                    const uint32_t e = sm.esc[o + __popc(e8 & ((1u << jb) - 1u))], sh = 8 * (jb & 3);
                    if (jb < 4) ex.x = (ex.x & ~(0xffu << sh)) | (e << sh);
                    else ex.y = (ex.y & ~(0xffu << sh)) | (e << sh);
                }
            }
        }
        put_values<D, false, O>(d, v0, valid, ex, pl, aligned);
    }
    esc_run += cnt;
    __syncthreads();  // also ends the block's reads of sm.stage before the next block's copy
    return ST_OK;
}

// ex with the bytes w[0 .. popc(m)) (consecutive ordinals) put at the set bits of m (8 values:
// .x values 0-3, .y values 4-7): two permutes that merge, with mg = sm.mg[m]. Nibble k of
// mg.x's low half is value k's source byte: 4 + its rank among m's bits when bit k is set
// (w's byte), else k (ex's); the high half the same for values 4-7 with ranks counted from
// r0 = popc(m & 15), whose bytes w[r0 .. r0 + 3] a funnel shift by mg.y = 8·r0 brings into
// one word (spreading the bytes by two permutes, then a byte mask from m, two ANDs and two
// merges, takes ~13 instructions).
__device__ __forceinline__ uint2 merge_spread(uint2 ex, uint2 w, uint2 mg) {
    return make_uint2(prmt(ex.x, w.x, mg.x), prmt(ex.y, __funnelshift_rc(w.x, w.y, mg.y), mg.x >> 16));
}

// Table lookups of 8 codes < 8 (phases 2 and 3, k <= 3) in two steps. sel_planes builds a
// byte-permute selector from the codes' k plane words p[0 .. k) (the codes' byte at bit sh of
// each): nibble j = code j, the sum over the planes b of sm.nsp[plane byte] << b (a plane
// byte's bits spread to nibbles); `all` gets the AND of the plane words. lookup8 then permutes
// the table's 8 bytes with it. One shared load and one add per plane, where spreading the
// plane byte to code bytes by two multiplies, then packing the code bytes into a selector,
// takes ~11 instructions per plane and 8 per lookup (2-5 % of the decoder's throughput on
// the H200). The plane byte comes out of a permute (byte sh / 8 of the word, zeros above):
// one instruction where shift and mask, then the index scaled, are three.
template <int KMAX>
__device__ __forceinline__ uint32_t sel_planes(const DecSmem& sm, const uint32_t* p, uint32_t k, uint32_t sh,
                                               uint32_t& all) {
    const uint32_t bsel = 0x4440u | (sh >> 3);
    uint32_t sel = 0;
#pragma unroll
    for (uint32_t b = 0; b < (uint32_t)KMAX; ++b) {
        if (b < k) {
            const uint32_t w = p[b];
            sel += sm.nsp[prmt(w, 0, bsel)] << b;
            all &= w;
        }
    }
    return sel;
}

// The eight bytes of tw (a table's 8 bytes) that sel_planes' selector picks: values 0-3 with
// its low half, 4-7 with its high half.
__device__ __forceinline__ uint2 lookup8(uint2 tw, uint32_t sel) {
    return make_uint2(prmt(tw.x, tw.y, sel), prmt(tw.x, tw.y, sel >> 16));
}

// A staged block of nb <= STAGED_MAX_NB values, K1 = d.k1, in three phases with four
// barriers per block (the tile path has ~9 per 2048 values):
//  1. escapes per tier-1 group (the AND of its K1 plane words) and raws per tier-2 group
//     (the AND of its k2 words), one block scan of both (packed in halves), checked
//     against n_esc1 and n_raw;
//  2. (k2 > 0) the exponent of every escape, eight consecutive ordinals per thread at a
//     time: their tier-2 codes from a byte of each planes2 word, the tier-2 table (byte
//     permutes), raw bytes from the group's raw prefix + popc spread over the raw codes;
//  3. every chunk independently: codes from the plane words, tier-1 exponents (byte
//     permutes of the table when K1 <= 3), escapes at the group's prefix + popc, values.
template <class D, int K1, class O>
__device__ uint32_t decode_staged(DecSmem& sm, const BlockDesc& staged, bool aligned) {
    // The sections as shared-memory addresses: a BlockDesc's pointers are generic (they
    // point into global memory or the stage), so loads through them compile to generic
    // loads (LD); rebuilt from sm.stage and 32-bit offsets they are shared loads (LDS).
    BlockDesc d = staged;
    const uint8_t* const sb = reinterpret_cast<const uint8_t*>(sm.stage);
    d.blk = sb + (uint32_t)(staged.blk - sb);
    d.p1 = sb + (uint32_t)(staged.p1 - sb);
    d.p2 = sb + (uint32_t)(staged.p2 - sb);
    d.raw = sb + (uint32_t)(staged.raw - sb);
    d.pay = sb + (uint32_t)(staged.pay - sb);
    const int tid = threadIdx.x;
    const uint32_t nb = (uint32_t)d.nb, G = (nb + 31) / 32, k2 = d.k2, n_esc1 = d.n_esc1, ng2 = (n_esc1 + 31) / 32;
    const uint32_t* p1 = reinterpret_cast<const uint32_t*>(d.p1);
    const uint32_t* p2 = reinterpret_cast<const uint32_t*>(d.p2);
    constexpr int GPT = STAGED_MAX_NB / 32 / DT;  // groups per thread
    // WHOLE: a full block's G groups are all whole (as in phase 3, an instance of its own)
    auto counts = [&](auto full) {
        constexpr bool WHOLE = decltype(full)::value;
#pragma unroll
        for (int h = 0; h < GPT; ++h) {
            const uint32_t g = (uint32_t)(h * DT + tid);
            uint32_t v = 0;
            if (WHOLE || g < G) {
                uint32_t m = FULL;
#pragma unroll
                for (int b = 0; b < K1; ++b) m &= p1[g * K1 + b];
                if (!WHOLE && g == G - 1 && (nb & 31)) m &= (1u << (nb & 31)) - 1u;
                v = __popc(m);
            }
            if (g < ng2) {
                uint32_t m = FULL;
                for (uint32_t b = 0; b < k2; ++b) m &= p2[g * k2 + b];
                if (g == ng2 - 1 && (n_esc1 & 31)) m &= (1u << (n_esc1 & 31)) - 1u;
                v |= (k2 ? (uint32_t)__popc(m) : 0u) << 16;
            }
            sm.pre[g] = v;
        }
    };
    // A full block with a 16-byte aligned output: instances of phases 1 and 3 of its own,
    // without bounds checks
    const bool whole = nb == STAGED_MAX_NB && aligned;  // uniform
    if (whole) counts(std::true_type{});
    else counts(std::false_type{});
    __syncthreads();
    const uint32_t tot = block_scan<GPT, DT>(sm.pre, sm.wtmp);
    if ((tot & 0xffffu) != n_esc1) return ST_ESCAPES;
    if (k2 && (tot >> 16) != d.n_raw) return ST_RAWS;
    // A thread's chunks c = tid + DT·i (phase 3) and eight-ordinal units u = tid + DT·i (phase
    // 2) are all at byte q = tid & 3 of their group's words (DT is a multiple of 4): the shift
    // and the mask below it are the thread's own constants (computed from c in the loops,
    // they would be ~5 instructions per chunk)
    static_assert(DT % 4 == 0, "a thread's chunks share their byte of the group's words");
    const uint32_t sh = 8 * ((uint32_t)tid & 3u), below = (1u << sh) - 1u;
    if (k2) {  // eight consecutive ordinals per thread (one byte of each plane word)
        // tier-2 symbols: codes < 8 when k2 <= 3 pick from 8 bytes by byte permutes (the
        // bytes t1 .. t1 + 7 <= 31 of the table; bytes8_at's aligned loads may read up to
        // 8 bytes past the table's 32, inside DecSmem, and drop them)
        const uint2 tw2 = bytes8_at(sm.table, d.t1);
#pragma unroll 2  // 1-2 % faster (two tiers) than the compiler's choice
        for (uint32_t q8 = tid; 8 * q8 < n_esc1; q8 += DT) {
            const uint32_t o = 8 * q8, gi = o >> 5;  // o & 31 = sh
            uint32_t m = FULL;
            uint2 ex;
            if (k2 <= 3) {  // uniform; codes < 8
                ex = lookup8(tw2, sel_planes<3>(sm, p2 + gi * k2, k2, sh, m));
            } else {
                uint2 c2 = make_uint2(0, 0);
#pragma unroll
                for (uint32_t b = 0; b < 4; ++b) {
                    const uint32_t w = p2[gi * 4 + b];
                    const uint2 sc = scatter_plane((w >> sh) & 0xffu);
                    c2.x |= sc.x << b;
                    c2.y |= sc.y << b;
                    m &= w;
                }
                ex = make_uint2(0, 0);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    ex.x |= (uint32_t)sm.table[d.t1 + byte_at(c2.x, k)] << (8 * k);
                    ex.y |= (uint32_t)sm.table[d.t1 + byte_at(c2.y, k)] << (8 * k);
                }
            }
            // raw codes among the eight; those past n_esc1 (the last group's padding, which
            // decoders ignore) are not masked: they come after every real one, so the raw bytes
            // they take (from the stage, past the raw list) land past n_esc1, which phase 3
            // never reads (the raw counts that were checked are masked)
            const uint32_t r8 = (m >> sh) & 0xffu;
            if (r8) {  // consecutive raw ordinals from rb: spread over the raw positions
                const uint32_t rb = (sm.pre[gi] >> 16) + __popc(m & below);
                // (fp16: phase 3 checks these raw exponents, from sm.esc)
                ex = merge_spread(ex, bytes8_at(d.raw, rb), sm.mg[r8]);
            }
            *reinterpret_cast<uint2*>(sm.esc + o) = ex;
        }
        __syncthreads();
        if (sm.err) return sm.err;
    }
    const uint8_t* esc = k2 ? sm.esc : d.raw;  // one tier: every escape is raw, in order
    const uint2 tw = *reinterpret_cast<const uint2*>(sm.table);
    // the chunks, with no bounds to check in a full block's (WHOLE, the common case: a full
    // block and a 16-byte aligned output, one instance each; per-chunk checks would be ~10
    // of a chunk's ~86 instructions)
    auto values = [&](auto full) {
        constexpr bool WHOLE = decltype(full)::value;
        for (int c = tid; WHOLE ? c < (int)STAGED_MAX_NB / 8 : 8 * c < d.nb; c += DT) {
            const int v0 = 8 * c, valid = WHOLE ? 8 : (d.nb - v0 > 8 ? 8 : d.nb - v0);
            const uint32_t g = (uint32_t)c >> 2;  // 8 (c & 3) = sh
            const Payload<D> pl = load_payload<D, WHOLE>(d, c, v0);
            uint32_t all = FULL;
            uint2 ex;
            if constexpr (K1 <= 3) {  // codes < 8
                ex = lookup8(tw, sel_planes<K1>(sm, p1 + g * K1, K1, sh, all));
            } else {
                uint2 codes = make_uint2(0, 0);
#pragma unroll
                for (int b = 0; b < K1; ++b) {
                    const uint32_t w = p1[g * K1 + b];
                    const uint2 sc = scatter_plane((w >> sh) & 0xffu);
                    codes.x |= sc.x << b;
                    codes.y |= sc.y << b;
                    all &= w;
                }
                ex = make_uint2(0, 0);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    ex.x |= (uint32_t)sm.table[byte_at(codes.x, k)] << (8 * k);  // code bytes < 2^K1
                    ex.y |= (uint32_t)sm.table[byte_at(codes.y, k)] << (8 * k);
                }
            }
            const uint32_t e8 = (all >> sh) & (WHOLE ? 0xffu : (1u << valid) - 1u);
            if (e8) {  // the chunk's escapes are ordinals ob.. ob+popc(e8)-1: spread them with two permutes
                const uint32_t ob = (sm.pre[g] & 0xffffu) + __popc(all & below);
                ex = merge_spread(ex, bytes8_at(esc, ob), sm.mg[e8]);
                // fp16: exponents from the stream (raw bytes, or via sm.esc) must be < 32. The
                // table's bytes were checked and it is 0 past its end, so only a merged-in byte
                // can fail: check the merged values
                if (D::NSYM < 256 && ((ex.x | ex.y) & 0xe0e0e0e0u)) sm.err = ST_SYMBOL;
            }
            put_values<D, WHOLE, O>(d, v0, valid, ex, pl, WHOLE || aligned);
        }
    };
    if (whole) values(std::true_type{});
    else values(std::false_type{});
    __syncthreads();  // sm.err, and the end of this block's reads of sm.stage
    return sm.err;
}

// The tiles of a coded block, with the code width K1 fixed at compile time.
template <class D, int K1, class O>
__device__ uint32_t decode_tiles(DecSmem& sm, const BlockDesc& d, uint32_t flags) {
    uint32_t esc_run = 0, raw_run = 0;
    for (int t0 = 0; t0 < d.nb; t0 += DTILE) {
        const uint32_t s = decode_tile<D, K1, O>(sm, d, t0, esc_run, raw_run, flags & 1);
        if (s) return s;
    }
    if (esc_run != d.n_esc1) return ST_ESCAPES;
    if (d.k2 && raw_run != d.n_raw) return ST_RAWS;
    return ST_OK;
}

// Copy the coded block to sm.stage and point d's sections there. Decoding from global memory
// cost a dependent round trip per phase of every tile (planes, escapes, raw bytes, payload);
// from shared memory it is one round trip per block. The copy is asynchronous (cp.async, 16
// bytes each, no registers, every one in flight at once): the block is only 4-byte aligned,
// so the 16-byte lines that hold it are copied, and it starts at byte (blk & 15) of the
// stage. The bytes before the block in its first line (never used) belong to the stream's
// header or an earlier block. The line the block ends in is copied word by word up to the
// block's end (sizes are multiples of 4): the last block of a stream may end its allocation,
// and a read past it is out of bounds for compute-sanitizer. The caller waits for the copies
// (cp_async_wait_all) and its __syncthreads() publishes them; the previous block's last reads of sm.stage ended at the
// __syncthreads() that closes its decoding.
__device__ __forceinline__ void stage_block(DecSmem& sm, BlockDesc& d, uint32_t bytes) {
    const uint32_t tid = threadIdx.x, skew = (uint32_t)(reinterpret_cast<uintptr_t>(d.blk) & 15);
    const uint8_t* line = d.blk - skew;
    uint8_t* stage = reinterpret_cast<uint8_t*>(sm.stage);
    const uint32_t end = skew + bytes, whole = end / 16;
    for (uint32_t i = tid; i < whole; i += DT) cp_async16(stage + 16 * i, line + 16 * i, d.blk, d.blk + bytes);
    if (tid < 4 && 16 * whole + 4 * tid + 4 <= end) {
        const uint32_t w = 16 * whole + 4 * tid;
        cp_async4(reinterpret_cast<uint32_t*>(stage + w), line + w);
    }
    const uint8_t* base = stage + skew;
    d.p1 = base + (d.p1 - d.blk);
    d.p2 = base + (d.p2 - d.blk);
    d.raw = base + (d.raw - d.blk);
    d.pay = base + (d.pay - d.blk);
    d.blk = base;
}

// A staged raw block's values (at `src` in the stage, 4-byte aligned) to `out` (16-byte
// aligned), `len` bytes: output unit v is the stage's 16-byte units around src + 16 v,
// shifted by (src & 15) / 4 words; a partial last unit by thread 0. (The staging's copies
// are all in flight at once; 4-byte loads and stores straight from global memory would
// take one round trip per 1 KB of each thread.)
template <class O>
__device__ __forceinline__ void copy_out_raw(const uint8_t* src, uint8_t* out, uint32_t len) {
    const uint32_t tid = threadIdx.x, sw = (uint32_t)(reinterpret_cast<uintptr_t>(src) & 15) / 4, nv = len / 16;
    const uint4* u = reinterpret_cast<const uint4*>(src - 4 * sw);
    for (uint32_t v = tid; v < nv; v += DT) {
        const uint4 p = u[v];
        O::put128(out + 16 * v, sw ? shift_words(p, u[v + 1], 4 - sw) : p);
    }
    if (tid == 0) {
        for (uint32_t b = 16 * nv; b < len; b += 4) {
            if (b + 4 <= len) O::put32(out + b, *reinterpret_cast<const uint32_t*>(src + b));
            else O::put16(out + b, *reinterpret_cast<const uint16_t*>(src + b));
        }
    }
}

template <class D, class O = PlainOut>
__device__ uint32_t decode_block(DecSmem& sm, BlockDesc& d, uint32_t bytes, uint32_t w0, uint32_t w1, uint32_t flags) {
    const int tid = threadIdx.x;
    const uint32_t st = parse_block<D>(d, bytes, w0, w1);
    if (st) return st;
    const bool staged = bytes <= 4 * STAGE_WORDS;
    if (d.k1 == 0) {  // raw
        const uint32_t len = D::SIZE * (uint32_t)d.nb;
        if (!staged || !(flags & 1) || (reinterpret_cast<uintptr_t>(d.out) & 15)) {  // from global memory
            if (flags & 2) {
                for (uint32_t w = tid; w < len / 4; w += DT) O::put32(d.out + 4 * w, ld32(d.blk + 8 + 4 * w));
                if ((len & 3) && tid == 0)
                    O::put16(d.out + len - 2, *reinterpret_cast<const uint16_t*>(d.blk + 8 + len - 2));
            } else {
                for (uint32_t h = tid; h < len / 2; h += DT) {
                    if constexpr (std::is_same<O, PlainOut>::value)  // as written before O (the same registers)
                        reinterpret_cast<uint16_t*>(d.out)[h] = reinterpret_cast<const uint16_t*>(d.blk + 8)[h];
                    else
                        O::put16(d.out + 2 * (size_t)h, reinterpret_cast<const uint16_t*>(d.blk + 8)[h]);
                }
            }
            return ST_OK;
        }
        d.t1 = d.t2 = 0;  // no table
        d.p1 = d.p2 = d.raw = d.pay = d.blk;
    }
    const uint8_t* blk = d.blk;
    if (staged) stage_block(sm, d, bytes);  // the copy first: the table's load then waits beside it
    // From global memory: sm.stage is not published yet. fp16: the bytes past the table are
    // 0, so every byte a lookup can give is a valid exponent (the check of the merged values in
    // decode_staged relies on it). bf16 and fp32 check nothing there and keep the shorter form
    // (the padded one spills 16 bytes in the bf16 decoder: 4 % slower on the H200).
    if ((uint32_t)tid < (D::NSYM < 256 ? 32u : d.t1 + d.t2)) {
        const uint32_t e = (uint32_t)tid < d.t1 + d.t2 ? blk[8 + tid] : 0u;
        if (e >= (uint32_t)D::NSYM) sm.err = ST_SYMBOL;
        sm.table[tid] = (uint8_t)e;
    }
    if (staged) cp_async_wait_all();
    __syncthreads();
    if (d.k1 == 0) {  // a staged raw block: out in 16-byte stores (the output is 16-byte aligned)
        copy_out_raw<O>(d.blk + 8, d.out, D::SIZE * (uint32_t)d.nb);
        return ST_OK;
    }
    if (sm.err) return sm.err;
    if (staged && (uint32_t)d.nb <= STAGED_MAX_NB) {
        switch (d.k1) {
            case 1: return decode_staged<D, 1, O>(sm, d, flags & 1);
            case 2: return decode_staged<D, 2, O>(sm, d, flags & 1);
            case 3: return decode_staged<D, 3, O>(sm, d, flags & 1);
            case 4: return decode_staged<D, 4, O>(sm, d, flags & 1);
            default: return decode_staged<D, 5, O>(sm, d, flags & 1);
        }
    }
    switch (d.k1) {
        case 1: return decode_tiles<D, 1, O>(sm, d, flags);
        case 2: return decode_tiles<D, 2, O>(sm, d, flags);
        case 3: return decode_tiles<D, 3, O>(sm, d, flags);
        case 4: return decode_tiles<D, 4, O>(sm, d, flags);
        default: return decode_tiles<D, 5, O>(sm, d, flags);
    }
}

// Stream header checks (format.rs StreamHeader::parse), identical in every CTA. The six
// header words are loaded together and checked by one branch (checking each word before
// loading the next would make four dependent round trips at every CTA's start); which
// check failed is found after it.
template <class D>
__device__ uint32_t check_stream(const uint8_t* in, uint64_t in_len, uint64_t n, uint32_t& B, uint32_t& nblocks) {
    if (in_len < 24) return ST_TRUNCATED;
    uint32_t h[6];
#pragma unroll
    for (int i = 0; i < 6; ++i) h[i] = ld32(in + 4 * i);
    const uint64_t hn = (uint64_t)h[2] | ((uint64_t)h[3] << 32);
    B = h[4];
    nblocks = h[5];
    const bool ok = (h[0] == D::MAGIC) & (h[1] == 1u) & (hn == n) & (B >= 32u) & (B % 32u == 0u) & (B <= (1u << 24));
    if (!ok) {
        if (h[0] != D::MAGIC) return ST_MAGIC;
        if (h[1] != 1) return ST_VERSION;
        if (hn != n) return ST_COUNT;
        return ST_GEOMETRY;
    }
    if ((n + B - 1) / B != nblocks) return ST_GEOMETRY;
    if (in_len < 24 + 4 * (uint64_t)nblocks) return ST_TRUNCATED;
    return ST_OK;
}

// The first of CTA i's blocks [cta_start(i), cta_start(i + 1)) of nb (cta_start(G) = nb;
// nb < 2^32, a u32 header field). Contiguous ranges, in order. Without a tail (P = 0) the
// blocks split evenly over the grid of G CTAs (with fewer blocks than CTAs, the CTAs with a
// block are spread over the grid, so over the SMs). With one (P: its wave, the CTAs
// resident at once; gpu.rs decode_grid), the last 2·P CTAs take 2 blocks each, then 1, and
// the head of the grid splits the others evenly.
__device__ __forceinline__ uint32_t cta_start(uint32_t nb, uint32_t P, uint32_t i) {
    const uint32_t G = gridDim.x;
    // no tail unless every CTA of the head has a block
    const uint32_t p = (G > 2 * P && nb >= 3 * P && nb - 3 * P >= G - 2 * P) ? P : 0u;
    const uint32_t head = G - 2 * p, a = nb - 3 * p, h = i < head ? i : head, t = i - h;
    return (uint32_t)((uint64_t)a * h / head) + 2 * (t < p ? t : p) + (t > p ? t - p : 0u);
}

// The permute tables of every decoder CTA, mg[m] (merge_spread) and nsp[m], one m per
// thread (DT = 256 = the number of 8-bit masks); published by decode_block's barrier before
// any use.
__device__ __forceinline__ void init_tables(DecSmem& sm, int tid) {
    const uint32_t m = (uint32_t)tid;
    uint32_t sx = 0, r = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (h) r = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const bool set = (m >> (4 * h + k)) & 1u;
            sx |= (set ? 4u + r : (uint32_t)k) << (16 * h + 4 * k);
            r += set;
        }
    }
    sm.mg[m] = make_uint2(sx, 8u * (uint32_t)__popc(m & 15u));  // published by decode_block's barrier before any use
    uint32_t ns = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) ns |= ((m >> k) & 1u) << (4 * k);
    sm.nsp[m] = ns;
}

// flags bit 0: `out` is 16-byte aligned; bit 1: `out` is 4-byte aligned; bits 8..19: SMs,
// 20..23: CTAs per SM (the grid's wave is their product; 0: unknown); bit 24: the grid ends
// in a tail (cta_start) of that wave.
template <class D>
__device__ void decompress_kernel(const uint8_t* in, uint64_t in_len, uint8_t* out, uint64_t n, uint32_t* status,
                                  uint32_t flags) {
    pdl_enter();
    BFX_DYN_SMEM(DecSmem, sm);
    BFX_EMU_POISON(sm);
    const int tid = threadIdx.x;
    if (tid == 0) sm.err = 0;
    uint32_t B = 0, nblocks = 0;
    const uint32_t st = check_stream<D>(in, in_len, n, B, nblocks);
    if (st) {
        if (blockIdx.x == 0 && tid == 0) report(status, st, 0);
        return;
    }
    const uint32_t wave = ((flags >> 24) & 1u) ? shape_sms(flags) * shape_per_sm(flags) : 0u;
    const uint64_t b0 = cta_start(nblocks, wave, blockIdx.x), b1 = cta_start(nblocks, wave, blockIdx.x + 1);
    if (b0 == b1) return;
    // Bytes before block b0: the sizes in 16-byte loads (the table is 4-byte aligned: up to
    // three single words first, up to three after).
    const uint32_t* tab = reinterpret_cast<const uint32_t*>(in + 24);
    const uint64_t skew = ((16u - (reinterpret_cast<uintptr_t>(tab) & 15u)) & 15u) / 4u, lead = skew < b0 ? skew : b0;
    const uint64_t nv = (b0 - lead) / 4, tail = lead + 4 * nv;
    uint64_t part = (uint64_t)tid < lead ? tab[tid] : 0u;
    if (tail + tid < b0) part += tab[tail + tid];
    const uint4* tv = reinterpret_cast<const uint4*>(tab + lead);
#pragma unroll 4
    for (uint64_t i = tid; i < nv; i += DT) {
        const uint4 v = tv[i];
        part += (uint64_t)v.x + v.y + v.z + v.w;
    }
    uint64_t off = 24 + 4 * (uint64_t)nblocks + block_sum64<DT>(part, sm.wtmp64);
    // A size before b0 that is not a multiple of 4 (a corrupt table) would make every access
    // here misaligned, a fault. The CTA of the first such block reports it (ST_BLOCK_SIZE:
    // its own offset is aligned); the others stop.
    if (off & 3) return;
    init_tables(sm, tid);
    // A block's size and header words are copied to sm.next one block ahead (cp.async, no
    // registers held), so that their latency hides behind the previous block instead of
    // delaying its staging by two dependent round trips.
    // sm.next[j & 1] holds block j's; block b0's are loaded here (the barrier in block_sum64
    // above does not cover them: one more below).
    if (tid == 0) {
        sm.next[b0 & 1][0] = ld32(in + 24 + 4 * b0);
        const bool hdr = off + 8 <= in_len;
        sm.next[b0 & 1][1] = hdr ? ld32(in + off) : 0u;
        sm.next[b0 & 1][2] = hdr ? ld32(in + off + 4) : 0u;
    }
    __syncthreads();
    for (uint64_t j = b0; j < b1; ++j) {
        const uint32_t bytes = sm.next[j & 1][0];
        if (tid == 0 && j + 1 < b1) {  // read after this block's last barrier
            uint32_t* next = sm.next[(j + 1) & 1];
            cp_async4(next, in + 28 + 4 * j);
            // The next header's offset is only aligned if this size is (it is validated
            // below, after this copy is issued: a misaligned copy would be a device fault).
            if (bytes % 4 == 0 && off + bytes + 8 <= in_len) {
                cp_async4(next + 1, in + off + bytes);
                cp_async4(next + 2, in + off + bytes + 4);
            } else {
                next[1] = next[2] = 0;
            }
        }
        BlockDesc d;
        d.nb = (int)(n - j * B < B ? n - j * B : B);
        d.blk = in + off;
        d.out = out + j * B * D::SIZE;
        uint32_t s = ST_OK;
        if (bytes % 4 || bytes < 8 + (uint32_t)d.nb || bytes > 8 + D::SIZE * B) s = ST_BLOCK_SIZE;
        else if (off + bytes > in_len) s = ST_TRUNCATED;
        else s = decode_block<D>(sm, d, bytes, sm.next[j & 1][1], sm.next[j & 1][2], flags);  // off + 8 <= in_len
        if (s) {
            if (tid == 0) {
                report(status, s, j);
                cp_async_wait_all();  // nothing lands in shared memory after the CTA ends
            }
            return;
        }
        off += bytes;
        if (j + 1 < b1) {
            if (tid == 0) cp_async_wait_all();
            __syncthreads();
        }
    }
}

}  // namespace bfx

// ===================================================================== entry points ===
// Parameters as in bfx.cu: u64 for pointers and sizes, u32 otherwise.

// Bytes of dynamic shared memory a decoder CTA needs, and its threads (read by the launcher).
extern "C" __device__ uint32_t hoccl_bfx_decode_smem = sizeof(bfx::DecSmem);
extern "C" __device__ uint32_t hoccl_bfx_decode_threads = bfx::DT;
// The most waves (as many CTAs as fit the SMs at once) in the grid (gpu.rs aims at 8 blocks
// per CTA beyond one wave).
extern "C" __device__ uint32_t hoccl_bfx_decode_waves = 8;
// The launcher ends the grid in a tail of small CTAs (gpu.rs decode_grid, cta_start above)
// once the blocks fill a wave of CTAs of this many blocks (at most 8) and three waves more:
// from 7 waves' worth of blocks (115 MiB of bf16 on the H200). At 128 MiB the tail gains
// 8-10 % on the H200 (both tier modes), the head CTAs having 4-5 blocks. A CTA of one or
// two blocks has nothing to hide its first block's latency behind, so the head keeps at
// least 4.
extern "C" __device__ uint32_t hoccl_bfx_decode_tail = 4;

// status = 0 before the decoder may set it.
extern "C" __global__ void hoccl_bfx_decompress_begin(uint32_t* status) {
    bfx::pdl_enter();
    if (threadIdx.x == 0 && blockIdx.x == 0 && status) *status = 0;
}

#define BFX_DECOMPRESS(NAME, D)                                                                             \
    extern "C" __global__ void __launch_bounds__(bfx::DT, 1024 / bfx::DT)                                   \
        NAME(const uint8_t* in, uint64_t in_len, uint8_t* out, uint64_t n, uint32_t* status, uint32_t flags) { \
        bfx::decompress_kernel<D>(in, in_len, out, n, status, flags);                                       \
    }
BFX_DECOMPRESS(hoccl_bfx_decompress_bf16, bfx::Bf16T)
BFX_DECOMPRESS(hoccl_bfx_decompress_f16, bfx::F16T)
BFX_DECOMPRESS(hoccl_bfx_decompress_f32, bfx::F32T)
