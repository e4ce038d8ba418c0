#!/usr/bin/env bash
# The CUDA checks, for a machine with a GPU, torch and torchvision (run from the repository
# root, with sumflow's extension built into python/sumflow). Steps, all by default, in
# this order:
#   tests      python/tests/test_cuda.py
#   b64        ResNet-50 trained through sumflow by one worker, 64 images (the defaults),
#              twice; backward timed with and without sumflow's hooks, sums checked
#   python     the same with the copies staged by the Python thread (SUMFLOW_CUDA_STAGING=python)
#   gradient   the same with every gradient sent alone (SUMFLOW_FUSION_THRESHOLD=0)
#   spans16    the same in 16 MiB spans (not run by default)
#   b128       one worker, 128 images
#   np2        two workers sharing the GPU, 64 images each
#   profile    one worker, 64 images, then where the hooks' time goes (cProfile)
#   hooks      the same hooks on this host's CPU alone (sumflow_bench.hook_cost): how fast
#              this host runs their Python, to compare with the machine the project's
#              CI runs on
#   ab         an A/B of this tree against another (BASELINE: that tree's python/ folder,
#              with its extension built), 64 images, alternating three times; compared
#              by sumflow_bench.cuda_compare into ab.txt and ab.png (not run by default)
#   cudahooks  hook_cost on CUDA tensors, with the profile of the hooks, staged by the
#              driver and then by the Python thread (not run by default)
#   horovod    Horovod's suite with CUDA tensors, given HOROVOD_SUITE (a copy of
#              ../shared/conformance/horovod-torch); last, as it takes the longest
# Results and logs go to the folder given, each as soon as its step ends (the suite's
# log as it runs, so that a hang leaves it behind). About 6 minutes on an H200.
#
#     bench/cuda_check.sh cuda-results
#     HOROVOD_SUITE=.devrun/hvd bench/cuda_check.sh cuda-results tests profile horovod
set -uo pipefail
out=${1:?usage: bench/cuda_check.sh OUT_DIR [STEP...]}
shift
steps=${*:-tests hooks b64 python gradient b128 np2 horovod}
mkdir -p "$out"
export PYTHONPATH="$PWD/python:$PWD/bench" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
status=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  nproc
} 2>&1 | tee "$out/device.txt"
resnet() {  # tag, workers, images per worker, then sumflow-run's flags and '--' and the benchmark's
  local tag=$1 np=$2 batch=$3
  shift 3
  local flags=() extra=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do flags+=("$1"); shift; done
  [ $# -gt 0 ] && shift && extra=("$@")
  echo "== ResNet-50 ($tag), $np worker(s), batch $batch"
  # sumflow-run forwards SUMFLOW_* settings only through -x, never from its environment.
  timeout -k 5 90 "$python" -m sumflow.launcher -np "$np" --timeout 60 "${flags[@]}" \
    "$python" -m sumflow_bench.cuda_training --steps 30 --batch "$batch" \
    --json "$out/resnet50-$tag.json" --plot "$out/resnet50-$tag.png" "${extra[@]}" \
    > "$out/resnet50-$tag.log" 2>&1 || status=1
  grep -E "backward:|Error" "$out/resnet50-$tag.log"
}
horovod() {
  if [ -z "${HOROVOD_SUITE:-}" ]; then
    echo "== Horovod's suite skipped: HOROVOD_SUITE is not set"
    return
  fi
  echo "== Horovod's suite, CUDA tensors, two one-GPU machines sharing the GPU"
  local bin suite
  bin=$(mktemp -d)
  suite=$(mktemp -d)
  printf '#!/bin/sh\nexec %s -m sumflow.launcher "$@"\n' "$python" > "$bin/sumflow-run"
  printf '#!/bin/sh\nexec %s "$@"\n' "$python" > "$bin/python"
  chmod +x "$bin/sumflow-run" "$bin/python"
  # run.sh keeps the suite's output in a folder it deletes, and shows it at the end: a
  # copy writes it here instead, where a test that hangs leaves it to read.
  cp "$HOROVOD_SUITE"/* "$suite"/
  sed -i "s#\"\$work/out.log\"#\"$out/horovod-out.log\"#g" "$suite/run.sh"
  local extra=(-v)
  # A test that hangs fails after 90 s with every thread's stack, where pytest-timeout is.
  "$python" -c 'import pytest_timeout' 2> /dev/null && extra+=(--timeout 90)
  PATH="$bin:$PATH" timeout -k 5 420 bash "$suite/run.sh" -np 2 \
    --launcher-flags '--machine-per-worker --timeout 60' -- "${extra[@]}" \
    > "$out/horovod.log" 2>&1 || status=1
  tail -3 "$out/horovod.log"
}
for step in $steps; do
  case $step in
    tests)
      echo "== CUDA tests"
      timeout -k 5 200 "$python" -m pytest -q -p no:cacheprovider -rs python/tests/test_cuda.py \
        > "$out/test_cuda.log" 2>&1 || status=1
      tail -3 "$out/test_cuda.log" ;;
    b64) resnet np1-b64 1 64; resnet np1-b64-again 1 64 ;;
    python) resnet np1-b64-python-staging 1 64 -x SUMFLOW_CUDA_STAGING=python ;;
    gradient) resnet np1-b64-per-gradient 1 64 -x SUMFLOW_FUSION_THRESHOLD=0 ;;
    spans16) resnet np1-b64-16mib 1 64 -x SUMFLOW_FUSION_THRESHOLD=16777216 ;;
    b128) resnet np1-b128 1 128 ;;
    np2) resnet np2-b64 2 64 ;;
    profile) resnet np1-b64-profile 1 64 -- --profile-hooks ;;
    hooks)
      echo "== the gradient hooks on the CPU (hook_cost)"
      timeout -k 5 60 "$python" -m sumflow.launcher -np 1 --timeout 50 \
        "$python" -m sumflow_bench.hook_cost --steps 30 > "$out/hook_cost.log" 2>&1 || status=1
      grep -E "gradients|Error" "$out/hook_cost.log" ;;
    ab)
      if [ -z "${BASELINE:-}" ]; then
        echo "== the A/B skipped: BASELINE (another tree's python/ folder) is not set"
        continue
      fi
      this=() base=()
      for i in 1 2 3; do
        resnet ab-this-$i 1 64
        PYTHONPATH="$BASELINE:$PWD/bench" resnet ab-baseline-$i 1 64
        this+=("$out/resnet50-ab-this-$i.json") base+=("$out/resnet50-ab-baseline-$i.json")
      done
      "$python" -m sumflow_bench.cuda_compare --plot "$out/ab.png" \
        "this=$(IFS=,; echo "${this[*]}")" "baseline=$(IFS=,; echo "${base[*]}")" \
        > "$out/ab.txt" 2>&1 || status=1
      tail -3 "$out/ab.txt" ;;
    cudahooks)
      for staging in driver python; do
        echo "== the gradient hooks on CUDA tensors (hook_cost), staged by $staging"
        timeout -k 5 90 "$python" -m sumflow.launcher -np 1 --timeout 80 \
          -x SUMFLOW_CUDA_STAGING=$staging "$python" -m sumflow_bench.hook_cost --steps 30 \
          --device cuda --profile 30 > "$out/hook_cost-cuda-$staging.log" 2>&1 || status=1
        grep -E "gradients|Error" "$out/hook_cost-cuda-$staging.log"
      done ;;
    horovod) horovod ;;
    *) echo "cuda_check.sh: unknown step $step" >&2; exit 2 ;;
  esac
done
exit $status
