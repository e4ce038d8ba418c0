"""A worker process for test_collectives.py: `python collectives_worker.py OUTDIR`.

Runs every Horovod collective on data each worker can also compute for every other
worker, checks each result against that reference (integers exact, floats within 1e-6
relative), and writes OUTDIR/rank<r>.txt: "ok", or the failures, one per line.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import sumflow.torch as hvd

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
    torch.int16,
]


def data(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Worker `rank`'s tensor: small integers, exact in every dtype and in their sums."""
    n = 1
    for d in shape:
        n *= d
    values = (torch.arange(n) * 7 + rank * 3) % 11 + (1 if dtype == torch.uint8 else -5)
    return values.reshape(shape).to(dtype)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.is_floating_point():
        return torch.allclose(got.double(), want.double(), rtol=1e-6, atol=0)
    return torch.equal(got, want)


def expected_sum(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    wide = torch.stack([t.double() if t.is_floating_point() else t.long() for t in tensors])
    return wide.sum(0).to(dtype)


class Checks:
    """Runs each check, collecting failures instead of stopping at the first."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.everyone = list(range(size))
        self.failures: list[str] = []

    def run(self, label: str, body: Callable[[], None]) -> None:
        try:
            body()
        except Exception:
            self.failures.append(f"{label}: {traceback.format_exc(limit=3)}")

    def expect(self, label: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not same(got, want):
            self.failures.append(
                f"{label}: got {got.dtype} {list(got.shape)} {got.flatten()[:8].tolist()}, "
                f"want {want.dtype} {list(want.shape)} {want.flatten()[:8].tolist()}"
            )

    def reductions(self, dtype: torch.dtype) -> None:
        r, n = self.rank, self.size
        mine = data(r, (5, 3), dtype)
        wide = torch.stack(
            [
                data(q, (5, 3), dtype).double()
                if dtype.is_floating_point
                else data(q, (5, 3), dtype).long()
                for q in self.everyone
            ]
        )
        if dtype.is_floating_point:
            average = wide.sum(0) / n
        else:
            average = torch.div(wide.sum(0), n, rounding_mode="trunc")
        wants = {
            hvd.Average: average,
            hvd.Min: wide.amin(0),
            hvd.Max: wide.amax(0),
            hvd.Product: wide.prod(0),
        }
        # 16-bit floats round their sums once; with more than two workers the reference's
        # own rounding may differ, so their sums are checked with two workers or fewer.
        if dtype not in (torch.float16, torch.bfloat16) or n <= 2:
            wants[hvd.Sum] = wide.sum(0)
        for op, want in wants.items():
            label = f"{op.name}.{dtype}"
            self.expect(label, hvd.allreduce(mine, op=op, name=label), want.to(dtype))

    def gathers(self, dtype: torch.dtype) -> None:
        r, n = self.rank, self.size
        # A different number of rows per worker, worker 0 with none.
        rows = [0 if q == 0 and n > 1 else q + 1 for q in self.everyone]
        pieces = [data(q, (rows[q], 2), dtype) for q in self.everyone]
        whole = [data(q, (5, 3), dtype) for q in self.everyone]
        self.expect(
            f"allgather.{dtype}", hvd.allgather(pieces[r], name=f"ag.{dtype}"), torch.cat(pieces)
        )
        grouped = hvd.grouped_allgather([pieces[r], whole[r]], name=f"gag.{dtype}")
        self.expect(f"grouped_allgather.{dtype}.0", grouped[0], torch.cat(pieces))
        self.expect(f"grouped_allgather.{dtype}.1", grouped[1], torch.cat(whole))
        self.expect(
            f"broadcast.{dtype}", hvd.broadcast(whole[r], n - 1, name=f"bc.{dtype}"), whole[n - 1]
        )

    def alltoall(self, dtype: torch.dtype) -> None:
        """Worker i sends (i + j) % 3 rows to worker j."""
        r = self.rank

        def splits(i: int) -> list[int]:
            return [(i + j) % 3 for j in self.everyone]

        send = data(r, (sum(splits(r)), 2), dtype)
        got, received = hvd.alltoall(
            send, torch.tensor(splits(r), dtype=torch.int32), name=f"a2a.{dtype}"
        )
        pieces = []
        for i in self.everyone:
            theirs = splits(i)
            block = data(i, (sum(theirs), 2), dtype)
            pieces.append(block[sum(theirs[:r]) : sum(theirs[:r]) + theirs[r]])
        self.expect(f"alltoall.{dtype}", got, torch.cat(pieces))
        if received.tolist() != [splits(i)[r] for i in self.everyone]:
            self.failures.append(f"alltoall.{dtype}: received splits {received.tolist()}")

    def reducescatter(self, dtype: torch.dtype) -> None:
        """A first dimension of 2n + 1 rows: worker 0 receives 3, the others 2."""
        r, n = self.rank, self.size
        shape = (2 * n + 1, 3)
        total = expected_sum([data(q, shape, dtype) for q in self.everyone], dtype)
        counts = [3 if q == 0 else 2 for q in self.everyone]
        start = sum(counts[:r])
        got = hvd.reducescatter(data(r, shape, dtype), op=hvd.Sum, name=f"rs.{dtype}")
        self.expect(f"reducescatter.{dtype}", got, total[start : start + counts[r]])

    def grouped_allreduce(self) -> None:
        """Mixed dtypes, fused per dtype; out of place, then in place."""
        shapes = [((4,), torch.float32), ((2, 3), torch.int64), ((1,), torch.float64)]
        ts = [data(self.rank, s, dt) for s, dt in shapes]
        want = [expected_sum([data(q, s, dt) for q in self.everyone], dt) for s, dt in shapes]
        for i, (g, w) in enumerate(
            zip(hvd.grouped_allreduce(ts, op=hvd.Sum, name="g"), want, strict=True)
        ):
            self.expect(f"grouped_allreduce.{i}", g, w)
        hvd.grouped_allreduce_(ts, op=hvd.Sum, name="g_")
        for i, (g, w) in enumerate(zip(ts, want, strict=True)):
            self.expect(f"grouped_allreduce_.{i}", g, w)

    def reuse(self) -> None:
        """One name, another shape and dtype each call: each call stands alone."""
        for k, dt in ((3, torch.float32), (5, torch.int64), (3, torch.float32)):
            got = hvd.allreduce(torch.ones(k, dtype=dt), op=hvd.Sum, name="reuse")
            self.expect(f"reuse.{k}.{dt}", got, torch.full((k,), self.size, dtype=dt))

    def process_sets(self) -> None:
        """Sets of 1 to n - 1 members (the first k ranks, and the odd ranks): each member's
        results are those of the members alone; a worker outside a set may not run its
        operations."""
        r, n = self.rank, self.size
        sets = [list(range(k)) for k in range(1, n)] + ([list(range(1, n, 2))] if n > 2 else [])
        registered = [hvd.add_process_set(ranks) for ranks in sets]
        for ranks, ps in zip(sets, registered, strict=True):
            label = f"set{ranks}"
            if r not in ranks:
                try:
                    hvd.allreduce(torch.ones(1), process_set=ps)
                    self.failures.append(f"{label}: a non-member's allreduce ran")
                except ValueError:
                    pass
                continue
            me = ranks.index(r)
            mine = data(r, (4, 2), torch.int64)
            theirs = [data(q, (4, 2), torch.int64) for q in ranks]
            self.expect(
                f"{label}.sum",
                hvd.allreduce(mine, op=hvd.Sum, name="ps", process_set=ps),
                expected_sum(theirs, torch.int64),
            )
            self.expect(
                f"{label}.avg",
                hvd.allreduce(mine.double(), name="ps", process_set=ps),
                expected_sum(theirs, torch.float64) / len(ranks),
            )
            rows = [data(q, (q + 1, 2), torch.float32) for q in ranks]
            self.expect(
                f"{label}.allgather",
                hvd.allgather(rows[me], name="ps", process_set=ps),
                torch.cat(rows),
            )
            self.expect(
                f"{label}.broadcast",
                hvd.broadcast(mine, ranks[-1], name="ps", process_set=ps),
                theirs[-1],
            )
            k = len(ranks)
            got = hvd.reducescatter(
                data(r, (2 * k, 3), torch.int32), op=hvd.Sum, name="ps", process_set=ps
            )
            total = expected_sum([data(q, (2 * k, 3), torch.int32) for q in ranks], torch.int32)
            self.expect(f"{label}.reducescatter", got, total[2 * me : 2 * me + 2])
            out, received = hvd.alltoall(
                torch.full((k,), float(r)), torch.ones(k, dtype=torch.int32), "ps", ps
            )
            self.expect(f"{label}.alltoall", out, torch.tensor([float(q) for q in ranks]))
            self.expect(f"{label}.alltoall.splits", received, torch.ones(k, dtype=torch.int32))
            hvd.barrier(process_set=ps)
        for ps in registered:
            hvd.remove_process_set(ps)

    def objects(self) -> None:
        got = hvd.allgather_object({"rank": self.rank, "pad": "x" * self.rank})
        if got != [{"rank": q, "pad": "x" * q} for q in self.everyone]:
            self.failures.append(f"allgather_object: {got}")


def main() -> None:
    out = Path(sys.argv[1])
    hvd.init()
    checks = Checks(hvd.rank(), hvd.size())
    for dtype in DTYPES:
        checks.run(f"reductions.{dtype}", lambda dtype=dtype: checks.reductions(dtype))
        checks.run(f"gathers.{dtype}", lambda dtype=dtype: checks.gathers(dtype))
        checks.run(f"alltoall.{dtype}", lambda dtype=dtype: checks.alltoall(dtype))
        if dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
            checks.run(f"reducescatter.{dtype}", lambda dtype=dtype: checks.reducescatter(dtype))
    checks.run("grouped_allreduce", checks.grouped_allreduce)
    checks.run("reuse", checks.reuse)
    checks.run("objects", checks.objects)
    checks.run("process_sets", checks.process_sets)
    report = "\n".join(checks.failures) if checks.failures else "ok"
    (out / f"rank{checks.rank}.txt").write_text(report)
    hvd.shutdown()


if __name__ == "__main__":
    main()
