#!/bin/sh
# The image's root file system, distroless-style, from two binaries and the machine they were
# built on: the binaries themselves (under /usr/local/bin), the shared libraries they load (ldd:
# the dynamic loader, libc, libm, libuv, libcjson, libcrypto), the CA store for https:// replicas
# and agents without upstream_tls.ca_file (docs/security.md §3), the runtime user (uid 10001) and
# the folders detproxy writes to. No shell, no package manager: about 10 MB.
#
#   deploy/docker/rootfs.sh OUT DETPROXY DETPROXY_SIM
#
# Used by both ways of making the image: the build stage of deploy/docker/Dockerfile, and
# `make image IMAGE_FROM=host` (scripts/image.sh), which packages the binaries already built on
# this machine and needs nothing from any archive. OUT/logdir is the audit log's folder, to be
# copied to /var/log/detproxy owned by the runtime user (ownership is set by the image build).
set -eu
[ $# -eq 3 ] || { echo "usage: rootfs.sh OUT DETPROXY DETPROXY_SIM" >&2; exit 2; }
out=$1 r=$1/rootfs
ca=/etc/ssl/certs/ca-certificates.crt
[ -f "$ca" ] || { echo "rootfs.sh: no CA store at $ca (Debian's ca-certificates)" >&2; exit 1; }
install -d "$r/usr/local/bin"
for b in "$2" "$3"; do
  [ -x "$b" ] || { echo "rootfs.sh: no executable $b" >&2; exit 1; }
  # A library ldd cannot find would make the image fail only when it runs: refuse it here.
  if ldd "$b" | grep 'not found' >&2; then
    echo "rootfs.sh: $b needs the libraries above, which are not installed" >&2
    exit 1
  fi
  cp -L "$b" "$r/usr/local/bin/"
done
for b in "$2" "$3"; do
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'
done | sort -u >"$out/libs"
[ -s "$out/libs" ] || { echo "rootfs.sh: ldd found no libraries (not dynamic?)" >&2; exit 1; }
while read -r lib; do cp --parents -L "$lib" "$r"; done <"$out/libs"
rm "$out/libs"
# Symbols are of no use inside the image; strip copies only, never the build tree's binaries.
if command -v strip >/dev/null; then
  strip "$r/usr/local/bin/"*
fi
install -d -m 0755 "$r/etc/ssl/certs" "$r/etc/detproxy"
install -d -m 1777 "$r/tmp"
cp "$ca" "$r/etc/ssl/certs/"
printf 'root:x:0:0:root:/root:/usr/sbin/nologin\ndetproxy:x:10001:10001::/nonexistent:/usr/sbin/nologin\n' >"$r/etc/passwd"
printf 'root:x:0:\ndetproxy:x:10001:\n' >"$r/etc/group"
printf 'hosts: files dns\n' >"$r/etc/nsswitch.conf"
install -d -m 0750 "$out/logdir"
