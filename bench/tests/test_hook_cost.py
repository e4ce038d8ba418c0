"""sumflow_bench.hook_cost: ResNet-50's parameter set, and the benchmark run end to end."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

from sumflow_bench.hook_cost import resnet50_shapes


def test_the_parameter_set_is_resnet50s() -> None:
    shapes = resnet50_shapes()
    assert len(shapes) == 161
    assert sum(math.prod(s) for s in shapes) == 25_557_032  # torchvision's count


def test_the_benchmark_times_sending_hooks_and_the_others() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
    env.update(OMP_NUM_THREADS="1", RUST_LOG="warn")
    proc = subprocess.run(
        [sys.executable, "-m", "sumflow.launcher", "-np", "1", "--timeout", "60",
         sys.executable, "-m", "sumflow_bench.hook_cost", "--steps", "2", "--warmup", "1",
         "--profile", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = re.search(r"161 CPU gradients, fusion 4194304 B: .* \((\d+) a step\)", proc.stdout)
    assert line, proc.stdout[-2000:]
    # 97.5 MiB of gradients in spans of at least 4 MiB, each closed as soon as it holds
    # that much (the last holds the rest).
    assert line.group(1) == "19"
    # The profile of the timed steps' hooks, sumflow's among them.
    assert "function calls" in proc.stdout, proc.stdout
    assert "_sf_grad_ready" in proc.stdout, proc.stdout
