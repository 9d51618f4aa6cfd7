/* Leaves the caller's session (an exec's end does not end it), then forks up to N children
 * that wait, and says "MADE REFUSED" (how many forks worked and how many the kernel refused),
 * then holds them for HOLD seconds. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: forks N HOLD\n");
        return 2;
    }
    setsid();
    int want = atoi(argv[1]), made = 0, refused = 0;
    for (int i = 0; i < want; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            pause();
            _exit(0);
        }
        if (pid < 0)
            refused++;
        else
            made++;
    }
    printf("%d %d\n", made, refused);
    fflush(stdout);
    sleep(atoi(argv[2]));
    kill(0, SIGKILL);
    return 0;
}
