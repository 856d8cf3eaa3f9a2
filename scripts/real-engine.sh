#!/usr/bin/env bash
# A real llama.cpp server for tests and demos, from Debian's archive (no GPU, no model hub).
#
#   scripts/real-engine.sh setup                 make the sid chroot and the tiny models (idempotent)
#   scripts/real-engine.sh start NAME PORT [MODEL] [-- llama-server flags...]
#                                                start llama-server NAME on 127.0.0.1:PORT and wait
#                                                for /health; MODEL: f16 (default), q8_0, q4_0;
#                                                https with --ssl-cert-file/--ssl-key-file (paths
#                                                inside the chroot: $DIR/root/...)
#   scripts/real-engine.sh stop [NAME...]        stop the named servers (default: all it started)
#   scripts/real-engine.sh status                list the servers it started
#   scripts/real-engine.sh info                  versions, model hashes, paths (key=value lines)
#
# Why a chroot, not a source build: Debian sid's llama.cpp-tools needs libc6 >= 2.43, which
# bookworm does not have; mmdebstrap makes a sid root in ~40 s (one download, ~300 MB, reused),
# while building llama.cpp and ggml from Debian's source packages takes far longer on two cores
# and still needs sid's toolchain. The chroot also gives python3-gguf for the model generator.
#
# State lives outside the repository: $DETPROXY_REAL_DIR (default /var/cache/detproxy/real):
#   root/                the sid chroot (models in root/models, generator in root/gen)
#   run/NAME.pid|.log    servers this script started; stop kills only those pids, and only
#                        while they are still llama-server processes.
# One setup runs at a time ($DIR/setup.lock); a second waits for it.
# Exit codes: 0 ok, 1 failure, 2 usage, 77 the Debian archive cannot be reached (callers skip).
set -euo pipefail

DIR=${DETPROXY_REAL_DIR:-/var/cache/detproxy/real}
ROOT=$DIR/root
RUN=$DIR/run
MIRROR=${DETPROXY_REAL_MIRROR:-http://deb.debian.org/debian}
# The versions the project's measurements were made with (docs/real-engines.md). Sid moves: a
# newer one still works, and `setup` says loudly that it differs.
PIN_TOOLS="1:0.7.0+dfsg-2"
PIN_GGUF="1:0.7.0+dfsg-2"
PACKAGES=llama.cpp-tools,python3-gguf,python3-numpy
# The official OpenAI client for the end-to-end streaming test (Node 18+, CommonJS).
OPENAI_NPM=openai@4.95.0
HERE=$(cd "$(dirname "$0")" && pwd)
GEN=$HERE/real/gen-gguf.py

die() { echo "real-engine: $*" >&2; exit 1; }
say() { echo "real-engine: $*" >&2; }
need_root() { [ "$(id -u)" -eq 0 ] || die "needs root (chroot)"; }

archive_reachable() {
  curl -fsS -o /dev/null --max-time 15 "$MIRROR/dists/sid/InRelease"
}

version_of() { chroot "$ROOT" dpkg-query -W -f='${Version}' "$1" 2>/dev/null || true; }

make_root() {
  [ -x "$ROOT/usr/bin/llama-server" ] && return 0
  if ! archive_reachable; then
    say "SKIP: the Debian archive ($MIRROR) cannot be reached; no real llama.cpp"
    exit 77
  fi
  if ! command -v mmdebstrap >/dev/null; then
    say "installing mmdebstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap \
      >/dev/null || die "cannot install mmdebstrap"
  fi
  local t0=$SECONDS tmp=$DIR/root.tmp
  rm -rf "$tmp"
  mkdir -p "$DIR"
  say "mmdebstrap sid -> $ROOT ($PACKAGES)"
  # The machine's clock may be ahead of sid's Release file: do not let apt call it expired.
  mmdebstrap --quiet --variant=apt --include="$PACKAGES" \
    --aptopt='Acquire::Check-Valid-Until "false"' sid "$tmp" "$MIRROR" \
    || { rm -rf "$tmp"; die "mmdebstrap failed"; }
  mv "$tmp" "$ROOT"
  say "chroot ready in $((SECONDS - t0)) s ($(du -sh "$ROOT" | cut -f1))"
}

check_versions() {
  local tools gguf
  tools=$(version_of llama.cpp-tools)
  gguf=$(version_of python3-gguf)
  [ -n "$tools" ] || die "llama.cpp-tools is not installed in $ROOT"
  if [ "$tools" != "$PIN_TOOLS" ] || [ "$gguf" != "$PIN_GGUF" ]; then
    say "WARNING: llama.cpp-tools $tools / python3-gguf $gguf, not the pinned" \
        "$PIN_TOOLS / $PIN_GGUF: measurements may differ"
  fi
}

# The models, regenerated when the generator changed. The F16 file is byte-identical on every
# run (fixed seed); Q8_0 and Q4_0 come from llama-quantize.
make_models() {
  local want have
  want=$(sha256sum "$GEN" | cut -d' ' -f1)
  have=$(cat "$ROOT/models/.generator" 2>/dev/null || true)
  [ "$want" = "$have" ] && [ -s "$ROOT/models/tiny-q4_0.gguf" ] && return 0
  mkdir -p "$ROOT/gen" "$ROOT/models"
  cp "$GEN" "$ROOT/gen/gen-gguf.py"
  chroot "$ROOT" python3 /gen/gen-gguf.py /models/tiny-f16.gguf.tmp
  chroot "$ROOT" python3 /gen/gen-gguf.py /models/tiny-f16.gguf.again
  cmp -s "$ROOT/models/tiny-f16.gguf.tmp" "$ROOT/models/tiny-f16.gguf.again" \
    || die "the model generator is not deterministic"
  rm -f "$ROOT/models/tiny-f16.gguf.again"
  mv "$ROOT/models/tiny-f16.gguf.tmp" "$ROOT/models/tiny-f16.gguf"
  local q
  for q in Q8_0 Q4_0; do
    local out=/models/tiny-${q,,}.gguf
    chroot "$ROOT" llama-quantize /models/tiny-f16.gguf "$out" "$q" >"$DIR/quantize.log" 2>&1 \
      || die "llama-quantize $q failed (see $DIR/quantize.log)"
  done
  echo "$want" >"$ROOT/models/.generator"
  say "models: $(cd "$ROOT/models" && sha256sum tiny-*.gguf | tr '\n' ' ')"
}

# The openai npm package in $DIR/npm (node_modules reused across builds).
make_npm() {
  [ -f "$DIR/npm/node_modules/openai/package.json" ] && return 0
  if ! command -v npm >/dev/null; then
    say "installing nodejs and npm"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm \
      >/dev/null || die "cannot install nodejs/npm"
  fi
  mkdir -p "$DIR/npm"
  npm install --prefix "$DIR/npm" --no-audit --no-fund --loglevel=error "$OPENAI_NPM" >&2 \
    || die "npm install $OPENAI_NPM failed"
}

cmd_setup() {
  need_root
  local t0=$SECONDS
  # One setup at a time: two would build the same root.tmp and models/*.tmp.
  mkdir -p "$DIR"
  exec 9>"$DIR/setup.lock"
  flock -n 9 || { say "waiting for another setup ($DIR/setup.lock)"; flock 9; }
  make_root
  check_versions
  make_models
  make_npm
  say "setup done in $((SECONDS - t0)) s"
}

cmd_info() {
  [ -x "$ROOT/usr/bin/llama-server" ] || die "not set up (run: $0 setup)"
  echo "root=$ROOT"
  echo "llama_cpp_tools=$(version_of llama.cpp-tools)"
  echo "python3_gguf=$(version_of python3-gguf)"
  echo "python3_numpy=$(version_of python3-numpy)"
  echo "node_modules=$DIR/npm/node_modules"
  local f
  for f in "$ROOT"/models/tiny-*.gguf; do
    echo "model_$(basename "$f" .gguf | sed 's/^tiny-//')=/models/$(basename "$f") $(sha256sum "$f" | cut -d' ' -f1)"
  done
}

# A pid file's process, if it is still the llama-server this script started.
live_pid() {
  local pidf=$RUN/$1.pid pid
  [ -f "$pidf" ] || return 1
  pid=$(cat "$pidf")
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "llama-server" || return 1
  echo "$pid"
}

# Still running (not exited, not a zombie waiting for this script to reap it).
alive() {
  local st
  st=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  st=${st##*) }
  [ "${st%% *}" != Z ]
}

cmd_start() {
  need_root
  [ $# -ge 2 ] || { echo "usage: $0 start NAME PORT [MODEL] [-- flags...]" >&2; exit 2; }
  local name=$1 port=$2 model=f16
  shift 2
  if [ $# -gt 0 ] && [ "$1" != "--" ]; then model=$1; shift; fi
  [ $# -gt 0 ] && [ "$1" = "--" ] && shift
  [[ $name =~ ^[A-Za-z0-9_.-]+$ ]] || die "bad name '$name'"
  [[ $port =~ ^[0-9]+$ ]] || die "bad port '$port'"
  [ -s "$ROOT/models/tiny-$model.gguf" ] || die "no model '$model' (run: $0 setup)"
  mkdir -p "$RUN"
  if pid=$(live_pid "$name"); then
    die "$name is already running (pid $pid)"
  fi
  if curl -s -o /dev/null --max-time 1 "http://127.0.0.1:$port/" 2>/dev/null; then
    die "port $port is already in use"
  fi
  # --ssl-cert-file among the flags: the server speaks https (its certificate is the caller's,
  # so the readiness check below does not verify it).
  local scheme=http arg
  for arg in "$@"; do [ "$arg" = --ssl-cert-file ] && scheme=https; done
  # -t 1: several replicas share two cores; -np 4 -c 2048: four slots of 512 tokens.
  setsid chroot "$ROOT" llama-server -m "/models/tiny-$model.gguf" --host 127.0.0.1 \
    --port "$port" -t 1 -np 4 -c 2048 --no-webui "$@" >"$RUN/$name.log" 2>&1 </dev/null &
  local pid=$!
  echo $pid >"$RUN/$name.pid"
  local i
  for i in $(seq 1 200); do
    if curl -kfsS -o /dev/null --max-time 1 "$scheme://127.0.0.1:$port/health" 2>/dev/null &&
      alive "$pid"; then
      echo "{\"name\":\"$name\",\"port\":$port,\"pid\":$pid,\"model\":\"$model\"}"
      return 0
    fi
    # Not live_pid: its cmdline check can read empty while the process is between execs.
    alive "$pid" || { tail -5 "$RUN/$name.log" >&2; rm -f "$RUN/$name.pid"; die "$name exited"; }
    sleep 0.05
  done
  cmd_stop "$name"
  die "$name did not answer /health within 10 s"
}

cmd_stop() {
  local names=("$@") n pid
  if [ ${#names[@]} -eq 0 ]; then
    for f in "$RUN"/*.pid; do [ -e "$f" ] && names+=("$(basename "$f" .pid)"); done
  fi
  for n in "${names[@]}"; do
    if pid=$(live_pid "$n"); then
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 100); do [ -d "/proc/$pid" ] || break; sleep 0.05; done
      [ -d "/proc/$pid" ] && kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$RUN/$n.pid"
  done
}

cmd_status() {
  local f n pid
  for f in "$RUN"/*.pid; do
    [ -e "$f" ] || continue
    n=$(basename "$f" .pid)
    if pid=$(live_pid "$n"); then echo "$n running pid $pid"; else echo "$n stopped"; fi
  done
}

case "${1:-}" in
  setup) shift; cmd_setup "$@" ;;
  start) shift; cmd_start "$@" ;;
  stop) shift; cmd_stop "$@" ;;
  status) shift; cmd_status ;;
  info) shift; cmd_info ;;
  *) sed -n '2,10p' "$0" >&2; exit 2 ;;
esac
