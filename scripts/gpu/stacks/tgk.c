/* tgk PID: send SIGUSR2 to every thread of process PID (tgkill), 0.1 s apart so that the
 * backtraces that bt.c prints do not interleave. Built by scripts/gpu/pack.sh into
 * carry/stacks/tgk (static). */
#define _GNU_SOURCE
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: tgk PID\n");
        return 2;
    }
    int pid = atoi(argv[1]);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task", pid);
    DIR *dir = opendir(path);
    if (!dir) {
        perror(path);
        return 1;
    }
    struct dirent *e;
    while ((e = readdir(dir))) {
        if (e->d_name[0] == '.') continue;
        syscall(SYS_tgkill, pid, atoi(e->d_name), SIGUSR2);
        usleep(100000);
    }
    closedir(dir);
    return 0;
}
