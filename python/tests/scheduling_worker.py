"""A worker for test_scheduling.py: switches the partition size and credit during a job
(as the auto-tuner does) and checks that every sum stays exact.

Usage: python scheduling_worker.py OUT_DIR
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import sumflow.torch as hvd
from sumflow.torch import ops


def check(x: torch.Tensor, want: float, what: str) -> None:
    if not torch.equal(x, torch.full_like(x, want)):
        raise AssertionError(f"{what}: got {x[:4].tolist()}..., want {want}")


def main() -> None:
    out = Path(sys.argv[1])
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    service = ops._runtime.current().service
    total = sum(r + 1 for r in range(size))
    x = torch.full((1000,), float(rank + 1))
    hvd.allreduce_(x, name="x", op=hvd.Sum)
    check(x, total, "first sum")
    first = service.schedule()
    # An operation in flight (rank 1 joins it a second late) refuses the switch.
    if rank == 1:
        time.sleep(1.0)
    x.fill_(rank + 1)
    handle = hvd.allreduce_async_(x, name="x", op=hvd.Sum)
    refused = ""
    if rank == 0:
        try:
            service.reconfigure(partition_bytes=256)
        except ValueError as e:
            refused = str(e)
    hvd.synchronize(handle)
    check(x, total, "sum during the refused switch")
    # Every worker switches between the same two steps: 16 partitions of 64 elements.
    service.reconfigure(partition_bytes=256, credit_bytes=512)
    switched = service.schedule()
    for step in range(3):
        x.fill_(rank + 1 + step)
        hvd.allreduce_(x, name="x", op=hvd.Sum)
        check(x, total + size * step, f"sum {step} at 256-byte partitions")
    # Back to the first size: its keys, and their round count, are reused.
    service.reconfigure(partition_bytes=first["partition_bytes"])
    x.fill_(rank + 1)
    hvd.allreduce_(x, name="x", op=hvd.Sum)
    check(x, total, "sum back at the first size")
    (out / f"rank{rank}.txt").write_text(
        "\n".join(
            [
                refused,
                repr(first),
                repr(switched),
                repr(service.schedule()),
            ]
        )
    )
    hvd.shutdown()


if __name__ == "__main__":
    main()
