"""Goodput worker of an elastic job: sums a gradient set round after round under
``hvd.elastic.run``, committing after each round, and prints each round's time with the
membership epoch it ran in. Also runs in a fixed job (one epoch).

    python -m sumflow_bench.elastic_goodput_worker --megabytes 64 --rounds 40

Every worker fills its tensors with rank + 1 before each round and checks the sum exactly
after it, so a change of servers that lost or doubled a gradient fails the run. Rank 0
prints ``ROUND r epoch e seconds t`` per round (the slowest worker's time, after a
barrier); ``sumflow_bench.elastic_servers`` reads them.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import sumflow.torch as hvd
from sumflow.torch import _runtime
from sumflow_bench.goodput_worker import make_tensors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megabytes", type=float, default=64.0, help="gradient set size, MB")
    p.add_argument("--tensors", type=int, default=8, help="tensors it is split into")
    p.add_argument("--rounds", type=int, default=40, help="rounds in all")
    args = p.parse_args(argv)
    if args.megabytes <= 0 or args.tensors < 1 or args.rounds < 1:
        p.error("--megabytes must be > 0, --tensors and --rounds at least 1")
    hvd.init()
    tensors = make_tensors(args.megabytes, args.tensors)
    names = [f"goodput.{i}" for i in range(len(tensors))]
    state = hvd.elastic.ObjectState(round=0)

    def declare() -> None:
        hvd.declare_tensors(list(zip(names, tensors, strict=True)), api="push_pull")

    state.register_reset_callbacks([declare])
    declare()

    @hvd.elastic.run
    def rounds(state: hvd.elastic.ObjectState) -> None:
        while state.round < args.rounds:
            for t in tensors:
                t.fill_(hvd.rank() + 1)
            hvd.barrier()
            start = time.perf_counter()
            handles = [
                hvd.push_pull_async(t, average=False, name=n, priority=i)
                for i, (n, t) in enumerate(zip(names, tensors, strict=True))
            ]
            for h in handles:
                hvd.synchronize(h)
            seconds = time.perf_counter() - start
            expected = hvd.size() * (hvd.size() + 1) / 2
            for n, t in zip(names, tensors, strict=True):
                if not bool((t == expected).all()):
                    raise SystemExit(f"rank {hvd.rank()}: {n} does not hold the sum {expected}")
            slowest = hvd.allreduce(
                torch.tensor([seconds]), op=hvd.Max, name="goodput.seconds"
            ).item()
            if hvd.rank() == 0:
                epoch = _runtime.current().epoch or 0  # None in a fixed job: its one epoch
                print(f"ROUND {state.round} epoch {epoch} seconds {slowest:.4f}", flush=True)
            state.round += 1
            state.commit()

    rounds(state)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
