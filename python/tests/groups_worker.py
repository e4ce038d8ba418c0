"""A worker process for test_groups.py: `python groups_worker.py OUTDIR`.

Trains the same integer-valued model with DistributedOptimizer without groups and with
each way of giving them (VARIANTS), recording, for the first step, when each gradient was
ready and when it was issued; saves the parameters and the records to OUTDIR/rank<r>.pt.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import sumflow.torch as hvd
from sumflow.torch import ops

STEPS = 4
BATCH = 6  # rows per worker
#: A power of two: each step adds 9 bits to the weights' binary fractions, so after STEPS
#: every value, and every sum of them, is still exact in float64.
LR = 2.0**-9


class Net(torch.nn.Module):
    """Integer weights, and an output linear in them (no weight multiplies another, which
    would double the bits each step); a module the forward never uses, whose gradients
    exist only as the zeros step() sends for them."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.first = torch.nn.Linear(4, 3).double()
        self.second = torch.nn.Linear(4, 3).double()
        self.unused = torch.nn.Linear(3, 3).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-2, 3, p.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) + self.second(x.flip(1))


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker `rank`'s rows of step `step`'s global batch: small integers."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(-3, 4, (BATCH * size, 4), generator=g).double()
    y = torch.randint(-3, 4, (BATCH * size, 3), generator=g).double()
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    return x[rows], y[rows]


def loss_of(m: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # A sum, not a mean: averaged over the workers it is the whole batch's sum / size.
    return 0.5 * ((m(x) - y) ** 2).sum()


def explicit(m: Net) -> list[list[torch.Tensor]]:
    """Not consecutive; the second group holds a parameter no forward uses; second.bias
    and unused.bias are in no group."""
    return [[m.second.weight, m.first.bias], [m.first.weight, m.unused.weight]]


#: name -> (DistributedOptimizer's extra arguments for a model, backward passes per step).
VARIANTS: dict[str, tuple[Callable[[Net], dict[str, Any]], int]] = {
    "plain": (lambda m: {}, 1),
    "num_groups=2": (lambda m: {"num_groups": 2}, 1),
    "groups=3": (lambda m: {"groups": 3}, 1),
    "groups=lists": (lambda m: {"groups": explicit(m)}, 1),
    "groups=lists, 2 passes": (lambda m: {"groups": explicit(m)}, 2),
    "groups=lists, cross_barrier": (
        lambda m: {"groups": explicit(m), "cross_barrier": True, "model": m},
        1,
    ),
    "num_groups=2, SUMFLOW_FUSION_THRESHOLD": (lambda m: {"num_groups": 2}, 1),
}


def train(variant: str) -> dict[str, Any]:
    extra, passes = VARIANTS[variant]
    m = Net()
    names = {p: n for n, p in m.named_parameters()}
    #: The first step's readiness and issues, in order; step() marked by ("step", "").
    events: list[tuple[str, str]] = []
    recording = True

    def record(kind: str, name: str) -> None:
        if recording:
            events.append((kind, name))

    # Registered before the optimizer's own hooks, so each runs first for its parameter.
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda p: record("ready", names[p]))
    prefix = "DistributedOptimizer.grad."
    issue = ops.issue_declared

    def recording_issue(name: str, *args: Any, **kwargs: Any) -> int:
        record("issue", name[len(prefix) :])
        return issue(name, *args, **kwargs)

    env_fusion = "SUMFLOW_FUSION_THRESHOLD" in variant
    if env_fusion:
        os.environ["SUMFLOW_FUSION_THRESHOLD"] = "1048576"
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=LR),
            named_parameters=m.named_parameters(),
            backward_passes_per_step=passes,
            **extra(m),
        )
    os.environ.pop("SUMFLOW_FUSION_THRESHOLD", None)
    ops.issue_declared = recording_issue  # type: ignore[assignment]
    try:
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(step, hvd.rank(), hvd.size())
            for chunk in range(passes):
                rows = slice(chunk * BATCH // passes, (chunk + 1) * BATCH // passes)
                loss_of(m, x[rows], y[rows]).backward()
            record("step", "")
            opt.step()
            recording = False
        opt.synchronize()  # with cross_barrier: every update is done
    finally:
        ops.issue_declared = issue  # type: ignore[assignment]
    return {
        "model": {k: v.detach().clone() for k, v in m.state_dict().items()},
        "events": events,
        "warnings": [str(w.message) for w in warned],
    }


def main() -> None:
    outdir = Path(sys.argv[1])
    hvd.init()
    result = {variant: train(variant) for variant in VARIANTS}
    torch.save(result, outdir / f"rank{hvd.rank()}.pt")
    hvd.shutdown()


if __name__ == "__main__":
    main()
