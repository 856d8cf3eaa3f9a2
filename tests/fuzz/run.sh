#!/usr/bin/env bash
# Run every libFuzzer target for FUZZ_SECONDS each, starting from its seed corpus: the
# module's (corpus/policy for fuzz_policy_*) plus the target's own when it has one
# (corpus/policy_route for fuzz_policy_route).
# Usage: tests/fuzz/run.sh BUILD_DIR
set -euo pipefail
build=${1:?build dir}
here=$(cd "$(dirname "$0")" && pwd)
secs=${FUZZ_SECONDS:-60}
status=0
for bin in "$build"/tests/fuzz/fuzz_*; do
  [ -x "$bin" ] || continue
  name=$(basename "$bin")
  mod=${name#fuzz_}; mod=${mod%%_*}
  work=$(mktemp -d)
  for seeds in "$here/corpus/$mod" "$here/corpus/${name#fuzz_}"; do
    [ -d "$seeds" ] && cp -r "$seeds"/. "$work"/ 2>/dev/null || true
  done
  echo "== $name: ${secs}s from $(ls "$work" | wc -l) seeds"
  if ! "$bin" -max_total_time="$secs" -max_len=16384 -print_final_stats=1 "$work" 2>&1 | tail -n 12; then
    echo "FAIL: $name"; status=1
  fi
  if ls crash-* leak-* timeout-* >/dev/null 2>&1; then
    echo "FAIL: $name left reproducers:"; ls crash-* leak-* timeout-* 2>/dev/null; status=1
  fi
  rm -rf "$work"
done
exit $status
