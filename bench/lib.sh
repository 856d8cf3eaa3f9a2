# Shared by bench/run.sh and bench/profile.sh: compile the bench tools against a build's static
# libraries (no CMake change needed). Usage: bench_tools BUILD_DIR; sets UP, LOAD, MCOUNT,
# TLSCOUNT.
bench_tools() {
  local b=$1 here
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  local cflags=(-O2 -g -Wall -Wextra -Werror -Wno-unused-parameter -I"$here" -I/usr/share/include/llhttp)
  local libs=("$b/net/libdp_net.a" "$b/net/libdp_httpv.a" "$b/common/libdp_common.a" "$b/libllhttp.a")
  local l
  for l in "${libs[@]}"; do
    [ -f "$l" ] || { echo "bench: $l missing (build first)" >&2; return 1; }
  done
  mkdir -p "$b/bench"
  UP="$b/bench/bench-upstream"
  LOAD="$b/bench/bench-load"
  MCOUNT="$b/bench/malloc_count.so"
  TLSCOUNT="$b/bench/tls_count.so"
  if [ ! -x "$UP" ] || [ "$here/bench/upstream.c" -nt "$UP" ] || [ "$b/net/libdp_net.a" -nt "$UP" ]; then
    cc "${cflags[@]}" "$here/bench/upstream.c" "${libs[@]}" $(pkg-config --libs libuv openssl) -o "$UP" || return 1
  fi
  if [ ! -x "$LOAD" ] || [ "$here/bench/openloop.c" -nt "$LOAD" ]; then
    cc "${cflags[@]}" "$here/bench/openloop.c" "$b/libllhttp.a" -o "$LOAD" || return 1
  fi
  if [ ! -f "$MCOUNT" ] || [ "$here/bench/malloc_count.c" -nt "$MCOUNT" ]; then
    cc -O2 -Wall -Wextra -shared -fPIC "$here/bench/malloc_count.c" -o "$MCOUNT" -ldl -lpthread || return 1
  fi
  if [ ! -f "$TLSCOUNT" ] || [ "$here/bench/tls_count.c" -nt "$TLSCOUNT" ]; then
    cc -O2 -Wall -Wextra -Werror -shared -fPIC "$here/bench/tls_count.c" -o "$TLSCOUNT" -ldl \
      $(pkg-config --libs openssl) || return 1
  fi
}
