// Verifiable test data: byte i of a buffer filled for `seed` is byte (i & 3) of
// pattern_word(seed, i >> 2). Must match `device::pattern_word` in Rust bit for bit.
// Used by tests and benchmarks only: collectives never launch kernels.
#include <stdint.h>

__device__ __forceinline__ uint32_t hoccl_pattern_word(uint64_t seed, uint64_t w) {
    uint64_t z = (seed * 0x9E3779B97F4A7C15ull) ^ (w + 0x632BE59BD9B4E019ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (uint32_t)(z ^ (z >> 31));
}

// Fills len bytes at dst; dst may have any alignment. Grid-stride over bytes, word-wise
// where aligned would be faster, but this is a test generator, kept simple and exact.
extern "C" __global__ void hoccl_fill_pattern(uint8_t* dst, uint64_t len, uint64_t seed) {
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x * 4;
    for (uint64_t w = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) * 4; w < len; w += stride) {
        uint32_t v = hoccl_pattern_word(seed, w >> 2);
        #pragma unroll
        for (int b = 0; b < 4; ++b) {
            if (w + b < len) dst[w + b] = (uint8_t)(v >> (8 * b));
        }
    }
}
