/* The C ABI (hoccl.h) from C under MPI: version, creation from MPI_Comm_c2f, every
 * collective checked against expectations computed here, a thread-global group spanning two
 * communicators, NULL and bad-enum arguments, hocclGetLastError, abort, and handles that stay
 * safe to pass after destroy. Exits non-zero on any failure. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hoccl/hoccl.h"

static int g_rank, g_size;
static long g_failures, g_checks;

static void expect(int ok, const char* what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    fprintf(stderr, "c_api_check: rank %d: FAILED: %s (last error: %s)\n", g_rank, what, hocclGetLastError());
  }
}

static void expect_rc(hocclResult_t got, hocclResult_t want, const char* what) {
  char msg[256];
  snprintf(msg, sizeof msg, "%s: %s (%d), expected %s (%d)", what, hocclGetErrorString(got), (int)got,
           hocclGetErrorString(want), (int)want);
  expect(got == want, msg);
}

/* Byte i of rank r's data for a seed (splitmix64 finalizer). */
static uint8_t value(uint64_t seed, int rank, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + (uint64_t)rank * 0xD1B54A32D192ED03ull + i * 0xA24BAED4963EE407ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (uint8_t)(z ^ (z >> 31));
}

static void fill(uint8_t* p, size_t n, uint64_t seed, int rank, size_t from) {
  for (size_t i = 0; i < n; ++i) p[i] = value(seed, rank, from + i);
}

/* Count wrong bytes of host[0..n) against (seed, rank, from + i). */
static size_t wrong(const uint8_t* host, size_t n, uint64_t seed, int rank, size_t from) {
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad += host[i] != value(seed, rank, from + i);
  return bad;
}

struct Bufs {
  hocclComm_t comm;
  struct CUstream_st* stream;
  void* send;
  void* recv;
  uint8_t* host;
  size_t bytes; /* of each device buffer */
};

static void upload(struct Bufs* b, void* dev, size_t n, uint64_t seed, int rank, size_t from) {
  fill(b->host, n, seed, rank, from);
  expect_rc(hocclMemcpyToDevice(b->comm, dev, b->host, n), hocclSuccess, "hocclMemcpyToDevice");
}

static const uint8_t* finish(struct Bufs* b, const void* dev, size_t n) {
  expect_rc(hocclStreamSynchronize(b->comm, b->stream), hocclSuccess, "hocclStreamSynchronize");
  memset(b->host, 0, n);
  expect_rc(hocclMemcpyToHost(b->comm, b->host, dev, n), hocclSuccess, "hocclMemcpyToHost");
  return b->host;
}

static void collectives(struct Bufs* b, size_t count) {
  const size_t len = count * 4; /* float32 elements */
  size_t bad = 0;
  upload(b, b->send, len, 1, g_rank, 0);
  expect_rc(hocclAllGather(b->send, b->recv, count, hocclFloat32, b->comm, b->stream), hocclSuccess, "AllGather");
  const uint8_t* got = finish(b, b->recv, len * g_size);
  for (int p = 0; p < g_size; ++p) bad += wrong(got + p * len, len, 1, p, 0);
  expect(bad == 0, "AllGather: wrong bytes");

  upload(b, b->send, len * g_size, 2, g_rank, 0);
  expect_rc(hocclAlltoAll(b->send, b->recv, count, hocclFloat, b->comm, b->stream), hocclSuccess, "AlltoAll");
  got = finish(b, b->recv, len * g_size);
  bad = 0;
  for (int p = 0; p < g_size; ++p) bad += wrong(got + p * len, len, 2, p, g_rank * len);
  expect(bad == 0, "AlltoAll: wrong bytes");

  for (int root = 0; root < g_size; ++root) {
    upload(b, b->send, len, 3 + root, root, 0);
    expect_rc(hocclBroadcast(b->send, b->recv, count, hocclFloat32, root, b->comm, b->stream), hocclSuccess,
              "Broadcast");
    expect(wrong(finish(b, b->recv, len), len, 3 + root, root, 0) == 0, "Broadcast: wrong bytes");

    upload(b, b->send, len, 20 + root, g_rank, 0);
    expect_rc(hocclGather(b->send, b->recv, count, hocclFloat32, root, b->comm, b->stream), hocclSuccess, "Gather");
    got = finish(b, b->recv, len * g_size);
    for (int p = 0; p < g_size && g_rank == root; ++p)
      expect(wrong(got + p * len, len, 20 + root, p, 0) == 0, "Gather: wrong bytes");

    upload(b, b->send, len * g_size, 40 + root, root, 0);
    expect_rc(hocclScatter(b->send, b->recv, count, hocclFloat32, root, b->comm, b->stream), hocclSuccess, "Scatter");
    expect(wrong(finish(b, b->recv, len), len, 40 + root, root, g_rank * len) == 0, "Scatter: wrong bytes");
  }
}

/* Element i of rank r's int32 input for the reductions (small, so products stay exact). */
static int32_t rval(int r, size_t i) { return (int32_t)((r * 7 + (int)(i % 13)) % 11) - 5; }

/* AllReduce (sum, in place and out of place), ReduceScatter (max), Reduce (avg at every
 * root) on int32, against a fold in rank order computed here. */
static void reductions(struct Bufs* b, size_t count) {
  int32_t* in = (int32_t*)b->host;
  const size_t len = count * 4;
  for (size_t i = 0; i < count * (size_t)g_size; ++i) in[i] = rval(g_rank, i);
  expect_rc(hocclMemcpyToDevice(b->comm, b->send, in, len * g_size), hocclSuccess, "hocclMemcpyToDevice");
  expect_rc(hocclMemcpyToDevice(b->comm, b->recv, in, len), hocclSuccess, "hocclMemcpyToDevice");
  expect_rc(hocclAllReduce(b->send, b->send, count, hocclInt32, hocclSum, b->comm, b->stream), hocclSuccess,
            "AllReduce in place");
  expect_rc(hocclAllReduce(b->recv, b->recv, count, hocclInt32, hocclProd, b->comm, b->stream), hocclSuccess,
            "AllReduce prod in place");
  const int32_t* got = (const int32_t*)finish(b, b->send, len);
  size_t bad = 0;
  for (size_t i = 0; i < count; ++i) {
    int32_t s = 0;
    for (int p = 0; p < g_size; ++p) s += rval(p, i);
    bad += got[i] != s;
  }
  expect(bad == 0, "AllReduce sum: wrong elements");
  got = (const int32_t*)finish(b, b->recv, len);
  bad = 0;
  for (size_t i = 0; i < count; ++i) {
    int64_t pr = 1;
    for (int p = 0; p < g_size; ++p) pr = (int32_t)((uint32_t)pr * (uint32_t)rval(p, i));
    bad += got[i] != (int32_t)pr;
  }
  expect(bad == 0, "AllReduce prod: wrong elements");

  for (size_t i = 0; i < count * (size_t)g_size; ++i) in[i] = rval(g_rank, i);
  expect_rc(hocclMemcpyToDevice(b->comm, b->send, in, len * g_size), hocclSuccess, "hocclMemcpyToDevice");
  expect_rc(hocclReduceScatter(b->send, b->recv, count, hocclInt32, hocclMax, b->comm, b->stream), hocclSuccess,
            "ReduceScatter");
  got = (const int32_t*)finish(b, b->recv, len);
  bad = 0;
  for (size_t i = 0; i < count; ++i) {
    int32_t m = rval(0, g_rank * count + i);
    for (int p = 1; p < g_size; ++p) m = rval(p, g_rank * count + i) > m ? rval(p, g_rank * count + i) : m;
    bad += got[i] != m;
  }
  expect(bad == 0, "ReduceScatter max: wrong elements");

  for (int root = 0; root < g_size; ++root) {
    expect_rc(hocclReduce(b->send, b->recv, count, hocclInt32, hocclAvg, root, b->comm, b->stream), hocclSuccess,
              "Reduce");
    got = (const int32_t*)finish(b, b->recv, len);
    bad = 0;
    for (size_t i = 0; i < count && g_rank == root; ++i) {
      int32_t s = 0;
      for (int p = 0; p < g_size; ++p) s += rval(p, i);
      bad += got[i] != s / g_size; /* C's division truncates toward zero, as hoccl's avg */
    }
    expect(bad == 0, "Reduce avg: wrong elements");
  }
  expect_rc(hocclAllReduce(b->send, b->recv, count, hocclInt32, (hocclRedOp_t)5, b->comm, b->stream),
            hocclInvalidArgument, "reduction operator 5");
  expect(strstr(hocclGetLastError(), "reduction operator") != NULL, "hocclGetLastError names the operator");
  expect_rc(hocclReduce(b->send, b->recv, count, hocclInt32, hocclSum, g_size, b->comm, b->stream),
            hocclInvalidArgument, "Reduce root out of range");
  expect_rc(hocclReduceScatter(b->send, b->recv, count, hocclInt32, (hocclRedOp_t)-1, b->comm, b->stream),
            hocclInvalidArgument, "reduction operator -1");
}

/* Rank r sends r + 1 + p bytes to rank p, packed in rank order in both buffers. */
static void alltoallv(struct Bufs* b) {
  size_t* sc = calloc((size_t)g_size * 4, sizeof(size_t));
  size_t *sd = sc + g_size, *rc = sd + g_size, *rd = rc + g_size;
  for (int p = 0; p < g_size; ++p) {
    sc[p] = (size_t)(g_rank + 1 + p);
    rc[p] = (size_t)(p + 1 + g_rank);
    if (p > 0) sd[p] = sd[p - 1] + sc[p - 1], rd[p] = rd[p - 1] + rc[p - 1];
  }
  size_t total = rd[g_size - 1] + rc[g_size - 1];
  upload(b, b->send, sd[g_size - 1] + sc[g_size - 1], 60, g_rank, 0);
  expect_rc(hocclAlltoAllv(b->send, sc, sd, b->recv, rc, rd, hocclUint8, b->comm, b->stream), hocclSuccess,
            "AlltoAllv");
  const uint8_t* got = finish(b, b->recv, total);
  size_t bad = 0;
  for (int p = 0; p < g_size; ++p) {
    size_t from = 0; /* rank p's displacement for this rank */
    for (int q = 0; q < g_rank; ++q) from += (size_t)(p + 1 + q);
    bad += wrong(got + rd[p], rc[p], 60, p, from);
  }
  expect(bad == 0, "AlltoAllv: wrong bytes");
  expect_rc(hocclAlltoAllv(b->send, NULL, sd, b->recv, rc, rd, hocclUint8, b->comm, b->stream),
            hocclInvalidArgument, "AlltoAllv with NULL sendcounts");
  free(sc);
}

/* One thread-global group over two communicators: a ring forward on `a`, backward on `b`. */
static void two_communicator_group(struct Bufs* a, struct Bufs* b) {
  const size_t n = 4099;
  const int next = (g_rank + 1) % g_size, prev = (g_rank + g_size - 1) % g_size;
  upload(a, a->send, n, 80, g_rank, 0);
  upload(b, b->send, n, 81, g_rank, 0);
  expect_rc(hocclGroupStart(), hocclSuccess, "GroupStart");
  expect_rc(hocclGroupStart(), hocclSuccess, "nested GroupStart");
  expect_rc(hocclSend(a->send, n, hocclUint8, next, a->comm, a->stream), hocclSuccess, "Send on a");
  expect_rc(hocclRecv(a->recv, n, hocclInt8, prev, a->comm, a->stream), hocclSuccess, "Recv on a");
  expect_rc(hocclGroupEnd(), hocclSuccess, "nested GroupEnd");
  expect_rc(hocclSend(b->send, n, hocclUint8, prev, b->comm, b->stream), hocclSuccess, "Send on b");
  expect_rc(hocclRecv(b->recv, n, hocclUint8, next, b->comm, b->stream), hocclSuccess, "Recv on b");
  expect_rc(hocclGroupEnd(), hocclSuccess, "GroupEnd");
  expect(wrong(finish(a, a->recv, n), n, 80, prev, 0) == 0, "group ring on a: wrong bytes");
  expect(wrong(finish(b, b->recv, n), n, 81, next, 0) == 0, "group ring on b: wrong bytes");
}

static void bad_arguments(struct Bufs* b) {
  int v = 0;
  hocclResult_t async = hocclInternalError;
  expect_rc(hocclAllGather(b->send, b->recv, 1, hocclUint8, NULL, b->stream), hocclInvalidArgument, "NULL comm");
  expect_rc(hocclAllGather(b->send, NULL, 10, hocclUint8, b->comm, b->stream), hocclInvalidArgument, "NULL recvbuff");
  expect(strstr(hocclGetLastError(), "null") != NULL, "hocclGetLastError names the NULL buffer");
  expect_rc(hocclAllGather(b->send, b->recv, 10, (hocclDataType_t)42, b->comm, b->stream), hocclInvalidArgument,
            "data type 42");
  expect_rc(hocclSend(b->send, 1, hocclUint8, -1, b->comm, b->stream), hocclInvalidArgument, "peer -1");
  expect_rc(hocclBroadcast(b->send, b->recv, 1, hocclUint8, g_size, b->comm, b->stream), hocclInvalidArgument,
            "root out of range");
  expect_rc(hocclCommCount(b->comm, NULL), hocclInvalidArgument, "CommCount(NULL)");
  expect_rc(hocclCommGetAsyncError(b->comm, NULL), hocclInvalidArgument, "GetAsyncError(NULL)");
  expect_rc(hocclCommInitMpi(NULL, MPI_Comm_c2f(MPI_COMM_WORLD)), hocclInvalidArgument, "CommInitMpi(NULL)");
  expect_rc(hocclGetVersion(NULL), hocclInvalidArgument, "GetVersion(NULL)");
  expect_rc(hocclMemAlloc(b->comm, NULL, 8), hocclInvalidArgument, "MemAlloc(NULL)");
  expect_rc(hocclGroupEnd(), hocclInvalidUsage, "GroupEnd without GroupStart");
  expect(strcmp(hocclGetErrorString(hocclNumResults), "unknown result code") == 0, "GetErrorString(out of range)");
  expect_rc(hocclCommGetAsyncError(b->comm, &async), hocclSuccess, "GetAsyncError");
  expect(async == hocclSuccess, "no async error after synchronous argument errors");
  expect_rc(hocclCommUserRank(b->comm, &v), hocclSuccess, "still usable");
}

static void open_bufs(struct Bufs* b, int mpi_comm_f, size_t bytes) {
  memset(b, 0, sizeof *b);
  b->bytes = bytes;
  expect_rc(hocclCommInitMpi(&b->comm, mpi_comm_f), hocclSuccess, "CommInitMpi");
  expect_rc(hocclMemAlloc(b->comm, &b->send, bytes), hocclSuccess, "MemAlloc");
  expect_rc(hocclMemAlloc(b->comm, &b->recv, bytes), hocclSuccess, "MemAlloc");
  expect_rc(hocclStreamCreate(b->comm, &b->stream), hocclSuccess, "StreamCreate");
  b->host = malloc(bytes);
}

int main(int argc, char** argv) {
  int provided = 0, version = 0, n = 0, r = -1;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) return 2;
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  setenv("HOCCL_TIMEOUT_MS", "30000", 0);
  setenv("HOCCL_CHUNK_BYTES", "65536", 0);
  expect_rc(hocclGetVersion(&version), hocclSuccess, "GetVersion");
  expect(version == HOCCL_VERSION_CODE, "GetVersion matches HOCCL_VERSION_CODE");

  struct Bufs a, b;
  open_bufs(&a, MPI_Comm_c2f(MPI_COMM_WORLD), (size_t)1 << 20);
  open_bufs(&b, MPI_Comm_c2f(MPI_COMM_WORLD), (size_t)1 << 16);
  expect_rc(hocclCommCount(a.comm, &n), hocclSuccess, "CommCount");
  expect_rc(hocclCommUserRank(a.comm, &r), hocclSuccess, "CommUserRank");
  expect(n == g_size && r == g_rank, "count/rank match MPI's");

  collectives(&a, 0);
  collectives(&a, 1);
  collectives(&a, 40001);
  reductions(&a, 0);
  reductions(&a, 1);
  reductions(&a, 10007);
  alltoallv(&a);
  two_communicator_group(&a, &b);
  bad_arguments(&a);

  /* Abort b: calls fail with hocclAborted; destroy releases it; then the handle is unknown. */
  expect_rc(hocclCommAbort(b.comm), hocclSuccess, "CommAbort");
  expect_rc(hocclAllGather(b.send, b.recv, 1, hocclUint8, b.comm, b.stream), hocclAborted, "AllGather after abort");
  expect_rc(hocclCommAbort(b.comm), hocclSuccess, "CommAbort twice");
  expect_rc(hocclCommDestroy(b.comm), hocclSuccess, "CommDestroy after abort");
  expect_rc(hocclCommCount(b.comm, &n), hocclInvalidUsage, "CommCount after abort and destroy");

  expect_rc(hocclMemFree(a.comm, a.send), hocclSuccess, "MemFree");
  expect_rc(hocclMemFree(a.comm, a.recv), hocclSuccess, "MemFree");
  expect_rc(hocclStreamDestroy(a.comm, a.stream), hocclSuccess, "StreamDestroy");
  expect_rc(hocclCommDestroy(a.comm), hocclSuccess, "CommDestroy");
  expect_rc(hocclCommDestroy(a.comm), hocclInvalidUsage, "CommDestroy twice");
  expect_rc(hocclAllGather(a.send, a.recv, 1, hocclUint8, a.comm, a.stream), hocclInvalidUsage,
            "AllGather after destroy");
  expect_rc(hocclCommUserRank(a.comm, &r), hocclInvalidUsage, "CommUserRank after destroy");
  free(a.host);
  free(b.host);

  long total = 0, checks = 0;
  MPI_Allreduce(&g_failures, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(&g_checks, &checks, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0) printf("c_api_check: %s (%ld failures, %ld checks on %d ranks)\n", total ? "FAILED" : "OK", total, checks, g_size);
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
