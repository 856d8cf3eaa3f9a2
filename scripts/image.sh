#!/usr/bin/env bash
# `make image`: the container image ${IMAGE:-localhost/detproxy:latest}, made with podman. Two
# ways, one image (same files, same runtime settings):
#
#   IMAGE_FROM=source (default)  build deploy/docker/Dockerfile: compile inside a Debian 12
#                                build stage (apt-get there uses the host's network), then copy
#                                the binaries and their libraries onto an empty base;
#   IMAGE_FROM=host              package the binaries already built on this machine
#                                (${BUILD:-build/release}, built first if missing) and the shared
#                                libraries they load (deploy/docker/rootfs.sh,
#                                deploy/docker/Dockerfile.host): nothing from any archive or
#                                registry, a few seconds.
#
# As root it first runs scripts/podman-setup.sh, which installs podman when missing, writes the
# container config this VM needs and, for IMAGE_FROM=source, makes the debian:bookworm-slim base
# image locally (podman pulls nothing: --pull=never). Extra arguments go to `podman build`.
set -euo pipefail
cd "$(dirname "$0")/.."
image=${IMAGE:-localhost/detproxy:latest}
from=${IMAGE_FROM:-source}
case "$from" in
  source | host) ;;
  *) echo "make image: IMAGE_FROM is source or host, not '$from'" >&2; exit 2 ;;
esac
if [ "$(id -u)" -eq 0 ]; then
  if [ "$from" = host ]; then scripts/podman-setup.sh --no-base; else scripts/podman-setup.sh; fi
fi
command -v podman >/dev/null || {
  echo "make image: podman is not installed (run as root: scripts/podman-setup.sh installs it)" >&2
  exit 1
}
if [ "$from" = source ]; then
  podman image exists docker.io/library/debian:bookworm-slim || {
    echo "make image: no local debian:bookworm-slim image (as root, scripts/podman-setup.sh" \
      "makes one; IMAGE_FROM=host needs none)" >&2
    exit 1
  }
  commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
  git diff-index --quiet HEAD -- 2>/dev/null || commit="$commit-dirty"
  podman build --pull=never --network host --ignorefile deploy/docker/Dockerfile.dockerignore \
    --build-arg DETPROXY_COMMIT="$commit" -f deploy/docker/Dockerfile -t "$image" "$@" .
else
  build=${BUILD:-build/release}
  # A sanitizer build loads its runtime libraries and is several times slower: not for an image.
  if grep -qsE '^DP_(SANITIZE|TSAN):BOOL=ON' "$build/CMakeCache.txt"; then
    echo "make image: $build is a sanitizer build; IMAGE_FROM=host packages a Release build" >&2
    exit 1
  fi
  if [ ! -f "$build/CMakeCache.txt" ]; then
    scripts/deps.sh
    cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
  fi
  # Up to date with the tree (the commit `detproxy --version` reports is this tree's).
  cmake --build "$build" -j "$(nproc)" --target detproxy detproxy-sim -- --no-print-directory
  ctx=$(mktemp -d)
  trap 'rm -rf "$ctx"' EXIT
  deploy/docker/rootfs.sh "$ctx" "$build/proxy/detproxy" "$build/tests/sim/detproxy-sim"
  podman build --pull=never --network none -f deploy/docker/Dockerfile.host -t "$image" "$@" \
    "$ctx"
fi
podman image inspect --format '{{.Size}}' "$image" |
  awk -v i="$image" -v f="$from" '{printf "make image: %s (from %s), %.1f MB\n", i, f, $1 / 1e6}'
