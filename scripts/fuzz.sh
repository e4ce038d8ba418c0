#!/usr/bin/env bash
# Fuzzes sumflow's inputs from peers with libFuzzer, SECS seconds per target (default 60):
#   frame_decoder  arbitrary bytes through both frame decoders (they must agree)
#   handshake      arbitrary bytes as the other side of the job-token handshake
#   membership     the coordinator's state machine under arbitrary connections and frames
#   payloads       compressed payloads through the server's validator and decoder
#   connection     a summation server's connection handler (and its engine) fed frames
#                  built from the input by an authenticated worker, on loopback
#
#     scripts/fuzz.sh [SECS] [TARGET...]     (default: every target)
#
# Builds with stable Rust's sanitizer-coverage flags, so neither nightly nor cargo-fuzz is
# needed (`cargo fuzz run TARGET` works too, where those are installed).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(frame_decoder handshake membership payloads connection)
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
 -Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
# An explicit --target keeps the instrumentation out of build scripts.
host=$(rustc -vV | sed -n 's/^host: //p')
bins=()
for t in "${targets[@]}"; do bins+=(--bin "$t"); done
cargo build --release --locked "${bins[@]}" --target-dir target --target "$host"
total=0
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  # Frames are the seeds of the targets that read frames.
  seeds=()
  case "$t" in frame_decoder | membership) seeds=(seeds) ;; esac
  echo "fuzzing $t for ${secs}s"
  log=$(mktemp)
  status=0
  ./target/"$host"/release/"$t" "corpus/$t" "${seeds[@]}" -max_total_time="$secs" \
    -max_len=4096 -print_final_stats=1 >"$log" 2>&1 || status=$?
  if [ "$status" -ne 0 ]; then
    tail -40 "$log"
    echo "fuzzing $t found a failure (exit $status); the input is saved under fuzz/ as crash-*"
    exit "$status"
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  echo "  $t: $runs executions, no failure"
  total=$((total + runs))
  rm -f "$log"
done
echo "fuzzing: $total executions in all, no failure"
