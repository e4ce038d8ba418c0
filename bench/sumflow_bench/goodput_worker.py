"""Goodput worker: sums a large gradient set across workers, round after round, and times it.

Run on every worker by the cluster harness (or by hand under ``sumflow-run``/``torchrun``):

    python -m sumflow_bench.goodput_worker --system sumflow --megabytes 32 --json out.json

Every worker holds ``--tensors`` float32 tensors of ``--megabytes`` in all (or, with
``--model``, the parameter tensors of a layer profile: ``resnet50`` is 161 tensors, 102 MB),
filled with its rank + 1 for the first round (whose sums are checked) and with zeros for
every later one, and sums them across the workers:

- ``sumflow``: ``push_pull_async`` on every tensor, then ``synchronize`` on every handle;
- ``gloo``: ``torch.distributed.all_reduce`` on every tensor with ``async_op``, then a wait
  on every request (env:// rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).

A round starts after a barrier; its time is the slowest worker's, from its own exit from the
barrier (how far apart the workers left it is reported too). Goodput is the bytes of
gradient synchronized per second per worker (BytePS Fig. 12): the set's size over the round
time. The first round's sums are checked exactly. Rank 0 writes the JSON: round times,
median goodput, and the wall-clock window of the measured rounds (so the harness can read
the CPU utilisation of exactly that window).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

SYSTEMS = ("sumflow", "gloo")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--megabytes", type=float, default=32.0, help="gradient set size, MB")
    p.add_argument("--tensors", type=int, default=8, help="tensors it is split into")
    p.add_argument(
        "--model",
        help="sum a layer profile's parameter tensors instead (e.g. resnet50; "
        "--megabytes and --tensors then do not apply)",
    )
    p.add_argument("--warmup", type=int, default=2, help="rounds before measuring")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds")
    p.add_argument("--json", type=Path, help="where rank 0 writes the results")
    args = p.parse_args(argv)
    if args.megabytes <= 0 or args.tensors < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--megabytes must be > 0, --tensors and --rounds >= 1, --warmup >= 0")
    return args


class Collective:
    """The operations one system offers the benchmark."""

    rank: int
    size: int

    def sum_all(self, tensors: list[torch.Tensor]) -> None:
        """Sums every tensor across workers, in place."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def gather_floats(self, value: float) -> list[float]:
        """Every worker's ``value``, by rank."""
        slots = torch.zeros(self.size, dtype=torch.float64)
        slots[self.rank] = value
        self.sum_small(slots)
        return slots.tolist()

    def sum_small(self, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def describe(self) -> list[str]:
        """Lines about how the work is spread (sumflow: bytes per server)."""
        return []

    def declare(self, tensors: list[torch.Tensor]) -> None:
        """Announces the tensors before the first round (sumflow places them together)."""

    def close(self) -> None:
        pass


class SumflowCollective(Collective):
    def __init__(self) -> None:
        import sumflow.torch as sf

        self.sf = sf
        sf.init()
        self.rank, self.size = sf.rank(), sf.size()

    def describe(self) -> list[str]:
        from sumflow.torch import _runtime

        return list(_runtime.current().service.placement_report())

    def declare(self, tensors: list[torch.Tensor]) -> None:
        self.sf.declare_tensors(
            [(f"goodput.{i}", t) for i, t in enumerate(tensors)], api="push_pull"
        )

    def sum_all(self, tensors: list[torch.Tensor]) -> None:
        handles = [
            self.sf.push_pull_async(t, average=False, name=f"goodput.{i}", priority=i)
            for i, t in enumerate(tensors)
        ]
        for h in handles:
            self.sf.synchronize(h)

    def barrier(self) -> None:
        self.sf.barrier()

    def sum_small(self, tensor: torch.Tensor) -> None:
        self.sf.push_pull(tensor, average=False, name="goodput.gather")

    def close(self) -> None:
        self.sf.shutdown()


class GlooCollective(Collective):
    def __init__(self) -> None:
        import datetime

        import torch.distributed as dist

        missing = [
            v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if v not in os.environ
        ]
        if missing:
            sys.exit(f"gloo needs {', '.join(missing)} in the environment (env:// rendezvous)")
        self.dist = dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def sum_all(self, tensors: list[torch.Tensor]) -> None:
        works = [self.dist.all_reduce(t, async_op=True) for t in tensors]
        for w in works:
            w.wait()

    def barrier(self) -> None:
        self.dist.barrier()

    def sum_small(self, tensor: torch.Tensor) -> None:
        self.dist.all_reduce(tensor)

    def close(self) -> None:
        # Every rank is done with the group before any tears it down.
        self.dist.barrier()
        self.dist.destroy_process_group()


def make_tensors(megabytes: float, count: int) -> list[torch.Tensor]:
    """``count`` float32 tensors of ``megabytes`` MB in all (the last takes the rest)."""
    elements = max(count, int(megabytes * 1e6 / 4))
    base, extra = divmod(elements, count)
    return [torch.empty(base + (extra if i == count - 1 else 0)) for i in range(count)]


def model_tensors(name: str) -> list[torch.Tensor]:
    """One float32 tensor per parameter of layer profile `name`, in forward order."""
    from sumflow import profiles

    return [torch.empty(p.numel) for p in profiles.load(name).params()]


def run(args: argparse.Namespace, make: Callable[[], Collective]) -> dict[str, object] | None:
    coll = make()
    tensors = (
        model_tensors(args.model) if args.model else make_tensors(args.megabytes, args.tensors)
    )
    coll.declare(tensors)
    nbytes = sum(t.numel() * 4 for t in tensors)
    expected = coll.size * (coll.size + 1) / 2
    times: list[float] = []
    spreads: list[float] = []
    window: list[float] = []
    total = args.warmup + args.rounds
    for t in tensors:
        t.fill_(coll.rank + 1)
    for r in range(total):
        coll.barrier()
        if r == args.warmup:
            window.append(time.time())
        began = time.time()
        start = time.perf_counter()
        coll.sum_all(tensors)
        elapsed = time.perf_counter() - start
        if r == 0:
            if coll.rank == 0:
                for line in coll.describe():
                    print(f"{args.system}: {line}", file=sys.stderr, flush=True)
            for i, t in enumerate(tensors):
                if not bool((t == expected).all()):
                    raise SystemExit(
                        f"rank {coll.rank}: tensor {i} does not hold the sum {expected}"
                    )
                # Every later round sums zeros, which stay zeros: nothing refills the
                # tensors inside the measured window, whose CPU time is then the
                # systems' own (a refill per round was 5-10% of it, alike for both).
                t.zero_()
        slowest = max(coll.gather_floats(elapsed))
        # How far apart the workers left the barrier: the slowest worker's time includes
        # it, a cost of the machine's scheduler (every worker wakes at once), not of the
        # sum. A sum of one nonzero term per slot is exact, so the clocks arrive intact.
        starts = coll.gather_floats(began)
        spread = max(starts) - min(starts)
        if r >= args.warmup:
            times.append(slowest)
            spreads.append(spread)
        if coll.rank == 0:
            phase = "warm-up" if r < args.warmup else "round"
            print(
                f"{args.system}: {phase} {r + 1}/{total}: {slowest * 1e3:.0f} ms, "
                f"{nbytes / slowest / 1e6:.1f} MB/s per worker, "
                f"started within {spread * 1e3:.0f} ms",
                file=sys.stderr,
                flush=True,
            )
    window.append(time.time())
    result = None
    if coll.rank == 0:
        median = statistics.median(times)
        result = {
            "system": args.system,
            "workers": coll.size,
            "bytes": nbytes,
            "tensors": len(tensors),
            "round_seconds": times,
            "start_spread_seconds": spreads,
            "goodput_bytes_per_s": nbytes / median,
            "window": window,
        }
    coll.close()
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # The emulated hosts share the machine's cores, and torch's OpenMP threads spin after
    # every parallel fill: perf counted 11% of the machine in libgomp during a round, CPU
    # neither system spends on summing.
    torch.set_num_threads(1)
    make = SumflowCollective if args.system == "sumflow" else GlooCollective
    result = run(args, make)
    if result is not None and args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
