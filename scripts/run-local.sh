#!/usr/bin/env bash
# Sets up and runs the main job on this machine: a coordinator, 2 summation servers and
# 4 worker processes exchanging a ResNet-50-shaped gradient set over loopback, every sum
# checked exactly. Each output line is prefixed with the process it came from.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

WORKERS=${WORKERS:-4}
SERVERS=${SERVERS:-2}
ROUNDS=${ROUNDS:-10}

step "toolchain"
ensure_rust
step "building (release)"
cargo build --release --locked --bins --example demo_worker -p sumflow-summation -p sumflow-coordinator -p sumflow-client
bin=target/release

run_dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$run_dir"
}
trap cleanup EXIT INT TERM

# A fresh secret for this job, passed through a private file rather than the command line.
umask 077
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$run_dir/token"
export SUMFLOW_JOB_TOKEN_FILE="$run_dir/token"
export RUST_LOG=${RUST_LOG:-warn}

prefix() { sed -u "s/^/[$1] /"; }

step "starting the coordinator, $SERVERS servers and $WORKERS workers"
"$bin/sumflow-coordinator" --bind 127.0.0.1:0 --workers "$WORKERS" --servers "$SERVERS" \
  --addr-file "$run_dir/coordinator" > >(prefix coordinator) 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$run_dir/coordinator" ] && break; sleep 0.05; done
[ -s "$run_dir/coordinator" ] || { echo "the coordinator did not start"; exit 1; }
export SUMFLOW_COORDINATOR=$(cat "$run_dir/coordinator")

for s in $(seq 0 $((SERVERS - 1))); do
  "$bin/sumflow-server" --coordinator "$SUMFLOW_COORDINATOR" --host-id "local-server-$s" \
    > >(prefix "server $s") 2>&1 &
  pids+=($!)
done
workers=()
for w in $(seq 0 $((WORKERS - 1))); do
  SUMFLOW_RANK=$w SUMFLOW_ROUNDS=$ROUNDS "$bin/examples/demo_worker" > >(prefix "worker $w") 2>&1 &
  workers+=($!)
done

# Any worker failing fails the job; the others are stopped by the cleanup.
status=0
for p in "${workers[@]}"; do wait "$p" || status=1; done
for p in "${pids[@]}"; do wait "$p" || status=1; done
[ "$status" -eq 0 ] && step "job finished: every sum verified" || step "job FAILED"
exit "$status"
