#include "net/tcpinfo.h"

#include <errno.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <stddef.h>
#include <string.h>
#include <sys/socket.h>

int net_tcp_bytes_acked(int fd, uint64_t *out)
{
    struct tcp_info ti;
    socklen_t len = sizeof(ti);
    memset(&ti, 0, sizeof(ti));
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0)
        return -1;
    if (len < offsetof(struct tcp_info, tcpi_bytes_acked) + sizeof(ti.tcpi_bytes_acked)) {
        errno = ENOPROTOOPT; /* a kernel older than the field */
        return -1;
    }
    /* The SYN, acknowledged by the SYN-ACK, is counted as the first byte. */
    *out = ti.tcpi_bytes_acked > 0 ? ti.tcpi_bytes_acked - 1 : 0;
    return 0;
}
