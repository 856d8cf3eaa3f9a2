#!/usr/bin/env bash
# Prepare podman on a machine like the project's CI VM (Debian 12, root, no container registry
# reachable). These are THIS VM's needs, not recommendations for other hosts:
#   - crun fails here (cgroup v1/v2 hybrid layout): runc is made the engine's runtime;
#   - setrlimit inside containers fails unless containers.conf has default_ulimits = [];
#   - no registry: debian:bookworm-slim (the Dockerfile's base) is made locally with
#     `mmdebstrap --variant=minbase bookworm` and `podman import`;
#   - `podman kube play` builds its pause image around catatonit, which podman only recommends
#     (and this script installs without recommends).
#
#   scripts/podman-setup.sh             # everything, the base image included
#   scripts/podman-setup.sh --no-base   # podman and its config only: for an image that needs no
#                                       # base (`make image IMAGE_FROM=host`)
#
# `make image` runs it (scripts/image.sh). Idempotent; run as root. Packages are installed only
# when missing. Exit 0 when podman is ready, else non-zero with the reason.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
base=1
case "${1:-}" in
  "") ;;
  --no-base) base=0 ;;
  *) echo "usage: podman-setup.sh [--no-base]" >&2; exit 2 ;;
esac
[ "$(id -u)" -eq 0 ] || { echo "podman-setup: run as root" >&2; exit 1; }
pkgs=(podman runc catatonit)
[ $base -eq 1 ] && pkgs+=(mmdebstrap)
need=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "podman-setup: installing ${need[*]}" >&2
  apt-get update -qq || true
  apt-get install -y -qq --no-install-recommends "${need[@]}" uidmap slirp4netns fuse-overlayfs >&2
fi
conf=/etc/containers/containers.conf
if ! grep -qs '^# detproxy podman-setup' "$conf"; then
  [ -f "$conf" ] && cp "$conf" "$conf.before-detproxy"
  install -d /etc/containers
  cat >>"$conf" <<'CONF'
# detproxy podman-setup (scripts/podman-setup.sh): this VM's needs, see that script.
[containers]
default_ulimits = []
[engine]
runtime = "runc"
CONF
fi
if [ $base -eq 0 ]; then
  podman info >/dev/null
  echo "podman-setup: ok (no base image)" >&2
  exit 0
fi
if ! podman image exists docker.io/library/debian:bookworm-slim; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "podman-setup: building the debian:bookworm-slim base with mmdebstrap (minbase)" >&2
  mmdebstrap --quiet --variant=minbase bookworm "$tmp/base.tar"
  podman import "$tmp/base.tar" docker.io/library/debian:bookworm-slim >/dev/null
fi
podman run --rm --network none docker.io/library/debian:bookworm-slim true
echo "podman-setup: ok" >&2
