/* What the kernel's TCP knows of a connection that its socket API does not say: kept apart
 * from net/sock.c because <linux/tcp.h>, which has these fields, clashes with the
 * <netinet/tcp.h> that libuv's header brings in. */
#ifndef DP_NET_TCPINFO_H
#define DP_NET_TCPINFO_H

#include <stdint.h>

/* Bytes of data sent on TCP socket fd that the peer has acknowledged (TCP_INFO's
 * tcpi_bytes_acked, Linux 4.1 and later), the SYN not counted: 0, or -1 with errno set. */
int net_tcp_bytes_acked(int fd, uint64_t *out);

#endif
