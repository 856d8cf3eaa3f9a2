#!/usr/bin/env bash
# `make image`: build deploy/docker/Dockerfile with podman into ${IMAGE:-localhost/detproxy:latest}.
# Needs the debian:bookworm-slim base image locally (podman pulls nothing: --pull=never); on a
# machine without a registry make it with scripts/podman-setup.sh. The build uses the host's
# network for apt inside the build stage.
set -euo pipefail
cd "$(dirname "$0")/.."
image=${IMAGE:-localhost/detproxy:latest}
command -v podman >/dev/null || { echo "make image: podman is not installed" >&2; exit 1; }
podman image exists docker.io/library/debian:bookworm-slim || {
  echo "make image: no local debian:bookworm-slim image (scripts/podman-setup.sh makes one)" >&2
  exit 1
}
commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
git diff-index --quiet HEAD -- 2>/dev/null || commit="$commit-dirty"
podman build --pull=never --network host --ignorefile deploy/docker/Dockerfile.dockerignore \
  --build-arg DETPROXY_COMMIT="$commit" -f deploy/docker/Dockerfile -t "$image" "$@" .
podman image inspect --format '{{.Size}}' "$image" |
  awk -v i="$image" '{printf "make image: %s, %.1f MB\n", i, $1 / 1e6}'
