// CopyReduce: dst[i] = fold(srcs[0][i], ..., srcs[m-1][i]) for m in 1..=8, every dtype and
// operator of the contract in src/reduce.rs (element arithmetic: reduce.cuh); PreMulSum
// multiplies each input by its scalar first. Launched by
// src/device/cuda/reduce.rs, which picks the grid (any CTA count) and the flags.
//
// Work split. With the vector path (flags bit 0: every pointer has the same address mod 16,
// a multiple of the element size) the elements before the first 16-byte boundary of dst
// and after the last one are the scalar head and tail, and the 16-byte units between are
// cut into segments of SEG units (32 lanes x UNROLL units, 2 KiB), which the warps of the
// grid take in turn (global warp w: segments w, w + W, ...). A lane loads its UNROLL units
// of every input (all m x UNROLL loads in flight) before it folds them: no shared memory,
// no barrier. Without the vector path every element is scalar, grid-stride by thread.
// dst may be one of the sources (in place): each element is read before it is written by
// the same thread, and no other thread touches it.
#include "reduce.cuh"

namespace red {

constexpr int MAX_SRCS = 8;
constexpr int RT = 512;  // threads per CTA (reduce.rs reads hoccl_reduce_threads)
constexpr int UNROLL = 2;
constexpr int SEG = 32 * UNROLL;  // 16-byte units per warp segment

// Mirror of reduce.rs `ReduceArgs` (#[repr(C)], 104 bytes).
struct ReduceArgs {
    const uint8_t* src[MAX_SRCS];
    uint8_t* dst;
    uint64_t count;  // elements
    uint32_t nsrc;   // 1..=8
    uint32_t flags;  // bit 0: vector path
    // PREMUL only: the scalar's bits (the dtype's width, low bytes), or, when scalar_ptr is
    // not null, the address of the scalar in device memory, read when the kernel runs.
    uint64_t scalar;
    const uint8_t* scalar_ptr;
};

// The PREMUL scalar as an element of T (any other operator: unused).
template <class D, int OP>
__device__ __forceinline__ typename D::U premul_scalar(const ReduceArgs& a) {
    using T = typename D::U;
    if constexpr (OP != PREMUL) return T(0);
    else if (a.scalar_ptr != nullptr) return *reinterpret_cast<const T*>(a.scalar_ptr);
    else return (T)a.scalar;
}

// The operator the fold applies: PREMUL folds its products with SUM.
template <int OP>
struct FoldOp {
    static constexpr int v = OP == PREMUL ? SUM : OP;
};

template <class D, int OP>
__device__ __forceinline__ typename D::U fold_scalar(const ReduceArgs& a, uint64_t i, typename D::U sc) {
    using T = typename D::U;
    T v[MAX_SRCS];
#pragma unroll
    for (int s = 0; s < MAX_SRCS; ++s)
        if (s < (int)a.nsrc) {
            v[s] = reinterpret_cast<const T*>(a.src[s])[i];
            if constexpr (OP == PREMUL) v[s] = D::template step<PROD>(v[s], sc);
        }
    T acc = v[0];
#pragma unroll
    for (int s = 1; s < MAX_SRCS; ++s)
        if (s < (int)a.nsrc) acc = D::template step<FoldOp<OP>::v>(acc, v[s]);
    if constexpr (OP == AVG) acc = D::avg(acc, a.nsrc);
    return acc;
}

template <class D, int OP>
__device__ __forceinline__ void reduce_kernel(const ReduceArgs& a) {
    using T = typename D::U;
    constexpr uint64_t S = sizeof(T);
    const uint64_t n = a.count;
    const uint64_t tid = (uint64_t)blockIdx.x * RT + threadIdx.x, nthreads = (uint64_t)gridDim.x * RT;
    uint64_t head = n, nvec = 0;
    if (a.flags & 1) {
        const uint64_t mis = reinterpret_cast<uintptr_t>(a.dst) & 15;
        head = mis ? (16 - mis) / S : 0;
        if (head > n) head = n;
        nvec = (n - head) * S / 16;
    }
    const uint64_t vend = head + nvec * (16 / S);  // first element of the tail
    const T sc = premul_scalar<D, OP>(a);
    // scalar head and tail
    for (uint64_t i = tid; i < head + (n - vend); i += nthreads) {
        const uint64_t e = i < head ? i : vend + (i - head);
        reinterpret_cast<T*>(a.dst)[e] = fold_scalar<D, OP>(a, e, sc);
    }
    if (nvec == 0) return;
    const int lane = threadIdx.x & 31;
    const uint64_t gw = tid >> 5, nw = nthreads >> 5;
    const uint64_t off = head * S;  // byte offset of the first unit (the same in every pointer)
    for (uint64_t seg = gw; seg * SEG < nvec; seg += nw) {
        uint4 v[UNROLL][MAX_SRCS];
        const uint64_t u0 = seg * SEG + lane;
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const uint64_t u = u0 + 32 * k;
#pragma unroll
            for (int s = 0; s < MAX_SRCS; ++s)
                if (s < (int)a.nsrc && u < nvec) v[k][s] = reinterpret_cast<const uint4*>(a.src[s] + off)[u];
        }
        if constexpr (OP == PREMUL) {
            const uint4 sc16 = splat16<D>(sc);
#pragma unroll
            for (int k = 0; k < UNROLL; ++k)
#pragma unroll
                for (int s = 0; s < MAX_SRCS; ++s)
                    if (s < (int)a.nsrc) v[k][s] = step16<D, PROD>(v[k][s], sc16);
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const uint64_t u = u0 + 32 * k;
            if (u >= nvec) continue;
            uint4 acc = v[k][0];
#pragma unroll
            for (int s = 1; s < MAX_SRCS; ++s)
                if (s < (int)a.nsrc) acc = step16<D, FoldOp<OP>::v>(acc, v[k][s]);
            if constexpr (OP == AVG) acc = avg16<D>(acc, a.nsrc);
            reinterpret_cast<uint4*>(a.dst + off)[u] = acc;
        }
    }
}

}  // namespace red

extern "C" __device__ uint32_t hoccl_reduce_threads = red::RT;

#define RED_KERNEL(NAME, D, OP)                                                  \
    extern "C" __global__ void __launch_bounds__(red::RT, 1) NAME(red::ReduceArgs a) { \
        red::reduce_kernel<D, OP>(a);                                            \
    }
#define RED_DTYPE(DT, D)                                   \
    RED_KERNEL(hoccl_reduce_##DT##_sum, red::D, red::SUM)   \
    RED_KERNEL(hoccl_reduce_##DT##_prod, red::D, red::PROD) \
    RED_KERNEL(hoccl_reduce_##DT##_max, red::D, red::MAX)   \
    RED_KERNEL(hoccl_reduce_##DT##_min, red::D, red::MIN)   \
    RED_KERNEL(hoccl_reduce_##DT##_avg, red::D, red::AVG)   \
    RED_KERNEL(hoccl_reduce_##DT##_premulsum, red::D, red::PREMUL)
RED_DTYPE(i8, I8)
RED_DTYPE(u8, U8)
RED_DTYPE(i32, I32)
RED_DTYPE(u32, U32)
RED_DTYPE(i64, I64)
RED_DTYPE(u64, U64)
RED_DTYPE(f16, F16)
RED_DTYPE(f32, F32T)
RED_DTYPE(f64, F64T)
RED_DTYPE(bf16, BF16)
RED_DTYPE(f8e4m3, E4M3)
RED_DTYPE(f8e5m2, E5M2)
