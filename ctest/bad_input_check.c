/* Bad input through the C ABI (hoccl.h) from a C program, table-driven (the table in prose
 * is docs/design.md, "Errors"; tests/bad_input.rs drives the same classes from Rust). Ranks
 * are forked processes joined through a unique id (ctest/spawn_ranks.h). Each case must
 * return its documented code with a message in hocclGetLastError(), on every rank alike (a
 * buffer fault goes into the buffer every rank uses), and a good AllReduce afterwards must
 * give the right sum.   bad_input_check NRANKS */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hoccl/hoccl.h"
#include "spawn_ranks.h"

#define BYTES 4096
#define COUNT 16

static int g_failures;

static void expect(int rank, int ok, const char* what, int ci) {
  if (!ok) {
    ++g_failures;
    fprintf(stderr, "bad_input_check: rank %d: case %d: FAILED: %s (last error: %s)\n", rank, ci, what, hocclGetLastError());
  }
}

enum op { ALLGATHER, ALLTOALL, BROADCAST, GATHER, SCATTER, ALLREDUCE, REDUCESCATTER, REDUCE, SEND, RECV, NOPS };
static const char* const op_names[NOPS] = {"AllGather", "AlltoAll", "Broadcast", "Gather", "Scatter",
                                           "AllReduce", "ReduceScatter", "Reduce", "Send", "Recv"};

enum fault { NULL_BUF, HOST_PTR, FREED_PTR, SHORT_BUF, OVERFLOW, DTYPE_NEG, DTYPE_PAST, OP_PAST, OP_NEG,
             ROOT_SIZE, ROOT_NEG, PEER_SIZE, PEER_NEG, COMM_NULL, COMM_NEVER, COMM_DESTROYED, COMM_ABORTED, NFAULTS };
static const struct {
  const char* name;
  hocclResult_t want;
} faults[NFAULTS] = {
    {"NULL buffer", hocclInvalidArgument},        {"host pointer", hocclInvalidArgument},
    {"freed pointer", hocclInvalidArgument},      {"buffer shorter than the count", hocclInvalidArgument},
    {"byte size overflows", hocclInvalidArgument}, {"dtype -1", hocclInvalidArgument},
    {"dtype hocclNumTypes", hocclInvalidArgument}, {"op hocclNumOps", hocclInvalidArgument},
    {"op -1", hocclInvalidArgument},              {"root = size", hocclInvalidArgument},
    {"root -1", hocclInvalidArgument},            {"peer = size", hocclInvalidArgument},
    {"peer -1", hocclInvalidArgument},            {"NULL communicator", hocclInvalidArgument},
    {"never-created communicator", hocclInvalidUsage}, {"destroyed communicator", hocclInvalidUsage},
    {"aborted communicator", hocclAborted},
};

static int applies(int f, int op) {
  int reduces = op == ALLREDUCE || op == REDUCESCATTER || op == REDUCE;
  int rooted = op == BROADCAST || op == GATHER || op == SCATTER || op == REDUCE;
  int p2p = op == SEND || op == RECV;
  if (f == OP_PAST || f == OP_NEG) return reduces;
  if (f == ROOT_SIZE || f == ROOT_NEG) return rooted;
  if (f == PEER_SIZE || f == PEER_NEG) return p2p;
  return 1;
}

struct ctx {
  hocclComm_t comm, destroyed, aborted;
  struct CUstream_st* s;
  void *a, *b, *freed;
  char host[BYTES];
  int rank, nranks;
};

static hocclResult_t call(struct ctx* c, int op, int f) {
  const void* sb = c->a;
  void* rb = c->b;
  size_t n = COUNT;
  int dt = hocclFloat32, red = hocclSum;
  int root = (op == SEND || op == RECV) ? (c->rank + 1) % c->nranks : 0;
  hocclComm_t comm = c->comm;
  /* The buffer every rank uses: the receive buffer of Broadcast, Scatter and Recv. */
  int recv_side = op == BROADCAST || op == SCATTER || op == RECV;
  void* bad = NULL;
  switch (f) {
    case NULL_BUF: bad = NULL; break;
    case HOST_PTR: bad = c->host; break;
    case FREED_PTR: bad = c->freed; break;
    case SHORT_BUF: n = BYTES / 4 + 1; break;
    case OVERFLOW: n = SIZE_MAX / 2; break;
    case DTYPE_NEG: dt = -1; break;
    case DTYPE_PAST: dt = hocclNumTypes; break;
    case OP_PAST: red = hocclNumOps; break;
    case OP_NEG: red = -1; break;
    case ROOT_SIZE: case PEER_SIZE: root = c->nranks; break;
    case ROOT_NEG: case PEER_NEG: root = -1; break;
    case COMM_NULL: comm = NULL; break;
    case COMM_NEVER: comm = (hocclComm_t)(uintptr_t)0x1000; break;
    case COMM_DESTROYED: comm = c->destroyed; break;
    case COMM_ABORTED: comm = c->aborted; break;
    default: break;
  }
  if (f == NULL_BUF || f == HOST_PTR || f == FREED_PTR) {
    if (recv_side) rb = bad;
    else sb = bad;
  }
  switch (op) {
    case ALLGATHER: return hocclAllGather(sb, rb, n, dt, comm, c->s);
    case ALLTOALL: return hocclAlltoAll(sb, rb, n, dt, comm, c->s);
    case BROADCAST: return hocclBroadcast(sb, rb, n, dt, root, comm, c->s);
    case GATHER: return hocclGather(sb, rb, n, dt, root, comm, c->s);
    case SCATTER: return hocclScatter(sb, rb, n, dt, root, comm, c->s);
    case ALLREDUCE: return hocclAllReduce(sb, rb, n, dt, red, comm, c->s);
    case REDUCESCATTER: return hocclReduceScatter(sb, rb, n, dt, red, comm, c->s);
    case REDUCE: return hocclReduce(sb, rb, n, dt, red, root, comm, c->s);
    case SEND: return hocclSend(sb, n, dt, root, comm, c->s);
    default: return hocclRecv(rb, n, dt, root, comm, c->s);
  }
}

static float val(int r, int ci, int k) { return (float)(r * 1000 + ci * 10 + k); }

/* A good AllReduce (sum) after case ci, checked. */
static void good(struct ctx* c, int ci) {
  float in[COUNT], out[COUNT];
  for (int k = 0; k < COUNT; ++k) in[k] = val(c->rank, ci, k);
  expect(c->rank, hocclMemcpyToDevice(c->comm, c->a, in, sizeof in) == hocclSuccess, "upload", ci);
  expect(c->rank, hocclAllReduce(c->a, c->b, COUNT, hocclFloat32, hocclSum, c->comm, c->s) == hocclSuccess, "good AllReduce", ci);
  expect(c->rank, hocclStreamSynchronize(c->comm, c->s) == hocclSuccess, "synchronize", ci);
  expect(c->rank, hocclMemcpyToHost(c->comm, out, c->b, sizeof out) == hocclSuccess, "download", ci);
  for (int k = 0; k < COUNT; ++k) {
    float want = 0;
    for (int p = 0; p < c->nranks; ++p) want += val(p, ci, k);
    if (out[k] != want) {
      expect(c->rank, 0, "good AllReduce: wrong sum", ci);
      break;
    }
  }
}

static hocclComm_t solo(void) {
  hocclUniqueId id;
  hocclComm_t comm = NULL;
  if (hocclGetUniqueId(&id) != hocclSuccess || hocclCommInitRank(&comm, 1, id, 0) != hocclSuccess) return NULL;
  return comm;
}

static int make_id(void* id, void* arg) {
  (void)arg;
  return hocclGetUniqueId((hocclUniqueId*)id) == hocclSuccess ? 0 : 1;
}

static int rank_main(int rank, int nranks, const void* idp, void* arg) {
  (void)arg;
  static struct ctx c;
  hocclUniqueId id;
  memcpy(&id, idp, sizeof id);
  c.rank = rank;
  c.nranks = nranks;
  if (hocclCommInitRank(&c.comm, nranks, id, rank) != hocclSuccess) {
    expect(rank, 0, "hocclCommInitRank", -1);
    return 1;
  }
  c.destroyed = solo();
  c.aborted = solo();
  expect(rank, c.destroyed && c.aborted, "one-rank communicators", -1);
  expect(rank, hocclCommDestroy(c.destroyed) == hocclSuccess, "destroy", -1);
  expect(rank, hocclCommAbort(c.aborted) == hocclSuccess, "abort", -1);
  expect(rank, hocclStreamCreate(c.comm, &c.s) == hocclSuccess, "hocclStreamCreate", -1);
  expect(rank, hocclMemAlloc(c.comm, &c.a, BYTES) == hocclSuccess && hocclMemAlloc(c.comm, &c.b, BYTES) == hocclSuccess,
         "hocclMemAlloc", -1);
  if (g_failures) return 1;
  int ci = 0;
  for (int op = 0; op < NOPS; ++op) {
    for (int f = 0; f < NFAULTS; ++f) {
      if (!applies(f, op)) continue;
      if (f == FREED_PTR) {
        /* A fresh freed address: nothing allocates between this free and the call (the good
         * AllReduce may allocate scratch, which can take an older freed address). */
        expect(rank, hocclMemAlloc(c.comm, &c.freed, BYTES) == hocclSuccess && hocclMemFree(c.comm, c.freed) == hocclSuccess,
               "a freed allocation", ci);
      }
      hocclResult_t rc = call(&c, op, f);
      if (rc != faults[f].want || hocclGetLastError()[0] == '\0') {
        ++g_failures;
        fprintf(stderr, "bad_input_check: rank %d: %s with %s: got %d (%s), want %d\n", rank, op_names[op], faults[f].name,
                (int)rc, hocclGetLastError(), (int)faults[f].want);
      }
      good(&c, ci++);
    }
  }
  /* Group misuse: an end without a start; nested groups balance. */
  expect(rank, hocclGroupEnd() == hocclInvalidUsage, "GroupEnd without GroupStart", ci);
  for (int i = 0; i < 3; ++i) expect(rank, hocclGroupStart() == hocclSuccess, "GroupStart", ci);
  for (int i = 0; i < 3; ++i) expect(rank, hocclGroupEnd() == hocclSuccess, "GroupEnd", ci);
  expect(rank, hocclGroupEnd() == hocclInvalidUsage, "one GroupEnd too many", ci);
  expect(rank, hocclMemFree(c.comm, c.freed) == hocclInvalidArgument, "freeing twice", ci);
  good(&c, ci);
  hocclResult_t async = hocclInternalError;
  expect(rank, hocclCommGetAsyncError(c.comm, &async) == hocclSuccess && async == hocclSuccess, "no async error", ci);
  expect(rank, hocclCommDestroy(c.aborted) == hocclSuccess, "destroying an aborted handle", ci);
  expect(rank, hocclMemFree(c.comm, c.a) == hocclSuccess && hocclMemFree(c.comm, c.b) == hocclSuccess, "hocclMemFree", ci);
  expect(rank, hocclCommDestroy(c.comm) == hocclSuccess, "hocclCommDestroy", ci);
  printf("bad_input_check: rank %d: %d cases\n", rank, ci);
  return g_failures != 0;
}

int main(int argc, char** argv) {
  int nranks = argc > 1 ? atoi(argv[1]) : 2;
  setenv("HOCCL_TIMEOUT_MS", "30000", 0);
  int rc = spawn_ranks(nranks, sizeof(hocclUniqueId), make_id, rank_main, NULL);
  printf("bad_input_check: %s (%d ranks)\n", rc == 0 ? "OK" : "FAILED", nranks);
  return rc;
}
