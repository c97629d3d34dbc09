/* Preloaded (LD_PRELOAD) into a process that may hang: on SIGUSR2 the receiving thread
 * writes its backtrace to stderr between "== BT tid N name" and "== END" lines. Frames
 * of the program come as "path(+0xOFFSET)"; scripts/gpu/symbolize.sh turns them into
 * functions with the unstripped binary of the build machine. Diagnostics only: backtrace
 * is not async-signal-safe, which is acceptable in a process about to be killed.
 * Built by scripts/gpu/pack.sh into carry/stacks/libbt.so. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static void on_signal(int sig) {
    (void)sig;
    void *frames[48];
    int n = backtrace(frames, 48);
    char name[32] = {0};
    pthread_getname_np(pthread_self(), name, sizeof name);
    char head[96];
    int len = snprintf(head, sizeof head, "== BT tid %ld %s\n", (long)syscall(SYS_gettid), name);
    if (write(2, head, len) < 0) return;
    backtrace_symbols_fd(frames, n, 2);
    if (write(2, "== END\n", 7) < 0) return;
}

__attribute__((constructor)) static void install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR2, &sa, 0);
    void *warm[2];
    backtrace(warm, 2); /* loads libgcc's unwinder now, not inside the handler */
}
