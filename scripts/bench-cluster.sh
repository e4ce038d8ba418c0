#!/usr/bin/env bash
# Sets up and runs the emulated-cluster benchmark (python -m sumflow_bench.cluster): the
# Python environment (.venv with sumflow and sumflow-bench), iproute2 and iperf3, then the
# harness with the arguments given (none: the standard configuration). Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

if [ "$(id -u)" -ne 0 ]; then
  echo "the emulated cluster needs root (network namespaces, tc): run this with sudo" >&2
  exit 2
fi
step "toolchain"
ensure_rust
step "python environment"
ensure_python_env
step "iproute2 and iperf3"
ensure_cluster_tools
step "emulated-cluster benchmark"
python -m sumflow_bench.cluster "$@"
