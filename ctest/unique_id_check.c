/* Communicators from a unique id through the C ABI (hoccl.h), without MPI: rank 0 calls
 * hocclGetUniqueId and hands the id to the other ranks (processes forked before any hoccl
 * call, the id passed through pipes, ctest/spawn_ranks.h). Rank 1 first presents the id with
 * its secret altered and must be refused with hocclInvalidArgument within seconds, the reason
 * in hocclGetLastError(); then every rank joins, and an AllReduce and an AllGather on the
 * communicator are checked against values computed here.   unique_id_check NRANKS */
#define _POSIX_C_SOURCE 200809L /* setenv, clock_gettime */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hoccl/hoccl.h"
#include "spawn_ranks.h"

/* Where hoccl's TCP bootstrap keeps the secret in the id (src/bootstrap/tcp.rs). */
#define SECRET_AT 24
#define SECRET_LEN 16
#define COUNT 10007

static int g_failures;

static void expect(int rank, int ok, const char* what) {
  if (!ok) {
    ++g_failures;
    fprintf(stderr, "unique_id_check: rank %d: FAILED: %s (last error: %s)\n", rank, what, hocclGetLastError());
  }
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int make_id(void* id, void* arg) {
  (void)arg;
  if (hocclGetUniqueId(NULL) != hocclInvalidArgument) return 1;
  hocclResult_t rc = hocclGetUniqueId((hocclUniqueId*)id);
  if (rc != hocclSuccess) fprintf(stderr, "unique_id_check: hocclGetUniqueId: %s\n", hocclGetLastError());
  return rc == hocclSuccess ? 0 : 1;
}

static int32_t ival(int r, size_t i) { return (int32_t)(i % 1000) * 3 - 1400 + r * 17; }
static float fval(int r, size_t i) { return (float)r * 0.5f + (float)(i % 512) * 0.25f; }

static int rank_main(int rank, int nranks, const void* idp, void* arg) {
  (void)arg;
  hocclUniqueId id;
  hocclComm_t comm = NULL;
  memcpy(&id, idp, sizeof id);
  if (rank == 1) {
    hocclUniqueId bad = id;
    for (int i = SECRET_AT; i < SECRET_AT + SECRET_LEN; ++i) bad.internal[i] = (char)(bad.internal[i] ^ 0x5a);
    double t0 = now_s();
    hocclResult_t rc = hocclCommInitRank(&comm, nranks, bad, rank);
    double took = now_s() - t0;
    expect(rank, rc == hocclInvalidArgument, "a wrong secret is refused with hocclInvalidArgument");
    expect(rank, strstr(hocclGetLastError(), "wrong secret") != NULL, "hocclGetLastError says the secret was wrong");
    expect(rank, took < 10.0, "the refusal comes within 10 s");
    expect(rank, comm == NULL, "a refused creation leaves NULL");
  }
  expect(rank, hocclCommInitRank(&comm, nranks, id, nranks) == hocclInvalidArgument, "rank == nranks is refused");
  if (hocclCommInitRank(&comm, nranks, id, rank) != hocclSuccess) {
    expect(rank, 0, "hocclCommInitRank");
    return 1;
  }
  int n = -1, me = -1;
  expect(rank, hocclCommCount(comm, &n) == hocclSuccess && n == nranks, "hocclCommCount");
  expect(rank, hocclCommUserRank(comm, &me) == hocclSuccess && me == rank, "hocclCommUserRank");

  void *a = NULL, *g = NULL;
  struct CUstream_st* s = NULL;
  const size_t bytes = COUNT * 4;
  int32_t* host = malloc(bytes * (size_t)nranks);
  expect(rank, hocclMemAlloc(comm, &a, bytes) == hocclSuccess, "hocclMemAlloc");
  expect(rank, hocclMemAlloc(comm, &g, bytes * (size_t)nranks) == hocclSuccess, "hocclMemAlloc");
  expect(rank, hocclStreamCreate(comm, &s) == hocclSuccess, "hocclStreamCreate");
  if (host == NULL || a == NULL || g == NULL || g_failures) return 1;

  /* AllReduce (sum, in place) on int32. */
  for (size_t i = 0; i < COUNT; ++i) host[i] = ival(rank, i);
  expect(rank, hocclMemcpyToDevice(comm, a, host, bytes) == hocclSuccess, "upload");
  expect(rank, hocclAllReduce(a, a, COUNT, hocclInt32, hocclSum, comm, s) == hocclSuccess, "hocclAllReduce");
  expect(rank, hocclStreamSynchronize(comm, s) == hocclSuccess, "hocclStreamSynchronize");
  expect(rank, hocclMemcpyToHost(comm, host, a, bytes) == hocclSuccess, "download");
  size_t bad = 0;
  for (size_t i = 0; i < COUNT; ++i) {
    int32_t want = 0;
    for (int p = 0; p < nranks; ++p) want += ival(p, i);
    bad += host[i] != want;
  }
  expect(rank, bad == 0, "AllReduce sum: wrong elements");

  /* AllGather (out of place) on float32. */
  float* f = (float*)host;
  for (size_t i = 0; i < COUNT; ++i) f[i] = fval(rank, i);
  expect(rank, hocclMemcpyToDevice(comm, a, f, bytes) == hocclSuccess, "upload");
  expect(rank, hocclAllGather(a, g, COUNT, hocclFloat32, comm, s) == hocclSuccess, "hocclAllGather");
  expect(rank, hocclStreamSynchronize(comm, s) == hocclSuccess, "hocclStreamSynchronize");
  expect(rank, hocclMemcpyToHost(comm, f, g, bytes * (size_t)nranks) == hocclSuccess, "download");
  bad = 0;
  for (int p = 0; p < nranks; ++p)
    for (size_t i = 0; i < COUNT; ++i) bad += f[(size_t)p * COUNT + i] != fval(p, i);
  expect(rank, bad == 0, "AllGather: wrong elements");

  hocclResult_t async = hocclInternalError;
  expect(rank, hocclCommGetAsyncError(comm, &async) == hocclSuccess && async == hocclSuccess, "no async error");
  expect(rank, hocclMemFree(comm, a) == hocclSuccess && hocclMemFree(comm, g) == hocclSuccess, "hocclMemFree");
  expect(rank, hocclStreamDestroy(comm, s) == hocclSuccess, "hocclStreamDestroy");
  expect(rank, hocclCommDestroy(comm) == hocclSuccess, "hocclCommDestroy");
  free(host);
  return g_failures != 0;
}

int main(int argc, char** argv) {
  int nranks = argc > 1 ? atoi(argv[1]) : 2;
  setenv("HOCCL_TIMEOUT_MS", "30000", 0);
  int rc = spawn_ranks(nranks, sizeof(hocclUniqueId), make_id, rank_main, NULL);
  printf("unique_id_check: %s (%d ranks)\n", rc == 0 ? "OK" : "FAILED", nranks);
  return rc;
}
