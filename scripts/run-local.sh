#!/usr/bin/env bash
# Sets up and runs the main local job: data-parallel training through sumflow on this
# machine. A coordinator, 2 CPU summation servers, the machine's colocated server and 4
# worker processes train a small CNN on scikit-learn's digits (examples/train_digits.py)
# with sumflow.torch's DistributedOptimizer, over loopback. Each output line is prefixed
# with the process it came from; the job fails unless the test accuracy reaches 95%.
#
#   bash scripts/run-local.sh                 # the training job (sets up .venv first)
#   bash scripts/run-local.sh --demo          # the Rust-only demo instead: 4 workers push
#                                             # and pull a ResNet-50-shaped gradient set
#                                             # through 2 servers, every sum checked
#   WORKERS=2 SERVERS=0 bash scripts/run-local.sh -- --epochs 5   # arguments after --
#                                             # go to train_digits.py
#
# Environment: WORKERS (4), SERVERS (2: CPU-only servers), MIN_ACCURACY (0.95); for
# --demo, ROUNDS (10).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

WORKERS=${WORKERS:-4}
SERVERS=${SERVERS:-2}

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }

mode=train
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --demo) mode=demo ;;
    -h | --help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "run-local.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# The Rust-only demo: release binaries and the demo_worker example, no Python.
run_demo() {
  local rounds=${ROUNDS:-10}
  step "building (release)"
  cargo build --release --locked --bins --example demo_worker -p sumflow-summation -p sumflow-coordinator -p sumflow-client
  local bin=target/release

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
  SUMFLOW_COORDINATOR=$(cat "$run_dir/coordinator")
  export SUMFLOW_COORDINATOR

  for s in $(seq 0 $((SERVERS - 1))); do
    "$bin/sumflow-server" --coordinator "$SUMFLOW_COORDINATOR" --host-id "local-server-$s" \
      > >(prefix "server $s") 2>&1 &
    pids+=($!)
  done
  local workers=()
  for w in $(seq 0 $((WORKERS - 1))); do
    SUMFLOW_RANK=$w SUMFLOW_ROUNDS=$rounds "$bin/examples/demo_worker" > >(prefix "worker $w") 2>&1 &
    workers+=($!)
  done

  # Any worker failing fails the job; the others are stopped by the cleanup.
  local status=0
  for p in "${workers[@]}"; do wait "$p" || status=1; done
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  if [ "$status" -eq 0 ]; then step "job finished: every sum verified"; else step "job FAILED"; fi
  return "$status"
}

# The training job through the Python package and the sumflow-run launcher.
run_training() {
  step "python environment (.venv, requirements-dev.txt, maturin develop --release)"
  ensure_python_env

  local launcher=(sumflow-run)
  command -v sumflow-run >/dev/null 2>&1 || launcher=(python -m sumflow.launcher)
  # Global, not local: the EXIT trap runs after this function has returned.
  result=$(mktemp --suffix=.json)
  trap 'rm -f "$result"' EXIT

  step "training on digits: $WORKERS workers, $SERVERS CPU servers (+ this machine's colocated one)"
  echo "+ ${launcher[*]} -np $WORKERS --servers $SERVERS python examples/train_digits.py ${extra[*]}"
  local status=0
  "${launcher[@]}" -np "$WORKERS" --servers "$SERVERS" \
    python examples/train_digits.py --json "$result" \
    --min-accuracy "${MIN_ACCURACY:-0.95}" "${extra[@]}" || status=$?
  if [ "$status" -ne 0 ]; then
    step "job FAILED (exit $status)"
    return "$status"
  fi
  python - "$result" <<'PY'
import json
import sys

m = json.load(open(sys.argv[1]))
print(
    f"\n==> job finished: test accuracy {m['accuracy']:.2%} after {m['epochs']} epochs on "
    f"{m['workers']} workers; {m['samples_per_s']:.0f} training samples/s in all"
)
PY
}

step "toolchain"
ensure_rust
if [ "$mode" = demo ]; then run_demo; else run_training; fi
