/* hoccl's libnccl.so.2 through NCCL's C API (include/hoccl-nccl/nccl.h), from C, without MPI:
 * the program forks its ranks before any library call and rank 0 hands them the unique id
 * through pipes (ctest/spawn_ranks.h).   nccl_check NRANKS [STREAM]
 *
 * Checked against values computed here: the unique-id bootstrap and a refused wrong secret
 * (bounded time, message in ncclGetLastError); InitRank, InitRankConfig (blocking 1 and 0,
 * ids carried by ncclBroadcast), InitAll, Split (two colors, and NCCL_SPLIT_NOCOLOR),
 * Count/CuDevice/UserRank, GetVersion, GetErrorString; AllReduce (sum, prod, max, min, avg
 * on float, int32, bf16), ReduceScatter, Reduce, AllGather, Broadcast, Bcast, Send/Recv in
 * groups, AlltoAll, Gather, Scatter; MemAlloc/MemFree, CommRegister/Deregister and window
 * registration, RedOpCreatePreMulSum (host and device scalars)/RedOpDestroy; Finalize, Abort,
 * GetAsyncError, Revoke (a pending Recv released, then the calls NCCL allows and refuses);
 * and error paths: NULL communicator, bad data type, operator, root and
 * peer, a count that overflows, a refused function. Exits non-zero on any failure.
 *
 * Buffers come from ncclMemAlloc. On CUDA (libcuda.so.1 loads and HOCCL_BACKEND is not
 * "host") they are GPU memory, copied with the driver's cuMemcpy and waited for with
 * cuCtxSynchronize; rank r uses GPU r mod the GPU count. On the host backend they are host
 * memory, and work on the default stream is waited for with ncclCommFinalize (which on
 * hoccl's host backend also drains the default stream). STREAM picks the stream of every
 * collective on CUDA: "created" (the default: a non-blocking stream made here), "null"
 * (stream 0, the legacy default stream), "legacy" (cudaStreamLegacy) or "per-thread"
 * (cudaStreamPerThread); the host backend has stream 0 only, whatever STREAM says. The
 * sections that drive several ranks from this thread give each its own created stream:
 * two ranks on one default stream would wait for each other. Also: creation inside a group
 * (InitRank and Split deferred to GroupEnd, collectives kept for them, a failing group). */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nccl.h"
#include "spawn_ranks.h"

/* Where hoccl's TCP bootstrap keeps the secret in the id (src/bootstrap/tcp.rs). */
#define SECRET_AT 24
#define SECRET_LEN 16

static int g_rank, g_n, g_failures, g_checks;
/* The stream of every collective: NULL (stream 0) on the host backend; on CUDA as STREAM says. */
static cudaStream_t g_stream = NULL;
static const char* g_stream_mode = "created";

static void expect(int ok, const char* what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    fprintf(stderr, "nccl_check: rank %d: FAILED: %s (last error: %s)\n", g_rank, what, ncclGetLastError(NULL));
  }
}

static void expect_rc(ncclResult_t got, ncclResult_t want, const char* what) {
  char msg[320];
  snprintf(msg, sizeof msg, "%s: %d (%s), expected %d (%s)", what, (int)got, ncclGetErrorString(got), (int)want,
           ncclGetErrorString(want));
  expect(got == want, msg);
}

/* A refused call: the code, and a non-empty message in ncclGetLastError. */
static void expect_refused(ncclResult_t got, ncclResult_t want, const char* what) {
  expect_rc(got, want, what);
  const char* last = ncclGetLastError(NULL);
  char msg[320];
  snprintf(msg, sizeof msg, "%s: ncclGetLastError is empty", what);
  expect(last != NULL && last[0] != '\0', msg);
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------- device shim ---------- */

typedef int CUresult;
static struct {
  int cuda;
  CUresult (*init)(unsigned);
  CUresult (*count)(int*);
  CUresult (*get)(int*, int);
  CUresult (*retain)(void**, int);
  CUresult (*set_current)(void*);
  CUresult (*htod)(unsigned long long, const void*, size_t);
  CUresult (*dtoh)(void*, unsigned long long, size_t);
  CUresult (*sync)(void);
  CUresult (*stream_create)(cudaStream_t*, unsigned);
  int ordinal;
} cu;

static void* sym(void* lib, const char* name) {
  void* p = dlsym(lib, name);
  if (p == NULL) fprintf(stderr, "nccl_check: libcuda lacks %s\n", name);
  return p;
}

/* CUDA when libcuda works (unless HOCCL_BACKEND=host), else the host backend. */
static int device_init(int rank) {
  const char* backend = getenv("HOCCL_BACKEND");
  if (backend != NULL && strcmp(backend, "host") == 0) return 0;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  int want_cuda = backend != NULL && strcmp(backend, "cuda") == 0;
  if (lib == NULL) return want_cuda ? -1 : 0;
  *(void**)&cu.init = sym(lib, "cuInit");
  *(void**)&cu.count = sym(lib, "cuDeviceGetCount");
  *(void**)&cu.get = sym(lib, "cuDeviceGet");
  *(void**)&cu.retain = sym(lib, "cuDevicePrimaryCtxRetain");
  *(void**)&cu.set_current = sym(lib, "cuCtxSetCurrent");
  *(void**)&cu.htod = sym(lib, "cuMemcpyHtoD_v2");
  *(void**)&cu.dtoh = sym(lib, "cuMemcpyDtoH_v2");
  *(void**)&cu.sync = sym(lib, "cuCtxSynchronize");
  *(void**)&cu.stream_create = sym(lib, "cuStreamCreate");
  if (!cu.init || !cu.count || !cu.get || !cu.retain || !cu.set_current || !cu.htod || !cu.dtoh || !cu.sync ||
      !cu.stream_create)
    return -1;
  int n = 0, dev = 0;
  void* ctx = NULL;
  if (cu.init(0) != 0 || cu.count(&n) != 0 || n == 0) return want_cuda ? -1 : 0;
  cu.ordinal = rank % n;
  if (cu.get(&dev, cu.ordinal) != 0 || cu.retain(&ctx, dev) != 0 || cu.set_current(ctx) != 0) return -1;
  cu.cuda = 1;
  return 0;
}

static void* dalloc(size_t bytes) {
  void* p = NULL;
  expect_rc(ncclMemAlloc(&p, bytes), ncclSuccess, "ncclMemAlloc");
  return p;
}

static void dfree(void* p) { expect_rc(ncclMemFree(p), ncclSuccess, "ncclMemFree"); }

/* Synchronous: on CUDA a copy from pageable memory may return before its DMA landed, so the
 * context is synchronized after it (collectives on other streams must see the data). */
static void upload(void* dst, const void* src, size_t n) {
  if (n == 0) return;
  if (cu.cuda)
    expect(cu.htod((unsigned long long)(uintptr_t)dst, src, n) == 0 && cu.sync() == 0, "cuMemcpyHtoD");
  else
    memcpy(dst, src, n);
}

static void download(void* dst, const void* src, size_t n) {
  if (n == 0) return;
  if (cu.cuda)
    expect(cu.dtoh(dst, (unsigned long long)(uintptr_t)src, n) == 0, "cuMemcpyDtoH");
  else
    memcpy(dst, src, n);
}

/* Wait for every operation issued on `comm` (stream 0). */
static void wait_for(ncclComm_t comm) {
  if (cu.cuda)
    expect(cu.sync() == 0, "cuCtxSynchronize");
  else
    expect_rc(ncclCommFinalize(comm), ncclSuccess, "ncclCommFinalize (waiting on the host backend)");
}

/* ---------------------------------------------------------------- values --------------- */

/* Element i of rank r's input for salt s: small integers (-2..2), so sums, products,
 * max/min of up to 16 ranks are exact in every type used here. */
static int ival(int r, size_t i, int s) { return (int)((i * 7 + (size_t)r * 13 + (size_t)s * 5) % 5) - 2; }

static uint16_t bf16_of(float f) { /* round to nearest even; the values here are exact */
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}
static float f_of_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static size_t tsize(ncclDataType_t t) { return t == ncclBfloat16 ? 2 : 4; }

/* Rank r's n elements of type t (float, int32 or bf16) at salt s into host memory. */
static void fill(void* host, ncclDataType_t t, int r, size_t n, size_t from, int s) {
  for (size_t i = 0; i < n; ++i) {
    int v = ival(r, from + i, s);
    if (t == ncclFloat32)
      ((float*)host)[i] = (float)v;
    else if (t == ncclInt32)
      ((int32_t*)host)[i] = v;
    else
      ((uint16_t*)host)[i] = bf16_of((float)v);
  }
}

static double elem(const void* host, ncclDataType_t t, size_t i) {
  if (t == ncclFloat32) return ((const float*)host)[i];
  if (t == ncclInt32) return ((const int32_t*)host)[i];
  return f_of_bf16(((const uint16_t*)host)[i]);
}

/* The reduction of element i over ranks 0..n-1 in rank order, as hoccl defines it: exact
 * for these values, except avg: the sum divided by n, in f32 for floats (then rounded to
 * bf16), truncated for integers. */
static double reduced(ncclDataType_t t, ncclRedOp_t op, int n, size_t i, int s) {
  double acc = ival(0, i, s);
  for (int r = 1; r < n; ++r) {
    double v = ival(r, i, s);
    if (op == ncclSum || op == ncclAvg) acc += v;
    else if (op == ncclProd) acc *= v;
    else if (op == ncclMax) acc = v > acc ? v : acc;
    else acc = v < acc ? v : acc;
  }
  if (op != ncclAvg) return acc;
  if (t == ncclInt32) return (double)((int32_t)acc / n);
  float q = (float)acc / (float)n;
  return t == ncclBfloat16 ? f_of_bf16(bf16_of(q)) : q;
}

/* ---------------------------------------------------------------- collectives ---------- */

struct Bufs {
  void *a, *b; /* device, `bytes` each */
  void* h;     /* host, `bytes` */
  size_t bytes;
};

static const char* tname(ncclDataType_t t) { return t == ncclFloat32 ? "float" : t == ncclInt32 ? "int32" : "bf16"; }
static const char* oname(ncclRedOp_t o) {
  static const char* n[] = {"sum", "prod", "max", "min", "avg"};
  return (int)o >= 0 && (int)o < 5 ? n[o] : "?";
}

static void all_reduce(ncclComm_t comm, struct Bufs* b, size_t count) {
  const ncclDataType_t types[] = {ncclFloat32, ncclInt32, ncclBfloat16};
  for (int ti = 0; ti < 3; ++ti) {
    for (int op = ncclSum; op <= ncclAvg; ++op) {
      ncclDataType_t t = types[ti];
      int in_place = (op + ti) % 2;
      char what[128];
      fill(b->h, t, g_rank, count, 0, op + 10 * ti);
      upload(b->a, b->h, count * tsize(t));
      void* out = in_place ? b->a : b->b;
      snprintf(what, sizeof what, "AllReduce %s %s count %zu%s", oname((ncclRedOp_t)op), tname(t), count,
               in_place ? " in place" : "");
      expect_rc(ncclAllReduce(b->a, out, count, t, (ncclRedOp_t)op, comm, g_stream), ncclSuccess, what);
      wait_for(comm);
      download(b->h, out, count * tsize(t));
      size_t bad = 0;
      for (size_t i = 0; i < count; ++i) bad += elem(b->h, t, i) != reduced(t, (ncclRedOp_t)op, g_n, i, op + 10 * ti);
      expect(bad == 0, what);
    }
  }
}

static void reduce_scatter_and_reduce(ncclComm_t comm, struct Bufs* b, size_t count) {
  /* ReduceScatter (sum, int32): block r of every rank's n * count input, reduced, to rank r. */
  fill(b->h, ncclInt32, g_rank, count * g_n, 0, 31);
  upload(b->a, b->h, count * g_n * 4);
  expect_rc(ncclReduceScatter(b->a, b->b, count, ncclInt32, ncclSum, comm, g_stream), ncclSuccess, "ReduceScatter");
  wait_for(comm);
  download(b->h, b->b, count * 4);
  size_t bad = 0;
  for (size_t i = 0; i < count; ++i)
    bad += ((int32_t*)b->h)[i] != (int32_t)reduced(ncclInt32, ncclSum, g_n, (size_t)g_rank * count + i, 31);
  expect(bad == 0, "ReduceScatter sum int32: wrong elements");

  /* Reduce (max, float) to every root. */
  for (int root = 0; root < g_n; ++root) {
    fill(b->h, ncclFloat32, g_rank, count, 0, 40 + root);
    upload(b->a, b->h, count * 4);
    expect_rc(ncclReduce(b->a, b->b, count, ncclFloat32, ncclMax, root, comm, g_stream), ncclSuccess, "Reduce");
    wait_for(comm);
    if (g_rank != root) continue;
    download(b->h, b->b, count * 4);
    bad = 0;
    for (size_t i = 0; i < count; ++i) bad += ((float*)b->h)[i] != (float)reduced(ncclFloat32, ncclMax, g_n, i, 40 + root);
    expect(bad == 0, "Reduce max float at the root: wrong elements");
  }
}

static void movement(ncclComm_t comm, struct Bufs* b, size_t count) {
  const size_t len = count * 4;
  size_t bad = 0;
  /* AllGather (float), out of place. */
  fill(b->h, ncclFloat32, g_rank, count, 0, 50);
  upload(b->a, b->h, len);
  expect_rc(ncclAllGather(b->a, b->b, count, ncclFloat32, comm, g_stream), ncclSuccess, "AllGather");
  wait_for(comm);
  download(b->h, b->b, len * g_n);
  for (int p = 0; p < g_n; ++p)
    for (size_t i = 0; i < count; ++i) bad += ((float*)b->h)[p * count + i] != (float)ival(p, i, 50);
  expect(bad == 0, "AllGather: wrong elements");

  /* AlltoAll (int32): block j of rank r's input goes to rank j. */
  for (int p = 0; p < g_n; ++p) fill((int32_t*)b->h + p * count, ncclInt32, g_rank, count, (size_t)p * count, 60);
  upload(b->a, b->h, len * g_n);
  expect_rc(ncclAlltoAll(b->a, b->b, count, ncclInt32, comm, g_stream), ncclSuccess, "AlltoAll");
  wait_for(comm);
  download(b->h, b->b, len * g_n);
  bad = 0;
  for (int p = 0; p < g_n; ++p)
    for (size_t i = 0; i < count; ++i) bad += ((int32_t*)b->h)[p * count + i] != ival(p, (size_t)g_rank * count + i, 60);
  expect(bad == 0, "AlltoAll: wrong elements");

  for (int root = 0; root < g_n; ++root) {
    /* Broadcast (out of place) and Bcast (in place). */
    fill(b->h, ncclInt32, root, count, 0, 70 + root);
    if (g_rank == root) upload(b->a, b->h, len);
    expect_rc(ncclBroadcast(b->a, b->b, count, ncclInt32, root, comm, g_stream), ncclSuccess, "Broadcast");
    expect_rc(ncclBcast(b->a, count, ncclInt32, root, comm, g_stream), ncclSuccess, "Bcast");
    wait_for(comm);
    download(b->h, b->b, len);
    bad = 0;
    for (size_t i = 0; i < count; ++i) bad += ((int32_t*)b->h)[i] != ival(root, i, 70 + root);
    expect(bad == 0, "Broadcast: wrong elements");
    download(b->h, b->a, len);
    bad = 0;
    for (size_t i = 0; i < count; ++i) bad += ((int32_t*)b->h)[i] != ival(root, i, 70 + root);
    expect(bad == 0, "Bcast in place: wrong elements");

    /* Gather to the root. */
    fill(b->h, ncclFloat32, g_rank, count, 0, 80 + root);
    upload(b->a, b->h, len);
    expect_rc(ncclGather(b->a, b->b, count, ncclFloat32, root, comm, g_stream), ncclSuccess, "Gather");
    wait_for(comm);
    if (g_rank == root) {
      download(b->h, b->b, len * g_n);
      bad = 0;
      for (int p = 0; p < g_n; ++p)
        for (size_t i = 0; i < count; ++i) bad += ((float*)b->h)[p * count + i] != (float)ival(p, i, 80 + root);
      expect(bad == 0, "Gather: wrong elements");
    }

    /* Scatter from the root: block j to rank j. */
    fill(b->h, ncclFloat32, root, count * g_n, 0, 90 + root);
    if (g_rank == root) upload(b->a, b->h, len * g_n);
    expect_rc(ncclScatter(b->a, b->b, count, ncclFloat32, root, comm, g_stream), ncclSuccess, "Scatter");
    wait_for(comm);
    download(b->h, b->b, len);
    bad = 0;
    for (size_t i = 0; i < count; ++i) bad += ((float*)b->h)[i] != (float)ival(root, (size_t)g_rank * count + i, 90 + root);
    expect(bad == 0, "Scatter: wrong elements");
  }

  /* Send/Recv in a group: a ring forward and backward at once (deadlocks without the group). */
  const int next = (g_rank + 1) % g_n, prev = (g_rank + g_n - 1) % g_n;
  fill(b->h, ncclInt32, g_rank, count * 2, 0, 99);
  upload(b->a, b->h, len * 2);
  expect_rc(ncclGroupStart(), ncclSuccess, "GroupStart");
  expect_rc(ncclSend(b->a, count, ncclInt32, next, comm, g_stream), ncclSuccess, "Send to next");
  expect_rc(ncclSend((char*)b->a + len, count, ncclInt32, prev, comm, g_stream), ncclSuccess, "Send to prev");
  expect_rc(ncclRecv(b->b, count, ncclInt32, prev, comm, g_stream), ncclSuccess, "Recv from prev");
  expect_rc(ncclRecv((char*)b->b + len, count, ncclInt32, next, comm, g_stream), ncclSuccess, "Recv from next");
  expect_rc(ncclGroupEnd(), ncclSuccess, "GroupEnd");
  wait_for(comm);
  download(b->h, b->b, len * 2);
  bad = 0;
  for (size_t i = 0; i < count; ++i) {
    bad += ((int32_t*)b->h)[i] != ival(prev, i, 99);
    bad += ((int32_t*)b->h)[count + i] != ival(next, count + i, 99);
  }
  expect(bad == 0, "Send/Recv ring in a group: wrong elements");
}

static void collectives(ncclComm_t comm, size_t count) {
  struct Bufs b;
  b.bytes = (count * 2 + 16) * (size_t)g_n * 4;
  b.a = dalloc(b.bytes);
  b.b = dalloc(b.bytes);
  b.h = malloc(b.bytes);
  if (b.a == NULL || b.b == NULL || b.h == NULL) return;
  all_reduce(comm, &b, count);
  reduce_scatter_and_reduce(comm, &b, count);
  movement(comm, &b, count);
  dfree(b.a);
  dfree(b.b);
  free(b.h);
}

/* AllReduce (sum, int32) of COUNT elements on `comm` (its ranks are `members`, in order). */
static void check_sum(ncclComm_t comm, const int* members, int n, int me, const char* what) {
  const size_t count = 1000;
  int32_t* h = malloc(count * 4);
  void* d = dalloc(count * 4);
  if (h == NULL || d == NULL) return;
  fill(h, ncclInt32, members[me], count, 0, 7);
  upload(d, h, count * 4);
  expect_rc(ncclAllReduce(d, d, count, ncclInt32, ncclSum, comm, g_stream), ncclSuccess, what);
  wait_for(comm);
  download(h, d, count * 4);
  size_t bad = 0;
  for (size_t i = 0; i < count; ++i) {
    int32_t s = 0;
    for (int p = 0; p < n; ++p) s += ival(members[p], i, 7);
    bad += h[i] != s;
  }
  expect(bad == 0, what);
  dfree(d);
  free(h);
}

/* ---------------------------------------------------------------- communicators -------- */

/* A fresh id from rank 0, carried to every rank by ncclBroadcast on `world`. */
static ncclUniqueId shared_id(ncclComm_t world) {
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  void* d = dalloc(sizeof id);
  if (g_rank == 0) {
    expect_rc(ncclGetUniqueId(&id), ncclSuccess, "ncclGetUniqueId (second id)");
    upload(d, &id, sizeof id);
  }
  expect_rc(ncclBroadcast(d, d, sizeof id, ncclUint8, 0, world, g_stream), ncclSuccess, "Broadcast of an id");
  wait_for(world);
  download(&id, d, sizeof id);
  dfree(d);
  return id;
}

static void config_comms(ncclComm_t world) {
  int everyone[SPAWN_RANKS_MAX];
  for (int p = 0; p < g_n; ++p) everyone[p] = p;
  for (int blocking = 1; blocking >= 0; --blocking) {
    ncclUniqueId id = shared_id(world);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    ncclComm_t c = NULL;
    cfg.blocking = blocking;
    cfg.commName = blocking ? "blocking" : "nonblocking";
    ncclResult_t rc = ncclCommInitRankConfig(&c, g_n, id, g_rank, &cfg);
    if (!blocking && rc == ncclInProgress) {
      /* A non-blocking creation: poll until it is ready (bounded). */
      ncclResult_t st = ncclInProgress;
      double t0 = now_s();
      while (st == ncclInProgress && now_s() - t0 < 60) expect_rc(ncclCommGetAsyncError(c, &st), ncclSuccess, "GetAsyncError");
      rc = st;
    }
    expect_rc(rc, ncclSuccess, blocking ? "InitRankConfig blocking=1" : "InitRankConfig blocking=0");
    if (rc != ncclSuccess) continue;
    int n = -1, r = -1;
    expect(ncclCommCount(c, &n) == ncclSuccess && n == g_n, "config comm: Count");
    expect(ncclCommUserRank(c, &r) == ncclSuccess && r == g_rank, "config comm: UserRank");
    check_sum(c, everyone, g_n, g_rank, blocking ? "AllReduce on a blocking=1 comm" : "AllReduce on a blocking=0 comm");
    if (blocking) {
      expect_rc(ncclCommFinalize(c), ncclSuccess, "Finalize");
      expect_rc(ncclCommDestroy(c), ncclSuccess, "Destroy after Finalize");
    } else {
      ncclResult_t st = ncclInternalError;
      expect_rc(ncclCommGetAsyncError(c, &st), ncclSuccess, "GetAsyncError");
      expect_rc(st, ncclSuccess, "no asynchronous error");
      expect_rc(ncclCommAbort(c), ncclSuccess, "Abort");
    }
  }
}

/* ncclCommRevoke on a communicator of every rank (a fresh id) where rank 0's Recv from rank
 * 1 is pending (rank 1 never sends): the Recv fails and rank 0's stream is released (on
 * CUDA the context synchronizes); afterwards collectives are ncclInvalidUsage, Finalize and
 * a second revoke ncclInvalidArgument, the asynchronous state ncclSuccess; a split of the
 * revoked communicator works, and so does its destroy. */
static void revoke_comms(ncclComm_t world) {
  int everyone[SPAWN_RANKS_MAX];
  for (int p = 0; p < g_n; ++p) everyone[p] = p;
  ncclUniqueId id = shared_id(world);
  ncclComm_t c = NULL;
  if (ncclCommInitRank(&c, g_n, id, g_rank) != ncclSuccess) {
    expect(0, "InitRank of the communicator to revoke");
    return;
  }
  void* d = dalloc(64);
  if (g_rank == 0) expect_rc(ncclRecv(d, 4, ncclFloat32, 1, c, g_stream), ncclSuccess, "Recv that no rank sends");
  expect_rc(ncclCommRevoke(NULL, NCCL_REVOKE_DEFAULT), ncclSuccess, "Revoke(NULL)");
  expect_refused(ncclCommRevoke(c, 1), ncclInvalidArgument, "Revoke with flags 1");
  expect_rc(ncclCommRevoke(c, NCCL_REVOKE_DEFAULT), ncclSuccess, "Revoke");
  if (cu.cuda) expect(cu.sync() == 0, "cuCtxSynchronize: the revoked Recv released its stream");
  ncclResult_t st = ncclInternalError;
  expect_rc(ncclCommGetAsyncError(c, &st), ncclSuccess, "GetAsyncError after Revoke");
  expect_rc(st, ncclSuccess, "a revoked communicator is quiescent");
  expect_refused(ncclAllReduce(d, d, 4, ncclFloat32, ncclSum, c, g_stream), ncclInvalidUsage, "AllReduce after Revoke");
  expect(strstr(ncclGetLastError(NULL), "revoked") != NULL, "the message says revoked");
  expect_refused(ncclCommFinalize(c), ncclInvalidArgument, "Finalize after Revoke");
  expect_refused(ncclCommRevoke(c, NCCL_REVOKE_DEFAULT), ncclInvalidArgument, "a second Revoke");
  ncclComm_t sub = NULL;
  expect_rc(ncclCommSplit(c, 0, g_rank, &sub, NULL), ncclSuccess, "Split of a revoked communicator");
  if (sub != NULL) {
    check_sum(sub, everyone, g_n, g_rank, "AllReduce on the split of a revoked communicator");
    expect_rc(ncclCommDestroy(sub), ncclSuccess, "Destroy the split");
  }
  expect_rc(ncclCommDestroy(c), ncclSuccess, "Destroy after Revoke");
  dfree(d);
}

static void split_comms(ncclComm_t world) {
  /* Two colors (even and odd ranks), ordered by key = -rank: reversed. */
  ncclComm_t sub = NULL;
  int color = g_rank % 2, members[SPAWN_RANKS_MAX], n = 0, me = -1;
  expect_rc(ncclCommSplit(world, color, -g_rank, &sub, NULL), ncclSuccess, "Split by parity");
  for (int p = g_n - 1; p >= 0; --p)
    if (p % 2 == color) {
      if (p == g_rank) me = n;
      members[n++] = p;
    }
  if (sub != NULL) {
    int c = -1, r = -1;
    expect(ncclCommCount(sub, &c) == ncclSuccess && c == n, "split comm: Count");
    expect(ncclCommUserRank(sub, &r) == ncclSuccess && r == me, "split comm: UserRank follows the keys");
    check_sum(sub, members, n, me, "AllReduce on a split comm");
    expect_rc(ncclCommDestroy(sub), ncclSuccess, "Destroy split comm");
  }
  /* Rank 0 opts out with NCCL_SPLIT_NOCOLOR and gets NULL. */
  ncclComm_t rest = (ncclComm_t)(uintptr_t)1;
  expect_rc(ncclCommSplit(world, g_rank == 0 ? NCCL_SPLIT_NOCOLOR : 5, g_rank, &rest, NULL), ncclSuccess,
            "Split with NOCOLOR");
  if (g_rank == 0) {
    expect(rest == NULL, "NCCL_SPLIT_NOCOLOR gives NULL");
  } else if (rest != NULL) {
    n = 0;
    for (int p = 1; p < g_n; ++p) members[n++] = p;
    int c = -1;
    expect(ncclCommCount(rest, &c) == ncclSuccess && c == g_n - 1, "NOCOLOR split: Count");
    check_sum(rest, members, n, g_rank - 1, "AllReduce without rank 0");
    expect_rc(ncclCommDestroy(rest), ncclSuccess, "Destroy NOCOLOR split comm");
  }
}

/* Two ranks in this process (ncclCommInitAll, both on this rank's GPU), driven from this
 * thread inside one group, as NCCL requires for several communicators per thread. Each rank
 * has its own stream: on hoccl a rank's collective holds its stream until the peer's data
 * arrived, so two ranks on one stream would wait for each other (on the host backend each
 * communicator's stream 0 is its own queue; on CUDA two streams are created). */
static void init_all(void) {
  ncclComm_t comms[2] = {NULL, NULL};
  cudaStream_t streams[2] = {NULL, NULL};
  if (cu.cuda)
    for (int r = 0; r < 2; ++r) expect(cu.stream_create(&streams[r], 1 /* non-blocking */) == 0, "cuStreamCreate");
  int devs[2] = {cu.ordinal, cu.ordinal};
  expect_rc(ncclCommInitAll(comms, 2, devs), ncclSuccess, "InitAll");
  if (comms[0] == NULL || comms[1] == NULL) return;
  const size_t count = 777;
  float* h = malloc(count * 4);
  void* d[2] = {dalloc(count * 4), dalloc(count * 4)};
  for (int r = 0; r < 2; ++r) {
    int c = -1, me = -1;
    expect(ncclCommCount(comms[r], &c) == ncclSuccess && c == 2, "InitAll: Count");
    expect(ncclCommUserRank(comms[r], &me) == ncclSuccess && me == r, "InitAll: UserRank");
    fill(h, ncclFloat32, r, count, 0, 3);
    upload(d[r], h, count * 4);
  }
  expect_rc(ncclGroupStart(), ncclSuccess, "GroupStart (InitAll)");
  for (int r = 0; r < 2; ++r) expect_rc(ncclAllReduce(d[r], d[r], count, ncclFloat32, ncclSum, comms[r], streams[r]), ncclSuccess, "AllReduce (InitAll)");
  expect_rc(ncclGroupEnd(), ncclSuccess, "GroupEnd (InitAll)");
  for (int r = 0; r < 2; ++r) {
    wait_for(comms[r]);
    download(h, d[r], count * 4);
    size_t bad = 0;
    for (size_t i = 0; i < count; ++i) bad += h[i] != (float)(ival(0, i, 3) + ival(1, i, 3));
    expect(bad == 0, "AllReduce over InitAll's communicators: wrong elements");
  }
  for (int r = 0; r < 2; ++r) {
    dfree(d[r]);
    expect_rc(ncclCommDestroy(comms[r]), ncclSuccess, "Destroy (InitAll)");
  }
  free(h);
}

/* NCCL's way of driving several ranks from one thread: GroupStart, one InitRank per rank,
 * GroupEnd. The creations return their handles at once and GroupEnd creates them together
 * (each would otherwise wait for the others' rendezvous); collectives enqueued in the same
 * group apply to the new communicators. Three ranks in this process (each on its own stream
 * on CUDA, as in init_all), then a split of them inside a group, a split of `world` across the
 * processes inside a group with an AllReduce on the new communicator in that group, and a
 * group whose creation fails: GroupEnd fails and each handle of the group reports it. */
static void group_creation(ncclComm_t world) {
  enum { R = 3 };
  ncclComm_t comms[R] = {NULL, NULL, NULL};
  cudaStream_t streams[R] = {NULL, NULL, NULL};
  if (cu.cuda)
    for (int r = 0; r < R; ++r) expect(cu.stream_create(&streams[r], 1 /* non-blocking */) == 0, "cuStreamCreate");
  ncclUniqueId id;
  expect_rc(ncclGetUniqueId(&id), ncclSuccess, "GetUniqueId (group creation)");
  const size_t count = 513;
  float* h = malloc(count * 4);
  void* d[R];
  for (int r = 0; r < R; ++r) {
    d[r] = dalloc(count * 4);
    fill(h, ncclFloat32, r, count, 0, 71);
    upload(d[r], h, count * 4);
  }
  expect_rc(ncclGroupStart(), ncclSuccess, "GroupStart (creation)");
  for (int r = 0; r < R; ++r) {
    expect_rc(ncclCommInitRank(&comms[r], R, id, r), ncclSuccess, "InitRank inside a group");
    expect(comms[r] != NULL, "InitRank inside a group returns its handle at once");
  }
  ncclResult_t st = ncclSuccess;
  int c = -1;
  expect_rc(ncclCommGetAsyncError(comms[0], &st), ncclSuccess, "GetAsyncError on a pending creation");
  expect_rc(st, ncclInProgress, "a creation pending until GroupEnd is in progress");
  expect_refused(ncclCommCount(comms[0], &c), ncclInvalidUsage, "Count before GroupEnd");
  for (int r = 0; r < R; ++r)
    expect_rc(ncclAllReduce(d[r], d[r], count, ncclFloat32, ncclSum, comms[r], streams[r]), ncclSuccess,
              "AllReduce in the creating group");
  expect_rc(ncclGroupEnd(), ncclSuccess, "GroupEnd creates the communicators");
  for (int r = 0; r < R; ++r) {
    int me = -1;
    c = -1;
    expect(ncclCommCount(comms[r], &c) == ncclSuccess && c == R, "group creation: Count");
    expect(ncclCommUserRank(comms[r], &me) == ncclSuccess && me == r, "group creation: UserRank");
    wait_for(comms[r]);
    download(h, d[r], count * 4);
    size_t bad = 0;
    for (size_t i = 0; i < count; ++i) bad += h[i] != (float)(ival(0, i, 71) + ival(1, i, 71) + ival(2, i, 71));
    expect(bad == 0, "AllReduce enqueued in the creating group: wrong elements");
  }
  /* Split of the three inside a group: even and odd ranks. */
  ncclComm_t subs[R] = {NULL, NULL, NULL};
  expect_rc(ncclGroupStart(), ncclSuccess, "GroupStart (split)");
  for (int r = 0; r < R; ++r) expect_rc(ncclCommSplit(comms[r], r % 2, 0, &subs[r], NULL), ncclSuccess, "Split inside a group");
  expect_rc(ncclGroupEnd(), ncclSuccess, "GroupEnd creates the splits");
  for (int r = 0; r < R; ++r) {
    c = -1;
    expect(ncclCommCount(subs[r], &c) == ncclSuccess && c == (r % 2 == 0 ? 2 : 1), "split inside a group: Count");
    expect_rc(ncclCommDestroy(subs[r]), ncclSuccess, "Destroy (split inside a group)");
  }
  for (int r = 0; r < R; ++r) {
    dfree(d[r]);
    expect_rc(ncclCommDestroy(comms[r]), ncclSuccess, "Destroy (group creation)");
  }
  /* A split of `world` inside a group, across the processes, with a collective kept for it. */
  ncclComm_t all = NULL;
  int32_t* hi = malloc(count * 4);
  void* di = dalloc(count * 4);
  for (size_t i = 0; i < count; ++i) hi[i] = ival(g_rank, i, 72);
  upload(di, hi, count * 4);
  expect_rc(ncclGroupStart(), ncclSuccess, "GroupStart (split of world)");
  expect_rc(ncclCommSplit(world, 0, g_rank, &all, NULL), ncclSuccess, "Split of world inside a group");
  expect_rc(ncclAllReduce(di, di, count, ncclInt32, ncclSum, all, g_stream), ncclSuccess, "AllReduce on a split pending in the group");
  expect_rc(ncclGroupEnd(), ncclSuccess, "GroupEnd creates the split of world");
  if (all != NULL) {
    wait_for(all);
    download(hi, di, count * 4);
    size_t bad = 0;
    for (size_t i = 0; i < count; ++i) {
      int32_t want = 0;
      for (int p = 0; p < g_n; ++p) want += ival(p, i, 72);
      bad += hi[i] != want;
    }
    expect(bad == 0, "AllReduce kept for a split of world: wrong elements");
    expect_rc(ncclCommDestroy(all), ncclSuccess, "Destroy (split of world)");
  }
  dfree(di);
  free(hi);
  /* A group whose second creation cannot succeed (an id naming no rendezvous). */
  ncclUniqueId good, bad;
  memset(&bad, 0, sizeof bad);
  expect_rc(ncclGetUniqueId(&good), ncclSuccess, "GetUniqueId (failing group)");
  ncclComm_t a = NULL, b = NULL;
  expect_rc(ncclGroupStart(), ncclSuccess, "GroupStart (failing group)");
  expect_rc(ncclCommInitRank(&a, 1, good, 0), ncclSuccess, "InitRank (failing group, good id)");
  expect_rc(ncclCommInitRank(&b, 1, bad, 0), ncclSuccess, "InitRank (failing group, bad id: checked at GroupEnd)");
  expect_refused(ncclGroupEnd(), ncclInvalidArgument, "GroupEnd of a group whose creation fails");
  expect_refused(ncclCommCount(a, &c), ncclInvalidUsage, "Count on a handle of the failed group");
  expect(strstr(ncclGetLastError(NULL), "another creation of its group failed") != NULL, "the message says why");
  expect_rc(ncclCommDestroy(a), ncclSuccess, "Destroy a handle of the failed group");
  expect_rc(ncclCommAbort(b), ncclSuccess, "Abort the failed handle");
  free(h);
}

static void registration_and_operators(ncclComm_t world) {
  const size_t count = 513;
  void* d = dalloc(4096 * 4);
  void* handle = NULL;
  ncclWindow_t win = NULL;
  expect_rc(ncclCommRegister(world, d, 4096 * 4, &handle), ncclSuccess, "CommRegister");
  expect_rc(ncclCommDeregister(world, handle), ncclSuccess, "CommDeregister");
  expect_rc(ncclCommWindowRegister(world, d, 4096 * 4, &win, NCCL_WIN_DEFAULT), ncclSuccess, "CommWindowRegister");
  expect_rc(ncclCommWindowDeregister(world, win), ncclSuccess, "CommWindowDeregister");

  /* PreMulSum: each rank's input times the scalar, summed. A host scalar (2, float) is read
   * at creation; a device scalar (3, int32) is read by the reduce step when it runs. */
  float scalar = 2.0f, *h = malloc(count * 4);
  ncclRedOp_t op = ncclSum, dop = ncclSum;
  expect_rc(ncclRedOpCreatePreMulSum(&op, &scalar, ncclFloat32, ncclScalarHostImmediate, world), ncclSuccess,
            "RedOpCreatePreMulSum (host scalar)");
  expect((int)op >= (int)ncclNumOps, "a PreMulSum operator is numbered past the built-in ones");
  scalar = 100.0f; /* read at creation: changing it now changes nothing */
  fill(h, ncclFloat32, g_rank, count, 0, 11);
  upload(d, h, count * 4);
  expect_rc(ncclAllReduce(d, d, count, ncclFloat32, op, world, g_stream), ncclSuccess, "AllReduce with PreMulSum");
  wait_for(world);
  download(h, d, count * 4);
  size_t bad = 0;
  for (size_t i = 0; i < count; ++i) bad += h[i] != 2.0f * (float)reduced(ncclFloat32, ncclSum, g_n, i, 11);
  expect(bad == 0, "AllReduce with PreMulSum (host scalar): wrong elements");
  void* ds = dalloc(8);
  expect_rc(ncclRedOpCreatePreMulSum(&dop, ds, ncclInt32, ncclScalarDevice, world), ncclSuccess,
            "RedOpCreatePreMulSum (device scalar)");
  int32_t three = 3, *hi = (int32_t*)h;
  upload(ds, &three, 4); /* after creation: the step reads it when it runs */
  fill(h, ncclInt32, g_rank, count, 0, 12);
  upload(d, h, count * 4);
  expect_rc(ncclAllReduce(d, d, count, ncclInt32, dop, world, g_stream), ncclSuccess, "AllReduce with a device PreMulSum");
  wait_for(world);
  download(h, d, count * 4);
  bad = 0;
  for (size_t i = 0; i < count; ++i) bad += hi[i] != 3 * (int32_t)reduced(ncclInt32, ncclSum, g_n, i, 12);
  expect(bad == 0, "AllReduce with PreMulSum (device scalar): wrong elements");
  expect_refused(ncclAllReduce(d, d, count, ncclFloat32, dop, world, g_stream), ncclInvalidArgument,
                 "a PreMulSum operator on another data type");
  expect_rc(ncclRedOpDestroy(dop, world), ncclSuccess, "RedOpDestroy (device scalar)");
  dfree(ds);
  expect_rc(ncclRedOpDestroy(op, world), ncclSuccess, "RedOpDestroy");
  expect_refused(ncclRedOpDestroy(op, world), ncclInvalidArgument, "RedOpDestroy twice");
  dfree(d);
  free(h);
}

static void error_paths(ncclComm_t world) {
  void* d = dalloc(64);
  int v = 0;
  expect_refused(ncclAllReduce(d, d, 4, ncclFloat32, ncclSum, NULL, NULL), ncclInvalidArgument, "NULL comm");
  expect_refused(ncclCommCount(NULL, &v), ncclInvalidArgument, "Count on NULL");
  expect_refused(ncclAllReduce(d, d, 4, (ncclDataType_t)42, ncclSum, world, NULL), ncclInvalidArgument, "data type 42");
  expect_refused(ncclAllReduce(d, d, 4, ncclFloat32, (ncclRedOp_t)77, world, NULL), ncclInvalidArgument,
                 "operator 77 (never created)");
  expect_refused(ncclBroadcast(d, d, 4, ncclFloat32, g_n, world, NULL), ncclInvalidArgument, "root == nranks");
  expect_refused(ncclReduce(d, d, 4, ncclFloat32, ncclSum, -1, world, NULL), ncclInvalidArgument, "root -1");
  expect_refused(ncclSend(d, 4, ncclFloat32, g_n, world, NULL), ncclInvalidArgument, "peer == nranks");
  expect_refused(ncclRecv(d, 4, ncclFloat32, -1, world, NULL), ncclInvalidArgument, "peer -1");
  expect_refused(ncclAllReduce(d, d, SIZE_MAX / 2, ncclFloat32, ncclSum, world, NULL), ncclInvalidArgument,
                 "count * 4 overflows");
  expect_refused(ncclAllGather(d, d, SIZE_MAX / 4, ncclInt32, world, NULL), ncclInvalidArgument,
                 "AllGather count overflows");
  expect_refused(ncclGetVersion(NULL), ncclInvalidArgument, "GetVersion(NULL)");
  expect_refused(ncclGetUniqueId(NULL), ncclInvalidArgument, "GetUniqueId(NULL)");
  expect_refused(ncclMemFree((char*)d + 1), ncclInvalidArgument, "MemFree of a pointer MemAlloc did not return");
  expect_refused(ncclGroupEnd(), ncclInvalidUsage, "GroupEnd without GroupStart");
  ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
  ncclResult_t rc = ncclGroupSimulateEnd(&sim);
  expect(rc != ncclSuccess, "ncclGroupSimulateEnd is refused");
  expect(ncclGetLastError(NULL)[0] != '\0', "ncclGroupSimulateEnd: a message in ncclGetLastError");
  ncclResult_t st = ncclInternalError;
  expect_rc(ncclCommGetAsyncError(world, &st), ncclSuccess, "GetAsyncError");
  expect_rc(st, ncclSuccess, "argument errors leave no asynchronous error");
  expect_rc(ncclMemFree(NULL), ncclSuccess, "MemFree(NULL)");
  dfree(d);
}

/* ---------------------------------------------------------------- ranks ---------------- */

static int make_id(void* id, void* arg) {
  (void)arg;
  ncclResult_t rc = ncclGetUniqueId((ncclUniqueId*)id);
  if (rc != ncclSuccess) fprintf(stderr, "nccl_check: ncclGetUniqueId: %s\n", ncclGetLastError(NULL));
  return rc == ncclSuccess ? 0 : 1;
}

static int rank_main(int rank, int nranks, const void* idp, void* arg) {
  (void)arg;
  g_rank = rank;
  g_n = nranks;
  if (device_init(rank) != 0) {
    fprintf(stderr, "nccl_check: rank %d: CUDA requested but not usable\n", rank);
    return 1;
  }
  if (cu.cuda && strcmp(g_stream_mode, "created") == 0)
    expect(cu.stream_create(&g_stream, 1 /* non-blocking */) == 0, "cuStreamCreate");
  else if (cu.cuda && strcmp(g_stream_mode, "legacy") == 0)
    g_stream = (cudaStream_t)(uintptr_t)0x1; /* cudaStreamLegacy */
  else if (cu.cuda && strcmp(g_stream_mode, "per-thread") == 0)
    g_stream = (cudaStream_t)(uintptr_t)0x2; /* cudaStreamPerThread */
  ncclUniqueId id;
  memcpy(&id, idp, sizeof id);
  int version = 0;
  expect_rc(ncclGetVersion(&version), ncclSuccess, "GetVersion");
  expect(version == NCCL_VERSION_CODE && version >= 22800, "GetVersion reports NCCL_VERSION_CODE (2.28 or later)");
  expect(strlen(ncclGetErrorString(ncclInvalidUsage)) > 0, "GetErrorString");

  ncclComm_t world = NULL;
  if (rank == 1) {
    ncclUniqueId bad = id;
    for (int i = SECRET_AT; i < SECRET_AT + SECRET_LEN; ++i) bad.internal[i] = (char)(bad.internal[i] ^ 0x33);
    double t0 = now_s();
    ncclResult_t rc = ncclCommInitRank(&world, nranks, bad, rank);
    expect_refused(rc, ncclInvalidArgument, "InitRank with a wrong secret");
    expect(strstr(ncclGetLastError(NULL), "secret") != NULL, "the message names the secret");
    expect(now_s() - t0 < 10.0, "the wrong secret is refused within 10 s");
    expect(world == NULL, "a refused InitRank leaves NULL");
  }
  if (ncclCommInitRank(&world, nranks, id, rank) != ncclSuccess) {
    expect(0, "InitRank");
    return 1;
  }
  int n = -1, r = -1, dev = -1;
  expect(ncclCommCount(world, &n) == ncclSuccess && n == nranks, "Count");
  expect(ncclCommUserRank(world, &r) == ncclSuccess && r == rank, "UserRank");
  expect(ncclCommCuDevice(world, &dev) == ncclSuccess && dev == (cu.cuda ? cu.ordinal : 0), "CuDevice");

  collectives(world, 0);
  collectives(world, 1);
  collectives(world, 10007);
  config_comms(world);
  split_comms(world);
  revoke_comms(world);
  init_all();
  group_creation(world);
  registration_and_operators(world);
  error_paths(world);

  expect_rc(ncclCommFinalize(world), ncclSuccess, "Finalize");
  expect_rc(ncclCommDestroy(world), ncclSuccess, "Destroy");
  printf("nccl_check: rank %d: %d checks, %d failed (%s, stream %p)\n", rank, g_checks, g_failures,
         cu.cuda ? "CUDA" : "host backend", (void*)g_stream);
  return g_failures != 0;
}

int main(int argc, char** argv) {
  int nranks = argc > 1 ? atoi(argv[1]) : 2;
  if (argc > 2) g_stream_mode = argv[2];
  const char* modes[] = {"created", "null", "legacy", "per-thread"};
  int known = 0;
  for (int i = 0; i < 4; ++i) known |= strcmp(g_stream_mode, modes[i]) == 0;
  if (nranks < 2 || !known) {
    fprintf(stderr, "usage: %s NRANKS [created|null|legacy|per-thread] (NRANKS 2 or more)\n", argv[0]);
    return 2;
  }
  setenv("HOCCL_TIMEOUT_MS", "30000", 0);
  int rc = spawn_ranks(nranks, sizeof(ncclUniqueId), make_id, rank_main, NULL);
  printf("nccl_check: %s (%d ranks, %s, stream %s)\n", rc == 0 ? "OK" : "FAILED", nranks,
         getenv("HOCCL_BACKEND") ? getenv("HOCCL_BACKEND") : "backend auto", g_stream_mode);
  return rc;
}
