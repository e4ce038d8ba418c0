#!/usr/bin/env bash
# Sets up and runs every test: formatting, lints, unit and integration tests, a fuzz smoke
# run, and quick smoke runs of the benchmarks. Works on a fresh machine of this project's
# kind; installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

step "toolchain"
ensure_rust
export CARGO_TERM_COLOR=never

step "rustfmt"
cargo fmt --all -- --check

step "clippy (warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test (release: kernels are tested as they run)"
test_log=$(mktemp)
trap 'rm -f "$test_log"' EXIT
cargo test --workspace --release --locked 2>&1 | tee "$test_log"

step "benchmark smoke runs"
SUMFLOW_BENCH_QUICK=1 cargo bench --locked -p sumflow-summation --bench reduce
SUMFLOW_BENCH_QUICK=1 cargo bench --locked -p sumflow-summation --bench goodput

step "fuzz smoke run of the frame decoder"
scripts/fuzz.sh 30

step "all tests passed"
# One closing line with the totals over every test binary.
awk '/^test result:/ { p += $4; f += $6 } END { printf "summary: %d passed, %d failed\n", p, f }' "$test_log"
