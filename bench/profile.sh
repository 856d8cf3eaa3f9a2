#!/usr/bin/env bash
# Profile detproxy under scenario 1 of bench/run.sh (1 KB chat POSTs, policy rewrite on, one
# upstream replica) and write the raw material for bench/PROFILE.md into PROFILE_OUT:
#   perf.txt       perf record -e cpu-clock --call-graph dwarf (hardware counters are not
#                  available in this VM, so `perf stat -e instructions` does not work; cpu-clock
#                  sampling does, kernel included): by DSO, self, and inclusive (children)
#   callgrind.txt  valgrind --tool=callgrind over a fixed number of requests: instructions per
#                  request, top functions by self and inclusive cost
#   allocs.txt     allocation calls per request (LD_PRELOAD counter, bench/malloc_count.c) and
#                  the call sites making them (heaptrack)
#   syscalls.txt   syscalls per request for detproxy, nginx and HAProxy (strace -c -f)
# Builds detproxy into PROFILE_BUILD (default build/h-bench-prof: Release flags plus -g
# -fno-omit-frame-pointer) so the lead's build directories are not touched.
# Usage: bench/profile.sh   (about 1-3 minutes; PROFILE_PARTS="perf allocs callgrind syscalls")
# Needs perf (linux-perf), valgrind, heaptrack, strace, nginx, haproxy, wrk; a part whose tool is
# missing is skipped.
set -eu # no pipefail: reports are cut with head
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
PB=${PROFILE_BUILD:-build/h-bench-prof}
OUT=${PROFILE_OUT:-/tmp/detproxy-profile}
PCPU=${BENCH_PROXY_CPU:-0}
LCPU=${BENCH_LOAD_CPU:-1}
mkdir -p "$OUT"
log() { printf '[profile] %s\n' "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

log "building detproxy (Release, -g -fno-omit-frame-pointer) in $PB"
cmake -S . -B "$PB" -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="-g -fno-omit-frame-pointer" \
  -DDP_TESTS=OFF >/dev/null
cmake --build "$PB" -j2 --target detproxy dp_net dp_httpv dp_common llhttp >/dev/null
. bench/lib.sh
bench_tools "$here/$PB"
DP="$here/$PB/proxy/detproxy"

work=$(mktemp -d /tmp/detproxy-prof.XXXXXX)
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
read -r P_UP P_DP P_DPA P_NG P_HA P_HAS <<<"$(python3 -c '
import socket
ss=[socket.socket() for _ in range(6)]
[s.bind(("127.0.0.1",0)) for s in ss]
print(" ".join(str(s.getsockname()[1]) for s in ss))')"
# PROFILE_BODY: the request body (default the 1 KB chat POST; bench/gen_prompt.py writes the
# long prompt), PROFILE_CONNS: wrk's connections, PROFILE_SEED=force: a forced seed instead of
# a derived one (no canonical form hashed).
BODY=${PROFILE_BODY:-bench/chat_1k.json}
CONNS=${PROFILE_CONNS:-32}
URL_PATH=/v1/chat/completions

taskset -c "$LCPU" "$UP" --listen "127.0.0.1:$P_UP" 2>"$work/up.log" &
pids+=($!)
reps="{\"name\": \"u1\", \"url\": \"http://127.0.0.1:$P_UP\", \"attest\": {\"source\": \"vllm\"}}"
sed -e "s#@PORT@#$P_DP#; s#@ADMIN_PORT@#$P_DPA#; s#@SHADOW_RATE@#0.0#; s#@REPLICAS@#$reps#" \
  -e "s#@TLS@##; s#@WORKERS@##; s#@ATTEST_MS@#10000#; s#@SELF_RATE@#0.0#" \
  bench/configs/detproxy.json.in >"$work/dp.json"
if [ "${PROFILE_SEED:-derive}" = force ]; then
  sed -i 's#"seed": { "derive": true }#"seed": { "force": 42 }#' "$work/dp.json"
  grep -q '"force": 42' "$work/dp.json" || die "could not make the forced-seed config"
fi

wait_ready() { # PID
  local i
  for i in $(seq 1 600); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$P_DPA/readyz")" = 200 ] && return 0
    kill -0 "$1" 2>/dev/null || break
    sleep 0.1
  done
  die "detproxy not ready"
}
ticks() { local f; f=$(cut -d')' -f2 "/proc/$1/stat"); set -- $f; echo $((${12} + ${13})); }
HZ=$(getconf CLK_TCK)
wrk_reqs() { grep -o '"requests":[0-9]*' | cut -d: -f2; }

PARTS=" ${PROFILE_PARTS:-perf allocs callgrind syscalls} "
need() { command -v "$1" >/dev/null 2>&1 || { log "skipping $2: $1 not installed"; return 1; }; }
part() {
  [[ $PARTS == *" $1 "* ]] || return 1
  case $1 in
    perf) need perf perf && need wrk perf ;;
    allocs) need wrk allocs ;;
    callgrind) need valgrind callgrind && need callgrind_control callgrind ;;
    syscalls) need strace syscalls && need nginx syscalls && need haproxy syscalls ;;
    *) return 0 ;;
  esac
}

# ---- perf ---------------------------------------------------------------------------------------
if part perf; then
log "perf: wrk -c$CONNS 8 s, sampling detproxy for 5 s"
taskset -c "$PCPU" "$DP" run -c "$work/dp.json" 2>"$work/dp.log" &
dp=$!
pids+=($dp)
wait_ready $dp
BENCH_BODY=$BODY taskset -c "$LCPU" wrk -t1 -c"$CONNS" -d1s -s bench/post.lua "http://127.0.0.1:$P_DP$URL_PATH" >/dev/null
c0=$(ticks $dp)
BENCH_BODY=$BODY taskset -c "$LCPU" wrk -t1 -c"$CONNS" -d8s -s bench/post.lua "http://127.0.0.1:$P_DP$URL_PATH" >"$work/wrk.out" &
wp=$!
sleep 1.5
perf record -e cpu-clock -F 999 --call-graph dwarf,16384 -p $dp -o "$work/perf.data" -- sleep 5 \
  >/dev/null 2>"$work/perf.err" || die "perf record: $(cat "$work/perf.err")"
wait $wp
c1=$(ticks $dp)
n=$(grep WRKJSON "$work/wrk.out" | wrk_reqs)
{
  echo "# perf record -e cpu-clock -F 999 --call-graph dwarf, detproxy under wrk -t1 -c$CONNS ($(stat -c %s "$BODY")-byte chat POST)"
  echo "# wrk: $(grep WRKJSON "$work/wrk.out")"
  echo "# detproxy CPU over the 8 s run: $(awk "BEGIN{printf \"%.1f\", ($c1-$c0)/$HZ*1e6/$n}") us/request ($n requests)"
  echo
  echo "## by DSO"
  perf report -i "$work/perf.data" --no-children --sort dso -g none --stdio >"$work/r.dso" 2>/dev/null || true
  grep -v '^#' "$work/r.dso" | grep -v '^$' | head -15
  echo
  echo "## self (flat), top 40 symbols"
  perf report -i "$work/perf.data" --no-children --sort dso,symbol -g none --stdio >"$work/r.self" 2>/dev/null || true
  grep -v '^#' "$work/r.self" | grep -v '^$' | head -40
  echo
  echo "## inclusive (children), top 70 symbols"
  perf report -i "$work/perf.data" --children --sort symbol -g none --stdio >"$work/r.incl" 2>/dev/null || true
  grep -v '^#' "$work/r.incl" | grep -v '^$' | head -70
} >"$OUT/perf.txt"
cp "$work/perf.data" "$OUT/perf.data" 2>/dev/null || true
kill $dp; wait $dp 2>/dev/null || true
fi

# ---- allocations: counter, then call sites --------------------------------------------------------
if part allocs; then
log "allocations: LD_PRELOAD counter over a 5 s wrk run"
MALLOC_COUNT_FILE="$work/mc.txt" LD_PRELOAD="$MCOUNT" taskset -c "$PCPU" "$DP" run -c "$work/dp.json" \
  2>"$work/dp.log" &
dp=$!
pids+=($dp)
wait_ready $dp
BENCH_BODY=$BODY taskset -c "$LCPU" wrk -t1 -c"$CONNS" -d1s -s bench/post.lua "http://127.0.0.1:$P_DP$URL_PATH" >/dev/null
sleep 0.3
cp "$work/mc.txt" "$work/mc0.txt"
BENCH_BODY=$BODY taskset -c "$LCPU" wrk -t1 -c"$CONNS" -d5s -s bench/post.lua "http://127.0.0.1:$P_DP$URL_PATH" >"$work/wrk.out"
sleep 0.3
cp "$work/mc.txt" "$work/mc1.txt"
n=$(grep WRKJSON "$work/wrk.out" | wrk_reqs)
{
  echo "# allocation calls per request (LD_PRELOAD bench/malloc_count.c), $n requests, wrk -c$CONNS"
  join "$work/mc0.txt" "$work/mc1.txt" | awk -v n="$n" '{printf "%-9s %10.2f per request\n", $1, ($3-$2)/n}'
  echo
} >"$OUT/allocs.txt"
kill $dp; wait $dp 2>/dev/null || true

if command -v heaptrack >/dev/null; then
  log "allocations: heaptrack over 4000 requests"
  taskset -c "$PCPU" heaptrack -o "$work/ht" "$DP" run -c "$work/dp.json" >"$work/ht.log" 2>&1 &
  htp=$!
  pids+=($htp)
  wait_ready $htp
  taskset -c "$LCPU" "$LOAD" rate --target "127.0.0.1:$P_DP" --body $BODY --rate 1000 --conns 32 \
    --duration 4 --warmup 0 >"$work/ht.load"
  dpp=$(pgrep -f "^$DP run -c $work/dp.json" | head -1 || true)
  [ -n "$dpp" ] && kill "$dpp"
  wait $htp 2>/dev/null || true
  f=$(ls "$work"/ht*.zst "$work"/ht*.gz 2>/dev/null | head -1 || true)
  {
    echo "# heaptrack: 4000 requests at 1000/s (plus start-up); 'calls' are whole-run totals"
    echo "# load: $(cat "$work/ht.load")"
    if [ -n "$f" ]; then
      heaptrack_print -f "$f" -p 0 -a 1 -T 0 -l 0 -n 20 -s 60 >"$work/ht.txt" 2>/dev/null || true
      echo "## by call site (bench/heapsum.py: heaptrack counts / 4000 requests, sites >= 0.2/request)"
      python3 bench/heapsum.py "$work/ht.txt" 4000 0.2
      cp "$work/ht.txt" "$OUT/heaptrack.txt"
    fi
  } >>"$OUT/allocs.txt"
fi
fi

# ---- callgrind ---------------------------------------------------------------------------------
if part callgrind; then
log "callgrind: 3000 requests at 300/s"
taskset -c "$PCPU" valgrind --tool=callgrind --callgrind-out-file="$work/cg.out" --dump-instr=no \
  "$DP" run -c "$work/dp.json" >"$work/cg.log" 2>&1 &
cgp=$!
pids+=($cgp)
wait_ready $cgp
cgpid=$cgp # taskset execs valgrind, which runs detproxy in the same process
# Each dump holds the costs since the previous one: dump 1 is start-up, dump 2 the load.
# (callgrind_control -z instead leaves self costs unattributed in 3.19.)
callgrind_control -d "$cgpid" >/dev/null 2>&1 || true
taskset -c "$LCPU" "$LOAD" rate --target "127.0.0.1:$P_DP" --body $BODY --rate 300 --conns 16 \
  --duration 10 --warmup 0 >"$work/cg.load"
callgrind_control -d "$cgpid" >/dev/null 2>&1 || true
sleep 1
kill "$cgpid" 2>/dev/null || true
wait $cgp 2>/dev/null || true
n=$(grep -o '"completed":[0-9]*' "$work/cg.load" | cut -d: -f2)
dump="$work/cg.out.2"
[ -f "$dump" ] || die "callgrind dump 2 missing: $(ls "$work")"
callgrind_annotate "$dump" >"$work/cg.tot" 2>/dev/null || true
total=$(awk '/PROGRAM TOTALS/{gsub(",","",$1); print $1; exit}' "$work/cg.tot")
{
  echo "# callgrind over $n requests (start-up excluded): $total instructions,"
  echo "# $(awk "BEGIN{printf \"%.0f\", $total/$n}") instructions per request"
  echo "# load: $(cat "$work/cg.load")"
  echo
  echo "## self"
  # --threshold=100 lists every function; the frames open at the dump point (main, uv_run's
  # caller, ...) show a bogus 100% self cost in 3.19, hence the filter.
  callgrind_annotate --inclusive=no --threshold=100 --auto=no "$dump" >"$work/cg.self" 2>/dev/null || true
  sed -n '/file:function/,$p' "$work/cg.self" | grep -v '(100.0%)' | head -45
  echo
  echo "## inclusive"
  callgrind_annotate --inclusive=yes --threshold=100 --auto=no "$dump" >"$work/cg.incl" 2>/dev/null || true
  sed -n '/file:function/,$p' "$work/cg.incl" | grep -v '^ *[0-9,]* *([0-9.]*%) */work/main/[a-z/_]*\.[ch]:' | head -70
} >"$OUT/callgrind.txt"
cp "$dump" "$OUT/callgrind.out" 2>/dev/null || true
fi

# ---- syscalls per request, all three proxies ------------------------------------------------------
if part syscalls; then
log "syscalls: strace -c over 3000 requests each for detproxy, nginx, haproxy"
taskset -c "$PCPU" "$DP" run -c "$work/dp.json" 2>"$work/dp.log" &
dp=$!
pids+=($dp)
mkdir -p "$work/nginx" "$work/haproxy"
sed -e "s#@PREFIX@#$work/nginx#g; s#@PORT@#$P_NG#g; s#@UPSTREAM@#127.0.0.1:$P_UP#g; s#@WORKERS@#1#g; s#@SSL@##; s#@TLS@##" \
  bench/configs/nginx.conf.in >"$work/nginx/nginx.conf"
sed -e "s#@PREFIX@#$work/haproxy#g; s#@PORT@#$P_HA#g; s#@SSE_PORT@#$P_HAS#g; s#@UPSTREAM@#127.0.0.1:$P_UP#g; s#@NBTHREAD@#1#g; s#@SSL@##" \
  bench/configs/haproxy.cfg.in >"$work/haproxy/haproxy.cfg"
taskset -c "$PCPU" nginx -e "$work/nginx/error.log" -p "$work/nginx" -c "$work/nginx/nginx.conf" &
ng=$!
pids+=($ng)
taskset -c "$PCPU" haproxy -db -f "$work/haproxy/haproxy.cfg" >/dev/null 2>&1 &
ha=$!
pids+=($ha)
wait_ready $dp
sleep 0.5
: >"$OUT/syscalls.txt"
for t in detproxy nginx haproxy; do
  case $t in
    detproxy) port=$P_DP pid=$dp ;;
    nginx) port=$P_NG pid=$(pgrep -P $ng | head -1) ;;
    haproxy) port=$P_HA pid=$ha ;;
  esac
  taskset -c "$LCPU" "$LOAD" rate --target "127.0.0.1:$port" --body $BODY --rate 500 --conns 32 \
    --duration 1 --warmup 0 >/dev/null
  strace -c -f -p "$pid" -o "$work/strace.$t" &
  sp=$!
  sleep 0.5
  taskset -c "$LCPU" "$LOAD" rate --target "127.0.0.1:$port" --body $BODY --rate 1000 --conns 32 \
    --duration 3 --warmup 0 >"$work/st.load"
  sleep 0.3
  kill -INT $sp; wait $sp 2>/dev/null || true
  n=$(grep -o '"completed":[0-9]*' "$work/st.load" | cut -d: -f2)
  {
    echo "## $t: $n requests at 1000/s, 32 connections (no batching at this rate: the worst case)"
    awk -v n="$n" '/^[ ]*[0-9]/ && NF>=5 && $NF != "total" {printf "%-16s %8.2f per request\n", $NF, $4/n}' \
      "$work/strace.$t" | sort -k2 -nr >"$work/st.sorted"
    head -14 "$work/st.sorted"
    awk -v n="$n" '/total/ {printf "%-16s %8.2f per request\n", "TOTAL", $4/n}' "$work/strace.$t"
    echo
  } >>"$OUT/syscalls.txt"
done
fi
log "done: $OUT/{perf,callgrind,allocs,syscalls}.txt"
