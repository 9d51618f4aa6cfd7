/* Which socket families this process may open: one line per family, "NAME opened" or
 * "NAME refused: <strerror>". AF_VSOCK is also asked for with high bits set in the argument
 * (the kernel reads an int; a filter that compared only the low bits would be fooled). */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

static void try_family(const char *name, long family, int type) {
    long fd = syscall(SYS_socket, family, type, 0);
    if (fd >= 0) {
        printf("%s opened\n", name);
        close((int)fd);
    } else {
        printf("%s refused: %s\n", name, strerror(errno));
    }
}

int main(void) {
    try_family("unix", 1, SOCK_STREAM);
    try_family("inet", 2, SOCK_STREAM);
    try_family("inet6", 10, SOCK_STREAM);
    try_family("netlink", 16, SOCK_RAW);
    try_family("vsock", 40, SOCK_STREAM);
    try_family("vsock-high-bits", 0x100000000L | 40, SOCK_STREAM);
    try_family("alg", 38, SOCK_SEQPACKET);
    try_family("packet", 17, SOCK_RAW);
    return 0;
}
