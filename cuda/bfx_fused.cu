// Fused decompress + reduce: dst = fold(inputs) over m compressed streams (BFX1/HFX1/FFX1,
// all of the same n and block size B) and one raw local input, folded in the order given
// (the local input at position `local_pos` of the m + 1), with the arithmetic of
// src/reduce.rs (reduce.cuh). Launched by src/compress/fused.rs.
//
// A CTA takes a contiguous range of block indices (cta_start, as the decompressor), and for
// each block j walks the fold order: a compressed input's block j is decoded by the
// decompressor's own code (decode_block, bfx_decode.cu) with FoldOut as its output, which
// folds each decoded value into an accumulator in shared memory (the first input of the
// order sets it; the last writes acc op x to dst instead); the local input's values are
// folded the same way. Decoded values never reach global memory. Limits: B * value size <=
// 32 KiB (every block is staged: the default B of every dtype); other streams report
// ST_GEOMETRY. A corrupt stream stops the CTA and sets *status (code | block << 8, as the
// decompressor); dst's values for that CTA's blocks are then undefined.
//
// dst may be the local input (in place): each value of the local input is read before dst's
// value at the same place is written (by the same block step).
//
// GACC (the `_dacc` instances): the accumulator is dst's block itself instead of shared
// memory (it stays in L2 between the steps of a block), so a CTA needs only the decoder's
// shared memory and more CTAs fit an SM. dst must then not be the local input unless the
// local input comes first (the launcher checks), and 16-byte steps over the accumulator
// need dst 16-byte aligned (flags bit 0), as every store to dst does.
//
// Decompress + reduce + compress (`hoccl_bfx_drc_*`, the AllReduce step): the same fold,
// one block per CTA, whose reduced block (kept in the shared accumulator as it is written
// to dst) is then coded by the compressor's own block functions (bfx.cu) and placed in an
// output stream by the compressor's decoupled look-back: the stream the standalone
// compressor makes of dst, byte for byte, without reading dst back (drc_kernel below).
#include "bfx.cu"
#include "bfx_decode.cu"
#include "reduce.cuh"

namespace bfx {

constexpr int FUSE_MAX = 8;                 // compressed inputs per launch
constexpr uint32_t FUSE_ACC_BYTES = 32768;  // the accumulator: one block of values

// Mirror of compress::fused `FusedArgs` (#[repr(C)], 176 bytes).
struct FusedArgs {
    const uint8_t* in[FUSE_MAX];
    uint64_t in_len[FUSE_MAX];
    const uint8_t* local;
    uint8_t* dst;
    uint64_t n;
    uint32_t* status;
    uint32_t m;          // compressed inputs, 1..=FUSE_MAX
    uint32_t local_pos;  // 0..=m
    uint32_t flags;      // as the decompressor's (bit 0: dst 16-byte aligned, bit 1: 4-byte, shape, tail)
    uint32_t pad;
};

enum FoldMode : uint32_t { FOLD_FIRST = 0, FOLD_MID = 1, FOLD_LAST = 2 };

// The fold step the CTA is in, set by thread 0 before a barrier that precedes every
// decode_block (FoldOut's functions are static: the decoder calls them by type).
struct FoldState {
    uint8_t* acc;  // generic address of the accumulator (dynamic shared memory)
    uint8_t* dst;  // dst's values of the current block
    uint32_t mode;
    uint32_t n_inputs;  // m + 1 (Avg's divisor)
};
__shared__ FoldState fold_state;

// R: the element arithmetic (reduce.cuh); the decoder's output address o is inside the
// accumulator (d.out = fold_state.acc). KEEP: the last step writes its result to the
// accumulator too (drc_kernel codes the block from there).
template <class R, int OP, bool KEEP = false>
struct FoldOut {
    using T = typename R::U;
    // 2 or 4 bytes at o (aligned to their size; dst too: flags bit 1 for 4-byte steps)
    template <class W>
    static __device__ __forceinline__ void fold(uint8_t* o, W v) {
        constexpr int E = sizeof(W) / sizeof(T);
        const uint32_t mode = fold_state.mode;
        if (mode == FOLD_FIRST) {
            *reinterpret_cast<W*>(o) = v;
            return;
        }
        T x[E], a[E];
        const W w = *reinterpret_cast<const W*>(o);
        memcpy(x, &v, sizeof(W));
        memcpy(a, &w, sizeof(W));
#pragma unroll
        for (int i = 0; i < E; ++i) a[i] = R::template step<OP>(a[i], x[i]);
        if constexpr (OP == red::AVG) {
            if (mode == FOLD_LAST) {
#pragma unroll
                for (int i = 0; i < E; ++i) a[i] = R::avg(a[i], fold_state.n_inputs);
            }
        }
        W r;
        memcpy(&r, a, sizeof(W));
        *reinterpret_cast<W*>(mode == FOLD_MID ? o : fold_state.dst + (o - fold_state.acc)) = r;
        if (KEEP && mode == FOLD_LAST) *reinterpret_cast<W*>(o) = r;
    }
    static __device__ __forceinline__ void put128(uint8_t* o, uint4 v) {
        const uint32_t mode = fold_state.mode;
        if (mode == FOLD_FIRST) {
            *reinterpret_cast<uint4*>(o) = v;
            return;
        }
        uint4 r = red::step16<R, OP>(*reinterpret_cast<const uint4*>(o), v);
        if (mode == FOLD_MID) {
            *reinterpret_cast<uint4*>(o) = r;
            return;
        }
        if constexpr (OP == red::AVG) r = red::avg16<R>(r, fold_state.n_inputs);
        *reinterpret_cast<uint4*>(fold_state.dst + (o - fold_state.acc)) = r;
        if (KEEP) *reinterpret_cast<uint4*>(o) = r;
    }
    static __device__ __forceinline__ void put32(uint8_t* o, uint32_t v) { fold<uint32_t>(o, v); }
    static __device__ __forceinline__ void put16(uint8_t* o, uint16_t v) {
        if constexpr (sizeof(T) == 2) fold<uint16_t>(o, v);
    }
};

// The local input's values of one block (nb values at `loc`) folded into the accumulator
// in `mode` (FOLD_LAST: acc op x to dst, and with KEEP to the accumulator too). 16-byte
// steps when loc and dst allow them.
template <class D, class R, int OP, bool GACC, bool KEEP = false>
__device__ void fold_local(const uint8_t* loc, uint32_t nb, uint32_t mode, bool dst16) {
    using T = typename R::U;
    const uint32_t tid = threadIdx.x, bytes = nb * D::SIZE;
    uint8_t* acc = fold_state.acc;
    uint32_t done = 0;
    if ((reinterpret_cast<uintptr_t>(loc) & 15) == 0 && ((mode != FOLD_LAST && !GACC) || dst16)) {
        done = bytes & ~15u;
        for (uint32_t u = tid; u < done / 16; u += DT) {
            const uint4 x = reinterpret_cast<const uint4*>(loc)[u];
            uint4* a = reinterpret_cast<uint4*>(acc) + u;
            if (mode == FOLD_FIRST) {
                *a = x;
                continue;
            }
            uint4 r = red::step16<R, OP>(*a, x);
            if (mode == FOLD_MID) {
                *a = r;
                continue;
            }
            if constexpr (OP == red::AVG) r = red::avg16<R>(r, fold_state.n_inputs);
            reinterpret_cast<uint4*>(fold_state.dst)[u] = r;
            if (KEEP) *a = r;
        }
    }
    for (uint32_t i = done / sizeof(T) + tid; i < nb; i += DT) {
        const T x = reinterpret_cast<const T*>(loc)[i];
        T* a = reinterpret_cast<T*>(acc) + i;
        if (mode == FOLD_FIRST) {
            *a = x;
            continue;
        }
        T r = R::template step<OP>(*a, x);
        if (mode == FOLD_MID) {
            *a = r;
            continue;
        }
        if constexpr (OP == red::AVG) r = R::avg(r, fold_state.n_inputs);
        reinterpret_cast<T*>(fold_state.dst)[i] = r;
        if (KEEP) *a = r;
    }
}

// Item (block j of a stream at `in`, at byte offset `off`): its size from the table and its
// two header words (0 when past the stream's end; the size check then reports it) into
// `next`, by cp.async (the caller waits). `off` must be 4-byte aligned.
__device__ __forceinline__ void fetch_item(uint32_t* next, const uint8_t* in, uint64_t in_len, uint64_t j, uint64_t off) {
    cp_async4(next, in + 24 + 4 * j);
    if (off + 8 <= in_len) {
        cp_async4(next + 1, in + off);
        cp_async4(next + 2, in + off + 4);
    } else {
        next[1] = next[2] = 0;
    }
}

// Ask L2 for up to `want` bytes from p (at most `avail` exist there): whole 16-byte units
// inside them (cp.async.bulk.prefetch.L2, sm_90; timing only, nothing waits for it).
__device__ __forceinline__ void l2_prefetch(const uint8_t* p, uint64_t avail, uint64_t want) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint64_t lead = (16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15;
    uint64_t len = avail < want ? avail : want;
    if (len <= lead) return;
    len = (len - lead) & ~(uint64_t)15;
    if (len == 0) return;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + lead), "r"((uint32_t)len) : "memory");
#else
    (void)p;
    (void)avail;
    (void)want;
#endif
}

// Block j of the m streams and the local input (nb values), folded in the order into the
// accumulator, the last step into dst (and, KEEP, the accumulator). offs[k]: stream k's
// offset of block j (advanced past it). sm.next[item & 1] holds the current item's size and
// header words (fetched by the previous step, or before the first block); each compressed
// step fetches the next item's, of this block or, with `more`, of block j + 1 (the caller's
// next). Every thread calls it, after a barrier that follows the fetch of block j's first
// item; it ends with a barrier. Returns 0, or the status it reported for a corrupt block
// (the CTA must then stop: its cp.async copies have landed).
template <class D, class R, int OP, bool GACC, bool KEEP>
__device__ uint32_t fold_block(DecSmem& sm, const FusedArgs& a, uint64_t* offs, uint64_t j, bool more, uint32_t B,
                               uint32_t& item) {
    const int tid = threadIdx.x;
    const uint32_t m = a.m;
    const uint32_t nb = (uint32_t)(a.n - j * B < B ? a.n - j * B : B);
    for (uint32_t pos = 0; pos <= m; ++pos) {
        const uint32_t mode = pos == 0 ? FOLD_FIRST : (pos == m ? FOLD_LAST : FOLD_MID);
        const bool local = pos == a.local_pos;
        const uint32_t k = pos < a.local_pos ? pos : pos - 1;  // the stream, unless local
        const uint32_t* cur = sm.next[item & 1];
        // read before the barrier: thread 0 advances offs[k] once its decode_block returns,
        // which (a raw block from global memory) has no barrier to wait for the other threads
        const uint64_t off = local ? 0 : offs[k];
        if (tid == 0) {
            fold_state.mode = mode;
            fold_state.dst = a.dst + j * B * D::SIZE;
            if (GACC) fold_state.acc = fold_state.dst;
            if (!local) {  // the next item's size and header, and its block into L2
                const bool wrap = k + 1 == m;
                const uint64_t jn = wrap ? j + 1 : j;
                const uint32_t kn = wrap ? 0 : k + 1;
                const uint32_t bytes = cur[0];
                // with one stream the next item is its next block, past this one (whose
                // size is validated below: a misaligned one is not used for the copy)
                const uint64_t on = kn == k ? offs[k] + bytes : offs[kn];
                if ((!wrap || more) && (kn != k || bytes % 4 == 0)) {
                    fetch_item(sm.next[(item + 1) & 1], a.in[kn], a.in_len[kn], jn, on);
                    l2_prefetch(a.in[kn] + on, a.in_len[kn] > on ? a.in_len[kn] - on : 0, 8 + D::SIZE * B);
                }
                if (wrap && more) l2_prefetch(a.local + jn * B * D::SIZE, (a.n - jn * B) * D::SIZE, B * D::SIZE);
            }
        }
        __syncthreads();
        if (local) {
            fold_local<D, R, OP, GACC, KEEP>(a.local + j * B * D::SIZE, nb, mode, a.flags & 1);
        } else {
            const uint32_t bytes = cur[0];
            BlockDesc d;
            d.nb = (int)nb;
            d.blk = a.in[k] + off;
            d.out = fold_state.acc;
            uint32_t s = ST_OK;
            if (bytes % 4 || bytes < 8 + nb || bytes > 8 + D::SIZE * B) s = ST_BLOCK_SIZE;
            else if (off + bytes > a.in_len[k]) s = ST_TRUNCATED;
            else s = decode_block<D, FoldOut<R, OP, KEEP>>(sm, d, bytes, cur[1], cur[2], a.flags);
            if (s) {
                if (tid == 0) {
                    report(a.status, s, j);
                    cp_async_wait_all();  // nothing lands in shared memory after the CTA ends
                }
                return s;
            }
            if (tid == 0) {
                offs[k] = off + bytes;
                cp_async_wait_all();
            }
            ++item;
        }
        __syncthreads();  // the accumulator, offs, sm.next and sm.stage for the next step
    }
    return ST_OK;
}

template <class D, class R, int OP, bool GACC>
__device__ void fused_reduce_kernel(const FusedArgs& a) {
    pdl_enter();
    BFX_DYN_SMEM(DecSmem, sm);
    __shared__ uint64_t offs[FUSE_MAX];  // each stream's offset of its next block
    const int tid = threadIdx.x;
    const uint32_t m = a.m;
    if (tid == 0) {
        sm.err = 0;
        fold_state.acc = reinterpret_cast<uint8_t*>(&sm) + ((sizeof(DecSmem) + 15) & ~(size_t)15);
        fold_state.n_inputs = m + 1;
    }
    uint32_t B = 0, nblocks = 0;
    for (uint32_t k = 0; k < m; ++k) {
        uint32_t Bk = 0, nbk = 0;
        uint32_t st = check_stream<D>(a.in[k], a.in_len[k], a.n, Bk, nbk);
        if (!st && ((k && Bk != B) || Bk * D::SIZE > FUSE_ACC_BYTES)) st = ST_GEOMETRY;
        if (st) {
            if (blockIdx.x == 0 && tid == 0) report(a.status, st, 0);
            return;
        }
        B = Bk;
        nblocks = nbk;
    }
    const uint32_t wave = ((a.flags >> 24) & 1u) ? shape_sms(a.flags) * shape_per_sm(a.flags) : 0u;
    const uint64_t b0 = cta_start(nblocks, wave, blockIdx.x), b1 = cta_start(nblocks, wave, blockIdx.x + 1);
    if (b0 == b1) return;
    // each stream's bytes before block b0 (as the decompressor, one stream at a time)
    for (uint32_t k = 0; k < m; ++k) {
        const uint32_t* tab = reinterpret_cast<const uint32_t*>(a.in[k] + 24);
        uint64_t part = 0;
        for (uint64_t i = tid; i < b0; i += DT) part += tab[i];
        const uint64_t off = 24 + 4 * (uint64_t)nblocks + block_sum64<DT>(part, sm.wtmp64);
        // a misaligned offset (a corrupt table): the CTA of the first such block reports it
        if (off & 3) return;
        if (tid == 0) offs[k] = off;
    }
    init_tables(sm, tid);
    // Latency: a compressed block's size and header words are copied to sm.next one item
    // ahead (cp.async, as the decompressor does one block ahead), and the bytes the next
    // step reads (the next item's coded block, the local input's next block) are asked of L2
    // one step ahead (bulk prefetch, sm_90), so that staging and the local fold find them
    // there. Items: the compressed blocks in the order they are decoded, (j, k) for j in
    // b0..b1, k in 0..m; sm.next[i & 1] holds item i's.
    const uint32_t kfirst = 0;
    if (tid == 0) {
        fetch_item(sm.next[0], a.in[kfirst], a.in_len[kfirst], b0, offs[kfirst]);
        l2_prefetch(a.in[kfirst] + offs[kfirst], a.in_len[kfirst] - offs[kfirst], 8 + D::SIZE * B);
        l2_prefetch(a.local + b0 * B * D::SIZE, (a.n - b0 * B) * D::SIZE, B * D::SIZE);
        cp_async_wait_all();
    }
    __syncthreads();
    uint32_t item = 0;
    for (uint64_t j = b0; j < b1; ++j)
        if (fold_block<D, R, OP, GACC, false>(sm, a, offs, j, j + 1 < b1, B, item)) return;
}


// ------------------------------------------------------------------ + compress ---------

// Mirror of compress::fused `DrcArgs` (#[repr(C)], 232 bytes). f.n, f.local and f.dst cover
// this launch's values, which are blocks block0 .. of the output stream; f.flags bit 0 and
// 1 as for the fused kernel (dst's alignment).
struct DrcArgs {
    FusedArgs f;
    uint8_t* out;       // the output stream (its fixed header: hoccl_bfx_compress_begin)
    uint64_t* scratch;  // its look-back statuses, scratch[1 + j] of block j (zeroed likewise)
    uint64_t* out_len;  // the stream's length in bytes, written by the CTA of its last block
    uint64_t* offs;     // workspace: stream k's offset of block i at offs[k * blocks of f.n + i]
    uint64_t block0;    // this launch's first block in the output stream
    uint64_t blocks;    // blocks of the output stream
    uint32_t B;         // block size in values, of every input stream and of the output
    uint32_t tiers;     // the output's tier mode (1 or 2)
};

// The offsets of every stream's blocks (the input of drc_kernel, which takes one block per
// CTA and so cannot sum the size tables before a range as fused_reduce_kernel does): CTA k
// checks stream k's header (of f.n values, block size B, B values within the accumulator)
// and scans its size table into offs, 2048 entries per step. A failing check sets the
// status word (drc_kernel then codes nothing).
template <class D>
__device__ void drc_offsets_kernel(const DrcArgs& a) {
    pdl_enter();
    alignas(16) __shared__ uint32_t cnt[DT * 8];
    alignas(16) __shared__ uint32_t tmp[DWARPS];
    const int tid = threadIdx.x;
    const uint32_t k = blockIdx.x;
    if (k >= a.f.m) return;
    uint32_t Bk = 0, nbk = 0;
    uint32_t st = check_stream<D>(a.f.in[k], a.f.in_len[k], a.f.n, Bk, nbk);
    if (!st && (Bk != a.B || Bk * D::SIZE > FUSE_ACC_BYTES)) st = ST_GEOMETRY;
    if (st) {
        if (tid == 0) report(a.f.status, st, 0);
        return;
    }
    const uint32_t* tab = reinterpret_cast<const uint32_t*>(a.f.in[k] + 24);
    uint64_t* o = a.offs + (uint64_t)k * nbk;
    uint64_t carry = 24 + 4 * (uint64_t)nbk;
    for (uint64_t t0 = 0; t0 < nbk; t0 += DT * 8) {
        // a valid size is at most 8 + 32768; a larger one fails its own block's check (in
        // drc_kernel), so it is clamped here, and a step's 2048 sizes sum within 32 bits
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint64_t idx = t0 + (uint64_t)tid * 8 + i;
            const uint32_t v = idx < nbk ? tab[idx] : 0u;
            cnt[tid * 8 + i] = v < 0x10000u ? v : 0x10000u;
        }
        const uint32_t tot = block_scan<8, DT>(cnt, tmp);  // the thread's own entries, then barriers
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint64_t idx = t0 + (uint64_t)tid * 8 + i;
            if (idx < nbk) o[idx] = carry + cnt[tid * 8 + i];
        }
        carry += tot;
        __syncthreads();  // cnt is read before the next step writes it
    }
}

// drc_kernel's shared memory: the compressor's state over the decoder's (a CTA decodes its
// block first, then codes it: never both), the accumulator, the streams' offsets.
template <int CPT>
struct DrcSmem {
    union {
        DecSmem dec;
        EncSmem<CPT> enc;
    };
    alignas(16) uint8_t acc[FUSE_ACC_BYTES];
    uint64_t offs[FUSE_MAX];
    uint32_t bad;
};

// One block per CTA, block i of this launch = block j = block0 + i of the output stream
// (by CTA index: the look-back waits only on CTAs of lower index, as the compressor's
// default; see compress_kernel). The fold as fused_reduce_kernel's, with the shared
// accumulator, whose last step writes the result both to dst and to the accumulator
// (FoldOut's KEEP); then the block's chunks are loaded from the accumulator into registers
// and coded by encode_block_chunks (bfx.cu), its size published, its offset found by the
// look-back and the block written, exactly as compress_kernel does with a block it loads
// from global memory. m = 0 (no streams): the block is only coded (dst is not written; the
// caller passes dst = local): the launcher's way to continue an output stream over values
// reduced by other means. A corrupt stream (or a failed check by drc_offsets_kernel): the
// CTA reports it, publishes a size of 0 so its successors' look-back goes on, and writes
// no block (the stream is then not valid, the status word says why).
template <class D, int CPT, class R, int OP>
__device__ void drc_kernel(const DrcArgs& a) {
    pdl_enter();
    BFX_DYN_SMEM(DrcSmem<CPT>, s);
    BFX_EMU_POISON(s);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const FusedArgs& f = a.f;
    const uint32_t B = a.B, m = f.m;
    const uint64_t i = blockIdx.x, j = a.block0 + i, nblocks = (f.n + B - 1) / B;
    const uint32_t nb = (uint32_t)(f.n - i * B < B ? f.n - i * B : B);
    if (tid == 0) {
        s.dec.err = 0;
        fold_state.acc = s.acc;
        fold_state.n_inputs = m + 1;
        s.bad = f.status ? *reinterpret_cast<volatile uint32_t*>(f.status) : 0u;
    }
    init_tables(s.dec, tid);
    __syncthreads();
    bool ok = s.bad == 0;
    if (ok) {
        if ((uint32_t)tid < m) s.offs[tid] = a.offs[(uint64_t)tid * nblocks + i];
        if (tid == 0 && m > 0) {
            const uint64_t off0 = a.offs[i];
            fetch_item(s.dec.next[0], f.in[0], f.in_len[0], i, off0);
            l2_prefetch(f.in[0] + off0, f.in_len[0] > off0 ? f.in_len[0] - off0 : 0, 8 + D::SIZE * B);
            cp_async_wait_all();
        }
        __syncthreads();
        uint32_t item = 0;
        ok = fold_block<D, R, OP, false, true>(s.dec, f, s.offs, i, false, B, item) == ST_OK;  // uniform
    }
    EncSmem<CPT>& e = s.enc;  // the decoder's state is dead: fold_block ended with a barrier
    Out<D> o[CPT];
    uint32_t size = 0;
    if (ok) {
        encode_block_init<D>(e);
        Chunk<D> ch[CPT];
        const bool full = nb == ETILE * CPT;
#pragma unroll
        for (int c = 0; c < CPT; ++c) ch[c] = load_chunk<D>(s.acc, c * ET + tid, (int)nb, true, full);
        size = encode_block_chunks<D, CPT, false>(e, o, ch, (int)nb, a.tiers, [&](uint32_t sz) {
            if (tid == 0) publish_size(a.scratch + 1, j, sz);
        });
        if (e.k2 && size < raw_block_size<D>(nb)) {  // uniform, as in compress_kernel
            __syncthreads();
            if (warp != 0) planes2_words<CPT>(e, (uint32_t)tid - 32, ET - 32);
        }
    } else if (tid == 0) {
        publish_size(a.scratch + 1, j, 0);
    }
    if (warp == 0) {
        const uint64_t excl = lookback(a.scratch + 1, j, size, lane);
        if (lane == 0) {
            const uint64_t hdr = 24 + 4 * a.blocks;
            e.offset = hdr + excl;
            st32(a.out + 24 + 4 * j, size);
            if (j + 1 == a.blocks && a.out_len) *a.out_len = hdr + excl + size;
        }
    }
    __syncthreads();
    if (ok) encode_block_end<D, CPT, false>(e, o, (int)nb, a.out + e.offset);
}

}  // namespace bfx

// Dynamic shared memory of a fused CTA: the decoder's state, then the accumulator (the
// `_dacc` instances: the decoder's state only).
extern "C" __device__ uint32_t hoccl_bfx_fused_smem = ((sizeof(bfx::DecSmem) + 15) & ~15u) + bfx::FUSE_ACC_BYTES;
extern "C" __device__ uint32_t hoccl_bfx_fused_dacc_smem = sizeof(bfx::DecSmem);

// Shared-memory accumulator: 86 KB per CTA, 2 CTAs per SM. dst accumulator: 54 KB, and at
// most 85 registers for 3 CTAs per SM.
#define BFX_FUSED(NAME, D, R, OP, GACC, PER_SM)                                               \
    extern "C" __global__ void __launch_bounds__(bfx::DT, PER_SM) NAME(bfx::FusedArgs a) { \
        bfx::fused_reduce_kernel<D, R, OP, GACC>(a);                                        \
    }
#define BFX_FUSED_OPS(DT, D, R)                                                                \
    BFX_FUSED(hoccl_bfx_fused_reduce_##DT##_sum, D, R, red::SUM, false, 2)        \
    BFX_FUSED(hoccl_bfx_fused_reduce_##DT##_prod, D, R, red::PROD, false, 2)      \
    BFX_FUSED(hoccl_bfx_fused_reduce_##DT##_max, D, R, red::MAX, false, 2)        \
    BFX_FUSED(hoccl_bfx_fused_reduce_##DT##_min, D, R, red::MIN, false, 2)        \
    BFX_FUSED(hoccl_bfx_fused_reduce_##DT##_avg, D, R, red::AVG, false, 2)        \
    BFX_FUSED(hoccl_bfx_fused_reduce_dacc_##DT##_sum, D, R, red::SUM, true, 3)    \
    BFX_FUSED(hoccl_bfx_fused_reduce_dacc_##DT##_prod, D, R, red::PROD, true, 3)  \
    BFX_FUSED(hoccl_bfx_fused_reduce_dacc_##DT##_max, D, R, red::MAX, true, 3)    \
    BFX_FUSED(hoccl_bfx_fused_reduce_dacc_##DT##_min, D, R, red::MIN, true, 3)    \
    BFX_FUSED(hoccl_bfx_fused_reduce_dacc_##DT##_avg, D, R, red::AVG, true, 3)
#ifndef BFX_EMU  // the emulator runs the drc kernels only (tests/fused_drc.rs)
BFX_FUSED_OPS(bf16, bfx::Bf16T, red::BF16)
BFX_FUSED_OPS(f16, bfx::F16T, red::F16)
BFX_FUSED_OPS(f32, bfx::F32T, red::F32T)
#endif

// Decompress + reduce + compress: the offsets pass, then the kernel (one block per CTA;
// the accumulator in shared memory, 2 CTAs per SM). The dtype's block of values at most
// 32 KiB: CPT 8 chunks per thread for the 16-bit types, 4 for fp32.
extern "C" __device__ uint32_t hoccl_bfx_drc_smem =
    sizeof(bfx::DrcSmem<8>) > sizeof(bfx::DrcSmem<4>) ? sizeof(bfx::DrcSmem<8>) : sizeof(bfx::DrcSmem<4>);
static_assert(bfx::ETILE * 8 * 2 == bfx::FUSE_ACC_BYTES && bfx::ETILE * 4 * 4 == bfx::FUSE_ACC_BYTES,
              "a block of the accumulator's size is CPT 8 (16-bit) or 4 (fp32) chunks per thread");
static_assert(bfx::ET == bfx::DT, "one CTA shape for the decoder and the encoder");
#define BFX_DRC(NAME, D, CPT, R, OP)                                                       \
    extern "C" __global__ void __launch_bounds__(bfx::DT, 2) NAME(bfx::DrcArgs a) { \
        bfx::drc_kernel<D, CPT, R, OP>(a);                                               \
    }
#define BFX_DRC_OPS(DTN, D, CPT, R)                                                                       \
    extern "C" __global__ void __launch_bounds__(bfx::DT) hoccl_bfx_drc_offsets_##DTN(bfx::DrcArgs a) { \
        bfx::drc_offsets_kernel<D>(a);                                                                  \
    }                                                                                                    \
    BFX_DRC(hoccl_bfx_drc_##DTN##_sum, D, CPT, R, red::SUM)                                              \
    BFX_DRC(hoccl_bfx_drc_##DTN##_prod, D, CPT, R, red::PROD)                                            \
    BFX_DRC(hoccl_bfx_drc_##DTN##_max, D, CPT, R, red::MAX)                                              \
    BFX_DRC(hoccl_bfx_drc_##DTN##_min, D, CPT, R, red::MIN)                                              \
    BFX_DRC(hoccl_bfx_drc_##DTN##_avg, D, CPT, R, red::AVG)
BFX_DRC_OPS(bf16, bfx::Bf16T, 8, red::BF16)
BFX_DRC_OPS(f16, bfx::F16T, 8, red::F16)
BFX_DRC_OPS(f32, bfx::F32T, 4, red::F32T)
