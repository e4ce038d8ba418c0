"""A worker for test_failure_notices.py: worker 1 stalls for a few seconds before a sum
that worker 0 is already waiting on, as a worker stuck in its own code would."""

from __future__ import annotations

import sys
import time

import torch

import sumflow.torch as hvd


def main() -> int:
    stall = float(sys.argv[1])
    hvd.init()
    x = torch.ones(1 << 12)
    hvd.allreduce(x, name="warm-up")
    if hvd.rank() == 1:
        time.sleep(stall)
    hvd.allreduce(x, name="late")
    return 0


if __name__ == "__main__":
    sys.exit(main())
