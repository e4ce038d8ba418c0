#!/usr/bin/env bash
# The CUDA checks, for a machine with a GPU, torch and torchvision (run from the repository
# root, with sumflow's extension built into python/sumflow): the CUDA tests, then ResNet-50
# trained through sumflow by one worker and by two sharing the GPU (backward time with and
# without sumflow's hooks, sums checked). Results and logs go to the folder given.
#
#     bench/cuda_check.sh cuda-results
set -uo pipefail
out=${1:?usage: bench/cuda_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="$PWD/python:$PWD/bench" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
status=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  nproc
} 2>&1 | tee "$out/device.txt"
echo "== CUDA tests"
timeout 330 "$python" -m pytest -q -p no:cacheprovider -rs python/tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log" || status=1
run() {  # workers, images per worker
  echo "== ResNet-50, $1 worker(s), batch $2"
  timeout 150 "$python" -m sumflow.launcher -np "$1" --timeout 90 "$python" -m sumflow_bench.cuda_training \
    --steps 30 --batch "$2" --json "$out/resnet50-np$1-b$2.json" --plot "$out/resnet50-np$1-b$2.png" || status=1
}
run 1 64
run 1 128
run 2 64
exit $status
