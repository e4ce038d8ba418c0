"""A worker process for test_tune.py: `python tune_worker.py OUTDIR [sync|cross|fused]`.

Trains a small float64 model with DistributedOptimizer (across the global barrier with
`cross`; across it and fusing gradients, from a threshold of FUSION_START, with `fused`)
while the environment's SUMFLOW_AUTOTUNE* settings tune it, and saves the final
parameters and the schedule the service ran after every step (with `fused`, and the
optimizer's fusion threshold) to OUTDIR/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch_worker import batch

import sumflow.torch as hvd
from sumflow.torch import _runtime

STEPS = 24
#: `fused`'s starting threshold: two spans (24 + 6144 B, then 2048 + 20480 B).
FUSION_START = 4096


def model() -> torch.nn.Module:
    """Tensors of 20 KiB, 2 KiB, 6 KiB: partitions of 4 to 32 KiB cut them differently."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 256), torch.nn.ReLU(), torch.nn.Linear(256, 3)
    ).double()


def make_optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]


def main() -> None:
    outdir, mode = Path(sys.argv[1]), sys.argv[2]
    cross, fused = mode in ("cross", "fused"), mode == "fused"
    hvd.init()
    service = _runtime.current().service
    m = model()
    opt = hvd.DistributedOptimizer(
        make_optimizer(m.parameters()),
        named_parameters=m.named_parameters(),
        cross_barrier=cross,
        model=m if cross else None,
        fusion_threshold=FUSION_START if fused else 0,
    )
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    schedules = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, hvd.rank(), hvd.size())
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        s = service.schedule()
        fusion = (opt._sf_pool.threshold,) if fused else ()  # type: ignore[attr-defined]
        schedules.append((s["partition_bytes"], s["credit_bytes"], *fusion))
    opt.synchronize()  # the last updates, across the barrier
    result = {"state": {k: v.detach().clone() for k, v in m.state_dict().items()}}
    result["schedules"] = schedules
    torch.save(result, outdir / f"rank{hvd.rank()}.pt")
    hvd.shutdown()


if __name__ == "__main__":
    main()
