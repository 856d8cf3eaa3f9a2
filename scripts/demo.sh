#!/usr/bin/env bash
# `make demo`: three simulated replicas and detproxy on loopback, a scripted tour with curl,
# then keep serving until Ctrl-C (DEMO_ONESHOT=1 exits after the tour).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-build/release}
BIN="$here/$build/proxy/detproxy"
SIM="$here/$build/tests/sim/detproxy-sim"
work=$(mktemp -d /tmp/detproxy-demo.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

PORT=${DEMO_PORT:-18080}
ADMIN=${DEMO_ADMIN_PORT:-19901}
SIM_BASE=${DEMO_SIM_PORT:-18101}
MODEL=demo/llama-sim
CKPT=$(printf 'demo-checkpoint' | sha256sum | cut -c1-64)

bold() { printf '\n\033[1m%s\033[0m\n' "$*"; }
say() { printf '  %s\n' "$*"; }
show() { printf '  $ %s\n' "$*"; eval "$@" | sed 's/^/    /'; }

wait_port() {
  for _ in $(seq 1 100); do
    curl -s -o /dev/null "http://127.0.0.1:$1$2" && return 0
    sleep 0.05
  done
  echo "port $1 did not come up" >&2; exit 1
}

bold "Starting three simulated vLLM replicas (r1, r2 identical; r3 deployed from another quantization)"
for i in 1 2 3; do
  quant=awq; [ "$i" = 3 ] && quant=gptq
  "$SIM" --listen "127.0.0.1:$((SIM_BASE + i - 1))" --flavor vllm --model "$MODEL" \
    --quantization "$quant" --checkpoint-sha256 "$CKPT" --token-delay-ms 15 \
    2>"$work/sim$i.log" &
  pids+=($!)
done
for i in 1 2 3; do wait_port $((SIM_BASE + i - 1)) /health; done
say "r1 127.0.0.1:$SIM_BASE, r2 127.0.0.1:$((SIM_BASE + 1)), r3 127.0.0.1:$((SIM_BASE + 2))"

cat > "$work/detproxy.json" <<JSON
{
  "listen": "127.0.0.1:$PORT",
  "admin_listen": "127.0.0.1:$ADMIN",
  "pools": [{
    "name": "llama", "models": ["$MODEL"],
    "replicas": [
      {"name": "r1", "url": "http://127.0.0.1:$SIM_BASE"},
      {"name": "r2", "url": "http://127.0.0.1:$((SIM_BASE + 1))"},
      {"name": "r3", "url": "http://127.0.0.1:$((SIM_BASE + 2))"}
    ]
  }]
}
JSON

bold "Starting detproxy"
show "$BIN check -c $work/detproxy.json"
"$BIN" run -c "$work/detproxy.json" 2>"$work/detproxy.log" &
pids+=($!)
wait_port "$ADMIN" /healthz
say "proxy http://127.0.0.1:$PORT   admin http://127.0.0.1:$ADMIN   logs $work/detproxy.log"

bold "1. A completion through the proxy (headers show the request id, replica and pool fingerprint)"
show "curl -s -D- -o /dev/null http://127.0.0.1:$PORT/v1/completions -d '{\"model\":\"$MODEL\",\"prompt\":\"Count: one, two,\",\"max_tokens\":8,\"temperature\":0}' | grep -i '^x-detproxy'"

bold "2. Streaming is forwarded chunk by chunk"
show "curl -sN http://127.0.0.1:$PORT/v1/chat/completions -d '{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":4,\"stream\":true}' | cut -c1-110"

bold "3. Replica state and metrics on the admin listener"
show "curl -s http://127.0.0.1:$ADMIN/admin/replicas | python3 -m json.tool | grep -E '\"(name|state)\"'"
show "curl -s http://127.0.0.1:$ADMIN/metrics | grep '^detproxy_requests_total'"

bold "4. Bad input gets a clear, OpenAI-shaped error"
show "curl -s http://127.0.0.1:$PORT/v1/completions -d '{\"model\":\"no-such-model\",\"prompt\":\"x\"}'; echo"
show "printf 'GET / HTTP/1.1\\r\\nHost: a\\r\\nX: a\\r\\n b\\r\\n\\r\\n' | python3 -c 'import socket,sys; s=socket.create_connection((\"127.0.0.1\",$PORT)); s.sendall(sys.stdin.buffer.read()); print(s.recv(4096).decode().splitlines()[0])'"

bold "Tour done."
if [ "${DEMO_ONESHOT:-0}" = 1 ]; then exit 0; fi
say "detproxy keeps serving on http://127.0.0.1:$PORT — press Ctrl-C to stop."
wait
