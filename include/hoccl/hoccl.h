/* hoccl C API, shaped like NCCL's. Link the CMake target hoccl::hoccl (find_package(hoccl
 * CONFIG)) or pkg-config `hoccl`. C99 and C++.
 *
 * Results: every function returns a hocclResult_t; hocclGetErrorString() describes a code and
 * hocclGetLastError() gives the message of the calling thread's last failed call. No
 * function crashes on a NULL pointer or an unknown enum value: those are
 * hocclInvalidArgument.
 *
 * Handles: a hocclComm_t is an id, not a pointer. Once hocclCommDestroy returned, every call
 * with that handle returns hocclInvalidUsage. After hocclCommAbort every call returns
 * hocclAborted, except hocclCommAbort (success again) and hocclCommDestroy (success, and
 * the handle is released; optional after an abort, it frees a few bytes).
 *
 * Semantics (as NCCL's): every operation is enqueued on `stream`, a `struct CUstream_st*`
 * (hoccl/cuda_stream.h: CUDA's CUstream and cudaStream_t, passed unchanged; on the host
 * backend one from hocclStreamCreate; NULL is the default stream), and returns at once; it
 * starts after the work before it on that stream and completes before the work after it.
 * Every rank calls collectives in the same order. Counts are in elements of `datatype`. A
 * failure that happens later (a peer died, ranks disagreeing on counts, a timeout) is
 * reported by hocclCommGetAsyncError and makes later calls fail instead of hang.
 */
#ifndef HOCCL_H_
#define HOCCL_H_

#include <stddef.h>

#include "hoccl/cuda_stream.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HOCCL_MAJOR 0
#define HOCCL_MINOR 1
#define HOCCL_PATCH 0
/* HOCCL_MAJOR * 10000 + HOCCL_MINOR * 100 + HOCCL_PATCH, as hocclGetVersion reports it. */
#define HOCCL_VERSION_CODE (HOCCL_MAJOR * 10000 + HOCCL_MINOR * 100 + HOCCL_PATCH)

typedef enum {
  hocclSuccess = 0,
  hocclCudaError = 1,       /* a CUDA driver call failed */
  hocclSystemError = 2,     /* an OS call failed (shared memory, threads, dlopen) */
  hocclInternalError = 3,   /* a bug in hoccl */
  hocclInvalidArgument = 4, /* NULL or too-short buffer, bad data type, bad rank, overflow */
  hocclInvalidUsage = 5,    /* bad call sequence: destroyed handle, unmatched group end, ranks disagreeing */
  hocclRemoteError = 6,     /* a peer failed or disappeared */
  hocclInProgress = 7,
  hocclTimeout = 8,         /* no progress within HOCCL_TIMEOUT_MS */
  hocclCorruptData = 9,     /* compressed data failed validation */
  hocclAborted = 10,        /* the communicator was aborted */
  hocclMpiError = 11,       /* MPI reported an error */
  hocclNoDevice = 12,       /* the requested backend or GPU is not present */
  hocclNumResults = 13
} hocclResult_t;

/* NCCL's numbering, so ncclDataType_t values pass through unchanged. */
typedef enum {
  hocclInt8 = 0,
  hocclChar = 0,
  hocclUint8 = 1,
  hocclInt32 = 2,
  hocclInt = 2,
  hocclUint32 = 3,
  hocclInt64 = 4,
  hocclUint64 = 5,
  hocclFloat16 = 6,
  hocclHalf = 6,
  hocclFloat32 = 7,
  hocclFloat = 7,
  hocclFloat64 = 8,
  hocclDouble = 8,
  hocclBfloat16 = 9,
  hocclFloat8e4m3 = 10,
  hocclFloat8e5m2 = 11,
  hocclNumTypes = 12
} hocclDataType_t;

/* Reduction operators, NCCL's numbering (ncclRedOp_t values pass through unchanged). Every
 * reduction folds the ranks' inputs in rank order 0..n-1 with the arithmetic of
 * src/reduce.rs (16- and 8-bit floats computed in f32 and rounded each step; hocclAvg is
 * the sum divided by the number of ranks), so results are deterministic, bit for bit. */
typedef enum {
  hocclSum = 0,
  hocclProd = 1,
  hocclMax = 2,
  hocclMin = 3,
  hocclAvg = 4,
  hocclNumOps = 5
} hocclRedOp_t;

typedef struct hocclComm* hocclComm_t;

/* A TCP rendezvous (hocclGetUniqueId, hocclCommInitRank): the root's address and port and a
 * random secret every joining rank must present. Copy it to the other ranks by any means
 * (a pipe, a file, MPI_Bcast); it is a secret, so do not log its bytes. */
#define HOCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[HOCCL_UNIQUE_ID_BYTES];
} hocclUniqueId;

/* ---- library ------------------------------------------------------------------------- */
hocclResult_t hocclGetVersion(int* version);
const char* hocclGetErrorString(hocclResult_t result);
/* Message of this thread's last failed call ("" if none); valid until its next failure. */
const char* hocclGetLastError(void);

/* ---- communicators ------------------------------------------------------------------- */
/* Create a communicator over the MPI communicator whose Fortran handle is `mpiCommF`
 * (MPI_Comm_c2f(comm)). Collective over that communicator; MPI must be initialized (with
 * MPI_THREAD_MULTIPLE, or SERIALIZED if the application does not call MPI concurrently).
 * Reads the HOCCL_* environment variables. *comm is NULL on failure. */
hocclResult_t hocclCommInitMpi(hocclComm_t* comm, int mpiCommF);
/* Without MPI, as NCCL's ncclGetUniqueId / ncclCommInitRank. hocclGetUniqueId makes a fresh
 * id and starts a thread in this process that serves the rendezvous (listening on the
 * interface HOCCL_SOCKET_IFNAME chooses, else the first non-loopback one that is up, else
 * loopback): this process must live until every rank has joined. Each of the nranks ranks
 * then calls hocclCommInitRank with the id; it returns once all have joined (every wait
 * bounded by HOCCL_TIMEOUT_MS: hocclTimeout). The root refuses, with hocclInvalidArgument
 * and the reason in hocclGetLastError(), a wrong secret, a duplicate or out-of-range rank
 * and an nranks differing from the first joiner's; a refused rank may call again. Reads
 * the HOCCL_* environment variables. *comm is NULL on failure. */
hocclResult_t hocclGetUniqueId(hocclUniqueId* uniqueId);
hocclResult_t hocclCommInitRank(hocclComm_t* comm, int nranks, hocclUniqueId commId, int rank);
/* Wait for pending operations (bounded by the timeout), then release the communicator.
 * Returns the asynchronous error if one occurred; the handle is released in every case.
 * Call before MPI_Finalize. */
hocclResult_t hocclCommDestroy(hocclComm_t comm);
/* Tear down from any state, without waiting: pending operations fail. */
hocclResult_t hocclCommAbort(hocclComm_t comm);
/* *asyncError becomes the communicator's asynchronous error (hocclSuccess if none); its
 * message becomes this thread's last error. */
hocclResult_t hocclCommGetAsyncError(hocclComm_t comm, hocclResult_t* asyncError);
hocclResult_t hocclCommCount(hocclComm_t comm, int* count);
hocclResult_t hocclCommUserRank(hocclComm_t comm, int* rank);

/* ---- groups -------------------------------------------------------------------------- */
/* Thread-global as NCCL's: sends and receives (and collectives) called on this thread
 * between the outermost start and end, on any communicators, are launched together at the
 * end, so any pattern of pairs completes without deadlock. All calls of one communicator
 * within a group must use the same stream, and no other thread may use that communicator
 * while the group is open (its group is per communicator underneath). */
hocclResult_t hocclGroupStart(void);
hocclResult_t hocclGroupEnd(void);

/* ---- point to point and collectives --------------------------------------------------- */
hocclResult_t hocclSend(const void* sendbuff, size_t count, hocclDataType_t datatype, int peer, hocclComm_t comm,
                        struct CUstream_st* stream);
hocclResult_t hocclRecv(void* recvbuff, size_t count, hocclDataType_t datatype, int peer, hocclComm_t comm,
                        struct CUstream_st* stream);
/* recvbuff holds size * sendcount elements, rank r's at offset r * sendcount. In place when
 * sendbuff == recvbuff + rank * sendcount (in elements). */
hocclResult_t hocclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, hocclDataType_t datatype,
                             hocclComm_t comm, struct CUstream_st* stream);
/* Block j (count elements) of sendbuff goes to rank j, which stores it as block `rank` of
 * recvbuff. The buffers must not overlap. */
hocclResult_t hocclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, hocclDataType_t datatype,
                            hocclComm_t comm, struct CUstream_st* stream);
/* Per-peer counts and displacements in elements, one entry per rank (MPI_Alltoallv's
 * layout): sendcounts[j] elements at sendbuff + sdispls[j] go to rank j, which receives them
 * at recvbuff + rdispls[rank]; recvcounts[i] must equal rank i's sendcounts[rank]. */
hocclResult_t hocclAlltoAllv(const void* sendbuff, const size_t* sendcounts, const size_t* sdispls, void* recvbuff,
                             const size_t* recvcounts, const size_t* rdispls, hocclDataType_t datatype,
                             hocclComm_t comm, struct CUstream_st* stream);
/* root's count elements into every rank's recvbuff (sendbuff is read on the root only; in
 * place when sendbuff == recvbuff). */
hocclResult_t hocclBroadcast(const void* sendbuff, void* recvbuff, size_t count, hocclDataType_t datatype, int root,
                             hocclComm_t comm, struct CUstream_st* stream);
/* Every rank's count elements into block `rank` of root's recvbuff (size * count elements,
 * used on the root only). */
hocclResult_t hocclGather(const void* sendbuff, void* recvbuff, size_t count, hocclDataType_t datatype, int root,
                          hocclComm_t comm, struct CUstream_st* stream);
/* Block j of root's sendbuff (size * count elements) into rank j's recvbuff. */
hocclResult_t hocclScatter(const void* sendbuff, void* recvbuff, size_t count, hocclDataType_t datatype, int root,
                           hocclComm_t comm, struct CUstream_st* stream);

/* Every rank's count elements of sendbuff reduced with op into every rank's recvbuff (in
 * place when sendbuff == recvbuff). */
hocclResult_t hocclAllReduce(const void* sendbuff, void* recvbuff, size_t count, hocclDataType_t datatype,
                             hocclRedOp_t op, hocclComm_t comm, struct CUstream_st* stream);
/* sendbuff holds size * recvcount elements; block j of every rank's sendbuff, reduced with
 * op, into rank j's recvbuff (in place when recvbuff == sendbuff + rank * recvcount). */
hocclResult_t hocclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, hocclDataType_t datatype,
                                 hocclRedOp_t op, hocclComm_t comm, struct CUstream_st* stream);
/* Every rank's count elements reduced with op into root's recvbuff (used on the root only;
 * in place when the root's sendbuff == recvbuff). */
hocclResult_t hocclReduce(const void* sendbuff, void* recvbuff, size_t count, hocclDataType_t datatype,
                          hocclRedOp_t op, int root, hocclComm_t comm, struct CUstream_st* stream);

/* ---- device helpers --------------------------------------------------------------------
 * On the communicator's device. With CUDA, an application's own cudaMalloc memory and
 * streams work as well; on the host backend (no GPU) buffers and streams must come from
 * these. What they create is released with the communicator (destroy or abort). */
hocclResult_t hocclMemAlloc(hocclComm_t comm, void** ptr, size_t bytes);
hocclResult_t hocclMemFree(hocclComm_t comm, void* ptr);
hocclResult_t hocclStreamCreate(hocclComm_t comm, struct CUstream_st** stream);
hocclResult_t hocclStreamDestroy(hocclComm_t comm, struct CUstream_st* stream);
hocclResult_t hocclStreamSynchronize(hocclComm_t comm, struct CUstream_st* stream);
/* Synchronous copies between host memory and device memory. */
hocclResult_t hocclMemcpyToDevice(hocclComm_t comm, void* dst, const void* src, size_t bytes);
hocclResult_t hocclMemcpyToHost(hocclComm_t comm, void* dst, const void* src, size_t bytes);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* HOCCL_H_ */
