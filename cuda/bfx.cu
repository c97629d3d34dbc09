// Single-pass BFX1/HFX1/FFX1 compressor (see bfx.cuh for the thread layout,
// src/compress/format.rs for the format, src/compress/select.rs for the choice; the
// decompressor is in bfx_decode.cu).
//
// One CTA per block, blocks handed out in launch order by an atomic ticket. The CTA loads
// its block once into registers (16-byte loads), histograms the strided 1/8 sample, ranks
// symbols, picks (k1, k2), codes every value, and from the exact escape counts knows its
// compressed size before it writes anything. It publishes that size and finds its offset in
// the contiguous stream with a decoupled look-back over its predecessors, then writes every
// section straight to its final place. No second pass, no compaction.
//
// Included once (the fatbin's one translation unit includes every kernel file, and
// bfx_fused.cu includes this one for the encoder's block functions).
#pragma once
#include "bfx.cuh"

#include <type_traits>

namespace bfx {

// Threads per compressor CTA (one block per CTA; a thread holds B / (8·ET) chunks). The
// launcher reads it from the module (hoccl_bfx_compress_threads).
constexpr int ET = 256;
constexpr int EWARPS = ET / 32;
constexpr int ETILE = ET * 8;  // values per CTA step

// ===================================================================== compressor =====

// The codes of a chunk, kept as their bit planes ("spread") or as code bytes: see
// chunk_codes. Spread for the 16-bit types (on the H200 5-8 % faster than bytes for bf16,
// 2 % for fp16); fp32 spills more with it (3 % slower), so it keeps bytes.
template <class D>
constexpr bool kSpread = D::SIZE == 2;
// Narrow codes (spread form, k1 <= 3): one word per chunk, byte b < 3 the tier-1 plane b,
// byte 3 the raw mask (the escape mask is the AND of the k1 plane bytes), from 4-byte
// table entries.
// A chunk's codes (chunk_codes): one word when narrow (N), else two.
template <bool N>
using CodeT = std::conditional_t<N, uint32_t, uint2>;
// A chunk with a single raw exponent stores it with one byte store; the eight predicated
// stores only for chunks with more.

// A chunk's count word: raws only in the one-tier kernels (their escapes are their raws),
// else escapes | raws << 16.
template <bool ONE>
constexpr bool kRawCounts = ONE;

template <int CPT>
struct EncSmem {
    union {
        struct {
            uint32_t hist[256];
            alignas(16) uint32_t keys[256 + 4];  // sampled symbols' sort keys, then zeros to a multiple of 4
        };
        uint32_t p5[512 + 4];  // after choose: the fifth tier-1 plane's words (k1 = 5; kEarlyOut)
    };
    uint32_t cnt_by_rank[32];
    uint8_t code2[256];
    uint8_t table[32];
    uint2 cx[256];  // compaction selectors (kCx)
    alignas(16) uint32_t wtmp[EWARPS];
    uint64_t ticket, offset, nblocks;
    uint32_t k1, k2, n_esc1, n_raw, raw;
    // The large arrays last, from cnt to the end: a raw block's stage (raw_stage_bytes); the
    // escape list the very last: a kernel without it (kNoEsc) allocates up to it only.
    alignas(16) uint32_t cnt[ET * CPT];  // per chunk: escapes | raws << 16, then exclusive prefix
    union {  // the tables while coding, then the raw list
        alignas(8) uint8_t rawb[ETILE * CPT];  // raw exponents by raw ordinal
        uint2 lut[4][256];      // per symbol: its code byte's bits spread to bit 0 of each byte,
                                // shifted by 0-3 bits (or, bytes: lut[0] as its code byte)
        uint32_t lutn[4][256];  // narrow: code bits 0-2 and the raw flag spread, shifted by 0-3
    };
    alignas(8) uint8_t esc[ETILE * CPT];  // exponent of each escape, by escape ordinal (k2 > 0)
};

// The bf16 one-tier kernels have no escape list (k2 = 0: every escape is raw) and allocate
// EncSmem only up to it: 29 KB of shared memory per CTA instead of 45, so the four CTAs of
// an SM leave ~124 KB of L1 (for the spills and the block's loads) instead of ~60, and a
// raw block is staged in two passes (0-3 % faster on the H200 than the whole struct).
template <class D, bool T1>
constexpr bool kNoEsc = T1 && D::SIZE == 2 && D::NSYM == 256;
template <int CPT, bool NOESC>
constexpr uint32_t kEncSmemBytes = NOESC ? (uint32_t)offsetof(EncSmem<CPT>, esc) : (uint32_t)sizeof(EncSmem<CPT>);

// cx[m]: nibble i of .x (.y) is the position of set bit i (4 + i) of m (unused nibbles 0).
struct SelTable {
    uint2 v[256];
};
constexpr SelTable make_cx() {
    SelTable t{};
    for (uint32_t m = 0; m < 256; ++m) {
        uint32_t x = 0, y = 0, n = 0;
        for (uint32_t j = 0; j < 8; ++j) {
            if ((m >> j) & 1u) {
                if (n < 4) x |= j << (4 * n);
                else y |= j << (4 * (n - 4));
                ++n;
            }
        }
        t.v[m].x = x;
        t.v[m].y = y;
    }
    return t;
}
__device__ const SelTable kCx = make_cx();

template <class D>
__device__ __forceinline__ Chunk<D> load_chunk(const uint8_t* blk, int c, int nb, bool aligned, bool full) {
    Chunk<D> ch;
    const int valid = nb - 8 * c;
    if (aligned && (full || valid >= 8)) {
        const uint4* p = reinterpret_cast<const uint4*>(blk + (size_t)c * 8 * D::SIZE);
#pragma unroll
        for (int k = 0; k < D::WORDS / 4; ++k) {
            uint4 a = p[k];
            ch.w[4 * k] = a.x;
            ch.w[4 * k + 1] = a.y;
            ch.w[4 * k + 2] = a.z;
            ch.w[4 * k + 3] = a.w;
        }
        return ch;
    }
#pragma unroll
    for (int k = 0; k < D::WORDS; ++k) ch.w[k] = 0;
#pragma unroll
    for (int v = 0; v < 8; ++v) {
        if (v < valid) {
            const uint8_t* p = blk + ((size_t)c * 8 + v) * D::SIZE;
            if constexpr (D::SIZE == 2) ch.w[v / 2] |= (uint32_t)(*reinterpret_cast<const uint16_t*>(p)) << (16 * (v & 1));
            else ch.w[v] = *reinterpret_cast<const uint32_t*>(p);
        }
    }
    return ch;
}

// Steps 2-4 of select.rs: rank the sampled symbols, pick (k1, k2), build the lookup. Warp 0
// picks the widths and a barrier publishes them (every warp picking them itself, without
// that barrier, is no faster).
template <class D, int CPT>
__device__ void choose(EncSmem<CPT>& sm, int nb, uint32_t tiers) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool have = tid < D::NSYM;
    const uint32_t c = have ? sm.hist[tid] : 0u;
    const uint32_t bal = __ballot_sync(FULL, c > 0);
    if (lane == 0) sm.wtmp[warp] = __popc(bal);
    __syncthreads();
    uint32_t base, m;
    warp_totals<EWARPS>(sm.wtmp, warp, base, m);
    const uint32_t pre = base + __popc(bal & lanemask_lt(lane));
    // key = count << 8 | (255 - symbol): a symbol ranks before another (count desc, then
    // symbol asc) exactly when its key is larger; keys are distinct and >= 256, so the zeros
    // that pad the list to a multiple of 4 never count
    const uint32_t key = (c << 8) | (255u - (uint32_t)tid);
    if (c > 0) sm.keys[pre] = key;
    if (tid < 4) sm.keys[m + tid] = 0;
    __syncthreads();
    uint32_t r = 0;  // its rank (only this thread uses it)
    if (have) {
        if (c > 0) {  // the keys larger than its own, four per 16-byte load (up to 256 of them:
                      // random exponents sample nearly every symbol)
            const uint4* k4 = reinterpret_cast<const uint4*>(sm.keys);
            for (uint32_t i = 0; i < (m + 3) / 4; ++i) {
                const uint4 k = k4[i];
                r += (k.x > key ? 1u : 0u) + (k.y > key ? 1u : 0u) + (k.z > key ? 1u : 0u) + (k.w > key ? 1u : 0u);
            }
        } else {  // unsampled symbols follow in ascending order
            r = m + ((uint32_t)tid - pre);
        }
        if (r < 32) {
            sm.table[r] = (uint8_t)tid;
            sm.cnt_by_rank[r] = c;
        }
    }
    __syncthreads();
    if (warp == 0) {  // C(t) = sampled count of ranks < t: one scan, then two shuffles per candidate
        const uint32_t S = ((uint32_t)nb + 7u) / 8u;
        const uint32_t incl = warp_incl_scan(sm.cnt_by_rank[lane], lane);  // C(lane + 1)
        const int cand = lane < NCAND ? lane : 0;
        const uint32_t k1 = cand_k1(cand), k2 = cand_k2(cand), t1 = tier(k1), t12 = t1 + tier(k2);
        const uint32_t c1 = __shfl_sync(FULL, incl, (int)t1 - 1), c12 = __shfl_sync(FULL, incl, (int)t12 - 1);
        uint32_t best = FULL;
        if (lane < NCAND && (tiers == 2 || k2 == 0)) {
            const uint32_t cost = S * k1 + (S - c1) * k2 + 8u * (S - c12);
            best = (cost << 5) | (uint32_t)lane;  // cost < 2^27: first minimum wins
        }
        best = __reduce_min_sync(FULL, best);
        if (lane == 0) {
            sm.k1 = cand_k1(best & 31);
            sm.k2 = cand_k2(best & 31);
        }
    }
    __syncthreads();
    if (have) {
        const uint32_t t1 = tier(sm.k1), t2 = tier(sm.k2);
        uint32_t code;
        if (r < t1) {
            code = r;
        } else if (r < t1 + t2) {
            code = t1 | LUT_ESC;
            sm.code2[tid] = (uint8_t)(r - t1);
        } else {
            code = t1 | LUT_ESC | LUT_RAW;
            sm.code2[tid] = (uint8_t)t2;
        }
        if constexpr (kSpread<D>) {
            if (sm.k1 <= 3) {  // as chunk_codes<D, CPT, true> reads them
                const uint32_t e = (((code & 7u) | ((code >> 4) & 8u)) * 0x00204081u) & 0x01010101u;
#pragma unroll
                for (int k = 0; k < 4; ++k) sm.lutn[k][tid] = e << k;
            } else {
                const uint2 e = scatter_plane(code);
#pragma unroll
                for (int k = 0; k < 4; ++k) sm.lut[k][tid] = make_uint2(e.x << k, e.y << k);
            }
        } else {
            reinterpret_cast<uint8_t*>(sm.lut)[tid] = (uint8_t)code;
        }
    }
    __syncthreads();
}

// The codes of a chunk's 8 values. Spread form (kSpread): as bit planes, bit k of
// byte b (of the pair .x = bytes 0-3, .y = bytes 4-7) is bit b of value k's code byte
// (code bits 0-4, LUT_ESC bit 6, LUT_RAW bit 7). Each symbol's table entry holds its code
// byte's bits spread to bit 0 of each byte, so value k ORs its entry shifted by k: the
// tier-1 plane bytes (byte b < k1 of .x), the escape mask (byte 2 of .y) and the raw mask
// (byte 3 of .y) come out of the lookups, with no gathering afterwards. The index is the
// exponent times 8 (a byte offset), from two instructions per pair of values. The entries
// are kept shifted by 0-3 bits (four tables): value k reads table k & 3, so only the OR of
// the upper four values needs a shift.
// Narrow (k1 <= 3): one word, bytes 0-2 the tier-1 planes, byte 3 the raw mask, from
// 4-byte entries: half the shared-memory wavefronts of 8-byte ones for the same lookups
// (on the H200 3-4 % faster than the two-word form for bf16; fp16 the same). The four
// shifted tables together with the single-raw store: one tier 2-3 % faster.
// Byte form: byte k of .x (.y) = value k's (4 + k's) code byte.
template <class D, int CPT, bool N>
__device__ __forceinline__ CodeT<N> chunk_codes(const EncSmem<CPT>& sm, const Chunk<D>& ch) {
    if constexpr (N) {
        const uint8_t* l = reinterpret_cast<const uint8_t*>(sm.lutn);  // table k at 1024 k
        uint32_t lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            // the two exponents times 4, each by its own shift and mask (fewer instructions
            // than one shift and mask for both, then a mask and a shift to split them)
            const uint32_t w = top_pair<D>(ch, i), m = (D::EMASK2 & 0xffffu) << 2;
            const uint32_t ta = (w >> (D::ESHIFT - 2)) & m, tb = (w >> (D::ESHIFT + 14)) & m;
            const uint32_t a = *reinterpret_cast<const uint32_t*>(l + ((i & 1) ? 2048 : 0) + ta);
            const uint32_t b = *reinterpret_cast<const uint32_t*>(l + ((i & 1) ? 3072 : 1024) + tb);
            (i < 2 ? lo : hi) |= a | b;
        }
        return lo | (hi << 4);
    } else {
        const uint8_t* lut = reinterpret_cast<const uint8_t*>(sm.lut);
        uint32_t x = 0, y = 0;
        if constexpr (kSpread<D>) {
            uint2 lo = make_uint2(0, 0), hi = make_uint2(0, 0);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint32_t t = (top_pair<D>(ch, i) >> (D::ESHIFT - 3)) & (D::EMASK2 << 3);
                const uint2 a = *reinterpret_cast<const uint2*>(lut + ((i & 1) ? 4096 : 0) + (t & 0xffffu));  // table 0 or 2
                const uint2 b = *reinterpret_cast<const uint2*>(lut + ((i & 1) ? 6144 : 2048) + (t >> 16));  // 1 or 3
                uint2& acc = i < 2 ? lo : hi;
                acc.x |= a.x | b.x;
                acc.y |= a.y | b.y;
            }
            x = lo.x | (hi.x << 4);
            y = lo.y | (hi.y << 4);
        } else {
            const uint2 ex = chunk_exps<D>(ch);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                x |= (uint32_t)lut[byte_at(ex.x, k)] << (8 * k);
                y |= (uint32_t)lut[byte_at(ex.y, k)] << (8 * k);
            }
        }
        return make_uint2(x, y);
    }
}

// Escape mask (bit k: value k's code is an escape) and raw mask of a chunk's codes. Narrow:
// an escape is T1, all k1 code bits set (K1 = 0: k1 known at run time only).
template <class D, bool N, int K1>
__device__ __forceinline__ uint32_t esc_mask(CodeT<N> code, uint32_t k1) {
    if constexpr (N && K1 == 0) {
        const uint32_t m1 = k1 < 2 ? 0xffu : 0u, m2 = k1 < 3 ? 0xffu : 0u;
        return code & ((code >> 8) | m1) & ((code >> 16) | m2) & 0xffu;
    } else if constexpr (N) {
        uint32_t e = code;
        if constexpr (K1 >= 2) e &= code >> 8;
        if constexpr (K1 >= 3) e &= code >> 16;
        return e & 0xffu;
    } else if constexpr (kSpread<D>) {
        return __byte_perm(code.y, 0, 0x4442);
    } else {
        return gather_plane(code.x, code.y, 6);  // LUT_ESC
    }
}
template <class D, bool N>
__device__ __forceinline__ uint32_t raw_mask(CodeT<N> code) {
    if constexpr (N) return code >> 24;
    else if constexpr (kSpread<D>) return code.y >> 24;
    else return gather_plane(code.x, code.y, 7);  // LUT_RAW
}

// The bytes of tier-1 planes 0..min(K1, 4)-1 of a chunk's codes (byte b = plane b; the
// bytes >= K1 are not stored: quad_transpose puts them in plane words >= K1).
template <class D, bool N, int K1>
__device__ __forceinline__ uint32_t tier1_planes4(CodeT<N> code) {
    if constexpr (N) return code;
    else if constexpr (kSpread<D>) return code.x;
    else return plane_bytes4<K1>(code);
}
// The fifth tier-1 plane's byte (k1 = 5).
template <class D>
__device__ __forceinline__ uint32_t tier1_plane4(uint2 code) {
    if constexpr (kSpread<D>) return code.y & 0xffu;
    else return gather_plane(code.x, code.y, 4);
}

// The codes of the values >= valid of a chunk cleared.
template <class D, bool N>
__device__ __forceinline__ CodeT<N> clear_past(CodeT<N> code, int valid) {
    if constexpr (kSpread<D>) {
        const uint32_t vm = (valid <= 0 ? 0u : (1u << valid) - 1u) * 0x01010101u;  // bits < valid of each byte
        if constexpr (N) return code & vm;
        else return make_uint2(code.x & vm, code.y & vm);
    } else {
        const uint2 vm = valid_mask(valid);
        return make_uint2(code.x & vm.x, code.y & vm.y);
    }
}

// One thread: publish block j's size (`st[j]` is its status word), as soon as it is known,
// for its successors' look-back; block 0's is already its inclusive prefix.
__device__ __forceinline__ void publish_size(uint64_t* st, uint64_t j, uint64_t agg) {
    atomicExch(reinterpret_cast<unsigned long long*>(st + j), (unsigned long long)((j == 0 ? LB_INC : LB_AGG) | agg));
}

// Warp 0, after publish_size: sum the predecessors' sizes (decoupled look-back) and publish
// the inclusive prefix. Returns the exclusive prefix (bytes of blocks < j). Each step reads
// the LBD·32 statuses before `end` (lane l: distances l, l + 32, ...), re-reads only the
// unpublished ones, and ends at the nearest inclusive prefix among them, if any. LBD = 1:
// the nearest inclusive prefix is mostly within 32 blocks, and more loads in flight per
// step only cost registers (LBD 2 and 4 run 1-6 % slower on the H200).
__device__ uint64_t lookback(uint64_t* st, uint64_t j, uint64_t agg, int lane) {
    constexpr int LBD = 1;
    volatile uint64_t* vs = st;
    if (j == 0) return 0;
    uint64_t excl = 0;
    int64_t end = (int64_t)j;
    while (true) {
        uint64_t s[LBD];
#pragma unroll
        for (int k = 0; k < LBD; ++k) {
            const int64_t idx = end - 1 - lane - 32 * k;
            s[k] = idx >= 0 ? vs[idx] : LB_INC + 0;  // before block 0: an inclusive 0
        }
        bool wait = false;
#pragma unroll
        for (int k = 0; k < LBD; ++k) wait |= (s[k] >> 62) == 0;
        while (__any_sync(FULL, wait)) {  // unpublished statuses: read them again
            wait = false;
#pragma unroll
            for (int k = 0; k < LBD; ++k) {
                if ((s[k] >> 62) == 0) {
                    spin_pause();
                    s[k] = vs[end - 1 - lane - 32 * k];
                    wait |= (s[k] >> 62) == 0;
                }
            }
        }
        // the aggregates before the nearest inclusive prefix, summed in 32 bits (a compressor
        // block is at most 8 + 32768 bytes: B <= 16384 16-bit or 8192 fp32 values, so LBD·32 of
        // them fit), and that prefix (64 bits) from its lane
        uint32_t part = 0;
        bool found = false;
#pragma unroll
        for (int k = 0; k < LBD; ++k) {
            if (!found) {  // uniform
                const uint32_t inc = __ballot_sync(FULL, (s[k] >> 62) == 2);
                const int first = inc ? __ffs(inc) - 1 : 32;
                part += lane < first ? (uint32_t)(s[k] & LB_VAL) : 0u;
                if (inc) excl += __shfl_sync(FULL, s[k] & LB_VAL, first);
                found = inc != 0;
            }
        }
        excl += warp_sum32(part);
        if (found) break;
        end -= 32 * LBD;
    }
    if (lane == 0) atomicExch(reinterpret_cast<unsigned long long*>(st + j), (unsigned long long)(LB_INC | (excl + agg)));
    return excl;
}

// fp16 holds fewer words across the look-back: a raw block's values go to store_raw's stage
// in phase 1 (a 16-bit block fits it whole), and the fifth tier-1 plane's words (k1 = 5) to
// sm.p5, so Out keeps only the coded words (4 per chunk, not 5): 4 % faster on the H200,
// though ptxas reports more spill bytes. bf16 the same way (3 words, not 4) runs 5-11 %
// slower, so it keeps them.
template <class D>
constexpr bool kEarlyOut = D::SIZE == 2 && D::NSYM == 32;

// The output words of one chunk, computed before the look-back so that only stores remain
// after it (and the chunk's values and codes are dead by then). Coded: w[0] its tier-1
// plane word (lane q < k1 of the quad stores it), w[1] the fifth plane's (k1 = 5, q = 0;
// not with kEarlyOut), then from w[P] the payload: bf16 2 words of sign + mantissa bytes;
// fp16 the quad's top-bit plane word (q < 3) and 2 words of low mantissa bytes; fp32 the
// chunk's 8 value words, from which store_payload derives the payload (its 6 payload words
// held here spilled). Raw (not with kEarlyOut): the chunk's values.
template <class D>
struct Out {
    static constexpr int P = kEarlyOut<D> ? 1 : 2;
    static constexpr int N = P + (D::SIZE == 4 ? 8 : (D::NSYM == 32 ? 3 : 2));
    uint32_t w[N];
};

// Payload words of one chunk (every lane calls: fp16 uses a quad transpose).
template <class D>
__device__ __forceinline__ void payload_words(const Chunk<D>& ch, int c, Out<D>& o) {
    if constexpr (D::SIZE == 4) {
#pragma unroll
        for (int k = 0; k < 8; ++k) o.w[Out<D>::P + k] = ch.w[k];
        return;
    }
    constexpr int P = Out<D>::P;
    const uint32_t p0 = ch.w[0], p1 = ch.w[1], p2 = ch.w[2], p3 = ch.w[3];
    if constexpr (D::NSYM == 32) {
        const uint2 t = make_uint2(f16_top3(p0, p1), f16_top3(p2, p3));
        o.w[P] = quad_transpose(plane_bytes4<3>(t), c & 3);
        o.w[P + 1] = __byte_perm(p0, p1, 0x6420);
        o.w[P + 2] = __byte_perm(p2, p3, 0x6420);
        return;
    }
    o.w[P] = sm_bytes(p0, p1);
    o.w[P + 1] = sm_bytes(p2, p3);
}

// Stores of payload_words' words (nb bytes, 8 per chunk, at `pay`; fp16's planes first).
template <class D>
__device__ __forceinline__ void store_payload(const Out<D>& o, int c, int nb, uint32_t G, uint8_t* pay, bool full) {
    const int q = c & 3, g = c >> 2;
    constexpr int P = Out<D>::P;
    uint8_t* bytes = pay;
    if constexpr (D::NSYM == 32) {
        if ((full || (uint32_t)g < G) && q < 3) st32(pay + 4 * (3 * g + q), o.w[P]);
        bytes = pay + 12 * G;
        if (full || 8 * c < nb) st32(bytes + 8 * c, o.w[P + 1]);
        if (full || 8 * c + 4 < nb) st32(bytes + 8 * c + 4, o.w[P + 2]);
        return;
    }
    if constexpr (D::SIZE == 4) {
        Chunk<D> ch;
#pragma unroll
        for (int k = 0; k < 8; ++k) ch.w[k] = o.w[P + k];
        if (full || 8 * c < nb) st32(bytes + 8 * c, sm_bytes(top_pair<D>(ch, 0), top_pair<D>(ch, 1)));
        if (full || 8 * c + 4 < nb) st32(bytes + 8 * c + 4, sm_bytes(top_pair<D>(ch, 2), top_pair<D>(ch, 3)));
        uint8_t* lo = pay + pad4((uint32_t)nb) + 16 * c;
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (full || 8 * c + 2 * k < nb) st32(lo + 4 * k, low_pair<D>(ch, k));
        return;
    }
    if (full || 8 * c < nb) st32(bytes + 8 * c, o.w[P]);
    if (full || 8 * c + 4 < nb) st32(bytes + 8 * c + 4, o.w[P + 1]);
}

// The n bytes of `ex` that compaction selectors `sel` pick, to dst[0..n) (n <= 8). (ORing
// them into a zeroed list with shared atomics, at most three words per chunk, takes fewer
// instructions but runs 5-8 % slower on the H200.)
__device__ __forceinline__ void put_compacted(uint8_t* dst, uint2 ex, uint2 sel, int n) {
    const uint32_t lo = prmt(ex.x, ex.y, sel.x), hi = prmt(ex.x, ex.y, sel.y);
    const uint32_t m = 0xffu >> (8 - n);  // bit i: byte i is stored (predicates from one register, not 7 compares)
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if (m & (1u << i)) dst[i] = (uint8_t)((i < 4 ? lo : hi) >> (8 * (i & 3)));
}

// Tier-2 planes from the list of escape exponents by ordinal, the same way as planes1: a
// thread takes 8 exponents, looks up their tier-2 codes, gathers one byte per plane, and
// the quad assembles the plane words, into sm.cnt (free once the lists are built) at their
// word index in the planes2 section (at most 4·ceil(nb/32) words: k2 <= 4; sm.cnt holds
// one word per 8-value chunk); store_coded copies them out. Thread t of nt, whole warps (the quads shuffle),
// after a barrier that follows phase 1: the stream kernel runs it on warps 1.. while warp
// 0 runs the look-back (H200, against the same work after the look-back: two tiers +1.5 %
// at 256 MiB, +3 % at 512 MiB, fp16 +1.5 %).
template <int CPT>
__device__ void planes2_words(EncSmem<CPT>& sm, uint32_t t, uint32_t nt) {
    const uint32_t k2 = sm.k2, n_esc1 = sm.n_esc1, units = 4 * ((n_esc1 + 31) / 32);
    for (uint32_t u0 = 0; u0 < units; u0 += nt) {
        const uint32_t u = u0 + t, q = u & 3, g = u >> 2;
        uint2 code = make_uint2(0, 0);
        if (u < units) {
            const uint2 e = *reinterpret_cast<const uint2*>(sm.esc + 8 * u);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                code.x |= (uint32_t)sm.code2[byte_at(e.x, k)] << (8 * k);
                code.y |= (uint32_t)sm.code2[byte_at(e.y, k)] << (8 * k);
            }
            const uint2 vm = valid_mask((int)n_esc1 - 8 * (int)u);
            code.x &= vm.x;
            code.y &= vm.y;
        }
        const uint32_t w = quad_transpose(plane_bytes4<4>(code), q);
        if (u < units && q < k2) sm.cnt[g * k2 + q] = w;
    }
}

// Exponents of chunk c's escapes to sm.esc by escape ordinal (k2 > 0; planes2_words codes
// them) and of its raws to sm.rawb by raw ordinal (store_coded copies them out whole): both
// lists are in value order, and a chunk's escapes (raws) have consecutive ordinals from
// its prefix in sm.cnt. Shared memory only, so phase 1 does it: the warps that would wait
// for warp 0's look-back do it meanwhile.
// bf16 runs it in coded_words' pass and computes the exponents outside the branch (the
// payload's words share their permutes); fp16 and fp32 spill that way, so they run it in a
// loop of its own, before, with the exponents inside the branch.
template <class D>
constexpr bool kInterleaveCompact = D::SIZE == 2 && D::NSYM == 256;

template <class D, int CPT, bool N, int K1, bool ONE>
__device__ __forceinline__ void compact(EncSmem<CPT>& sm, const Chunk<D>& ch, CodeT<N> code, int c, uint32_t k1,
                                        uint32_t k2) {
    // one tier (ONE: k2 = 0): every escape is raw, the escape mask is the raw mask
    const uint32_t e8 = ONE ? raw_mask<D, N>(code) : esc_mask<D, N, K1>(code, k1);
    uint2 ex;
    if constexpr (kInterleaveCompact<D>) ex = chunk_exps_again<D>(ch);
    if (e8) {  // escapes are common (k1 = 2: ~30 % of values): compacted with two permutes
        if constexpr (!kInterleaveCompact<D>) ex = chunk_exps_again<D>(ch);
        const uint32_t r8 = raw_mask<D, N>(code);
        const uint32_t o = sm.cnt[c] & 0xffffu, ro = kRawCounts<ONE> ? sm.cnt[c] : sm.cnt[c] >> 16;
        if (!ONE && k2) put_compacted(sm.esc + o, ex, sm.cx[e8], __popc(e8));
        if (r8 && (r8 & (r8 - 1)) == 0)  // one raw (raws are rare: ~2 % of values)
            sm.rawb[ro] = (uint8_t)prmt(ex.x, ex.y, __popc(r8 - 1));
        else if (r8)
            put_compacted(sm.rawb + ro, ex, sm.cx[r8], __popc(r8));
    }
}

// The chunks of a coded block: each chunk's escape and raw exponents to the lists
// (compact: bf16 here, in the same pass, so its values die chunk by chunk and the
// exponents' permutes are shared with the payload's; fp16 and fp32 before, which spills
// less), and its output words. K1 (= sm.k1) is a template parameter
// so the plane loop has no run-time width.
template <class D, int CPT, bool N, int K1, bool ONE>
__device__ __forceinline__ void coded_words(EncSmem<CPT>& sm, const Chunk<D> (&ch)[CPT], const CodeT<N> (&codes)[CPT],
                                            Out<D> (&o)[CPT], uint32_t k2, int nb) {
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
        const int c = i * ET + threadIdx.x, q = c & 3;
        const CodeT<N> code = codes[i];
        if constexpr (kInterleaveCompact<D>) compact<D, CPT, N, K1, ONE>(sm, ch[i], code, c, K1, k2);
        o[i].w[0] = quad_transpose(tier1_planes4<D, N, K1>(code), q);
        if constexpr (!kEarlyOut<D>) o[i].w[1] = 0;
        if constexpr (K1 == 5 && !N) {  // the fifth plane: OR of the quad's bytes
            uint32_t p4 = tier1_plane4<D>(code) << (8 * q);
            p4 |= __shfl_xor_sync(FULL, p4, 1);
            p4 |= __shfl_xor_sync(FULL, p4, 2);
            if constexpr (kEarlyOut<D>) {
                if (q == 0 && 8 * c < nb) sm.p5[c >> 2] = p4;  // groups g < G
            } else {
                o[i].w[1] = p4;
            }
        }
        payload_words<D>(ch[i], c, o[i]);
    }
}

// Block coded: header, table, planes1, planes2, raws, payload.
template <class D, int CPT>
__device__ void store_coded(const EncSmem<CPT>& sm, const Out<D> (&o)[CPT], int nb, uint8_t* dst) {
    const int tid = threadIdx.x;
    const uint32_t k1 = sm.k1, k2 = sm.k2, tt = tier(k1) + tier(k2), G = ((uint32_t)nb + 31) / 32;
    const uint32_t n_esc1 = sm.n_esc1, n_raw = sm.n_raw;
    const bool full = nb == ETILE * CPT;  // uniform: no chunk bounds to check
    uint8_t* p1 = dst + 8 + pad4(tt);
    uint8_t* p2 = p1 + 4 * G * k1;
    uint8_t* raw = p2 + 4 * ((n_esc1 + 31) / 32) * k2;
    uint8_t* pay = raw + pad4(n_raw);
    if (tid == 0) {
        st32(dst, k1 | (k2 << 3) | (n_raw << 8));
        st32(dst + 4, n_esc1);
    }
    if ((uint32_t)tid < pad4(tt) / 4) {
        uint32_t v = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b)
            if (4 * (uint32_t)tid + b < tt) v |= (uint32_t)sm.table[4 * tid + b] << (8 * b);
        st32(dst + 8 + 4 * tid, v);
    }
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
        const int c = i * ET + tid, q = c & 3;
        const uint32_t g = (uint32_t)c >> 2;
        if ((full || g < G) && (uint32_t)q < k1) st32(p1 + 4 * (g * k1 + q), o[i].w[0]);
        if constexpr (!kEarlyOut<D>)
            if (k1 == 5 && (full || g < G) && q == 0) st32(p1 + 4 * (g * 5 + 4), o[i].w[1]);
        store_payload<D>(o[i], c, nb, G, pay, full);
    }
    if (kEarlyOut<D> && k1 == 5)
        for (uint32_t g = tid; g < G; g += ET) st32(p1 + 4 * (g * 5 + 4), sm.p5[g]);
    for (uint32_t w = tid; w < pad4(n_raw) / 4; w += ET) {
        uint32_t v = *reinterpret_cast<const uint32_t*>(sm.rawb + 4 * w);
        if (4 * w + 4 > n_raw) v &= (1u << (8 * (n_raw & 3))) - 1u;  // zero padding
        st32(raw + 4 * w, v);
    }
    for (uint32_t w = tid; w < k2 * ((n_esc1 + 31) / 32); w += ET) st32(p2 + 4 * w, sm.cnt[w]);  // planes2_words
}

// Bytes [0, n) of a shared-memory stage (16-byte aligned; n a multiple of 4) to `g` (4-byte
// aligned) by the CTA: unit v of 16 bytes at a + 16 v (a: g rounded down to 16) holds the
// stage's words 4 v - sw .. 4 v - sw + 3 (sw = (g - a) / 4), two 16-byte shared loads and
// one 16-byte store; the first and last units' words inside [0, n) one by one.
__device__ __forceinline__ void copy_out16(const uint4* stage, uint32_t n, uint8_t* g) {
    const uint32_t* stage32 = reinterpret_cast<const uint32_t*>(stage);
    uint8_t* a = reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(g) & ~(uintptr_t)15);
    const uint32_t s = (uint32_t)(g - a), sw = s / 4, nv = (s + n + 15) / 16;
    for (uint32_t v = threadIdx.x; v < nv; v += ET) {
        if (16 * v >= s && 16 * v + 16 <= s + n) {  // a whole unit (v >= 1 when sw > 0)
            const uint4 q = stage[v], p = sw ? stage[v - 1] : q;
            st128(a + 16 * v, shift_words(p, q, sw));
        } else {
#pragma unroll
            for (uint32_t i = 0; i < 4; ++i) {
                const int64_t w = (int64_t)(4 * v + i) - (int64_t)sw;
                if (w >= 0 && (uint64_t)w < n / 4) st32(a + 16 * v + 4 * i, stage32[w]);
            }
        }
    }
}

// A raw block's values go out through shared memory: the bytes of EncSmem from `cnt` to
// its end or, without the escape list, to `esc` (the counts, the lists and the tables:
// only the coded path reads them, and a raw block is known to be raw before phase 2) hold
// the block's words at 16-byte aligned chunk slots, and the CTA copies them to the block's
// place with 16-byte stores (the block is only 4-byte aligned: two 16-byte shared loads
// give each aligned unit's words). Stored straight from registers, a thread's chunk would
// be D::WORDS 4-byte stores 16 or 32 bytes apart, four or eight 128-byte lines per warp
// store: on the H200 a raw-only compressor runs at ~950 GB/s that way, ~1990 with 16-byte
// stores.
// fp16 stages its raw blocks already in phase 1 (kEarlyOut), the others in store_raw.
template <int CPT, bool NOESC>
constexpr uint32_t raw_stage_bytes() {
    return kEncSmemBytes<CPT, NOESC> - (uint32_t)offsetof(EncSmem<CPT>, cnt);
}
// Chunk rows (i of i * ET + tid) staged per pass: all of them for the 16-bit types, half
// for fp32 at its default block and for bf16 without the escape list (two passes); 0: no
// staging (the stores straight from registers).
template <class D, int CPT, bool NOESC>
constexpr int kRawRows = raw_stage_bytes<CPT, NOESC>() >= (uint32_t)(D::SIZE * ETILE * CPT + 16)       ? CPT
                         : raw_stage_bytes<CPT, NOESC>() >= (uint32_t)(D::SIZE * ETILE * (CPT / 2) + 16) ? CPT / 2
                                                                                                 : 0;

template <class D, int CPT, bool NOESC>
__device__ void store_raw(EncSmem<CPT>& sm, const Out<D> (&o)[CPT], int nb, uint8_t* dst) {
    const int tid = threadIdx.x;
    if (tid == 0) {
        st32(dst, 0);
        st32(dst + 4, 0);
    }
    const uint32_t bytes = pad4((uint32_t)(D::SIZE * nb));
    const bool full = nb == ETILE * CPT;  // uniform: no chunk bounds to check
    constexpr int R = kRawRows<D, CPT, NOESC>;
    if constexpr (kEarlyOut<D>) {  // staged by encode_codes
        copy_out16(reinterpret_cast<const uint4*>(sm.cnt), bytes, dst + 8);
    } else if constexpr (R > 0) {
        uint4* stage = reinterpret_cast<uint4*>(sm.cnt);
        // bytes [0, bytes) of the values go to dst + 8. A pass stages rows h .. h + R - 1,
        // the bytes [h0, h0 + R·ET·8·SIZE) (h0 = h·ET·8·SIZE)
#pragma unroll
        for (int h = 0; h < CPT; h += R) {
            const uint32_t h0 = (uint32_t)h * ET * 8 * D::SIZE, len = (uint32_t)R * ET * 8 * D::SIZE;
            if (h) __syncthreads();  // the previous pass's reads are done
#pragma unroll
            for (int i = 0; i < R; ++i)
#pragma unroll
                for (int k = 0; k < D::WORDS / 4; ++k)
                    stage[(i * ET + tid) * (D::WORDS / 4) + k] = make_uint4(o[h + i].w[4 * k], o[h + i].w[4 * k + 1],
                                                                            o[h + i].w[4 * k + 2], o[h + i].w[4 * k + 3]);
            __syncthreads();
            if (h0 >= bytes) continue;  // uniform: a partial block ends before this pass
            copy_out16(stage, bytes - h0 < len ? bytes - h0 : len, dst + 8 + h0);
        }
    } else {
#pragma unroll
        for (int i = 0; i < CPT; ++i) {
            const uint32_t base = (uint32_t)(i * ET + tid) * 8 * D::SIZE;
#pragma unroll
            for (int k = 0; k < D::WORDS; ++k)
                if (full || base + 4 * k < bytes) st32(dst + 8 + base + 4 * k, o[i].w[k]);
        }
    }
}

// Phase 1 after choose, with narrow codes (N: k1 <= 3) or not: code every value and count
// escapes, the exact size (on_size), then the lists and the output words (see
// encode_block_begin).
template <class D, int CPT, bool N, bool ONE, class OnSize>
__device__ __forceinline__ uint32_t encode_codes(EncSmem<CPT>& sm, Out<D> (&o)[CPT], const Chunk<D> (&ch)[CPT], int nb,
                                                 OnSize on_size) {
    const int tid = threadIdx.x;
    const bool full = nb == ETILE * CPT;  // uniform: only a partial block has chunk bounds to check
    const uint32_t k1 = sm.k1;
    CodeT<N> codes[CPT];
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
        const int c = i * ET + tid;
        codes[i] = chunk_codes<D, CPT, N>(sm, ch[i]);
        // the block's last chunk (a branch: the mask is rarely needed)
        if (!full && nb - 8 * c < 8) codes[i] = clear_past<D, N>(codes[i], nb - 8 * c);
        const uint32_t raw = __popc(raw_mask<D, N>(codes[i])), esc = ONE ? raw : __popc(esc_mask<D, N, 0>(codes[i], k1));
        sm.cnt[c] = kRawCounts<ONE> ? raw : esc | (raw << 16);
    }
    __syncthreads();
    const uint32_t tot = block_scan<CPT, ET>(sm.cnt, sm.wtmp);
    const uint32_t n_esc1 = kRawCounts<ONE> ? tot : tot & 0xffffu, n_raw = kRawCounts<ONE> ? tot : tot >> 16;
    const uint32_t raw_size = raw_block_size<D>((uint32_t)nb);
    const uint32_t size = coded_size<D>(nb, sm.k1, sm.k2, n_esc1, n_raw);
    on_size(size >= raw_size ? raw_size : size);
    if (size < raw_size) {
        const uint32_t k2 = sm.k2;
        if constexpr (!kInterleaveCompact<D>) {  // fp16 and fp32 spill when interleaved
#pragma unroll
            for (int i = 0; i < CPT; ++i) compact<D, CPT, N, 0, ONE>(sm, ch[i], codes[i], i * ET + tid, k1, k2);
        }
        switch (k1) {
            case 1: coded_words<D, CPT, N, 1, ONE>(sm, ch, codes, o, k2, nb); break;
            case 2: coded_words<D, CPT, N, 2, ONE>(sm, ch, codes, o, k2, nb); break;
            case 3: coded_words<D, CPT, N, 3, ONE>(sm, ch, codes, o, k2, nb); break;
            case 4: if constexpr (!N) coded_words<D, CPT, N, 4, ONE>(sm, ch, codes, o, k2, nb); break;
            default: if constexpr (!N) coded_words<D, CPT, N, 5, ONE>(sm, ch, codes, o, k2, nb); break;
        }
    } else if constexpr (kEarlyOut<D>) {  // to store_raw's stage (the counts are read: block_scan ends in a barrier)
        static_assert(kRawRows<D, CPT, false> == CPT, "a 16-bit block fits the raw stage");
        uint4* stage = reinterpret_cast<uint4*>(sm.cnt);
#pragma unroll
        for (int i = 0; i < CPT; ++i)
#pragma unroll
            for (int k = 0; k < D::WORDS / 4; ++k)
                stage[(i * ET + tid) * (D::WORDS / 4) + k] =
                    make_uint4(ch[i].w[4 * k], ch[i].w[4 * k + 1], ch[i].w[4 * k + 2], ch[i].w[4 * k + 3]);
    } else {
#pragma unroll
        for (int i = 0; i < CPT; ++i)
#pragma unroll
            for (int k = 0; k < D::WORDS; ++k) o[i].w[k] = ch[i].w[k];
    }
    if (tid == 0) {  // read by phase 2 (after the caller's barrier)
        sm.raw = size >= raw_size;
        sm.n_esc1 = n_esc1;
        sm.n_raw = n_raw;
    }
    return size >= raw_size ? raw_size : size;
}

// ---- one block, in two phases: the building blocks for kernels that place blocks
// themselves (the single-pass stream below; fused collectives writing into a peer's slot).

// Every thread, before a block's phase 1 (and before the barrier that ends its loads): clear
// the histogram, copy the compaction selectors.
template <class D, int CPT>
__device__ __forceinline__ void encode_block_init(EncSmem<CPT>& sm) {
    const int tid = threadIdx.x;
    if (tid < D::NSYM) sm.hist[tid] = 0;
    sm.cx[tid] = kCx.v[tid];  // read after the barriers of phase 1
}

// The full blocks' loads with ld128_once's cache hint (no L1 allocation, the read-only
// path, 256-byte L2 fetches) in the two-tier 16-bit kernels: 0.5-1.5 % faster there on the
// H200; the one-tier and fp32 kernels run 1-4 % slower with it.
template <class D, bool T1>
constexpr bool kLoadOnce = !T1 && D::SIZE == 2;

// Phase 1 from the block's chunks already in registers (chunk i * ET + tid in ch[i]; every
// thread, after encode_block_init): what encode_block_begin does after its loads. For
// kernels whose block is not in global memory (bfx_fused.cu: the reduced block in shared
// memory).
template <class D, int CPT, bool T1, class OnSize>
__device__ __forceinline__ uint32_t encode_block_chunks(EncSmem<CPT>& sm, Out<D> (&o)[CPT], const Chunk<D> (&ch)[CPT], int nb,
                                                        uint32_t tiers, OnSize on_size) {
    const int tid = threadIdx.x;
    const bool full = nb == ETILE * CPT;  // uniform: only a partial block has chunk bounds to check
    __syncthreads();
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
        if (!(full || 8 * (i * ET + tid) < nb)) continue;
        // value 0's exponent times 4, a byte offset into hist, straight from its word
        const uint32_t off = (top_pair<D>(ch[i], 0) >> (D::ESHIFT - 2)) & ((D::EMASK2 & 0xffffu) << 2);
        atomicAdd(reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(sm.hist) + off), 1u);
    }
    __syncthreads();
    choose<D, CPT>(sm, nb, tiers);
    if constexpr (kSpread<D>) {
        if (sm.k1 <= 3) return encode_codes<D, CPT, true, T1>(sm, o, ch, nb, on_size);
    }
    return encode_codes<D, CPT, false, T1>(sm, o, ch, nb, on_size);
}

// Phase 1, every thread of a CTA of ET: load the block at `src` (nb values, nb <=
// 2048·CPT; `aligned`: src is 16-byte aligned), choose its table and widths, code every
// value and count escapes; call on_size(size) (every thread, as soon as the block's exact
// size in bytes is known: the stream publishes it for the look-back); then compact the
// escape and raw lists and compute every output word into `o`, so that phase 2 only
// stores. Returns the size; `sm.raw` says whether the block is stored raw. T1: one tier
// only (`tiers` is 1, so k2 = 0: every escape is raw, and the code has no escape masks nor
// tier-2 paths; one instance for both modes, with the same specialisation as a branch,
// takes registers from the two-tier path: 1-3 % slower in both modes on the H200).
template <class D, int CPT, bool T1, class OnSize>
__device__ __forceinline__ uint32_t encode_block_begin(EncSmem<CPT>& sm, Out<D> (&o)[CPT], const uint8_t* src, int nb,
                                                       uint32_t tiers, bool aligned, OnSize on_size) {
    const int tid = threadIdx.x;
    const bool full = nb == ETILE * CPT;  // uniform: only a partial block has chunk bounds to check
    Chunk<D> ch[CPT];
    encode_block_init<D>(sm);
    if (aligned && full) {  // uniform: the common case without a check per chunk (a bounds test
                            // and a branch around the unaligned path per chunk are 2 % of the
                            // instructions; this path is 1.5-3 % faster on the H200)
        const uint4* p = reinterpret_cast<const uint4*>(src) + tid * (D::WORDS / 4);
#pragma unroll
        for (int i = 0; i < CPT; ++i)
#pragma unroll
            for (int k = 0; k < D::WORDS / 4; ++k) {
                const uint4* src4 = p + i * ET * (D::WORDS / 4) + k;
                const uint4 a = kLoadOnce<D, T1> ? ld128_once(src4) : *src4;
                ch[i].w[4 * k] = a.x;
                ch[i].w[4 * k + 1] = a.y;
                ch[i].w[4 * k + 2] = a.z;
                ch[i].w[4 * k + 3] = a.w;
            }
    } else {
#pragma unroll
        for (int i = 0; i < CPT; ++i) ch[i] = load_chunk<D>(src, i * ET + tid, nb, aligned, full);
    }
    return encode_block_chunks<D, CPT, T1>(sm, o, ch, nb, tiers, on_size);
}

// Phase 2, every thread, after a barrier that follows phase 1 (and, for a coded block with
// k2 > 0, planes2_words): write the block to `dst` (4-byte aligned; the size phase 1
// returned).
template <class D, int CPT, bool NOESC = false>
__device__ __forceinline__ void encode_block_end(EncSmem<CPT>& sm, const Out<D> (&o)[CPT], int nb, uint8_t* dst) {
    if (sm.raw) store_raw<D, CPT, NOESC>(sm, o, nb, dst);
    else store_coded<D, CPT>(sm, o, nb, dst);
}

// A staggered start. All CTAs of a first wave that started together would load their blocks
// at once, run their serial parts (choose, the look-back) and their ALU-bound parts at the
// same times, and store at once: on the H200 (256 MiB bf16) such a first wave's CTAs last
// twice as long as the steady state's. The steady state has the CTAs of an SM spread over
// a block's life, so the first wave starts that way: ticket t < sms * per_sm (flags bits
// 8..19: SMs, bits 20..23: CTAs per SM; 0: no stagger, the launcher's choice from two waves
// of blocks up) waits t * step / sms ns from the CTA's start (wait_slot; 700 ns steps: the
// 528 CTAs of an H200's first wave start over 2.8 us, one every 5.3 ns). On the H200 it
// gains 7-9 % at 64 MiB, 2-4 % at 128 MiB, up to 2 % from 256 MiB; steps of 2000 ns and
// more lose 1-5 %. The one-tier kernels step 500 ns (0.3-0.7 % faster there than 700; the
// two-tier kernels are not). Timing only: the bytes do not depend on it.
constexpr uint32_t kStaggerNs = 700, kStaggerNsT1 = 500;
static_assert(kStaggerNs < 65536 && kStaggerNsT1 < 65536, "wait_slot computes in 32 bits");
template <bool T1>
__device__ __forceinline__ void stagger_start(uint64_t ticket, uint32_t flags) {
    wait_slot(ticket, flags, T1 ? kStaggerNsT1 : kStaggerNs);
}

// Which block a CTA codes. By default block blockIdx.x: the look-back then waits only on
// CTAs of lower index, which the hardware dispatches first (CTAs start in index order, as
// CUB's single-pass scans also assume; the CUDA programming model does not promise it).
// Flags bit 25 (kEncTickets, `HOCCL_CODEC_TICKETS=1`): an atomic ticket instead, so a
// block's predecessors are always held by CTAs that started before it, whatever the
// dispatch order, at the cost of the ticket's round trip and a barrier before the block's
// loads (on the H200 1-9 % of compression throughput, the most at 128 MiB).
constexpr uint32_t kEncTickets = 1u << 25;

// The bf16 compressors prefetch a later block into L2. With blocks by CTA index, block j +
// wave is coded by the CTA that starts about when block j's ends, so block j's CTA, once
// its look-back is done and only its stores remain, has one thread ask for block j +
// wave · kL2PfQuarters / 4 with one bulk prefetch (cp.async.bulk.prefetch.L2: no
// registers, no loads from the other threads); the later CTA's loads then find part of the
// block in L2. Needs the grid's shape in the flags (bits 8..23: only from two waves of
// blocks up) and sm_90; not with tickets (the next CTA's block is unknown then). Timing
// only: the bytes do not depend on it. On the H200 (bf16 N(0, 0.02)) one tier gains 4-5 %,
// two tiers up to 1 %. A distance of 6 quarter waves is 1-2 % slower, 8 is 15 % slower
// (L2 thrashes); issued at the CTA's start the CTA's own loads queue behind it (4-19 %
// slower). fp16 and fp32 gain nothing (0 to -2.5 %), so they do not prefetch.
// Who issues it: in the one-tier kernels, whose warps 1-7 only wait at the barrier while
// warp 0 runs the look-back, thread 32 issues it then, so it leaves the path from the
// offset to the stores and starts ~1 us sooner (0.3-0.8 % faster); the two-tier kernels'
// warps 1-7 compute the tier-2 planes then (0.5-0.8 % slower with it), so thread 0 issues
// theirs after the look-back.
constexpr uint32_t kL2PfQuarters = 4;  // the distance, in quarter waves of resident CTAs
template <class D>
constexpr bool kL2Prefetch = D::SIZE == 2 && D::NSYM == 256;
template <class D>
__device__ __forceinline__ void prefetch_ahead(const uint8_t* in, uint64_t n, uint32_t B, uint32_t flags, uint32_t by) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(BFX_EMU)
    if (threadIdx.x != by || (flags & kEncTickets)) return;
    const uint32_t sms = shape_sms(flags);
    const uint64_t pj = (uint64_t)blockIdx.x + (uint64_t)sms * shape_per_sm(flags) * kL2PfQuarters / 4;
    if (sms == 0 || pj * B >= n) return;
    const uint64_t vals = n - pj * B < B ? n - pj * B : B;
    const uint8_t* p = in + pj * B * D::SIZE;
    const uint32_t bytes = (uint32_t)(vals * D::SIZE) & ~15u;
    if ((reinterpret_cast<uintptr_t>(p) & 15) == 0 && bytes != 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// The single-pass stream. scratch[0]: ticket counter (kEncTickets); scratch[1 + j]: look-back
// status of block j (both zeroed by hoccl_bfx_compress_begin). flags bit 0: `in` is 16-byte
// aligned; bits 8..23: the staggered start (stagger_start); bit 25: kEncTickets.
// (A second instance for full blocks with nb a compile-time constant, which folds the bounds
// checks away, spills more and runs 2-7 % slower.)
template <class D, int CPT, bool T1>
__device__ void compress_kernel(const uint8_t* in, uint64_t n, uint32_t B, uint32_t tiers, uint8_t* out,
                                uint64_t* scratch, uint64_t* out_len, uint32_t flags) {
    pdl_enter();
    alignas(alignof(EncSmem<CPT>)) __shared__ uint8_t sm_bytes[kEncSmemBytes<CPT, kNoEsc<D, T1>>];
    BFX_EMU_POISON(sm_bytes);
    EncSmem<CPT>& sm = *reinterpret_cast<EncSmem<CPT>*>(sm_bytes);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // the block's index, read afresh where used (a register held across the block spills;
    // sm.ticket is written once, before the first barrier)
    const auto block_j = [&]() -> uint64_t { return (flags & kEncTickets) ? sm.ticket : (uint64_t)blockIdx.x; };
    if (flags & kEncTickets) {  // uniform
        if (tid == 0) {
            const uint64_t t = atomicAdd(reinterpret_cast<unsigned long long*>(scratch), 1ull);
            // the stream header's size (a 64-bit division), computed while the ticket is in
            // flight rather than on the path from the look-back to the stores
            sm.nblocks = (n + B - 1) / B;
            stagger_start<T1>(t, flags);
            sm.ticket = t;
        }
        __syncthreads();
    } else {
        // read after phase 1's barriers. The grid is one CTA per block, so its size is the
        // block count: no 64-bit division by thread 0 before its loads (up to 1 % faster)
        if (tid == 0) sm.nblocks = (uint64_t)gridDim.x;
        stagger_start<T1>(blockIdx.x, flags);
    }
    const uint64_t j = block_j();
    const uint64_t start = j * B;
    const int nb = (int)(n - start < B ? n - start : B);
    Out<D> o[CPT];
    const uint32_t size = encode_block_begin<D, CPT, T1>(sm, o, in + start * D::SIZE, nb, T1 ? 1u : tiers, flags & 1, [&](uint32_t sz) {
        if (tid == 0) publish_size(scratch + 1, block_j(), sz);
    });
    // a coded block with tier-2 planes (uniform: sm.k2 is published by choose, the size
    // is every thread's own): warps 1.. compute them during the look-back
    if (!T1 && sm.k2 && size < raw_block_size<D>((uint32_t)nb)) {
        __syncthreads();  // the escape list, sm.n_esc1 and sm.raw are complete
        if (warp != 0) planes2_words<CPT>(sm, (uint32_t)tid - 32, ET - 32);
    }
    if (warp == 0) {
        const uint64_t j = block_j();
        const uint64_t excl = lookback(scratch + 1, j, size, lane);
        if (lane == 0) {
            const uint64_t nblocks = sm.nblocks;
            const uint64_t hdr = 24 + 4 * nblocks;
            sm.offset = hdr + excl;
            st32(out + 24 + 4 * j, size);
            if (j + 1 == nblocks && out_len) *out_len = hdr + excl + size;
        }
    }
    constexpr bool pf_w1 = T1;  // the prefetch by warp 1 during the look-back
    if (pf_w1 && warp == 1)
        if constexpr (kL2Prefetch<D>) prefetch_ahead<D>(in, n, B, flags, 32);
    __syncthreads();
    if (!pf_w1)
        if constexpr (kL2Prefetch<D>) prefetch_ahead<D>(in, n, B, flags, 0);
    encode_block_end<D, CPT, kNoEsc<D, T1>>(sm, o, nb, out + sm.offset);
}

}  // namespace bfx

// ===================================================================== entry points ===
// Kernel parameters are u64 for pointers and sizes, u32 otherwise (gpu.rs passes exactly
// these types).

// 1: every codec kernel (bfx.cu, bfx_decode.cu) starts with pdl_enter() waiting, so the
// launcher may launch them as programmatic dependents (read by the launcher; per
// architecture: 0 in the sm_80 code).
extern "C" __device__ uint32_t hoccl_bfx_pdl = BFX_GRIDDEP;

// Zero the look-back scratch (`words` u64), write the fixed stream header, and for an
// empty input the stream length.
extern "C" __global__ void __launch_bounds__(256) hoccl_bfx_compress_begin(uint8_t* out, uint64_t n, uint32_t B,
                                                                           uint32_t nblocks, uint32_t magic,
                                                                           uint64_t* scratch, uint64_t words,
                                                                           uint64_t* out_len) {
    bfx::pdl_enter();
    const uint64_t i0 = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (uint64_t i = i0; i < words; i += (uint64_t)gridDim.x * blockDim.x) scratch[i] = 0;
    if (i0 == 0) {
        bfx::st32(out, magic);
        bfx::st32(out + 4, 1);
        bfx::st32(out + 8, (uint32_t)n);
        bfx::st32(out + 12, (uint32_t)(n >> 32));
        bfx::st32(out + 16, B);
        bfx::st32(out + 20, nblocks);
        if (nblocks == 0 && out_len) *out_len = 24;
    }
}

// 4 CTAs per SM. The kernels holding 64 values per thread (CPT * WORDS >= 32) would use 80
// registers at 3 CTAs per SM; held to 64 they spill ~200 bytes but run 3-5 % faster on the
// H200 (bf16, 1 GiB, both tier modes; at 5 CTAs per SM, 48 registers, 20 % slower). A
// kernel's name says its block in steps of 2048 values (CPT: chunks per thread).
extern "C" __device__ uint32_t hoccl_bfx_compress_threads = bfx::ET;
// The staggered start's step in ns (0: none; the launcher passes the grid's shape only when
// it is nonzero).
extern "C" __device__ uint32_t hoccl_bfx_compress_stagger = bfx::kStaggerNs;
// Each block size has two kernels: NAME for both tier modes, NAME_t1 for one tier only
// (encode_block_begin's T1; the launcher takes it when `tiers` is 1).
#define BFX_COMPRESS1(NAME, D, CPT, T1)                                                             \
    extern "C" __global__ void __launch_bounds__(bfx::ET, 4)                                        \
        NAME(const uint8_t* in, uint64_t n, uint32_t B, uint32_t tiers, uint8_t* out, uint64_t* scratch, \
             uint64_t* out_len, uint32_t flags) {                                                   \
        bfx::compress_kernel<D, CPT, T1>(in, n, B, tiers, out, scratch, out_len, flags);            \
    }
#define BFX_COMPRESS(NAME, D, CPT) \
    BFX_COMPRESS1(NAME, D, CPT, false) \
    BFX_COMPRESS1(NAME##_t1, D, CPT, true)
BFX_COMPRESS(hoccl_bfx_compress_bf16_1, bfx::Bf16T, 1)
BFX_COMPRESS(hoccl_bfx_compress_bf16_2, bfx::Bf16T, 2)
BFX_COMPRESS(hoccl_bfx_compress_bf16_4, bfx::Bf16T, 4)
BFX_COMPRESS(hoccl_bfx_compress_bf16_8, bfx::Bf16T, 8)
BFX_COMPRESS(hoccl_bfx_compress_f16_1, bfx::F16T, 1)
BFX_COMPRESS(hoccl_bfx_compress_f16_2, bfx::F16T, 2)
BFX_COMPRESS(hoccl_bfx_compress_f16_4, bfx::F16T, 4)
BFX_COMPRESS(hoccl_bfx_compress_f16_8, bfx::F16T, 8)
BFX_COMPRESS(hoccl_bfx_compress_f32_1, bfx::F32T, 1)
BFX_COMPRESS(hoccl_bfx_compress_f32_2, bfx::F32T, 2)
BFX_COMPRESS(hoccl_bfx_compress_f32_4, bfx::F32T, 4)
