// Which CUDA driver calls of one thread block while another thread of the same process sits
// in a call that waits for GPU work? The answer decides what hoccl's proxy may do after a
// collective's enqueuing call has returned (docs/design.md, "Application threads that wait
// inside the driver").
//
// Thread A (main) makes GPU work wait for a host flag (a stream waits for it; the legacy stream
// waits for that stream through an event), then enters a call that waits for that work:
//   dtoh        cuMemcpyDtoH into pageable memory (what torch's .item()/.cpu() do)
//   dtoh-async  cuMemcpyDtoHAsync into pageable memory on the legacy stream + cuStreamSynchronize
//   ctxsync     cuCtxSynchronize
//   streamsync  cuStreamSynchronize of the waiting stream
//   free        cuMemFree of an unrelated allocation
// Thread B, 200 ms later, makes the calls a proxy makes (event create/record/query, an async
// copy on a non-blocking stream, cuStreamWriteValue32 that releases A), in A's context, or with
// a second argument in a context of its own (cuCtxCreate), copying to and from A's context with
// cuMemcpyPeerAsync. A watchdog releases A from the host after 3 s and names the call B was
// stuck in. Built and run by scripts/gpu/driverlock.sh (needs only cuda.h and libcuda.so.1).
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#define F(name, ...) typedef CUresult (*t_##name)(__VA_ARGS__); static t_##name p_##name;
F(cuInit, unsigned) F(cuDeviceGet, CUdevice*, int) F(cuDevicePrimaryCtxRetain, CUcontext*, CUdevice)
F(cuCtxSetCurrent, CUcontext) F(cuMemAlloc_v2, CUdeviceptr*, size_t) F(cuMemHostAlloc, void**, size_t, unsigned)
F(cuMemHostGetDevicePointer_v2, CUdeviceptr*, void*, unsigned) F(cuStreamCreate, CUstream*, unsigned)
F(cuStreamWaitValue32_v2, CUstream, CUdeviceptr, cuuint32_t, unsigned) F(cuEventCreate, CUevent*, unsigned)
F(cuEventRecord, CUevent, CUstream) F(cuStreamWaitEvent, CUstream, CUevent, unsigned)
F(cuMemcpyDtoH_v2, void*, CUdeviceptr, size_t) F(cuMemcpyDtoHAsync_v2, void*, CUdeviceptr, size_t, CUstream)
F(cuCtxSynchronize, void) F(cuStreamSynchronize, CUstream) F(cuMemcpyDtoDAsync_v2, CUdeviceptr, CUdeviceptr, size_t, CUstream)
F(cuEventQuery, CUevent) F(cuIpcGetMemHandle, CUipcMemHandle*, CUdeviceptr) F(cuStreamWriteValue32_v2, CUstream, CUdeviceptr, cuuint32_t, unsigned)
F(cuMemFree_v2, CUdeviceptr) F(cuCtxCreate_v2, CUcontext*, unsigned, CUdevice) F(cuMemcpyPeerAsync, CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream) F(cuCtxPushCurrent_v2, CUcontext) F(cuCtxPopCurrent_v2, CUcontext*)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static CUcontext ctx, ctx2; static CUdeviceptr e1; static CUstream s3; static int use2; static CUdeviceptr d1, d2, d3, flagd; static volatile unsigned *flag; static CUstream s1, s2;
static volatile const char *where = "start"; static volatile int done;
static void *second(void *arg) {
  (void)arg; p_cuCtxSetCurrent(use2 ? ctx2 : ctx); usleep(200000);
  double t = now(); CUevent e2; where = "cuEventCreate"; CUresult r = p_cuEventCreate(&e2, CU_EVENT_DISABLE_TIMING); printf("  B cuEventCreate %d %.1f us\n", r, (now() - t) * 1e6);
  if (use2) { where = "cuMemcpyPeerAsync"; t = now(); r = p_cuMemcpyPeerAsync(e1, ctx2, d1, ctx, 1 << 20, s3); printf("  B cuMemcpyPeerAsync (primary->ctx2) %d %.1f us\n", r, (now() - t) * 1e6);
              where = "cuMemcpyPeerAsync back"; t = now(); r = p_cuMemcpyPeerAsync(d2, ctx, e1, ctx2, 1 << 20, s3); printf("  B cuMemcpyPeerAsync (ctx2->primary) %d %.1f us\n", r, (now() - t) * 1e6);
              where = "cuEventRecord"; r = p_cuEventRecord(e2, s3); }
  else { where = "cuMemcpyDtoDAsync"; t = now(); r = p_cuMemcpyDtoDAsync_v2(d2, d1, 1 << 20, s2); printf("  B cuMemcpyDtoDAsync %d %.1f us\n", r, (now() - t) * 1e6);
         where = "cuEventRecord"; r = p_cuEventRecord(e2, s2); }
  where = "cuEventQuery loop"; t = now(); while ((r = p_cuEventQuery(e2)) == CUDA_ERROR_NOT_READY) {} printf("  B copy complete %d %.1f us\n", r, (now() - t) * 1e6);
  where = "cuStreamWriteValue32"; t = now(); r = p_cuStreamWriteValue32_v2(use2 ? s3 : s2, flagd, 1, 0); printf("  B cuStreamWriteValue32 (release) %d %.1f us\n", r, (now() - t) * 1e6);
  where = "released"; done = 1; return 0;
}
static void *watchdog(void *arg) {
  (void)arg; double t = now();
  while (!done && now() - t < 3.0) usleep(1000);
  if (!done) { printf("  BLOCKED: B stuck in %s after 3 s; releasing from the host\n", where); fflush(stdout); *flag = 1; }
  return 0;
}
int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "dtoh"; use2 = argc > 2;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW); if (!lib) { printf("no libcuda\n"); return 2; }
#define L(name) p_##name = (t_##name)dlsym(lib, #name); if (!p_##name) { printf("no %s\n", #name); return 2; }
  L(cuInit) L(cuDeviceGet) L(cuDevicePrimaryCtxRetain) L(cuCtxSetCurrent) L(cuMemAlloc_v2) L(cuMemHostAlloc)
  L(cuMemHostGetDevicePointer_v2) L(cuStreamCreate) L(cuStreamWaitValue32_v2) L(cuEventCreate) L(cuEventRecord)
  L(cuStreamWaitEvent) L(cuMemcpyDtoH_v2) L(cuMemcpyDtoHAsync_v2) L(cuCtxSynchronize) L(cuStreamSynchronize)
  L(cuMemcpyDtoDAsync_v2) L(cuEventQuery) L(cuIpcGetMemHandle) L(cuStreamWriteValue32_v2) L(cuMemFree_v2) L(cuCtxCreate_v2) L(cuMemcpyPeerAsync) L(cuCtxPushCurrent_v2) L(cuCtxPopCurrent_v2)
  CUdevice dev; p_cuInit(0); p_cuDeviceGet(&dev, 0); p_cuDevicePrimaryCtxRetain(&ctx, dev); p_cuCtxSetCurrent(ctx);
  p_cuMemAlloc_v2(&d1, 1 << 20); p_cuMemAlloc_v2(&d2, 1 << 20); p_cuMemAlloc_v2(&d3, 1 << 20);
  p_cuMemHostAlloc((void **)&flag, 4096, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE); *flag = 0;
  p_cuMemHostGetDevicePointer_v2(&flagd, (void *)flag, 0);
  p_cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING); p_cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING);
  if (use2) { CUcontext prev; CUresult rc = p_cuCtxCreate_v2(&ctx2, 0, dev); printf("ctx2 create %d\n", rc); p_cuMemAlloc_v2(&e1, 1 << 20); p_cuStreamCreate(&s3, CU_STREAM_NON_BLOCKING); p_cuCtxPopCurrent_v2(&prev); p_cuCtxSetCurrent(ctx); }
  CUevent e; p_cuEventCreate(&e, CU_EVENT_DISABLE_TIMING);
  p_cuStreamWaitValue32_v2(s1, flagd, 1, CU_STREAM_WAIT_VALUE_GEQ); p_cuEventRecord(e, s1);
  pthread_t b, w; pthread_create(&b, 0, second, 0); pthread_create(&w, 0, watchdog, 0);
  char host[64]; double t = now(); CUresult r = CUDA_SUCCESS;
  if (!strcmp(mode, "dtoh")) { p_cuStreamWaitEvent(0, e, 0); r = p_cuMemcpyDtoH_v2(host, d1, 64); }
  else if (!strcmp(mode, "dtoh-async")) { p_cuStreamWaitEvent(0, e, 0); r = p_cuMemcpyDtoHAsync_v2(host, d1, 64, 0); p_cuStreamSynchronize(0); }
  else if (!strcmp(mode, "ctxsync")) { p_cuStreamWaitEvent(0, e, 0); r = p_cuCtxSynchronize(); }
  else if (!strcmp(mode, "streamsync")) { r = p_cuStreamSynchronize(s1); }
  else if (!strcmp(mode, "free")) { p_cuStreamWaitEvent(0, e, 0); r = p_cuMemFree_v2(d3); }
  printf("%s: A's blocking call returned %d after %.1f ms\n", mode, r, (now() - t) * 1e3);
  pthread_join(b, 0); pthread_join(w, 0); fflush(stdout); return 0;
}
