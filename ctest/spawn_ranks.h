/* Ranks as processes without MPI, for the unique-id tests (C and C++, POSIX only).
 *
 *   int spawn_ranks(int nranks, size_t idBytes, make_id_fn makeId, rank_fn body, void* arg);
 *
 * Forks nranks - 1 children before the caller touches the library (so no library thread is
 * ever forked), then the parent (rank 0) calls makeId to fill an id of idBytes bytes and
 * writes it into one pipe per child; child r reads it and runs body(r, nranks, id, arg) and
 * exits with its result. The parent runs body as rank 0 and returns 0 only if every rank
 * returned 0. If makeId fails the pipes are closed, each child sees end of file and exits
 * with 3, and spawn_ranks returns 1. A child killed by a signal counts as a failure. */
#ifndef HOCCL_CTEST_SPAWN_RANKS_H_
#define HOCCL_CTEST_SPAWN_RANKS_H_

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int (*make_id_fn)(void* id, void* arg);
typedef int (*rank_fn)(int rank, int nranks, const void* id, void* arg);

#define SPAWN_RANKS_MAX 16

static int spawn_ranks_io(int fd, void* buf, size_t n, int writing) {
  char* p = (char*)buf;
  while (n > 0) {
    ssize_t k = writing ? write(fd, p, n) : read(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

static int spawn_ranks(int nranks, size_t idBytes, make_id_fn makeId, rank_fn body, void* arg) {
  pid_t pids[SPAWN_RANKS_MAX];
  int fds[SPAWN_RANKS_MAX];
  unsigned char id[1024];
  int failed = 0;
  if (nranks < 1 || nranks > SPAWN_RANKS_MAX || idBytes > sizeof id) {
    fprintf(stderr, "spawn_ranks: %d ranks of an id of %zu bytes: unsupported\n", nranks, idBytes);
    return 1;
  }
  fflush(stdout);
  fflush(stderr);
  for (int r = 1; r < nranks; ++r) {
    int p[2];
    if (pipe(p) != 0) {
      perror("spawn_ranks: pipe");
      return 1;
    }
    pid_t pid = fork();
    if (pid < 0) {
      perror("spawn_ranks: fork");
      return 1;
    }
    if (pid == 0) {
      close(p[1]);
      for (int q = 1; q < r; ++q) close(fds[q]);
      if (spawn_ranks_io(p[0], id, idBytes, 0) != 0) _exit(3);
      close(p[0]);
      int rc = body(r, nranks, id, arg);
      fflush(stdout);
      fflush(stderr);
      _exit(rc == 0 ? 0 : 1);
    }
    close(p[0]);
    pids[r] = pid;
    fds[r] = p[1];
  }
  int made = makeId(id, arg) == 0;
  for (int r = 1; r < nranks; ++r) {
    if (made && spawn_ranks_io(fds[r], id, idBytes, 1) != 0) {
      fprintf(stderr, "spawn_ranks: could not pass the id to rank %d\n", r);
      failed = 1;
    }
    close(fds[r]);
  }
  if (!made) {
    fprintf(stderr, "spawn_ranks: making the id failed\n");
    failed = 1;
  } else if (body(0, nranks, id, arg) != 0) {
    failed = 1;
  }
  for (int r = 1; r < nranks; ++r) {
    int st = 0;
    while (waitpid(pids[r], &st, 0) < 0 && errno == EINTR) {
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      if (WIFSIGNALED(st))
        fprintf(stderr, "spawn_ranks: rank %d killed by signal %d\n", r, WTERMSIG(st));
      else if (made)
        fprintf(stderr, "spawn_ranks: rank %d exited with %d\n", r, WEXITSTATUS(st));
      failed = 1;
    }
  }
  return failed;
}

#endif /* HOCCL_CTEST_SPAWN_RANKS_H_ */
