"""sumflow's allgather, reducescatter and alltoall against torch.distributed with gloo, on
the same data in the same run.

Every worker holds a 64 MB float32 set (8 tensors of 2M elements) and, rounds alternating
after a warm-up:

- **allgather**: each worker contributes its quarter (1/n) of every tensor and receives
  every worker's (sumflow ``grouped_allgather``; gloo ``all_gather`` per tensor, async);
- **reducescatter**: each worker's whole set is summed and each receives its 1/n of every
  tensor (sumflow ``grouped_reducescatter``; gloo has no reduce-scatter, so a gloo user's
  ``all_reduce`` per tensor, then the slice);
- **alltoall**: each worker sends 1/n of every tensor to each worker (sumflow
  ``alltoall`` per tensor, async; gloo ``all_to_all_single`` per tensor, async).

Each round starts after a barrier; a round's time is the slowest worker's. The first round
of each is checked against the exact result. Prints each method's median round, sumflow's
speed as a ratio of gloo's, and writes them as JSON.

    sumflow-run -np 4 python -m sumflow_bench.collectives_vs_gloo --json collectives.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import sumflow.torch as hvd
from sumflow_bench.pushpull_vs_gloo import init_gloo

TENSORS = 8


def data(elements: int, rank: int, i: int) -> torch.Tensor:
    """Worker `rank`'s tensor i: small integers, exact in float32 and in their sums."""
    return ((torch.arange(elements, dtype=torch.int64) * 7 + rank * 3 + i) % 1021).float()


def rounds(
    label: str,
    run: Callable[[], list[torch.Tensor]],
    check: Callable[[list[torch.Tensor]], None],
    reps: int,
    warmup: int,
) -> list[float]:
    """Times `reps` rounds (after `warmup`); the slowest worker's time per round."""
    times = []
    for rep in range(warmup + reps):
        hvd.barrier()
        start = time.perf_counter()
        out = run()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        slowest = hvd.allreduce(elapsed, op=hvd.Max, name=f"time.{label}")
        if rep == 0:
            check(out)
        if rep >= warmup:
            times.append(float(slowest.item()))
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megabytes", type=float, default=64.0, help="the set's size [64]")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="write the figures here (rank 0)")
    args = p.parse_args(argv)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    init_gloo(rank, size, 600.0)
    elements = int(args.megabytes * 1e6 / 4 / TENSORS) // size * size
    part = elements // size
    full = [data(elements, rank, i) for i in range(TENSORS)]
    mine = [t[rank * part : (rank + 1) * part].clone() for t in full]

    def expect(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
        for g, w in zip(got, want, strict=True):
            if not torch.equal(g, w):
                raise AssertionError(f"{what}: wrong result")

    gathered = [
        torch.cat([data(elements, q, i)[q * part : (q + 1) * part] for q in range(size)])
        for i in range(TENSORS)
    ]
    summed = [
        torch.stack([data(elements, q, i) for q in range(size)]).sum(0)[
            rank * part : (rank + 1) * part
        ]
        for i in range(TENSORS)
    ]
    received = [
        torch.cat([data(elements, q, i)[rank * part : (rank + 1) * part] for q in range(size)])
        for i in range(TENSORS)
    ]

    def sf_allgather() -> list[torch.Tensor]:
        return list(hvd.grouped_allgather(mine, name="bench.allgather"))

    def gloo_allgather() -> list[torch.Tensor]:
        outs = [[torch.empty_like(m) for _ in range(size)] for m in mine]
        works = [dist.all_gather(o, m, async_op=True) for o, m in zip(outs, mine, strict=True)]
        for w in works:
            w.wait()
        return [torch.cat(o) for o in outs]

    def sf_reducescatter() -> list[torch.Tensor]:
        return list(hvd.grouped_reducescatter(full, name="bench.rs", op=hvd.Sum))

    def gloo_reducescatter() -> list[torch.Tensor]:
        bufs = [t.clone() for t in full]
        works = [dist.all_reduce(b, async_op=True) for b in bufs]
        for w in works:
            w.wait()
        return [b[rank * part : (rank + 1) * part] for b in bufs]

    def sf_alltoall() -> list[torch.Tensor]:
        handles = [hvd.alltoall_async(t, name=f"bench.a2a.{i}") for i, t in enumerate(full)]
        return [hvd.synchronize(h)[0] for h in handles]

    def gloo_alltoall() -> list[torch.Tensor]:
        outs = [torch.empty_like(t) for t in full]
        works = [
            dist.all_to_all_single(o, t, async_op=True) for o, t in zip(outs, full, strict=True)
        ]
        for w in works:
            assert w is not None  # async_op=True gives a work to wait for
            w.wait()
        return outs

    results = {}
    Round = Callable[[], list[torch.Tensor]]
    ops: list[tuple[str, Round, Round, list[torch.Tensor]]] = [
        ("allgather", sf_allgather, gloo_allgather, gathered),
        ("reducescatter", sf_reducescatter, gloo_reducescatter, summed),
        ("alltoall", sf_alltoall, gloo_alltoall, received),
    ]
    for op, sf, gl, want in ops:
        sf_times: list[float] = []
        gl_times: list[float] = []
        for rep in range(args.reps):
            # Alternating rounds, so both see the same machine.
            check = functools.partial(expect, want=want, what=op)
            warmup = args.warmup if rep == 0 else 0
            sf_times += rounds(f"{op}.sumflow", sf, check, 1, warmup)
            try:
                gl_times += rounds(f"{op}.gloo", gl, check, 1, warmup)
            except RuntimeError as e:  # a collective this gloo build lacks
                gl_times = []
                if rank == 0:
                    print(f"{op}: gloo cannot: {e}", file=sys.stderr)
                break
        sf_med = statistics.median(sf_times)
        gl_med = statistics.median(gl_times) if gl_times else float("nan")
        results[op] = {"sumflow_s": sf_med, "gloo_s": gl_med, "ratio": gl_med / sf_med}
        if rank == 0:
            print(
                f"{op:14s} sumflow {sf_med * 1e3:8.1f} ms   gloo {gl_med * 1e3:8.1f} ms   "
                f"sumflow/gloo speed {gl_med / sf_med:.2f}x",
                flush=True,
            )
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "workers": size,
                    "megabytes": args.megabytes,
                    "reps": args.reps,
                    "results": results,
                },
                f,
                indent=1,
            )
    dist.destroy_process_group()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
