// Single-pass BFX1/HFX1/FFX1 compressor and the decompressor (see bfx.cuh for the thread
// layout, src/compress/format.rs for the format, src/compress/select.rs for the choice).
//
// Compressor: one CTA per block, blocks handed out in launch order by an atomic ticket.
// The CTA loads its block once into registers (16-byte loads), histograms the strided 1/8
// sample, ranks symbols, picks (k1, k2), codes every value, and from the exact escape counts
// knows its compressed size before it writes anything. It publishes that size and finds its
// offset in the contiguous stream with a decoupled look-back over its predecessors, then
// writes every section straight to its final place. No second pass, no compaction.
//
// Decompressor: CTA c decodes the contiguous range of blocks [c·n/G, (c+1)·n/G) of the n blocks, starting
// at the offset it sums from block_bytes; a block is decoded in tiles of 2048 values (any B
// works). Every header field is validated; corrupt input stops the CTA and sets *status.
#include "bfx.cuh"

namespace bfx {

// ===================================================================== compressor =====

template <int CPT>
struct EncSmem {
    uint32_t hist[256];
    uint32_t keys[256];
    uint32_t cnt_by_rank[32];
    uint16_t rank[256];
    uint8_t lut[256];
    uint8_t code2[256];
    uint8_t table[32];
    uint32_t cnt[THREADS * CPT];  // per chunk: escapes | raws << 16, then exclusive prefix
    uint8_t esc[TILE * CPT];      // exponent of each escape, by escape ordinal
    uint32_t g2[TILE * CPT / 32];
    uint32_t wtmp[WARPS];
    uint64_t ticket, offset;
    uint32_t k1, k2, n_esc1, n_raw, raw;
};

template <class D>
__device__ __forceinline__ Chunk<D> load_chunk(const uint8_t* blk, int c, int nb, bool aligned) {
    Chunk<D> ch;
    const int valid = nb - 8 * c;
    if (aligned && valid >= 8) {
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

// Steps 2-4 of select.rs: rank the sampled symbols, pick (k1, k2), build the lookup.
template <class D, int CPT>
__device__ void choose(EncSmem<CPT>& sm, int nb, uint32_t tiers) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool have = tid < D::NSYM;
    const uint32_t c = have ? sm.hist[tid] : 0u;
    const uint32_t bal = __ballot_sync(FULL, c > 0);
    if (lane == 0) sm.wtmp[warp] = __popc(bal);
    __syncthreads();
    uint32_t base = 0, m = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        uint32_t t = sm.wtmp[w];
        base += w < warp ? t : 0u;
        m += t;
    }
    const uint32_t pre = base + __popc(bal & lanemask_lt(lane));
    if (c > 0) sm.keys[pre] = (c << 8) | (uint32_t)tid;
    __syncthreads();
    if (have) {
        uint32_t r;
        if (c > 0) {  // count desc, then symbol asc
            r = 0;
            for (uint32_t i = 0; i < m; ++i) {
                uint32_t k = sm.keys[i], kc = k >> 8;
                r += (kc > c || (kc == c && (k & 0xffu) < (uint32_t)tid)) ? 1u : 0u;
            }
        } else {  // unsampled symbols follow in ascending order
            r = m + ((uint32_t)tid - pre);
        }
        sm.rank[tid] = (uint16_t)r;
        if (r < 32) {
            sm.table[r] = (uint8_t)tid;
            sm.cnt_by_rank[r] = c;
        }
    }
    __syncthreads();
    if (warp == 0) {
        const uint32_t S = ((uint32_t)nb + 7u) / 8u;
        uint32_t key = FULL;
        if (lane < NCAND) {
            const uint32_t k1 = cand_k1(lane), k2 = cand_k2(lane);
            if (tiers == 2 || k2 == 0) {
                const uint32_t t1 = tier(k1), t12 = t1 + tier(k2);
                uint32_t c1 = 0, c12 = 0;
                for (uint32_t r = 0; r < t12; ++r) {
                    uint32_t v = sm.cnt_by_rank[r];
                    c12 += v;
                    c1 += r < t1 ? v : 0u;
                }
                const uint32_t cost = S * k1 + (S - c1) * k2 + 8u * (S - c12);
                key = (cost << 5) | (uint32_t)lane;  // cost < 2^27: first minimum wins
            }
        }
        key = __reduce_min_sync(FULL, key);
        if (lane == 0) {
            sm.k1 = cand_k1(key & 31);
            sm.k2 = cand_k2(key & 31);
        }
    }
    __syncthreads();
    if (have) {
        const uint32_t r = sm.rank[tid], t1 = tier(sm.k1), t2 = tier(sm.k2);
        if (r < t1) {
            sm.lut[tid] = (uint8_t)r;
        } else if (r < t1 + t2) {
            sm.lut[tid] = (uint8_t)(t1 | LUT_ESC);
            sm.code2[tid] = (uint8_t)(r - t1);
        } else {
            sm.lut[tid] = (uint8_t)(t1 | LUT_ESC | LUT_RAW);
            sm.code2[tid] = (uint8_t)t2;
        }
    }
    __syncthreads();
}

template <int CPT>
__device__ __forceinline__ uint2 chunk_codes(const EncSmem<CPT>& sm, uint2 ex, uint2 vm) {
    uint32_t x = 0, y = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        x |= (uint32_t)sm.lut[(ex.x >> (8 * k)) & 0xffu] << (8 * k);
        y |= (uint32_t)sm.lut[(ex.y >> (8 * k)) & 0xffu] << (8 * k);
    }
    return make_uint2(x & vm.x, y & vm.y);
}

// Warp 0: publish this block's size and sum its predecessors' (decoupled look-back).
// Returns the exclusive prefix (bytes of blocks < j). `st[j]` is block j's status word.
__device__ uint64_t lookback(uint64_t* st, uint64_t j, uint64_t agg, int lane) {
    volatile uint64_t* vs = st;
    if (j == 0) {
        if (lane == 0) atomicExch(reinterpret_cast<unsigned long long*>(st), (unsigned long long)(LB_INC | agg));
        return 0;
    }
    if (lane == 0) atomicExch(reinterpret_cast<unsigned long long*>(st + j), (unsigned long long)(LB_AGG | agg));
    uint64_t excl = 0;
    int64_t end = (int64_t)j;
    while (true) {
        const int64_t idx = end - 1 - lane;
        uint64_t s = LB_INC + 0;
        if (idx >= 0) s = vs[idx];
        while (__any_sync(FULL, (s >> 62) == 0)) {
            if ((s >> 62) == 0) {
                spin_pause();
                s = vs[idx];
            }
        }
        const uint32_t inc = __ballot_sync(FULL, (s >> 62) == 2);
        const uint64_t v = s & LB_VAL;
        if (inc) {
            const int first = __ffs(inc) - 1;
            excl += warp_sum64(lane <= first ? v : 0ull);
            break;
        }
        excl += warp_sum64(v);
        end -= 32;
    }
    if (lane == 0) atomicExch(reinterpret_cast<unsigned long long*>(st + j), (unsigned long long)(LB_INC | (excl + agg)));
    return excl;
}

// Payload of one chunk (every lane calls: fp16 uses a quad transpose).
template <class D>
__device__ __forceinline__ void put_payload(const Chunk<D>& ch, int c, int nb, uint32_t G, uint8_t* pay) {
    const int q = c & 3, g = c >> 2;
    const uint32_t p0 = top_pair<D>(ch, 0), p1 = top_pair<D>(ch, 1), p2 = top_pair<D>(ch, 2), p3 = top_pair<D>(ch, 3);
    uint8_t* bytes = pay;  // nb bytes, 8 per chunk
    if constexpr (D::NSYM == 32) {
        const uint2 t = make_uint2(f16_top3(p0, p1), f16_top3(p2, p3));
        const uint32_t w = quad_transpose(plane_bytes4<3>(t), q);
        if ((uint32_t)g < G && q < 3) st32(pay + 4 * (3 * g + q), w);
        bytes = pay + 12 * G;
        if (8 * c < nb) st32(bytes + 8 * c, __byte_perm(p0, p1, 0x6420));
        if (8 * c + 4 < nb) st32(bytes + 8 * c + 4, __byte_perm(p2, p3, 0x6420));
        return;
    }
    if (8 * c < nb) st32(bytes + 8 * c, sm_bytes(p0, p1));
    if (8 * c + 4 < nb) st32(bytes + 8 * c + 4, sm_bytes(p2, p3));
    if constexpr (D::SIZE == 4) {
        uint8_t* lo = pay + pad4((uint32_t)nb) + 16 * c;
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (8 * c + 2 * k < nb) st32(lo + 4 * k, low_pair<D>(ch, k));
    }
}

// Tier-2 planes and raw exponents from the escape list (after the main pass).
template <int CPT>
__device__ void put_escapes(EncSmem<CPT>& sm, uint8_t* p2, uint8_t* raw) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t k2 = sm.k2, t2 = tier(k2), n_esc1 = sm.n_esc1, n_raw = sm.n_raw;
    if (k2 == 0) {
        for (uint32_t w = tid; w < pad4(n_raw) / 4; w += THREADS) {
            uint32_t v = 0;
#pragma unroll
            for (int b = 0; b < 4; ++b)
                if (4 * w + b < n_raw) v |= (uint32_t)sm.esc[4 * w + b] << (8 * b);
            st32(raw + 4 * w, v);
        }
        return;
    }
    const uint32_t ng = (n_esc1 + 31) / 32;
    for (uint32_t gi = warp; gi < ng; gi += WARPS) {
        const uint32_t o = 32 * gi + lane;
        const uint32_t c2 = o < n_esc1 ? sm.code2[sm.esc[o]] : 0u;
        uint32_t mine = 0;
        for (uint32_t b = 0; b < k2; ++b) {
            const uint32_t p = __ballot_sync(FULL, (c2 >> b) & 1u);
            if ((uint32_t)lane == b) mine = p;
        }
        if ((uint32_t)lane < k2) st32(p2 + 4 * (gi * k2 + lane), mine);
        const uint32_t m = __ballot_sync(FULL, o < n_esc1 && c2 == t2);
        if (lane == 0) sm.g2[gi] = __popc(m);
    }
    __syncthreads();
    if (warp == 0) {
        uint32_t carry = 0;
        for (uint32_t b = 0; b < ng; b += 32) {
            const uint32_t v = b + lane < ng ? sm.g2[b + lane] : 0u;
            const uint32_t inc = warp_incl_scan(v, lane);
            if (b + lane < ng) sm.g2[b + lane] = carry + inc - v;
            carry += __shfl_sync(FULL, inc, 31);
        }
    }
    __syncthreads();
    for (uint32_t gi = warp; gi < ng; gi += WARPS) {
        const uint32_t o = 32 * gi + lane;
        const uint32_t e = o < n_esc1 ? sm.esc[o] : 0u;
        const bool isr = o < n_esc1 && sm.code2[e] == t2;
        const uint32_t m = __ballot_sync(FULL, isr);
        if (isr) raw[sm.g2[gi] + __popc(m & lanemask_lt(lane))] = (uint8_t)e;
    }
    if ((uint32_t)tid < pad4(n_raw) - n_raw) raw[n_raw + tid] = 0;
}

// Block j coded: header, table, planes1, escapes, payload. K1 (= sm.k1) is a template
// parameter so the plane loop has no run-time width.
template <class D, int CPT, int K1>
__device__ void put_coded(EncSmem<CPT>& sm, const Chunk<D> (&ch)[CPT], const uint2 (&codes)[CPT], int nb, uint8_t* dst) {
    const int tid = threadIdx.x;
    constexpr uint32_t k1 = K1;
    const uint32_t k2 = sm.k2, tt = tier(k1) + tier(k2), G = ((uint32_t)nb + 31) / 32;
    const uint32_t n_esc1 = sm.n_esc1, n_raw = sm.n_raw;
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
        const int c = i * THREADS + tid, q = c & 3;
        const uint32_t g = (uint32_t)c >> 2;
        const uint2 code = codes[i];
        const uint32_t w = quad_transpose(plane_bytes4<K1>(code), q);
        if (g < G && (uint32_t)q < k1) st32(p1 + 4 * (g * k1 + q), w);
        if constexpr (K1 == 5) {  // the fifth plane: OR of the quad's bytes
            uint32_t p4 = gather_plane(code.x, code.y, 4) << (8 * q);
            p4 |= __shfl_xor_sync(FULL, p4, 1);
            p4 |= __shfl_xor_sync(FULL, p4, 2);
            if (g < G && q == 0) st32(p1 + 4 * (g * 5 + 4), p4);
        }
        const uint32_t e8 = gather_plane(code.x, code.y, 6);  // LUT_ESC
        if (e8) {  // escapes are common (k1 = 2 escapes ~30 %): predicated, not a loop
            const uint2 ex = chunk_exps_again<D>(ch[i]);
            const uint32_t o = sm.cnt[c] & 0xffffu;
#pragma unroll
            for (int jb = 0; jb < 8; ++jb)
                if ((e8 >> jb) & 1u) sm.esc[o + __popc(e8 & ((1u << jb) - 1u))] = (uint8_t)byte_of(ex, jb);
        }
        put_payload<D>(ch[i], c, nb, G, pay);
    }
    __syncthreads();
    put_escapes<CPT>(sm, p2, raw);
}

template <class D, int CPT>
__device__ void put_raw(const Chunk<D> (&ch)[CPT], int nb, uint8_t* dst) {
    const int tid = threadIdx.x;
    if (tid == 0) {
        st32(dst, 0);
        st32(dst + 4, 0);
    }
    const uint32_t bytes = pad4((uint32_t)(D::SIZE * nb));
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
        const uint32_t base = (uint32_t)(i * THREADS + tid) * 8 * D::SIZE;
#pragma unroll
        for (int k = 0; k < D::WORDS; ++k)
            if (base + 4 * k < bytes) st32(dst + 8 + base + 4 * k, ch[i].w[k]);
    }
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

// ---- one block, in two phases: the building blocks for kernels that place blocks
// themselves (the single-pass stream below; fused collectives writing into a peer's slot).

// Phase 1, every thread of a CTA of THREADS: load the block at `src` (nb values, nb <=
// 2048·CPT; `aligned`: src is 16-byte aligned), choose its table and widths, code every
// value and count escapes. Returns the block's exact size in bytes (to every thread);
// `sm.raw` says whether it will be stored raw.
template <class D, int CPT>
__device__ uint32_t encode_block_begin(EncSmem<CPT>& sm, Chunk<D> (&ch)[CPT], uint2 (&codes)[CPT], const uint8_t* src,
                                       int nb, uint32_t tiers, bool aligned) {
    const int tid = threadIdx.x;
    if (tid < D::NSYM) sm.hist[tid] = 0;
#pragma unroll
    for (int i = 0; i < CPT; ++i) ch[i] = load_chunk<D>(src, i * THREADS + tid, nb, aligned);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < CPT; ++i)
        if (8 * (i * THREADS + tid) < nb) atomicAdd(&sm.hist[chunk_exps<D>(ch[i]).x & 0xffu], 1u);
    __syncthreads();
    choose<D, CPT>(sm, nb, tiers);
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
        const int c = i * THREADS + tid;
        const uint2 vm = nb - 8 * c >= 8 ? make_uint2(FULL, FULL) : valid_mask(nb - 8 * c);
        codes[i] = chunk_codes<CPT>(sm, chunk_exps<D>(ch[i]), vm);
        const uint32_t esc = __popc((codes[i].x & 0x40404040u) | ((codes[i].y >> 1) & 0x20202020u));
        const uint32_t raw = __popc((codes[i].x & 0x80808080u) | ((codes[i].y >> 1) & 0x40404040u));
        sm.cnt[c] = esc | (raw << 16);
    }
    __syncthreads();
    const uint32_t tot = block_scan<CPT>(sm.cnt, sm.wtmp);
    const uint32_t n_esc1 = tot & 0xffffu, n_raw = tot >> 16;
    const uint32_t raw_size = 8 + pad4((uint32_t)(D::SIZE * nb));
    const uint32_t size = coded_size<D>(nb, sm.k1, sm.k2, n_esc1, n_raw);
    if (tid == 0) {  // read by phase 2 (after the caller's barrier)
        sm.raw = size >= raw_size;
        sm.n_esc1 = n_esc1;
        sm.n_raw = n_raw;
    }
    return size >= raw_size ? raw_size : size;
}

// Phase 2, every thread, after a barrier that follows phase 1: write the block to `dst`
// (4-byte aligned; the size phase 1 returned).
template <class D, int CPT>
__device__ void encode_block_end(EncSmem<CPT>& sm, const Chunk<D> (&ch)[CPT], const uint2 (&codes)[CPT], int nb,
                                 uint8_t* dst) {
    if (sm.raw) {
        put_raw<D, CPT>(ch, nb, dst);
        return;
    }
    switch (sm.k1) {
        case 1: put_coded<D, CPT, 1>(sm, ch, codes, nb, dst); break;
        case 2: put_coded<D, CPT, 2>(sm, ch, codes, nb, dst); break;
        case 3: put_coded<D, CPT, 3>(sm, ch, codes, nb, dst); break;
        case 4: put_coded<D, CPT, 4>(sm, ch, codes, nb, dst); break;
        default: put_coded<D, CPT, 5>(sm, ch, codes, nb, dst); break;
    }
}

// The single-pass stream. scratch[0]: ticket counter; scratch[1 + j]: look-back status of
// block j (both zeroed by hoccl_bfx_compress_begin). flags bit 0: `in` is 16-byte aligned.
template <class D, int CPT>
__device__ void compress_kernel(const uint8_t* in, uint64_t n, uint32_t B, uint32_t tiers, uint8_t* out,
                                uint64_t* scratch, uint64_t* out_len, uint32_t flags) {
    __shared__ EncSmem<CPT> sm;
    BFX_EMU_POISON(sm);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) sm.ticket = atomicAdd(reinterpret_cast<unsigned long long*>(scratch), 1ull);
    __syncthreads();
    const uint64_t j = sm.ticket, start = j * B, nblocks = (n + B - 1) / B;
    const int nb = (int)(n - start < B ? n - start : B);
    Chunk<D> ch[CPT];
    uint2 codes[CPT];
    const uint32_t size = encode_block_begin<D, CPT>(sm, ch, codes, in + start * D::SIZE, nb, tiers, flags & 1);
    if (warp == 0) {
        const uint64_t excl = lookback(scratch + 1, j, size, lane);
        if (lane == 0) {
            const uint64_t hdr = 24 + 4 * nblocks;
            sm.offset = hdr + excl;
            st32(out + 24 + 4 * j, size);
            if (j + 1 == nblocks && out_len) *out_len = hdr + excl + size;
        }
    }
    __syncthreads();
    encode_block_end<D, CPT>(sm, ch, codes, nb, out + sm.offset);
}

// ===================================================================== decompressor ===

struct DecSmem {
    uint8_t table[32];
    uint32_t cnt[THREADS];
    uint8_t esc[TILE];
    uint32_t g2[TILE / 32 + 2];
    uint32_t wtmp[WARPS];
    uint64_t wtmp64[WARPS];
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

// Everything a block's header words and size must satisfy (format.rs BlockHeader::parse).
template <class D>
__device__ uint32_t parse_block(BlockDesc& d, uint32_t bytes) {
    const uint32_t w0 = ld32(d.blk), w1 = ld32(d.blk + 4);
    d.k1 = w0 & 7;
    d.k2 = (w0 >> 3) & 7;
    d.n_raw = w0 >> 8;
    d.n_esc1 = w1 & 0xffffffu;
    if ((w0 & 0xc0u) || (w1 >> 24)) return ST_BLOCK_HEADER;
    const uint32_t nb = (uint32_t)d.nb;
    if (d.k1 == 0) {
        if (w0 || w1) return ST_BLOCK_HEADER;
        return bytes == 8 + pad4(D::SIZE * nb) ? ST_OK : ST_BLOCK_SIZE;
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
        for (uint32_t i = tid; i < cnt; i += THREADS) {
            const uint32_t e = d.raw[run + i];
            if (e >= (uint32_t)D::NSYM) sm.err = ST_SYMBOL;
            sm.esc[i] = (uint8_t)e;
        }
        __syncthreads();
        return sm.err;
    }
    const uint32_t ga = run / 32, ng = (run + cnt - 1) / 32 - ga + 1;
    for (int pass = 0; pass < 2; ++pass) {
        for (uint32_t gi = warp; gi < ng; gi += WARPS) {
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

// Values of one chunk from its exponents `ex` (packed) and the payload.
template <class D>
__device__ __forceinline__ void put_values(const BlockDesc& d, int c, int v0, int valid, uint2 ex, bool aligned) {
    const uint32_t nb = (uint32_t)d.nb, G = (nb + 31) / 32;
    const int q = c & 3, g = v0 >> 5;
    uint32_t pair[4];
    const uint8_t* bytes = D::NSYM == 32 ? d.pay + 12 * G : d.pay;
    const uint32_t b0 = ld32(bytes + v0), b1 = v0 + 4 < d.nb ? ld32(bytes + v0 + 4) : 0u;
    if constexpr (D::NSYM == 32) {
        uint2 t = make_uint2(0, 0);
#pragma unroll
        for (int b = 0; b < 3; ++b) {
            const uint2 s = scatter_plane((ld32(d.pay + 4 * (3 * g + b)) >> (8 * q)) & 0xffu);
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
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t sel = i & 1 ? 0x4342 : 0x4140;
            const uint32_t S = __byte_perm(i < 2 ? b0 : b1, 0, sel), E = __byte_perm(i < 2 ? ex.x : ex.y, 0, sel);
            pair[i] = ((S & 0x00800080u) << 8) | (E << 7) | (S & 0x007f007fu);
        }
    }
    uint8_t* o = d.out + (size_t)v0 * D::SIZE;
    if constexpr (D::SIZE == 4) {
        const uint8_t* lo = d.pay + pad4(nb) + 2 * v0;
        uint32_t f[8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint32_t l = v0 + 2 * k < d.nb ? ld32(lo + 4 * k) : 0u;
            f[2 * k] = __byte_perm(l, pair[k], 0x5410);
            f[2 * k + 1] = __byte_perm(l, pair[k], 0x7632);
        }
        if (aligned && valid == 8) {
            reinterpret_cast<uint4*>(o)[0] = make_uint4(f[0], f[1], f[2], f[3]);
            reinterpret_cast<uint4*>(o)[1] = make_uint4(f[4], f[5], f[6], f[7]);
        } else {
#pragma unroll
            for (int v = 0; v < 8; ++v)
                if (v < valid) reinterpret_cast<uint32_t*>(o)[v] = f[v];
        }
    } else {
        if (aligned && valid == 8) {
            *reinterpret_cast<uint4*>(o) = make_uint4(pair[0], pair[1], pair[2], pair[3]);
        } else {
#pragma unroll
            for (int v = 0; v < 8; ++v)
                if (v < valid) reinterpret_cast<uint16_t*>(o)[v] = (uint16_t)(pair[v >> 1] >> (16 * (v & 1)));
        }
    }
}

// One tile of a coded block: codes, escape ordinals, escapes, values. K1 = d.k1.
template <class D, int K1>
__device__ uint32_t decode_tile(DecSmem& sm, const BlockDesc& d, int t0, uint32_t& esc_run, uint32_t& raw_run, bool aligned) {
    const int tid = threadIdx.x, v0 = t0 + 8 * tid;
    const int valid = d.nb - v0 < 0 ? 0 : (d.nb - v0 > 8 ? 8 : d.nb - v0);
    const uint32_t g = (uint32_t)v0 >> 5, q = tid & 3;
    uint2 codes = make_uint2(0, 0);
    uint32_t e8 = 0;
    if (valid > 0) {
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
    sm.cnt[tid] = __popc(e8);
    __syncthreads();
    const uint32_t cnt = block_scan<1>(sm.cnt, sm.wtmp);
    if (esc_run + cnt > d.n_esc1) return ST_ESCAPES;
    if (cnt) {
        const uint32_t st = fill_escapes<D>(sm, d, esc_run, cnt, raw_run);
        if (st) return st;
    }
    if (valid > 0) {
        uint2 ex = make_uint2(0, 0);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            ex.x |= (uint32_t)sm.table[(codes.x >> (8 * k)) & 0x1fu] << (8 * k);
            ex.y |= (uint32_t)sm.table[(codes.y >> (8 * k)) & 0x1fu] << (8 * k);
        }
        if (e8) {  // predicated over the 8 values, not a loop over escapes
            const uint32_t o = sm.cnt[tid];
#pragma unroll
            for (int jb = 0; jb < 8; ++jb) {
                if ((e8 >> jb) & 1u) {
                    const uint32_t e = sm.esc[o + __popc(e8 & ((1u << jb) - 1u))], sh = 8 * (jb & 3);
                    if (jb < 4) ex.x = (ex.x & ~(0xffu << sh)) | (e << sh);
                    else ex.y = (ex.y & ~(0xffu << sh)) | (e << sh);
                }
            }
        }
        put_values<D>(d, tid, v0, valid, ex, aligned);
    }
    esc_run += cnt;
    __syncthreads();
    return ST_OK;
}

// The tiles of a coded block, with the code width K1 fixed at compile time.
template <class D, int K1>
__device__ uint32_t decode_tiles(DecSmem& sm, const BlockDesc& d, uint32_t flags) {
    uint32_t esc_run = 0, raw_run = 0;
    for (int t0 = 0; t0 < d.nb; t0 += TILE) {
        const uint32_t s = decode_tile<D, K1>(sm, d, t0, esc_run, raw_run, flags & 1);
        if (s) return s;
    }
    if (esc_run != d.n_esc1) return ST_ESCAPES;
    if (d.k2 && raw_run != d.n_raw) return ST_RAWS;
    return ST_OK;
}

template <class D>
__device__ uint32_t decode_block(DecSmem& sm, BlockDesc& d, uint32_t bytes, uint32_t flags) {
    const int tid = threadIdx.x;
    const uint32_t st = parse_block<D>(d, bytes);
    if (st) return st;
    if (d.k1 == 0) {  // raw
        const uint32_t len = D::SIZE * (uint32_t)d.nb;
        if (flags & 2) {
            for (uint32_t w = tid; w < len / 4; w += THREADS) st32(d.out + 4 * w, ld32(d.blk + 8 + 4 * w));
            if ((len & 3) && tid == 0)
                *reinterpret_cast<uint16_t*>(d.out + len - 2) = *reinterpret_cast<const uint16_t*>(d.blk + 8 + len - 2);
        } else {
            for (uint32_t h = tid; h < len / 2; h += THREADS)
                reinterpret_cast<uint16_t*>(d.out)[h] = reinterpret_cast<const uint16_t*>(d.blk + 8)[h];
        }
        return ST_OK;
    }
    if ((uint32_t)tid < d.t1 + d.t2) {
        const uint32_t e = d.blk[8 + tid];
        if (e >= (uint32_t)D::NSYM) sm.err = ST_SYMBOL;
        sm.table[tid] = (uint8_t)e;
    }
    __syncthreads();
    if (sm.err) return sm.err;
    switch (d.k1) {
        case 1: return decode_tiles<D, 1>(sm, d, flags);
        case 2: return decode_tiles<D, 2>(sm, d, flags);
        case 3: return decode_tiles<D, 3>(sm, d, flags);
        case 4: return decode_tiles<D, 4>(sm, d, flags);
        default: return decode_tiles<D, 5>(sm, d, flags);
    }
}

// Stream header checks (format.rs StreamHeader::parse), identical in every CTA.
template <class D>
__device__ uint32_t check_stream(const uint8_t* in, uint64_t in_len, uint64_t n, uint32_t& B, uint32_t& nblocks) {
    if (in_len < 24) return ST_TRUNCATED;
    if (ld32(in) != D::MAGIC) return ST_MAGIC;
    if (ld32(in + 4) != 1) return ST_VERSION;
    const uint64_t hn = (uint64_t)ld32(in + 8) | ((uint64_t)ld32(in + 12) << 32);
    if (hn != n) return ST_COUNT;
    B = ld32(in + 16);
    nblocks = ld32(in + 20);
    if (B < 32 || B % 32 || B > (1u << 24) || (n + B - 1) / B != nblocks) return ST_GEOMETRY;
    if (in_len < 24 + 4 * (uint64_t)nblocks) return ST_TRUNCATED;
    return ST_OK;
}

// flags bit 0: `out` is 16-byte aligned; bit 1: `out` is 4-byte aligned.
template <class D>
__device__ void decompress_kernel(const uint8_t* in, uint64_t in_len, uint8_t* out, uint64_t n, uint32_t* status,
                                  uint32_t flags) {
    __shared__ DecSmem sm;
    BFX_EMU_POISON(sm);
    const int tid = threadIdx.x;
    if (tid == 0) sm.err = 0;
    uint32_t B = 0, nblocks = 0;
    const uint32_t st = check_stream<D>(in, in_len, n, B, nblocks);
    if (st) {
        if (blockIdx.x == 0 && tid == 0) report(status, st, 0);
        return;
    }
    const uint64_t b0 = (uint64_t)nblocks * blockIdx.x / gridDim.x, b1 = (uint64_t)nblocks * (blockIdx.x + 1) / gridDim.x;
    if (b0 == b1) return;
    uint64_t part = 0;
#pragma unroll 8
    for (uint64_t i = tid; i < b0; i += THREADS) part += ld32(in + 24 + 4 * i);
    uint64_t off = 24 + 4 * (uint64_t)nblocks + block_sum64(part, sm.wtmp64);
    for (uint64_t j = b0; j < b1; ++j) {
        const uint32_t bytes = ld32(in + 24 + 4 * j);
        BlockDesc d;
        d.nb = (int)(n - j * B < B ? n - j * B : B);
        d.blk = in + off;
        d.out = out + j * B * D::SIZE;
        uint32_t s = ST_OK;
        if (bytes % 4 || bytes < 8 + (uint32_t)d.nb || bytes > 8 + D::SIZE * B) s = ST_BLOCK_SIZE;
        else if (off + bytes > in_len) s = ST_TRUNCATED;
        else s = decode_block<D>(sm, d, bytes, flags);
        if (s) {
            if (tid == 0) report(status, s, j);
            return;
        }
        off += bytes;
    }
}

}  // namespace bfx

// ===================================================================== entry points ===
// Kernel parameters are u64 for pointers and sizes, u32 otherwise (gpu.rs passes exactly
// these types).

// Zero the look-back scratch (`words` u64), write the fixed stream header, and for an
// empty input the stream length.
extern "C" __global__ void __launch_bounds__(256) hoccl_bfx_compress_begin(uint8_t* out, uint64_t n, uint32_t B,
                                                                           uint32_t nblocks, uint32_t magic,
                                                                           uint64_t* scratch, uint64_t words,
                                                                           uint64_t* out_len) {
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

extern "C" __global__ void hoccl_bfx_decompress_begin(uint32_t* status) {
    if (threadIdx.x == 0 && blockIdx.x == 0 && status) *status = 0;
}

#define BFX_COMPRESS(NAME, D, CPT)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256, CPT * D::WORDS >= 32 ? 3 : 4) NAME(const uint8_t* in, uint64_t n, uint32_t B, uint32_t tiers, \
                                                           uint8_t* out, uint64_t* scratch, uint64_t* out_len,        \
                                                           uint32_t flags) {                                          \
        bfx::compress_kernel<D, CPT>(in, n, B, tiers, out, scratch, out_len, flags);                                  \
    }
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

#define BFX_DECOMPRESS(NAME, D)                                                                                      \
    extern "C" __global__ void __launch_bounds__(256, 4) NAME(const uint8_t* in, uint64_t in_len, uint8_t* out,      \
                                                           uint64_t n, uint32_t* status, uint32_t flags) {           \
        bfx::decompress_kernel<D>(in, in_len, out, n, status, flags);                                                \
    }
BFX_DECOMPRESS(hoccl_bfx_decompress_bf16, bfx::Bf16T)
BFX_DECOMPRESS(hoccl_bfx_decompress_f16, bfx::F16T)
BFX_DECOMPRESS(hoccl_bfx_decompress_f32, bfx::F32T)
