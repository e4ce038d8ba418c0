#!/usr/bin/env bash
# The CUDA checks, for a machine with a GPU, torch and torchvision (run from the repository
# root, with sumflow's extension built into python/sumflow): the CUDA tests, then ResNet-50
# trained through sumflow by one worker (at the defaults, alternating with gradients sent
# one by one) and by two sharing the GPU (backward time with and without sumflow's hooks,
# sums checked), then, given HOROVOD_SUITE (a copy of ../shared/conformance/horovod-torch),
# Horovod's suite with CUDA tensors, last, as it takes the longest. Results and logs go to
# the folder given, each as soon as its step ends. About 6 minutes on an H200.
#
#     bench/cuda_check.sh cuda-results
#     HOROVOD_SUITE=.devrun/hvd bench/cuda_check.sh cuda-results
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
timeout 200 "$python" -m pytest -q -p no:cacheprovider -rs python/tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log" || status=1
run() {  # tag, workers, images per worker, sumflow-run flags...
  local tag=$1 np=$2 batch=$3
  shift 3
  echo "== ResNet-50 ($tag), $np worker(s), batch $batch"
  # sumflow-run forwards SUMFLOW_* settings only through -x, never from its environment.
  timeout 90 "$python" -m sumflow.launcher -np "$np" --timeout 60 "$@" "$python" -m sumflow_bench.cuda_training \
    --steps 30 --batch "$batch" --json "$out/resnet50-$tag.json" --plot "$out/resnet50-$tag.png" \
    2>&1 | tee "$out/resnet50-$tag.log" | grep -E "backward:|Error" || status=1
}
run np1-b64 1 64
run np1-b64-per-gradient 1 64 -x SUMFLOW_FUSION_THRESHOLD=0
run np1-b64-again 1 64
run np1-b128 1 128
run np2-b64 2 64
if [ -n "${HOROVOD_SUITE:-}" ]; then
  echo "== Horovod's suite, CUDA tensors, two one-GPU machines sharing the GPU"
  bin=$(mktemp -d)
  printf '#!/bin/sh\nexec %s -m sumflow.launcher "$@"\n' "$python" > "$bin/sumflow-run"
  printf '#!/bin/sh\nexec %s "$@"\n' "$python" > "$bin/python"
  chmod +x "$bin/sumflow-run" "$bin/python"
  PATH="$bin:$PATH" timeout 420 bash "$HOROVOD_SUITE/run.sh" -np 2 \
    --launcher-flags '--machine-per-worker --timeout 60' 2>&1 | tee "$out/horovod.log" | tail -3 || status=1
fi
exit $status
