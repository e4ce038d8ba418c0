#!/usr/bin/env bash
# Fuzzes the wire frame decoder for N seconds (default 60) with libFuzzer.
# Builds with stable Rust's sanitizer-coverage flags, so neither nightly nor cargo-fuzz is
# needed (`cargo fuzz run frame_decoder` works too, where those are installed).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-60}
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
 -Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
# An explicit --target keeps the instrumentation out of build scripts.
host=$(rustc -vV | sed -n 's/^host: //p')
cargo build --release --locked --bin frame_decoder --target-dir target --target "$host"
mkdir -p corpus/frame_decoder
echo "fuzzing the frame decoder for ${secs}s"
log=$(mktemp)
status=0
./target/"$host"/release/frame_decoder corpus/frame_decoder seeds -max_total_time="$secs" \
  -max_len=4096 -print_final_stats=1 >"$log" 2>&1 || status=$?
if [ "$status" -ne 0 ]; then
  tail -40 "$log"
  echo "fuzzing found a failure (exit $status); the input is saved under fuzz/ as crash-*"
  exit "$status"
fi
grep -E '^(Done|stat::number_of_executed_units)' "$log"
rm -f "$log"
