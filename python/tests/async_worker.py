"""A worker process for test_async.py: `python async_worker.py OUTDIR STALENESS SLOW`.

Every worker trains the same two parameters (a float32 matrix and a float64 vector) with
plain SGD (lr 1) on a gradient of rank + 1 everywhere, through ``AsyncOptimizer``, so every
delta is exact: -(rank + 1) per step. Worker SLOW sleeps 50 ms before each step. After each
step a worker holds the servers' latest value of every partition: the start less every
delta the servers had, which must include all of its own and, under a staleness bound s,
at least r - s steps of every other worker's (partitions may differ: each is the latest of
its own server). At the end (after a barrier) one more step with zero gradients reads the
final value: every worker's every step. Writes OUTDIR/rank<r>.txt: "ok", or the failures,
one per line.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch

import sumflow.torch as hvd

STEPS = 8


def main() -> None:
    out = Path(sys.argv[1])
    staleness = None if sys.argv[2] == "none" else int(sys.argv[2])
    slow = int(sys.argv[3])
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    failures: list[str] = []
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.full((300, 7), 1000.0))
    bias = torch.nn.Parameter(torch.full((11,), 500.0, dtype=torch.float64))
    optimizer = hvd.AsyncOptimizer(
        torch.optim.SGD([weight, bias], lr=1.0),
        named_parameters=[("weight", weight), ("bias", bias)],
        staleness=staleness,
    )
    everyone = sum(r + 1 for r in range(size))
    for step in range(1, STEPS + 1):
        if rank == slow:
            time.sleep(0.05)
        for p in (weight, bias):
            p.grad = torch.full_like(p, rank + 1.0)
        optimizer.step()
        own = step * (rank + 1)
        others = [r + 1 for r in range(size) if r != rank]
        behind = step if staleness is None else min(step, staleness)
        least = own + sum((step - behind) * d for d in others)
        most = own + STEPS * sum(others)
        for name, p, start in (("weight", weight, 1000.0), ("bias", bias, 500.0)):
            taken = start - p.detach().double()  # every delta the servers had, summed
            low, high = float(taken.min()), float(taken.max())
            if not least <= low <= high <= most:
                failures.append(f"step {step}: {name} took {low}..{high}, not in [{least}, {most}]")
    hvd.barrier()
    for p in (weight, bias):
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p, start in (("weight", weight, 1000.0), ("bias", bias, 500.0)):
        want = start - STEPS * everyone
        if not torch.all(p.detach() == want):
            failures.append(f"final {name}: {p.detach().unique().tolist()}, want {want}")
    (out / f"rank{rank}.txt").write_text("\n".join(failures) or "ok")
    hvd.shutdown()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        out = Path(sys.argv[1])
        rank = int(__import__("os").environ.get("SUMFLOW_RANK", "0"))
        (out / f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
