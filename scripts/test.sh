#!/usr/bin/env bash
# Sets up and runs every test: formatting, lints, unit and integration tests, the Python
# package's tests, a fuzz smoke run, and quick smoke runs of the benchmarks. Works on a
# fresh machine of this project's kind; installs what it needs (Rust if missing, and the
# Python environment in .venv: see ensure_python_env in scripts/lib.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
test_log=$tmp/cargo-test.log
junit=$tmp/pytest.xml
junit_oldest=$tmp/pytest-oldest-torch.xml

# One closing line with the totals over every Rust test binary and both pytest runs.
summary() {
  local rust py
  rust=$(awk '/^test result:/ { p += $4; f += $6 } END { printf "%d %d", p, f }' "$test_log")
  py="0 0"
  if [ -s "$junit" ]; then
    py=$(python - "$junit" "$junit_oldest" <<'PY'
import os
import sys
import xml.etree.ElementTree as ET

passed = failed = 0
for path in sys.argv[1:]:
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        continue  # a step that did not run
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
    for s in suites:
        n, fail, err, skip = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        passed += n - fail - err - skip
        failed += fail + err
print(passed, failed)
PY
)
  fi
  read -r rp rf <<<"$rust"
  read -r pp pf <<<"$py"
  printf 'summary: %d passed, %d failed\n' "$((rp + pp))" "$((rf + pf))"
}

step "toolchain"
ensure_rust
export CARGO_TERM_COLOR=never

step "rustfmt"
cargo fmt --all -- --check

step "clippy (warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test (release: kernels are tested as they run)"
cargo test --workspace --release --locked 2>&1 | tee "$test_log"

step "python environment (.venv, requirements-dev.txt, maturin develop --release)"
ensure_python_env

step "ruff (lint and format) on python/, examples/, bench/"
ruff check python/ examples/ bench/
ruff format --check python/ examples/ bench/

step "mypy (strict) on python/sumflow and bench/sumflow_bench; stubtest: _core.pyi against the built module"
mypy
python -m mypy.stubtest sumflow._core

step "tools of the emulated-cluster smoke test (iproute2, iperf3)"
ensure_cluster_tools || echo "could not install them: the emulated-cluster test will say it is skipped"

step "pytest"
pytest_status=0
python -m pytest -q --junitxml="$junit" || pytest_status=$?
if [ "$pytest_status" -ne 0 ]; then
  summary
  echo "pytest failed (exit $pytest_status)"
  exit "$pytest_status"
fi

step "the same wheel under the oldest Python and torch supported ($min_python, requirements-torch-oldest.txt): the torch API's tests"
oldest=$(ensure_oldest_torch_env "$tmp/wheels")
oldest_status=0
# Every module of the package imports; the plugin's API, Horovod's and DDP's:
# DistributedOptimizer (fused, grouped, crossing the barrier, asynchronous), the
# collectives, process sets, join, compression and CSC; the launchers' environments and
# the elastic membership and sampler (pure Python); and Horovod's own suite on one machine
# of two workers.
"$oldest" -m pytest -q -p no:cacheprovider --junitxml="$junit_oldest" python/tests/test_imports.py \
  python/tests/test_torch.py python/tests/test_collectives.py python/tests/test_cross_barrier.py \
  python/tests/test_fusion.py python/tests/test_groups.py python/tests/test_join.py \
  python/tests/test_compression.py python/tests/test_csc.py python/tests/test_async.py \
  python/tests/test_adasum.py \
  python/tests/test_jobenv.py python/tests/test_membership.py python/tests/test_elastic_sampler.py \
  "python/tests/test_horovod_conformance.py::test_no_horovod_test_that_passed_fails_now[1x2]" \
  || oldest_status=$?
if [ "$oldest_status" -ne 0 ]; then
  summary
  echo "pytest under the oldest Python and torch failed (exit $oldest_status)"
  exit "$oldest_status"
fi

step "end-to-end smoke run: sumflow-run, 2 workers + 1 CPU server, the digits example"
sumflow-run -np 2 --servers 1 python examples/train_digits.py --epochs 8 --min-accuracy 0.9
sumflow-run -np 2 --servers 1 python examples/train_digits.py --epochs 8 --min-accuracy 0.9 \
  --asynchronous --staleness 2
sumflow-run -np 2 --servers 1 python examples/train_digits.py --epochs 8 --min-accuracy 0.9 \
  --adasum

step "benchmark smoke runs"
SUMFLOW_BENCH_QUICK=1 cargo bench --locked -p sumflow-reduce --bench reduce
SUMFLOW_BENCH_QUICK=1 cargo bench --locked -p sumflow-summation --bench goodput

step "fuzz smoke runs: frames, the handshake, the coordinator's state machine, payloads"
scripts/fuzz.sh 15

step "all tests passed"
summary
