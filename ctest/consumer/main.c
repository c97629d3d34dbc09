/* A C program linking the installed hoccl through its C header: create a communicator over
 * MPI_COMM_WORLD, Broadcast from rank 0, check, destroy. */
#include <mpi.h>
#include <stdio.h>
#include <string.h>

#include <hoccl/hoccl.h>

#define CHECK(call)                                                                           \
  do {                                                                                        \
    hocclResult_t rc_ = (call);                                                               \
    if (rc_ != hocclSuccess) {                                                                \
      fprintf(stderr, "consumer_c: %s: %s: %s\n", #call, hocclGetErrorString(rc_), hocclGetLastError()); \
      ok = 0;                                                                                 \
      goto done;                                                                              \
    }                                                                                         \
  } while (0)

int main(int argc, char** argv) {
  int provided = 0, rank = 0, ok = 1, all_ok = 0;
  unsigned char host[4096];
  void* buf = NULL;
  struct CUstream_st* stream = NULL;
  hocclComm_t comm = NULL;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) return 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  CHECK(hocclCommInitMpi(&comm, MPI_Comm_c2f(MPI_COMM_WORLD)));
  CHECK(hocclMemAlloc(comm, &buf, sizeof host));
  CHECK(hocclStreamCreate(comm, &stream));
  for (size_t i = 0; i < sizeof host; ++i) host[i] = rank == 0 ? (unsigned char)(i * 7 + 1) : 0;
  CHECK(hocclMemcpyToDevice(comm, buf, host, sizeof host));
  CHECK(hocclBroadcast(buf, buf, sizeof host, hocclUint8, 0, comm, stream));
  CHECK(hocclStreamSynchronize(comm, stream));
  memset(host, 0, sizeof host);
  CHECK(hocclMemcpyToHost(comm, host, buf, sizeof host));
  for (size_t i = 0; i < sizeof host; ++i) ok = ok && host[i] == (unsigned char)(i * 7 + 1);
done:
  if (comm != NULL && hocclCommDestroy(comm) != hocclSuccess) ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0) printf("consumer_c: %s (Broadcast checked)\n", all_ok ? "OK" : "FAILED");
  MPI_Finalize();
  return all_ok ? 0 : 1;
}
