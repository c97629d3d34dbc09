/* The CUDA stream type, declared without the CUDA headers. CUDA's `CUstream` (driver API)
 * and `cudaStream_t` (runtime API) are both `struct CUstream_st *`, so a stream from either
 * passes to hoccl unchanged, and a program that never includes CUDA can still name it.
 * On the host backend (no GPU) the value is an opaque id from hoccl's own stream helpers;
 * NULL is the default stream on both backends. Valid C and C++. */
#ifndef HOCCL_CUDA_STREAM_H_
#define HOCCL_CUDA_STREAM_H_

struct CUstream_st;

#endif /* HOCCL_CUDA_STREAM_H_ */
