// How fast can two processes on one GPU exchange data when every copy and flag operation is
// enqueued by the calling thread, and no host thread takes part after the enqueue? The
// measurement behind docs/design.md, "Application threads that wait inside the driver".
//
// Two processes (fork; each opens the GPU itself) run N back-to-back sendrecv iterations of
// `bytes` each way on one user stream each, in one of two modes:
//   staged  each receiver owns a ring of R staging slots (device memory the sender maps
//           through CUDA IPC). Per iteration i, the sender's copy queue waits for the user
//           stream's work (an event), for slot i%R to be free (the receiver's "drained"
//           flag >= i-R), copies into it and raises "staged" := i; the receiver's user
//           stream waits for the peer's "staged" >= i, copies the slot out into its buffer,
//           raises "drained" := i, then waits for its own send (an event of the copy queue).
//   direct  the copy goes straight into the peer's buffer (mapped once), after the peer's
//           user stream raised "started" := i; the receiver's stream waits for "landed" >= i.
// Flags live in a shared-memory segment registered for device access in both processes
// (cuMemHostRegister); the waits and writes are cuStreamWaitValue64 / cuStreamWriteValue64.
// Prints the mean time per iteration (wall time of N iterations after a warm-up, both
// streams synchronized), the enqueue time per iteration, and whether every received byte
// was right. Built by scripts/gpu/build.sh, run by scripts/gpu/driverlock.sh.
//
// A third mode, `calls`, times the driver calls an enqueue is made of, one kind at a time,
// in both processes at once (the contention of a back-to-back sendrecv): per kind the mean
// and median host time of one call over N calls, the stream synchronized every 128 calls
// outside the timed calls. It gives the cost model of an enqueue under MPS: the sum of its
// calls.
//
// usage: callside_probe MODE BYTES [N] [R]
#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define F(name, ...) typedef CUresult (*t_##name)(__VA_ARGS__); static t_##name p_##name;
F(cuInit, unsigned) F(cuDeviceGet, CUdevice*, int) F(cuDevicePrimaryCtxRetain, CUcontext*, CUdevice)
F(cuCtxSetCurrent, CUcontext) F(cuMemAlloc_v2, CUdeviceptr*, size_t) F(cuMemHostRegister_v2, void*, size_t, unsigned)
F(cuMemHostGetDevicePointer_v2, CUdeviceptr*, void*, unsigned) F(cuStreamCreate, CUstream*, unsigned)
F(cuStreamWaitValue64_v2, CUstream, CUdeviceptr, cuuint64_t, unsigned) F(cuStreamWriteValue64_v2, CUstream, CUdeviceptr, cuuint64_t, unsigned)
F(cuEventCreate, CUevent*, unsigned) F(cuEventRecord, CUevent, CUstream) F(cuStreamWaitEvent, CUstream, CUevent, unsigned)
F(cuMemcpyDtoDAsync_v2, CUdeviceptr, CUdeviceptr, size_t, CUstream) F(cuStreamSynchronize, CUstream)
F(cuIpcGetMemHandle, CUipcMemHandle*, CUdeviceptr) F(cuIpcOpenMemHandle_v2, CUdeviceptr*, CUipcMemHandle, unsigned)
F(cuMemsetD8_v2, CUdeviceptr, unsigned char, size_t) F(cuMemcpyDtoH_v2, void*, CUdeviceptr, size_t) F(cuMemcpyHtoD_v2, CUdeviceptr, const void*, size_t)
F(cuGetErrorName, CUresult, const char**)
F(cuCtxGetCurrent, CUcontext*) F(cuPointerGetAttributes, unsigned, CUpointer_attribute*, void**, CUdeviceptr)
F(cuMemGetAddressRange_v2, CUdeviceptr*, size_t*, CUdeviceptr) F(cuStreamIsCapturing, CUstream, CUstreamCaptureStatus*)
F(cuStreamBatchMemOp_v2, CUstream, unsigned, CUstreamBatchMemOpParams*, unsigned)

static void die(const char *what, CUresult r) {
  const char *n = "?";
  if (p_cuGetErrorName) p_cuGetErrorName(r, &n);
  fprintf(stderr, "callside_probe: %s failed: %s\n", what, n);
  exit(3);
}
#define C(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) die(#call, r_); } while (0)

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

// Per process p (0, 1): flags written towards p and by p, each on its own cache line.
struct Side {
  volatile uint64_t staged, pad0[7];   // written by the peer's copy queue: slot i holds data for p
  volatile uint64_t drained, pad1[7];  // written by p's stream: p emptied slot i of its ring
  volatile uint64_t started, pad2[7];  // written by p's stream: p reached iteration i (direct)
  volatile uint64_t landed, pad3[7];   // written by the peer's copy queue: data of i is in p's buffer
};
struct Shared {
  struct Side side[2];
  CUipcMemHandle ring[2], buf[2];
  volatile int ready[2], go, pad;
  double per_iter_us[2], enqueue_us[2];
  int wrong[2];
  double call_mean_us[2][16], call_p50_us[2][16];
};
#define DEV_OF(sh, flags, field) ((flags) + (CUdeviceptr)((char *)&(field) - (char *)(sh)))

static void load(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) { fprintf(stderr, "callside_probe: no libcuda.so.1\n"); exit(2); }
#define L(name) p_##name = (t_##name)dlsym(lib, #name); if (!p_##name) { fprintf(stderr, "no %s\n", #name); exit(2); }
  L(cuInit) L(cuDeviceGet) L(cuDevicePrimaryCtxRetain) L(cuCtxSetCurrent) L(cuMemAlloc_v2) L(cuMemHostRegister_v2)
  L(cuMemHostGetDevicePointer_v2) L(cuStreamCreate) L(cuStreamWaitValue64_v2) L(cuStreamWriteValue64_v2) L(cuEventCreate)
  L(cuEventRecord) L(cuStreamWaitEvent) L(cuMemcpyDtoDAsync_v2) L(cuStreamSynchronize) L(cuIpcGetMemHandle)
  L(cuIpcOpenMemHandle_v2) L(cuMemsetD8_v2) L(cuMemcpyDtoH_v2) L(cuMemcpyHtoD_v2) L(cuGetErrorName)
  L(cuCtxGetCurrent) L(cuPointerGetAttributes) L(cuMemGetAddressRange_v2) L(cuStreamIsCapturing) L(cuStreamBatchMemOp_v2)
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

// The `calls` mode: each kind of call the enqueue of an op makes, timed alone, N times.
enum { KINDS = 13 };
static const char *kind_name[KINDS] = {
  "cuCtxGetCurrent", "cuPointerGetAttributes x3", "cuPointerGetAttributes x5", "cuMemGetAddressRange",
  "cuStreamIsCapturing", "cuStreamWriteValue64", "cuStreamWaitValue64 (met)", "cuStreamBatchMemOp 2 ops",
  "cuStreamBatchMemOp 3 ops", "cuMemcpyDtoDAsync 4 KiB", "cuMemcpyDtoDAsync 1 MiB", "cuEventRecord", "cuStreamWaitEvent",
};
static void calls(struct Shared *sh, int me, int n) {
  CUdevice dev; CUcontext ctx;
  C(p_cuInit(0)); C(p_cuDeviceGet(&dev, 0)); C(p_cuDevicePrimaryCtxRetain(&ctx, dev)); C(p_cuCtxSetCurrent(ctx));
  C(p_cuMemHostRegister_v2((void *)sh, (sizeof *sh + 4095) / 4096 * 4096, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE));
  CUdeviceptr flags; C(p_cuMemHostGetDevicePointer_v2(&flags, (void *)sh, 0));
  CUdeviceptr a, b;
  C(p_cuMemAlloc_v2(&a, 1 << 20)); C(p_cuMemAlloc_v2(&b, 1 << 20));
  CUstream s; C(p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUstream s2; C(p_cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
  CUevent ev; C(p_cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  struct Side *mine = &sh->side[me];
  CUdeviceptr w = DEV_OF(sh, flags, mine->started), wt = DEV_OF(sh, flags, mine->landed);
  double *d = malloc(sizeof(double) * n);
  for (int k = 0; k < KINDS; ++k) {
    __atomic_add_fetch(&sh->go, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&sh->go, __ATOMIC_SEQ_CST) < 2 * (k + 1)) {}
    for (int i = 0; i < n + 64; ++i) {
      if (i % 128 == 0) { C(p_cuStreamSynchronize(s)); C(p_cuStreamSynchronize(s2)); }
      CUpointer_attribute at[5] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                   CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE};
      uint64_t v[5] = {0}; void *vp[5] = {&v[0], &v[1], &v[2], &v[3], &v[4]};
      CUstreamBatchMemOpParams ops[3];
      memset(ops, 0, sizeof ops);
      ops[0].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64; ops[0].writeValue.address = w; ops[0].writeValue.value64 = (cuuint64_t)i;
      ops[1].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64; ops[1].waitValue.address = w; ops[1].waitValue.value64 = 0;
      ops[1].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
      ops[2].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64; ops[2].waitValue.address = wt; ops[2].waitValue.value64 = 0;
      ops[2].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
      CUcontext cur; CUdeviceptr base; size_t len; CUstreamCaptureStatus cs;
      double t0 = now();
      switch (k) {
        case 0: C(p_cuCtxGetCurrent(&cur)); break;
        case 1: C(p_cuPointerGetAttributes(3, at, vp, a + 4096)); break;
        case 2: C(p_cuPointerGetAttributes(5, at, vp, a + 4096)); break;
        case 3: C(p_cuMemGetAddressRange_v2(&base, &len, a + 4096)); break;
        case 4: C(p_cuStreamIsCapturing(s, &cs)); break;
        case 5: C(p_cuStreamWriteValue64_v2(s, w, (cuuint64_t)i, 0)); break;
        case 6: C(p_cuStreamWaitValue64_v2(s, wt, 0, CU_STREAM_WAIT_VALUE_GEQ)); break;
        case 7: C(p_cuStreamBatchMemOp_v2(s, 2, ops, 0)); break;
        case 8: C(p_cuStreamBatchMemOp_v2(s, 3, ops, 0)); break;
        case 9: C(p_cuMemcpyDtoDAsync_v2(b, a, 4096, s)); break;
        case 10: C(p_cuMemcpyDtoDAsync_v2(b, a, 1 << 20, s)); break;
        case 11: C(p_cuEventRecord(ev, s)); break;
        case 12: C(p_cuStreamWaitEvent(s2, ev, 0)); break;
      }
      double t = now() - t0;
      if (i >= 64) d[i - 64] = t;
    }
    C(p_cuStreamSynchronize(s)); C(p_cuStreamSynchronize(s2));
    double sum = 0;
    for (int i = 0; i < n; ++i) sum += d[i];
    qsort(d, n, sizeof *d, cmp_double);
    sh->call_mean_us[me][k] = sum / n * 1e6; sh->call_p50_us[me][k] = d[n / 2] * 1e6;
  }
  free(d);
}

static void run(struct Shared *sh, int me, int staged, size_t bytes, int n, int R) {
  int peer = 1 - me;
  CUdevice dev; CUcontext ctx;
  C(p_cuInit(0)); C(p_cuDeviceGet(&dev, 0)); C(p_cuDevicePrimaryCtxRetain(&ctx, dev)); C(p_cuCtxSetCurrent(ctx));
  C(p_cuMemHostRegister_v2((void *)sh, (sizeof *sh + 4095) / 4096 * 4096, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE));
  CUdeviceptr flags; C(p_cuMemHostGetDevicePointer_v2(&flags, (void *)sh, 0));
#define DEV(field) (flags + (CUdeviceptr)((char *)&(field) - (char *)sh))
  CUdeviceptr ring, send, recv;
  C(p_cuMemAlloc_v2(&ring, bytes * R)); C(p_cuMemAlloc_v2(&send, bytes)); C(p_cuMemAlloc_v2(&recv, bytes));
  C(p_cuIpcGetMemHandle(&sh->ring[me], ring)); C(p_cuIpcGetMemHandle(&sh->buf[me], recv));
  __atomic_store_n(&sh->ready[me], 1, __ATOMIC_SEQ_CST);
  while (!__atomic_load_n(&sh->ready[peer], __ATOMIC_SEQ_CST)) usleep(100);
  CUdeviceptr peer_ring, peer_recv;
  C(p_cuIpcOpenMemHandle_v2(&peer_ring, sh->ring[peer], CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  C(p_cuIpcOpenMemHandle_v2(&peer_recv, sh->buf[peer], CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  unsigned char *h = malloc(bytes);
  for (size_t k = 0; k < bytes; ++k) h[k] = (unsigned char)(k * 7 + me * 13 + 1);
  C(p_cuMemcpyHtoD_v2(send, h, bytes));
  CUstream user, q;
  C(p_cuStreamCreate(&user, CU_STREAM_NON_BLOCKING)); C(p_cuStreamCreate(&q, CU_STREAM_NON_BLOCKING));
  CUevent ev_user, ev_sent;
  C(p_cuEventCreate(&ev_user, CU_EVENT_DISABLE_TIMING)); C(p_cuEventCreate(&ev_sent, CU_EVENT_DISABLE_TIMING));
  struct Side *mine = &sh->side[me], *theirs = &sh->side[peer];
  int warm = n / 10 + 10;
  double t0 = 0, enq = 0;
  for (int i = 1; i <= warm + n; ++i) {
    if (i == warm + 1) {
      C(p_cuStreamSynchronize(user)); C(p_cuStreamSynchronize(q));
      __atomic_add_fetch(&sh->go, 1, __ATOMIC_SEQ_CST);
      while (__atomic_load_n(&sh->go, __ATOMIC_SEQ_CST) < 2) {}
      t0 = now(); enq = 0;
    }
    double e0 = now();
    if (staged) {
      int slot = (i - 1) % R;
      C(p_cuEventRecord(ev_user, user));
      C(p_cuStreamWaitEvent(q, ev_user, 0));
      if (i > R) C(p_cuStreamWaitValue64_v2(q, DEV(theirs->drained), (cuuint64_t)(i - R), CU_STREAM_WAIT_VALUE_GEQ));
      C(p_cuMemcpyDtoDAsync_v2(peer_ring + (CUdeviceptr)slot * bytes, send, bytes, q));
      C(p_cuStreamWriteValue64_v2(q, DEV(theirs->staged), (cuuint64_t)i, 0));
      C(p_cuEventRecord(ev_sent, q));
      C(p_cuStreamWaitValue64_v2(user, DEV(mine->staged), (cuuint64_t)i, CU_STREAM_WAIT_VALUE_GEQ));
      C(p_cuMemcpyDtoDAsync_v2(recv, ring + (CUdeviceptr)slot * bytes, bytes, user));
      C(p_cuStreamWriteValue64_v2(user, DEV(mine->drained), (cuuint64_t)i, 0));
      C(p_cuStreamWaitEvent(user, ev_sent, 0));
    } else {
      // The peer's buffer is overwritten by iteration i only after its stream reached i, which
      // comes after its stream consumed iteration i-1 (here: nothing reads it in between).
      C(p_cuStreamWriteValue64_v2(user, DEV(mine->started), (cuuint64_t)i, 0));
      C(p_cuEventRecord(ev_user, user));
      C(p_cuStreamWaitEvent(q, ev_user, 0));
      C(p_cuStreamWaitValue64_v2(q, DEV(theirs->started), (cuuint64_t)i, CU_STREAM_WAIT_VALUE_GEQ));
      C(p_cuMemcpyDtoDAsync_v2(peer_recv, send, bytes, q));
      C(p_cuStreamWriteValue64_v2(q, DEV(theirs->landed), (cuuint64_t)i, 0));
      C(p_cuEventRecord(ev_sent, q));
      C(p_cuStreamWaitValue64_v2(user, DEV(mine->landed), (cuuint64_t)i, CU_STREAM_WAIT_VALUE_GEQ));
      C(p_cuStreamWaitEvent(user, ev_sent, 0));
    }
    enq += now() - e0;
  }
  C(p_cuStreamSynchronize(user)); C(p_cuStreamSynchronize(q));
  double t = now() - t0;
  C(p_cuMemcpyDtoH_v2(h, recv, bytes));
  int wrong = 0;
  for (size_t k = 0; k < bytes; ++k) wrong += h[k] != (unsigned char)(k * 7 + peer * 13 + 1);
  sh->per_iter_us[me] = t / n * 1e6; sh->enqueue_us[me] = enq / n * 1e6; sh->wrong[me] = wrong;
}

int main(int argc, char **argv) {
  if (argc < 3) { fprintf(stderr, "usage: callside_probe staged|direct|calls BYTES [N] [R]\n"); return 2; }
  int staged = !strcmp(argv[1], "staged"), only_calls = !strcmp(argv[1], "calls");
  size_t bytes = strtoull(argv[2], 0, 0);
  int n = argc > 3 ? atoi(argv[3]) : 2000, R = argc > 4 ? atoi(argv[4]) : 4;
  load();
  struct Shared *sh = mmap(0, (sizeof(struct Shared) + 4095) / 4096 * 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (sh == MAP_FAILED) { perror("mmap"); return 2; }
  memset(sh, 0, sizeof *sh);
  pid_t child = fork();
  if (child == 0) {
    if (only_calls) calls(sh, 1, n); else run(sh, 1, staged, bytes, n, R);
    _exit(0);
  }
  if (only_calls) calls(sh, 0, n); else run(sh, 0, staged, bytes, n, R);
  int st = 0; waitpid(child, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) { fprintf(stderr, "callside_probe: the second process failed\n"); return 1; }
  if (only_calls) {
    printf("driver calls, 2 processes timing the same kind at once, %d calls each (us per call: mean / p50, process 0; process 1)\n", n);
    for (int k = 0; k < KINDS; ++k)
      printf("  %-28s %7.2f / %6.2f ; %7.2f / %6.2f\n", kind_name[k], sh->call_mean_us[0][k], sh->call_p50_us[0][k],
             sh->call_mean_us[1][k], sh->call_p50_us[1][k]);
    return 0;
  }
  printf("%-6s %9zu B x %d (ring %d): %8.2f us per sendrecv (rank 0; rank 1 %.2f), %5.2f GB/s each way, enqueue %.2f us, wrong bytes %d/%d\n",
         argv[1], bytes, n, R, sh->per_iter_us[0], sh->per_iter_us[1], bytes / sh->per_iter_us[0] / 1e3, sh->enqueue_us[0],
         sh->wrong[0], sh->wrong[1]);
  return sh->wrong[0] || sh->wrong[1];
}
