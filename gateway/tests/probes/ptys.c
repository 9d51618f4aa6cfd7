/* Opens up to N ptys through PTMX (each unlocked) and says how many it got and why it
 * stopped ("COUNT ok" or "COUNT ERROR"), then holds them for HOLD seconds. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: ptys PTMX N [HOLD]\n");
        return 2;
    }
    int want = atoi(argv[2]), got = 0, err = 0;
    for (int i = 0; i < want; i++) {
        int fd = open(argv[1], O_RDWR | O_NOCTTY);
        if (fd < 0 || unlockpt(fd) != 0) {
            err = errno;
            break;
        }
        got++;
    }
    printf("%d %s\n", got, err ? strerror(err) : "ok");
    fflush(stdout);
    if (argc > 3)
        sleep(atoi(argv[3]));
    return 0;
}
