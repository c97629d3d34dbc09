// A small SIMT emulator that runs cuda/bfx.cu and cuda/bfx_decode.cu as plain C++ on the CPU, so the kernels'
// logic (warp ballots and shuffles, barriers, look-back, tiles, validation) is tested in CI
// on machines without a GPU (tests/codec_emu.rs). Not a general CUDA emulator: exactly what
// bfx.cu uses.
//
// Every CUDA thread is a ucontext coroutine; the scheduler resumes them round-robin (in a
// shuffled order under BFX_EMU_SCHED, see sched_order). A
// thread runs until it reaches a collective (__syncthreads, a warp vote or shuffle, a spin)
// and then yields, so there is no preemption: atomics are plain read-modify-writes. CTAs run
// one after another, which makes `__shared__` (mapped to `static`) per CTA. All 32 lanes of a
// warp must reach every warp collective (as `FULL` masks require on the GPU): a lane that
// does not makes the emulator report a deadlock instead of hanging. Shared memory is
// filled with 0xA5 at each CTA start, so reads of unwritten shared memory show.
#pragma once
#define BFX_EMU 1
#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

struct uint2 {
    uint32_t x, y;
};
struct alignas(16) uint4 {
    uint32_t x, y, z, w;
};
inline uint2 make_uint2(uint32_t x, uint32_t y) { return uint2{x, y}; }
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return uint4{x, y, z, w}; }
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace emu {

constexpr size_t STACK = 256 * 1024;

#if defined(__x86_64__)
// Minimal stack switch (System V x86-64: callee-saved registers only). ucontext's
// swapcontext makes a system call per switch to save the signal mask; this does not.
extern "C" void bfx_emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl bfx_emu_switch
    .type bfx_emu_switch,@function
bfx_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size bfx_emu_switch, .-bfx_emu_switch
)");
#define BFX_EMU_FAST_SWITCH 1
#endif

struct Thread {
    ucontext_t ctx;
    void* sp = nullptr;
    std::vector<char> stack;
    unsigned tid = 0;
    bool done = false;
    // While *wait_ptr == wait_val the thread waits at a collective: the scheduler skips it.
    const uint64_t* wait_ptr = nullptr;
    uint64_t wait_val = 0;
};

struct Warp {
    uint64_t slot[2][32];
    unsigned arrived = 0;
    uint64_t gen = 0;
};

struct Cta {
    std::vector<Thread> threads;
    ucontext_t sched;
    void* sched_sp = nullptr;
    Thread* cur = nullptr;
    unsigned alive = 0, arrived = 0;
    uint64_t gen = 0, progress = 0;
    uint64_t serial = 0;  // one per CTA run (BFX_EMU_POISON)
    Warp warps[32];
    std::function<void()> body;
};

inline Cta& cta() {
    static Cta c;
    return c;
}
inline dim3& grid_dim() {
    static dim3 d;
    return d;
}
inline dim3& block_idx() {
    static dim3 d;
    return d;
}
inline dim3& block_dim() {
    static dim3 d;
    return d;
}

inline void yield() {
    Cta& c = cta();
#ifdef BFX_EMU_FAST_SWITCH
    bfx_emu_switch(&c.cur->sp, c.sched_sp);
#else
    swapcontext(&c.cur->ctx, &c.sched);
#endif
}

// Yield until *p != v (a barrier generation moved on).
inline void wait_change(const uint64_t* p, uint64_t v) {
    Cta& c = cta();
    c.cur->wait_ptr = p;
    c.cur->wait_val = v;
    while (*p == v) yield();
    c.cur->wait_ptr = nullptr;
}

inline dim3 thread_idx() {
    dim3 d;
    d.x = cta().cur->tid;
    return d;
}

inline void syncthreads() {
    Cta& c = cta();
    const uint64_t g = c.gen;
    if (++c.arrived == c.alive) {
        c.arrived = 0;
        ++c.gen;
        ++c.progress;
    } else {
        wait_change(&c.gen, g);
    }
}

// Every lane of the caller's warp contributes v; returns all 32 contributions.
inline const uint64_t* warp_all(uint64_t v) {
    Cta& c = cta();
    const unsigned tid = c.cur->tid;
    Warp& w = c.warps[tid / 32];
    const uint64_t g = w.gen;
    w.slot[g & 1][tid % 32] = v;
    if (++w.arrived == 32) {
        w.arrived = 0;
        ++w.gen;
        ++c.progress;
    } else {
        wait_change(&w.gen, g);
    }
    return w.slot[g & 1];
}

inline void entry() {
    Cta& c = cta();
    c.body();
    c.cur->done = true;
    --c.alive;
    if (c.arrived == c.alive && c.arrived > 0) {  // the rest wait at a barrier: release it
        c.arrived = 0;
        ++c.gen;
    }
    ++c.progress;
#ifdef BFX_EMU_FAST_SWITCH
    for (;;) yield();  // never resumed: the scheduler skips finished threads
#endif
    // (ucontext: returning ends the context; uc_link brings us back to the scheduler)
}

#ifdef BFX_EMU_FAST_SWITCH
// A fresh stack whose first switch "returns" into entry() with the ABI's alignment.
inline void* fresh_stack(Thread& th) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(th.stack.data()) + th.stack.size()) & ~(uintptr_t)15;
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;                               // entry()'s return address: never used
    *--sp = reinterpret_cast<void*>(&entry);       // popped by `ret`
    for (int i = 0; i < 6; ++i) *--sp = nullptr;   // rbp rbx r12 r13 r14 r15
    return sp;
}
#endif

// Scheduling order. With BFX_EMU_SCHED=<seed> (nonzero) the CTAs run in a shuffled order
// and every round of the scheduler resumes the threads in a fresh random order, so that a
// thread (or warp) may run a whole phase before or after any other: races between
// barriers that the fixed 0..255 order hides (a read in one phase of shared memory that a
// later phase of another thread overwrites) show as wrong output.
inline uint64_t& sched_state() {
    static uint64_t s = [] {
        const char* e = std::getenv("BFX_EMU_SCHED");
        return e ? std::strtoull(e, nullptr, 0) : 0ull;
    }();
    return s;
}
inline uint32_t sched_next() {
    uint64_t& s = sched_state();
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return (uint32_t)(s >> 16);
}
// order[0..n) = 0..n-1, shuffled when BFX_EMU_SCHED is set.
inline void sched_order(std::vector<unsigned>& order, unsigned n) {
    order.resize(n);
    for (unsigned i = 0; i < n; ++i) order[i] = i;
    if (sched_state() == 0) return;
    for (unsigned i = n; i > 1; --i) std::swap(order[i - 1], order[sched_next() % i]);
}

// Run `body` as `grid.x` CTAs of `block.x` threads, CTA after CTA (in index order when
// `in_order`, as the GPU starts them: a kernel may rely on it, even under BFX_EMU_SCHED).
inline void launch(unsigned grid, unsigned block, std::function<void()> body, bool in_order = false) {
    Cta& c = cta();
    grid_dim().x = grid;
    block_dim().x = block;
    c.body = std::move(body);
    if (c.threads.size() < block) c.threads.resize(block);
    std::vector<unsigned> ctas, order;
    sched_order(ctas, grid);
    if (in_order)
        for (unsigned i = 0; i < grid; ++i) ctas[i] = i;
    for (unsigned bi = 0; bi < grid; ++bi) {
        const unsigned b = ctas[bi];
        block_idx().x = b;
        ++c.serial;
        c.alive = block;
        c.arrived = 0;
        for (auto& w : c.warps) w.arrived = 0;
#ifndef BFX_EMU_FAST_SWITCH
        static ucontext_t proto;
        static bool have_proto = false;
        if (!have_proto) {  // getcontext costs a system call: once
            getcontext(&proto);
            have_proto = true;
        }
#endif
        for (unsigned t = 0; t < block; ++t) {
            Thread& th = c.threads[t];
            th.tid = t;
            th.done = false;
            th.wait_ptr = nullptr;
            th.stack.resize(STACK);
#ifdef BFX_EMU_FAST_SWITCH
            th.sp = fresh_stack(th);
#else
            th.ctx = proto;
            th.ctx.uc_stack.ss_sp = th.stack.data();
            th.ctx.uc_stack.ss_size = th.stack.size();
            th.ctx.uc_link = &c.sched;
            makecontext(&th.ctx, entry, 0);
#endif
        }
        unsigned idle_rounds = 0;
        while (c.alive > 0) {
            const uint64_t before = c.progress;
            sched_order(order, block);
            for (unsigned ti = 0; ti < block; ++ti) {
                Thread& th = c.threads[order[ti]];
                if (th.done || (th.wait_ptr && *th.wait_ptr == th.wait_val)) continue;
                c.cur = &th;
#ifdef BFX_EMU_FAST_SWITCH
                bfx_emu_switch(&c.sched_sp, th.sp);
#else
                swapcontext(&c.sched, &th.ctx);
#endif
            }
            idle_rounds = c.progress == before ? idle_rounds + 1 : 0;
            if (idle_rounds > 100000) {
                std::fprintf(stderr, "emu: deadlock in CTA %u (a warp collective not reached by all lanes?)\n", b);
                std::exit(3);
            }
        }
    }
}

inline uint32_t pred_mask(const uint64_t* all) {
    uint32_t m = 0;
    for (int i = 0; i < 32; ++i) m |= (all[i] ? 1u : 0u) << i;
    return m;
}

template <class T>
inline uint64_t bits(T v) {
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T>
inline T unbits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

}  // namespace emu

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx())
#define blockDim (::emu::block_dim())
#define gridDim (::emu::grid_dim())
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
// Shared memory poisoned once per CTA, by whichever thread gets there first (a shuffled
// schedule may run any thread's first phase, shared-memory writes included, before thread
// 0 starts: poisoning by thread 0 would erase them).
#define BFX_EMU_POISON(smem)                                           \
    do {                                                               \
        static uint64_t bfx_emu_poisoned = 0;                          \
        if (bfx_emu_poisoned != ::emu::cta().serial) {                 \
            std::memset(&(smem), 0xA5, sizeof(smem));                  \
            bfx_emu_poisoned = ::emu::cta().serial;                    \
        }                                                              \
    } while (0)

inline void emu_yield() { ::emu::yield(); }
// What the GPU would fault on (a misaligned access): the emulator stops with a message, so
// a test sees a fault, not a decoder's rejection.
inline void emu_fault(const char* what) {
    std::fprintf(stderr, "emu: fault: %s\n", what);
    std::exit(4);
}
inline void __syncthreads() { ::emu::syncthreads(); }
inline void __syncwarp(uint32_t = 0xffffffffu) { ::emu::warp_all(0); }
inline void __threadfence() {}
inline void __nanosleep(unsigned) { ::emu::yield(); }
inline uint32_t __ballot_sync(uint32_t, int p) { return ::emu::pred_mask(::emu::warp_all(p != 0)); }
inline uint32_t __ballot_sync(uint32_t m, bool p) { return __ballot_sync(m, (int)p); }
inline uint32_t __ballot_sync(uint32_t m, uint32_t p) { return __ballot_sync(m, (int)(p != 0)); }
inline bool __any_sync(uint32_t, bool p) { return ::emu::pred_mask(::emu::warp_all(p)) != 0; }
template <class T>
inline T __shfl_sync(uint32_t, T v, int src) {
    return ::emu::unbits<T>(::emu::warp_all(::emu::bits(v))[src & 31]);
}
template <class T>
inline T __shfl_xor_sync(uint32_t, T v, int d) {
    const unsigned lane = threadIdx.x % 32;
    return ::emu::unbits<T>(::emu::warp_all(::emu::bits(v))[(lane ^ d) & 31]);
}
template <class T>
inline T __shfl_up_sync(uint32_t, T v, unsigned d) {
    const unsigned lane = threadIdx.x % 32;
    const uint64_t* all = ::emu::warp_all(::emu::bits(v));
    return lane >= d ? ::emu::unbits<T>(all[lane - d]) : v;
}
inline uint32_t __reduce_min_sync(uint32_t, uint32_t v) {
    const uint64_t* all = ::emu::warp_all(v);
    uint32_t m = 0xffffffffu;
    for (int i = 0; i < 32; ++i) m = all[i] < m ? (uint32_t)all[i] : m;
    return m;
}
inline int __popc(uint32_t v) { return __builtin_popcount(v); }
inline int __ffs(uint32_t v) { return __builtin_ffs((int)v); }
inline int __clz(uint32_t v) { return v ? __builtin_clz(v) : 32; }
inline uint32_t __funnelshift_rc(uint32_t lo, uint32_t hi, uint32_t s) {
    return (uint32_t)((((uint64_t)hi << 32) | lo) >> (s < 32 ? s : 32));
}
inline uint32_t __funnelshift_r(uint32_t lo, uint32_t hi, uint32_t s) {
    return (uint32_t)((((uint64_t)hi << 32) | lo) >> (s & 31));
}
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
    const uint64_t t = ((uint64_t)y << 32) | x;
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i) r |= (uint32_t)((t >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
template <class T>
inline T atomicAdd(T* p, T v) {
    T o = *p;
    *p = o + v;
    return o;
}
template <class T>
inline T atomicExch(T* p, T v) {
    T o = *p;
    *p = v;
    return o;
}
template <class T>
inline T atomicCAS(T* p, T cmp, T v) {
    T o = *p;
    if (o == cmp) *p = v;
    return o;
}
