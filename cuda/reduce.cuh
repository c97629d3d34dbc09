// Element arithmetic of the reduction contract (src/reduce.rs), bit for bit, for every dtype
// the library has: shared by the CopyReduce kernels (reduce.cu) and the codec's fused
// decompress+reduce kernels (bfx_fused.cu).
//
// The fatbin is compiled with --use_fast_math (flush-to-zero, approximate division, FMA
// contraction) for the codec's sake, so every floating-point step here is inline PTX with
// an explicit rounding mode and no .ftz: add.rn / mul.rn / div.rn never contract into an
// FMA and keep subnormals, and comparisons are setp without .ftz. Conversions to the 16-
// and 8-bit storage types are integer code (the contract's NaN and saturation rules, which
// the cvt intrinsics do not all share).
//
// NaN results of f32/f64 arithmetic (the GPU's own arithmetic gives the canonical NaN
// 0x7fffffff): the contract's rule (src/reduce.rs) is a NaN operand, quieted (the
// accumulator first), else the positive quiet NaN 0x7fc00000 (f64 0x7ff8000000000000).
// For the 16- and 8-bit types only the sign of that NaN survives the rounding ("the quiet
// NaN of its sign").
#pragma once
#include <stdint.h>
#include <string.h>

#include <type_traits>

namespace red {

// PREMUL (PreMulSum): every input is first multiplied by a scalar (one PROD step, the
// input as the accumulator), then the products are folded with SUM (reduce.cu).
enum Op : int { SUM = 0, PROD = 1, MAX = 2, MIN = 3, AVG = 4, PREMUL = 5 };

// ------------------------------------------------------------------ f32 / f64 steps ----

__device__ __forceinline__ bool nan32(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }
__device__ __forceinline__ bool nan64(uint64_t u) { return (u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull; }

// The contract's NaN rule for r = a op b (see the file comment).
__device__ __forceinline__ uint32_t nan_fix32(uint32_t r, uint32_t a, uint32_t b) {
    if (!nan32(r)) return r;
    if (nan32(a)) return a | 0x00400000u;
    if (nan32(b)) return b | 0x00400000u;
    return 0x7fc00000u;
}
__device__ __forceinline__ uint64_t nan_fix64(uint64_t r, uint64_t a, uint64_t b) {
    if (!nan64(r)) return r;
    if (nan64(a)) return a | 0x0008000000000000ull;
    if (nan64(b)) return b | 0x0008000000000000ull;
    return 0x7ff8000000000000ull;
}

#ifndef BFX_EMU
__device__ __forceinline__ uint32_t add32(uint32_t a, uint32_t b) {
    uint32_t r;
    asm("add.rn.f32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return nan_fix32(r, a, b);
}
__device__ __forceinline__ uint32_t mul32(uint32_t a, uint32_t b) {
    uint32_t r;
    asm("mul.rn.f32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return nan_fix32(r, a, b);
}
__device__ __forceinline__ uint32_t div32(uint32_t a, uint32_t b) {
    uint32_t r;
    asm("div.rn.f32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return nan_fix32(r, a, b);
}
// b > a (false when either is NaN), subnormals compared as they are.
__device__ __forceinline__ bool gt32(uint32_t b, uint32_t a) {
    uint32_t r;
    asm("{ .reg .pred p; setp.gt.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "r"(b), "r"(a));
    return r != 0;
}
__device__ __forceinline__ bool lt32(uint32_t b, uint32_t a) {
    uint32_t r;
    asm("{ .reg .pred p; setp.lt.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "r"(b), "r"(a));
    return r != 0;
}
__device__ __forceinline__ uint64_t add64(uint64_t a, uint64_t b) {
    uint64_t r;
    asm("add.rn.f64 %0, %1, %2;" : "=l"(r) : "l"(a), "l"(b));
    return nan_fix64(r, a, b);
}
__device__ __forceinline__ uint64_t mul64(uint64_t a, uint64_t b) {
    uint64_t r;
    asm("mul.rn.f64 %0, %1, %2;" : "=l"(r) : "l"(a), "l"(b));
    return nan_fix64(r, a, b);
}
__device__ __forceinline__ uint64_t div64(uint64_t a, uint64_t b) {
    uint64_t r;
    asm("div.rn.f64 %0, %1, %2;" : "=l"(r) : "l"(a), "l"(b));
    return nan_fix64(r, a, b);
}
__device__ __forceinline__ bool gt64(uint64_t b, uint64_t a) {
    uint32_t r;
    asm("{ .reg .pred p; setp.gt.f64 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "l"(b), "l"(a));
    return r != 0;
}
__device__ __forceinline__ bool lt64(uint64_t b, uint64_t a) {
    uint32_t r;
    asm("{ .reg .pred p; setp.lt.f64 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "l"(b), "l"(a));
    return r != 0;
}

// u32 -> f32 bits (exact for the divisors used: n <= 2^24) and f64.
__device__ __forceinline__ uint32_t f32_of(uint32_t n) {
    uint32_t r;
    asm("cvt.rn.f32.u32 %0, %1;" : "=r"(r) : "r"(n));
    return r;
}
__device__ __forceinline__ uint64_t f64_of(uint32_t n) {
    uint64_t r;
    asm("cvt.rn.f64.u32 %0, %1;" : "=l"(r) : "r"(n));
    return r;
}
#else
// The CPU emulator (bfx_emu.hpp, tests/fused_drc.rs): the host's IEEE binary32/binary64
// arithmetic, round to nearest even with subnormals kept, as the PTX above (build it with
// -ffp-contract=off, so no step is fused into another); NaN results go through the same rule.
template <class F, class U>
inline F emu_f(U u) {
    F f;
    memcpy(&f, &u, sizeof f);
    return f;
}
template <class U, class F>
inline U emu_u(F f) {
    U u;
    memcpy(&u, &f, sizeof u);
    return u;
}
inline uint32_t add32(uint32_t a, uint32_t b) { return nan_fix32(emu_u<uint32_t>(emu_f<float>(a) + emu_f<float>(b)), a, b); }
inline uint32_t mul32(uint32_t a, uint32_t b) { return nan_fix32(emu_u<uint32_t>(emu_f<float>(a) * emu_f<float>(b)), a, b); }
inline uint32_t div32(uint32_t a, uint32_t b) { return nan_fix32(emu_u<uint32_t>(emu_f<float>(a) / emu_f<float>(b)), a, b); }
inline bool gt32(uint32_t b, uint32_t a) { return emu_f<float>(b) > emu_f<float>(a); }
inline bool lt32(uint32_t b, uint32_t a) { return emu_f<float>(b) < emu_f<float>(a); }
inline uint64_t add64(uint64_t a, uint64_t b) { return nan_fix64(emu_u<uint64_t>(emu_f<double>(a) + emu_f<double>(b)), a, b); }
inline uint64_t mul64(uint64_t a, uint64_t b) { return nan_fix64(emu_u<uint64_t>(emu_f<double>(a) * emu_f<double>(b)), a, b); }
inline uint64_t div64(uint64_t a, uint64_t b) { return nan_fix64(emu_u<uint64_t>(emu_f<double>(a) / emu_f<double>(b)), a, b); }
inline bool gt64(uint64_t b, uint64_t a) { return emu_f<double>(b) > emu_f<double>(a); }
inline bool lt64(uint64_t b, uint64_t a) { return emu_f<double>(b) < emu_f<double>(a); }
inline uint32_t f32_of(uint32_t n) { return emu_u<uint32_t>((float)n); }
inline uint64_t f64_of(uint32_t n) { return emu_u<uint64_t>((double)n); }
#endif

// ------------------------------------------------------------------ conversions --------

__device__ __forceinline__ uint32_t bf16_to_f32(uint32_t h) { return h << 16; }

// f32 -> bf16, nearest even; overflow gives inf; NaN gives 0x7fc0 with its sign.
__device__ __forceinline__ uint32_t f32_to_bf16(uint32_t u) {
    if (nan32(u)) return ((u >> 16) & 0x8000u) | 0x7fc0u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// A small float with M mantissa bits and exponent bias BIAS, exact in f32.
template <int M, int BIAS>
__device__ __forceinline__ uint32_t small_to_f32(uint32_t e, uint32_t m, uint32_t sign) {
    if (e == 0) {
        if (m == 0) return sign;
        const int p = 31 - __clz(m);  // leading bit: value = 2^(p + 1 - BIAS - M) * (m / 2^p)
        return sign | ((uint32_t)(p + 1 - BIAS - M + 127) << 23) | ((m ^ (1u << p)) << (23 - p));
    }
    return sign | ((e - BIAS + 127) << 23) | (m << (23 - M));
}

__device__ __forceinline__ uint32_t f16_to_f32(uint32_t h) {
    const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu;
    if (e == 31) return sign | 0x7f800000u | (m << 13);
    return small_to_f32<10, 15>(e, m, sign);
}
__device__ __forceinline__ uint32_t e4m3_to_f32(uint32_t b) {
    const uint32_t sign = (b & 0x80u) << 24, e = (b >> 3) & 15u, m = b & 7u;
    if ((b & 0x7fu) == 0x7fu) return sign | 0x7fc00000u;
    return small_to_f32<3, 7>(e, m, sign);
}
__device__ __forceinline__ uint32_t e5m2_to_f32(uint32_t b) {
    const uint32_t sign = (b & 0x80u) << 24, e = (b >> 2) & 31u, m = b & 3u;
    if (e == 31) return sign | 0x7f800000u | (m << 21);
    return small_to_f32<2, 15>(e, m, sign);
}

// |f32| (not NaN, sign removed: `u`) rounded to nearest even into a format with M mantissa
// bits and bias BIAS, as its unsigned code (may exceed the format: the caller clamps).
template <int M, int BIAS>
__device__ __forceinline__ uint32_t round_small(uint32_t u) {
    const uint32_t e = u >> 23;
    if (e == 0) return 0;  // f32 subnormals are far below half the smallest subnormal
    const int te = (int)e - 127 + BIAS;
    const uint32_t mant = u & 0x7fffffu;
    if (te >= 1) {
        if (te > 200) return 0xffffffu;  // far out of range (inf included): the caller clamps
        constexpr int drop = 23 - M;
        const uint32_t r = ((uint32_t)te << 23) | mant;
        return (r + ((1u << (drop - 1)) - 1u) + ((r >> drop) & 1u)) >> drop;
    }
    // subnormal: k = (mant | 2^23) * 2^(e - 150) / 2^(1 - BIAS - M), nearest even
    const int shift = 151 - BIAS - M - (int)e;
    if (shift > 24) return 0;
    const uint32_t mm = mant | 0x800000u, k = mm >> shift, rem = mm & ((1u << shift) - 1u), half = 1u << (shift - 1);
    return k + ((rem > half || (rem == half && (k & 1u))) ? 1u : 0u);
}

// f32 -> f16: nearest even, overflow gives inf, NaN gives 0x7e00 with its sign.
__device__ __forceinline__ uint32_t f32_to_f16(uint32_t u) {
    const uint32_t sign = (u >> 16) & 0x8000u;
    if (nan32(u)) return sign | 0x7e00u;
    const uint32_t c = round_small<10, 15>(u & 0x7fffffffu);
    return sign | (c >= 0x7c00u ? 0x7c00u : c);
}
// f32 -> OCP e4m3 / e5m2: nearest even, saturating to the largest finite value (infinities
// too), NaN gives 0x7f / 0x7e with its sign.
__device__ __forceinline__ uint32_t f32_to_e4m3(uint32_t u) {
    const uint32_t sign = (u >> 24) & 0x80u;
    if (nan32(u)) return sign | 0x7fu;
    const uint32_t c = round_small<3, 7>(u & 0x7fffffffu);
    return sign | (c > 0x7eu ? 0x7eu : c);
}
__device__ __forceinline__ uint32_t f32_to_e5m2(uint32_t u) {
    const uint32_t sign = (u >> 24) & 0x80u;
    if (nan32(u)) return sign | 0x7eu;
    const uint32_t c = round_small<2, 15>(u & 0x7fffffffu);
    return sign | (c > 0x7bu ? 0x7bu : c);
}

// ------------------------------------------------------------------ dtype traits -------
// T: the storage word; step(a, b): one fold step (a the accumulator); avg(a, n): the Avg
// division of the Sum fold by n.

template <class T, bool SIGNED>
struct IntT {
    using U = T;
    using ST = typename std::conditional<sizeof(T) == 1, int8_t,
               typename std::conditional<sizeof(T) == 4, int32_t, int64_t>::type>::type;
    template <int OP>
    __device__ static __forceinline__ T step(T a, T b) {
        if constexpr (OP == SUM || OP == AVG) return (T)(a + b);  // wrapping (unsigned words)
        else if constexpr (OP == PROD) return (T)(a * b);
        else if constexpr (SIGNED) {
            if constexpr (OP == MAX) return (ST)b > (ST)a ? b : a;
            else return (ST)b < (ST)a ? b : a;
        } else {
            if constexpr (OP == MAX) return b > a ? b : a;
            else return b < a ? b : a;
        }
    }
    __device__ static __forceinline__ T avg(T a, uint32_t n) {
        if constexpr (SIGNED) {
            return (T)(ST)((long long)(ST)a / (long long)n);
        } else {
            return (T)((unsigned long long)a / (unsigned long long)n);
        }
    }
};

struct F32T {
    using U = uint32_t;
    template <int OP>
    __device__ static __forceinline__ uint32_t step(uint32_t a, uint32_t b) {
        if constexpr (OP == SUM || OP == AVG) return add32(a, b);
        else if constexpr (OP == PROD) return mul32(a, b);
        else if constexpr (OP == MAX) return (gt32(b, a) || nan32(a)) ? b : a;
        else return (lt32(b, a) || nan32(a)) ? b : a;
    }
    __device__ static __forceinline__ uint32_t avg(uint32_t a, uint32_t n) { return div32(a, f32_of(n)); }
};

struct F64T {
    using U = uint64_t;
    template <int OP>
    __device__ static __forceinline__ uint64_t step(uint64_t a, uint64_t b) {
        if constexpr (OP == SUM || OP == AVG) return add64(a, b);
        else if constexpr (OP == PROD) return mul64(a, b);
        else if constexpr (OP == MAX) return (gt64(b, a) || nan64(a)) ? b : a;
        else return (lt64(b, a) || nan64(a)) ? b : a;
    }
    __device__ static __forceinline__ uint64_t avg(uint64_t a, uint32_t n) { return div64(a, f64_of(n)); }
};

// 16- and 8-bit floats: widen both to f32, compute, round back; min/max keep the input's bits.
template <class T, uint32_t (*WIDEN)(uint32_t), uint32_t (*NARROW)(uint32_t)>
struct SmallF {
    using U = T;
    template <int OP>
    __device__ static __forceinline__ T step(T a, T b) {
        const uint32_t fa = WIDEN(a), fb = WIDEN(b);
        if constexpr (OP == SUM || OP == AVG) return (T)NARROW(add32(fa, fb));
        else if constexpr (OP == PROD) return (T)NARROW(mul32(fa, fb));
        else if constexpr (OP == MAX) return (gt32(fb, fa) || nan32(fa)) ? b : a;
        else return (lt32(fb, fa) || nan32(fa)) ? b : a;
    }
    __device__ static __forceinline__ T avg(T a, uint32_t n) { return (T)NARROW(div32(WIDEN(a), f32_of(n))); }
};

using I8 = IntT<uint8_t, true>;
using U8 = IntT<uint8_t, false>;
using I32 = IntT<uint32_t, true>;
using U32 = IntT<uint32_t, false>;
using I64 = IntT<uint64_t, true>;
using U64 = IntT<uint64_t, false>;
using F16 = SmallF<uint16_t, f16_to_f32, f32_to_f16>;
using BF16 = SmallF<uint16_t, bf16_to_f32, f32_to_bf16>;
using E4M3 = SmallF<uint8_t, e4m3_to_f32, f32_to_e4m3>;
using E5M2 = SmallF<uint8_t, e5m2_to_f32, f32_to_e5m2>;

// 16 bytes as elements of T, folded element by element: acc = step(acc, x).
template <class D, int OP>
__device__ __forceinline__ uint4 step16(uint4 acc, uint4 x) {
    using T = typename D::U;
    constexpr int E = 16 / sizeof(T);
    T a[E], b[E];
    memcpy(a, &acc, 16);
    memcpy(b, &x, 16);
#pragma unroll
    for (int i = 0; i < E; ++i) a[i] = D::template step<OP>(a[i], b[i]);
    memcpy(&acc, a, 16);
    return acc;
}
// 16 bytes holding the element `v` of T in every lane.
template <class D>
__device__ __forceinline__ uint4 splat16(typename D::U v) {
    using T = typename D::U;
    constexpr int E = 16 / sizeof(T);
    T a[E];
#pragma unroll
    for (int i = 0; i < E; ++i) a[i] = v;
    uint4 r;
    memcpy(&r, a, 16);
    return r;
}
template <class D>
__device__ __forceinline__ uint4 avg16(uint4 acc, uint32_t n) {
    using T = typename D::U;
    constexpr int E = 16 / sizeof(T);
    T a[E];
    memcpy(a, &acc, 16);
#pragma unroll
    for (int i = 0; i < E; ++i) a[i] = D::avg(a[i], n);
    memcpy(&acc, a, 16);
    return acc;
}

}  // namespace red
