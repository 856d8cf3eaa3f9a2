#!/usr/bin/env bash
# `make demo`: simulated replicas and detproxy on loopback, a scripted tour with curl showing
# policy, attestation and drift, then keep serving until Ctrl-C (DEMO_ONESHOT=1 exits after the
# tour). Everything runs on 127.0.0.1; nothing leaves the machine.
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
trap cleanup EXIT
trap 'exit 0' INT TERM

PORT=${DEMO_PORT:-18080}
ADMIN=${DEMO_ADMIN_PORT:-19901}
BASE=${DEMO_SIM_PORT:-18101}
LLAMA=demo/llama-sim
MISTRAL=demo/mistral-sim
CKPT=$(printf 'llama-checkpoint-v1' | sha256sum | cut -c1-64)
CKPT_OTHER=$(printf 'llama-checkpoint-v0' | sha256sum | cut -c1-64)
CKPT_M=$(printf 'mistral-checkpoint' | sha256sum | cut -c1-64)
BANK_KEY=sk-demo-bank-0001
BANK_SHA=$(printf '%s' "$BANK_KEY" | sha256sum | cut -c1-64)

bold() { printf '\n\033[1m%s\033[0m\n' "$*"; }
say() { printf '  %s\n' "$*"; }
run() { printf '  \033[2m$ %s\033[0m\n' "$*"; eval "$@" 2>&1 | sed 's/^/    /'; }
json() { python3 -c "import json,sys; d=json.load(sys.stdin); $1"; }

wait_http() { # port path [scheme]
  for _ in $(seq 1 200); do
    curl -s -o /dev/null "${3:-http}://127.0.0.1:$1$2" && return 0
    sleep 0.05
  done
  echo "127.0.0.1:$1$2 did not come up" >&2; exit 1
}

sim() { # name port model checkpoint extra-flags...
  local name=$1 port=$2 model=$3 ckpt=$4; shift 4
  "$SIM" --listen "127.0.0.1:$port" --flavor vllm --model "$model" --framework-version 0.6.3 \
    --quantization awq --dtype float16 --checkpoint-sha256 "$ckpt" \
    --attest-key "$work/pipeline.key.pem" $SIM_TLS "$@" 2>"$work/$name.log" &
  pids+=($!)
}

bold "0. Set-up"
TLS_JSON=""
UP_TLS_JSON=""
SCHEME=http
RSCHEME=http
SIM_TLS=""
CURL_TLS=""
if [ "${DEMO_TLS:-0}" = 1 ]; then
  # A throwaway CA and a certificate for localhost/127.0.0.1, made with the openssl CLI.
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
    -subj "/CN=detproxy demo CA" -keyout "$work/ca.key" -out "$work/ca.crt" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=localhost" \
    -keyout "$work/proxy.key" -out "$work/proxy.csr" 2>/dev/null
  printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > "$work/san.ext"
  openssl x509 -req -in "$work/proxy.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
    -CAcreateserial -days 1 -extfile "$work/san.ext" -out "$work/proxy.crt" 2>/dev/null
  # The replicas' certificate, from the same CA (the proxy verifies it: SAN IP:127.0.0.1).
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=replica" \
    -keyout "$work/replica.key" -out "$work/replica.csr" 2>/dev/null
  openssl x509 -req -in "$work/replica.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
    -CAcreateserial -days 1 -extfile "$work/san.ext" -out "$work/replica.crt" 2>/dev/null
  chmod 600 "$work/proxy.key" "$work/replica.key"
  TLS_JSON='"tls": {"cert_file": "proxy.crt", "key_file": "proxy.key"},'
  UP_TLS_JSON='"upstream_tls": {"ca_file": "ca.crt"},'
  SCHEME=https
  RSCHEME=https
  SIM_TLS="--tls-cert $work/replica.crt --tls-key $work/replica.key"
  CURL_TLS="--cacert $work/ca.crt"
  say "DEMO_TLS=1: clients, replicas and their attestations all speak TLS 1.2+, verified"
  say "against a throwaway CA ($work/ca.crt); the admin listener stays plain HTTP on loopback"
fi
curl() { command curl $CURL_TLS "$@"; }
"$BIN" attest keygen --out "$work/pipeline" >/dev/null
say "Attestation signing key: $work/pipeline.key.pem (replicas sign, detproxy trusts the .pub)"
sim r1 $((BASE + 0)) "$LLAMA" "$CKPT"
sim r2 $((BASE + 1)) "$LLAMA" "$CKPT"
sim r3 $((BASE + 2)) "$LLAMA" "$CKPT_OTHER"                                # an old checkpoint
sim r4 $((BASE + 3)) "$LLAMA" "$CKPT" --quantization gptq --report-quantization awq  # lies
sim m1 $((BASE + 4)) "$MISTRAL" "$CKPT_M"
sim m2 $((BASE + 5)) "$MISTRAL" "$CKPT_M"
sim m3 $((BASE + 6)) "$MISTRAL" "$CKPT_M" --quantization gptq --report-quantization awq
sim n1 $((BASE + 7)) "$LLAMA" "$CKPT" --quantization gptq           # the candidate build
for i in 0 1 2 3 4 5 6 7; do wait_http $((BASE + i)) /health "$RSCHEME"; done
say "Eight simulated vLLM replicas on 127.0.0.1:$BASE-$((BASE + 7)):"
say "  pool llama:   r1 r2 (good), r3 (deployed from an older checkpoint), r4 (generates with"
say "                gptq but reports awq: a replica that lies about itself)"
say "  pool mistral: m1 m2 (good), m3 (same metadata, different outputs: silent drift)"
say "  pool llama-next: n1, a gptq build of llama, candidate for a rollout (no client traffic)"

# The canary's expected output hash comes from a replica known to be good.
CANARY_TEXT=$(curl -s "$RSCHEME://127.0.0.1:$BASE/v1/completions" -H 'content-type: application/json' \
  -d "{\"model\":\"$LLAMA\",\"prompt\":\"Count: one, two,\",\"max_tokens\":16,\"temperature\":0,\"seed\":0}" \
  | json 'print(d["choices"][0]["text"], end="")')
CANARY_SHA=$(printf '%s' "$CANARY_TEXT" | sha256sum | cut -c1-64)

agent() { printf '{"source":"agent","url":"%s://127.0.0.1:%s/attestation"}' "$RSCHEME" "$1"; }
cat > "$work/detproxy.json" <<JSON
{
  "listen": "127.0.0.1:$PORT",
  "admin_listen": "127.0.0.1:$ADMIN",
  $TLS_JSON
  "attestation": {"interval_ms": 1000, "timeout_ms": 1000, "require_signature": true,
                  "trusted_keys": ["pipeline.pub.pem"]},
  "pools": [
    {"name": "llama", "models": ["$LLAMA"], $UP_TLS_JSON
     "manifest": {"model": "$LLAMA", "checkpoint_sha256": "$CKPT", "quantization": "awq",
                  "dtype": "float16", "framework": {"name": "vllm", "version": "0.6.3"},
                  "canary": {"prompt": "Count: one, two,", "max_tokens": 16,
                             "expected_sha256": "$CANARY_SHA"}},
     "replicas": [
       {"name": "r1", "url": "$RSCHEME://127.0.0.1:$((BASE + 0))", "attest": $(agent $((BASE + 0)))},
       {"name": "r2", "url": "$RSCHEME://127.0.0.1:$((BASE + 1))", "attest": $(agent $((BASE + 1)))},
       {"name": "r3", "url": "$RSCHEME://127.0.0.1:$((BASE + 2))", "attest": $(agent $((BASE + 2)))},
       {"name": "r4", "url": "$RSCHEME://127.0.0.1:$((BASE + 3))", "attest": $(agent $((BASE + 3)))}],
     "candidates": [{"pool": "llama-next", "rate": 0.5}]},
    {"name": "llama-next", "models": ["$LLAMA"], $UP_TLS_JSON
     "manifest": {"model": "$LLAMA", "checkpoint_sha256": "$CKPT", "quantization": "gptq",
                  "dtype": "float16", "framework": {"name": "vllm", "version": "0.6.3"}},
     "replicas": [
       {"name": "n1", "url": "$RSCHEME://127.0.0.1:$((BASE + 7))", "attest": $(agent $((BASE + 7)))}]},
    {"name": "mistral", "models": ["$MISTRAL"], $UP_TLS_JSON
     "manifest": {"model": "$MISTRAL", "checkpoint_sha256": "$CKPT_M", "quantization": "awq",
                  "dtype": "float16", "framework": {"name": "vllm", "version": "0.6.3"}},
     "replicas": [
       {"name": "m1", "url": "$RSCHEME://127.0.0.1:$((BASE + 4))", "attest": $(agent $((BASE + 4)))},
       {"name": "m2", "url": "$RSCHEME://127.0.0.1:$((BASE + 5))", "attest": $(agent $((BASE + 5)))},
       {"name": "m3", "url": "$RSCHEME://127.0.0.1:$((BASE + 6))", "attest": $(agent $((BASE + 6)))}]}
  ],
  "policy": {"tenants": [
    {"name": "bank", "match": {"api_keys_sha256": ["$BANK_SHA"]},
     "sampling": {"temperature": {"force": 0}, "top_p": {"force": 1}, "seed": {"force": 1234}},
     "deny_params": ["logit_bias"], "audit": true},
    {"name": "default", "match": {"any": true},
     "sampling": {"temperature": {"default": 0.7, "max": 1.0}, "seed": {"derive": true}}}]},
  "shadow": {"rate": 0.7, "self_rate": 0.3, "max_inflight": 8},
  "log": {"level": "info", "audit_path": "audit.jsonl", "audit_store": "audit-store",
          "audit_signing_key": "audit.key.pem", "audit_checkpoint_lines": 1000}
}
JSON
mkdir -p "$work/audit-store"
"$BIN" attest keygen --out "$work/audit" >/dev/null

bold "1. Start detproxy (config validated first)"
run "'$BIN' check -c '$work/detproxy.json'"
"$BIN" run -c "$work/detproxy.json" 2>"$work/detproxy.log" &
pids+=($!)
wait_http "$ADMIN" /healthz
for _ in $(seq 1 100); do
  curl -s "http://127.0.0.1:$ADMIN/readyz" | grep -q '"ready"' && break; sleep 0.05
done
say "proxy $SCHEME://127.0.0.1:$PORT   admin http://127.0.0.1:$ADMIN   log $work/detproxy.log"

P="$SCHEME://127.0.0.1:$PORT"
export -f curl 2>/dev/null || true
A="http://127.0.0.1:$ADMIN"

bold "2. Policy: the compliance tenant sends temperature 0.9 and no seed..."
run "curl -s -D '$work/h' -o '$work/b' $P/v1/chat/completions -H 'Authorization: Bearer $BANK_KEY' -d '{\"model\":\"$LLAMA\",\"messages\":[{\"role\":\"user\",\"content\":\"Is this loan approved?\"}],\"temperature\":0.9,\"max_tokens\":8}'; grep -i '^x-detproxy' '$work/h'"
say "...and this is what the replica actually received (its own record of the request):"
R=$(grep -i '^x-detproxy-replica' "$work/h" | tr -d '\r' | awk '{print $2}')
RPORT=$((BASE + ${R#r} - 1))
run "curl -s $RSCHEME://127.0.0.1:$RPORT/_sim/last_request | python3 -c 'import json,sys; b=json.loads(json.load(sys.stdin)[\"body\"]); print({k: b[k] for k in (\"temperature\",\"top_p\",\"seed\")})'"
say "An audit line was written before the response completed:"
run "tail -1 '$work/audit.jsonl' | cut -c1-220"
say "A denied parameter never reaches a replica:"
run "curl -s $P/v1/chat/completions -H 'Authorization: Bearer $BANK_KEY' -d '{\"model\":\"$LLAMA\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logit_bias\":{\"1\":5}}'; echo"

bold "3. Policy: the default tenant sends the same prompt twice (different JSON key order)"
run "curl -s -D- -o /dev/null $P/v1/completions -d '{\"model\":\"$LLAMA\",\"prompt\":\"Write a haiku\",\"max_tokens\":8}' | grep -i x-detproxy-seed"
run "curl -s -D- -o /dev/null $P/v1/completions -d '{ \"max_tokens\": 8, \"prompt\": \"Write a haiku\", \"model\": \"$LLAMA\" }' | grep -i x-detproxy-seed"
say "Same derived seed both times: the same prompt samples the same way."

bold "4. Attestation: only replicas matching the pinned manifest get traffic"
sleep 2.5  # two canary rounds (interval 1 s): the liar needs 2 mismatches of 3 to be caught
run "curl -s $A/admin/replicas | python3 -c 'import json,sys
for r in json.load(sys.stdin)[\"replicas\"]:
    print(\"%-8s %-3s %-12s %s\" % (r[\"pool\"], r[\"name\"], r[\"state\"], \"; \".join(r[\"reasons\"])[:110]))'"
say "r3 was deployed from another checkpoint; r4 reports the right metadata but the canary"
say "prompt's output gives it away. Neither ever gets a client request (r4 only ever saw"
say "the canary probes: a canary pool admits a replica only after its canary matches):"
for _ in $(seq 1 20); do
  curl -s -o /dev/null "$P/v1/completions" -d "{\"model\":\"$LLAMA\",\"prompt\":\"hi\",\"max_tokens\":2,\"temperature\":0}"
done
run "for p in $((BASE + 2)) $((BASE + 3)); do curl -s $RSCHEME://127.0.0.1:\$p/_sim/requests | python3 -c 'import json,sys; rs=[json.loads(r[\"body\"]).get(\"prompt\") for r in json.load(sys.stdin)[\"requests\"] if r[\"inference\"]]; print(\"requests seen: %d, of which canary probes: %d\" % (len(rs), rs.count(\"Count: one, two,\")))'; done"
run "curl -s $A/metrics | grep '^detproxy_replica_admitted'"

bold "5. Drift: shadow copies compare replicas against each other and against themselves"
say "Sending 150 temperature-0 requests to pool mistral (70% get a cross shadow, 30% a self one)..."
for i in $(seq 1 150); do
  curl -s -o /dev/null "$P/v1/completions" \
    -d "{\"model\":\"$MISTRAL\",\"prompt\":\"question $i about the weather\",\"max_tokens\":16,\"temperature\":0}"
done
sleep 0.5
run "curl -s $A/admin/drift | python3 -c 'import json,sys
p = json.load(sys.stdin)[\"pools\"][\"mistral\"]
print(\"cross: %d samples, exact-match %.2f\" % (p[\"cross\"][\"samples\"], p[\"cross\"][\"exact_match_rate\"]))
print(\"self:  %d samples, exact-match %.2f\" % (p[\"self\"][\"samples\"], p[\"self\"][\"exact_match_rate\"]))
print(\"verdict:\", p[\"verdict\"], \" suspect:\", p[\"suspect\"])'"
say "m3 reports the same checkpoint and quantization as m1 and m2, but its outputs drift:"
say "cross pairs with m3 diverge far beyond the self-noise baseline, and detproxy names it."

bold "6. Rollout: is the gptq build of llama equivalent to what serves now?"
say "Half of llama's comparable requests are also copied to the candidate pool llama-next;"
say "clients only ever get llama's answers. Sending 80 temperature-0 requests to llama..."
for i in $(seq 1 80); do
  curl -s -o /dev/null "$P/v1/completions" \
    -d "{\"model\":\"$LLAMA\",\"prompt\":\"rollout question $i\",\"max_tokens\":16,\"temperature\":0}"
done
sleep 0.5
run "'$BIN' rollout report -c '$work/detproxy.json' --pool llama > '$work/rollout.txt' && rc=0 || rc=\$?; cut -c1-150 '$work/rollout.txt' | head -5; echo \"exit code: \$rc\""
say "The candidate diverges far beyond llama's own cross/self noise: exit 1 stops a CD pipeline."
run "curl -s $A/metrics | grep '^detproxy_candidate_total'"

bold "7. Evidence: the audit trail is chained, signed, and replayable"
say "The compliance tenant's bodies are in the store, named by the hashes on their audit lines."
say "Each line names the SHA-256 of the one before; replay re-sends the stored body to an"
say "admitted replica with the audited fingerprint and compares the answers:"
run "'$BIN' replay -c '$work/detproxy.json' --audit '$work/audit.jsonl' --all"
say "Stopping detproxy writes a signed shutdown checkpoint; then the whole file verifies:"
kill -TERM "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true
run "'$BIN' audit verify '$work/audit.jsonl' --pubkey '$work/audit.pub.pem' --store '$work/audit-store'"
say "Edit one byte of a copy (status 200 -> 201) and the chain names the line after it:"
sed 's/"status":200/"status":201/' "$work/audit.jsonl" > "$work/audit-tampered.jsonl"
run "'$BIN' audit verify '$work/audit-tampered.jsonl' --pubkey '$work/audit.pub.pem' || true"
"$BIN" run -c "$work/detproxy.json" 2>>"$work/detproxy.log" &
pids+=($!)
wait_http "$ADMIN" /healthz

bold "8. Fleet: a drain on one instance reaches another through etcd"
ETCD_BIN=$(command -v etcd || true)
if [ -z "$ETCD_BIN" ]; then
  say "Skipped: etcd is not installed (scripts/deps.sh installs Debian's etcd-server)."
else
  EC=${DEMO_ETCD_PORT:-18379}
  "$ETCD_BIN" --name demo --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$EC" \
    --advertise-client-urls "http://127.0.0.1:$EC" --listen-peer-urls "http://127.0.0.1:$((EC + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((EC + 1))" \
    --initial-cluster "demo=http://127.0.0.1:$((EC + 1))" 2>"$work/etcd.log" &
  pids+=($!)
  wait_http "$EC" /health
  "$SIM" --listen "127.0.0.1:$((BASE + 20))" --model "$LLAMA" 2>"$work/fleet-sim.log" &
  pids+=($!)
  wait_http "$((BASE + 20))" /v1/models
  for gw in a b; do
    gp=$([ $gw = a ] && echo $((PORT + 10)) || echo $((PORT + 11)))
    ga=$([ $gw = a ] && echo $((ADMIN + 10)) || echo $((ADMIN + 11)))
    cat > "$work/fleet-$gw.json" <<JSON
{"listen": "127.0.0.1:$gp", "admin_listen": "127.0.0.1:$ga",
 "pools": [{"name": "llama", "models": ["$LLAMA"],
            "replicas": [{"name": "r1", "url": "http://127.0.0.1:$((BASE + 20))"}]}],
 "fleet": {"name": "demo", "instance": "gw-$gw", "lease_ttl_ms": 3000,
           "etcd": {"endpoints": ["http://127.0.0.1:$EC"]}}}
JSON
    "$BIN" run -c "$work/fleet-$gw.json" 2>>"$work/fleet-$gw.log" &
    pids+=($!)
    wait_http "$ga" /healthz
  done
  FA=http://127.0.0.1:$((ADMIN + 10))
  FB=http://127.0.0.1:$((ADMIN + 11))
  for _ in $(seq 1 100); do
    [ "$(curl -s $FB/admin/fleet | json 'print(len(d["members"]))')" = 2 ] && break
    sleep 0.05
  done
  say "Two instances, gw-a and gw-b, share one etcd (a 3-member cluster in production)."
  say "An operator drains r1 on gw-a only:"
  run "curl -s -X POST '$FA/admin/replicas/r1/drain?reason=maintenance' -o /dev/null -w '%{http_code}\\n'"
  for _ in $(seq 1 100); do
    [ "$(curl -s $FB/admin/replicas | json 'print(d["replicas"][0]["drained"])')" = True ] && break
    sleep 0.01
  done
  run "curl -s $FB/admin/fleet | json 'x=d[\"drains\"][0]; print(\"gw-b holds:\", x[\"replica\"], \"drained by\", x[\"origin\"], \"-\", x[\"reason\"]); print(\"attestation:\", d[\"attestation\"][\"mode\"], \"- r1 attested by\", d[\"attestation\"][\"replicas\"][0][\"attester\"])'"
  run "curl -s $FB/admin/replicas | json 'r=d[\"replicas\"][0]; print(\"gw-b r1 drained:\", r[\"drained\"])'"
  say "Quarantines for drift travel the same way; docs/fleet.md has the rest."
fi

bold "Tour done."
if [ "${DEMO_ONESHOT:-0}" = 1 ]; then exit 0; fi
say "detproxy keeps serving on $P (admin $A). Press Ctrl-C to stop."
wait
