"""CUDA tensors through sumflow (``_staging``: pinned buffers, copies on a side stream,
sums issued as their copies complete; by the core through the CUDA driver, and by the
Python thread): every collective exact (Adasum too, on 2 workers), DistributedOptimizer
equal to one process on the whole batch, and a sum of a CUDA tensor issued without waiting for
the GPU. Skipped where no GPU is present; run them on a GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
WORKER = HERE / "cuda_worker.py"

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CUDA path needs a GPU"
)


@pytest.mark.parametrize(
    ("workers", "how"),
    [
        (2, []),
        (3, []),
        (3, ["--machine-per-worker"]),
        (2, ["-x", "SUMFLOW_SHARED_MEMORY=off"]),
        (2, ["-x", "SUMFLOW_CUDA_STAGING=python"]),
    ],
    ids=["2-shared-memory", "3-shared-memory", "3-machines", "2-servers", "2-python-staging"],
)
def test_every_collective_on_cuda_tensors_is_exact(
    tmp_path: Path, workers: int, how: list[str]
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "sumflow.launcher",
            "-np",
            str(workers),
            "--timeout",
            "60",
            *how,
            sys.executable,
            str(WORKER),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in range(workers):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "ok", rank
