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

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.uint8, torch.int8, torch.int16]


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


def main() -> None:
    out = Path(sys.argv[1])
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    failures: list[str] = []

    def check(label: str, run: Callable[[], None]) -> None:
        try:
            run()
        except Exception:
            failures.append(f"{label}: {traceback.format_exc(limit=3)}")

    def expect(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not same(got, want):
            failures.append(f"{label}: got {got.dtype} {list(got.shape)} {got.flatten()[:8].tolist()}, "
                            f"want {want.dtype} {list(want.shape)} {want.flatten()[:8].tolist()}")

    everyone = [r_ for r_ in range(n)]
    for dtype in DTYPES:
        shape = (5, 3)
        mine = data(r, shape, dtype)
        all_ = [data(q, shape, dtype) for q in everyone]
        wide = torch.stack([t.long() if not t.is_floating_point() else t.double() for t in all_])

        def reduce(label: str, op: object, want: torch.Tensor) -> None:
            check(label, lambda: expect(label, hvd.allreduce(mine, op=op, name=label), want))

        if dtype not in (torch.float16, torch.bfloat16) or n <= 2:
            reduce(f"sum.{dtype}", hvd.Sum, wide.sum(0).to(dtype))
        if dtype.is_floating_point:
            reduce(f"avg.{dtype}", hvd.Average, (wide.sum(0) / n).to(dtype))
        else:
            reduce(f"avg.{dtype}", hvd.Average, torch.div(wide.sum(0), n, rounding_mode="trunc").to(dtype))
        reduce(f"min.{dtype}", hvd.Min, wide.amin(0).to(dtype))
        reduce(f"max.{dtype}", hvd.Max, wide.amax(0).to(dtype))
        reduce(f"prod.{dtype}", hvd.Product, wide.prod(0).to(dtype))

        # allgather with a different number of rows per worker, rank 0 with none.
        rows = [0 if q == 0 and n > 1 else q + 1 for q in everyone]
        gathered_in = [data(q, (rows[q], 2), dtype) for q in everyone]
        check(f"allgather.{dtype}", lambda: expect(
            f"allgather.{dtype}", hvd.allgather(gathered_in[r], name=f"ag.{dtype}"),
            torch.cat(gathered_in)))
        check(f"grouped_allgather.{dtype}", lambda: [
            expect(f"grouped_allgather.{dtype}.{i}", g, torch.cat([gathered_in[q][:, :1] * 0 + i for q in everyone]).to(dtype) if False else w)
            for i, (g, w) in enumerate(zip(
                hvd.grouped_allgather([gathered_in[r], mine], name=f"gag.{dtype}"),
                [torch.cat(gathered_in), torch.cat(all_)]))
        ])
        check(f"broadcast.{dtype}", lambda: expect(
            f"broadcast.{dtype}", hvd.broadcast(mine, n - 1, name=f"bc.{dtype}"), all_[n - 1]))

        # alltoall: worker i sends (i + j) % 3 rows to worker j.
        def alltoall() -> None:
            splits = [(r + j) % 3 for j in everyone]
            send = data(r, (sum(splits), 2), dtype)
            got, received = hvd.alltoall(send, torch.tensor(splits, dtype=torch.int32), name=f"a2a.{dtype}")
            pieces = []
            for i in everyone:
                theirs = [(i + j) % 3 for j in everyone]
                block = data(i, (sum(theirs), 2), dtype)
                pieces.append(block[sum(theirs[:r]): sum(theirs[:r]) + theirs[r]])
            expect(f"alltoall.{dtype}", got, torch.cat(pieces))
            if received.tolist() != [(i + r) % 3 for i in everyone]:
                failures.append(f"alltoall.{dtype}: received splits {received.tolist()}")

        check(f"alltoall.{dtype}", alltoall)

        # reducescatter of a first dimension not divisible by the workers.
        def reducescatter() -> None:
            t = data(r, (2 * n + 1, 3), dtype)
            total = torch.stack([data(q, (2 * n + 1, 3), dtype).double() for q in everyone]).sum(0)
            counts = [2 + (1 if q < 1 else 0) for q in everyone]
            start = sum(counts[:r])
            expect(f"reducescatter.{dtype}", hvd.reducescatter(t, op=hvd.Sum, name=f"rs.{dtype}"),
                   total[start:start + counts[r]].to(dtype))

        if dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
            check(f"reducescatter.{dtype}", reducescatter)

    # grouped allreduce of mixed dtypes, in place and not.
    def grouped() -> None:
        ts = [data(r, (4,), torch.float32), data(r, (2, 3), torch.int64), data(r, (1,), torch.float64)]
        want = [torch.stack([data(q, t.shape, t.dtype).double() for q in everyone]).sum(0).to(t.dtype) for t in ts]
        for g, w in zip(hvd.grouped_allreduce(ts, op=hvd.Sum, name="grouped"), want):
            expect("grouped_allreduce", g, w)
        hvd.grouped_allreduce_(ts, op=hvd.Sum, name="grouped_")
        for g, w in zip(ts, want):
            expect("grouped_allreduce_", g, w)

    check("grouped", grouped)
    # A name reused with another shape and dtype: each call stands alone.
    check("reuse", lambda: [expect(f"reuse.{k}", hvd.allreduce(torch.ones(k, dtype=dt), op=hvd.Sum, name="reuse"),
                                   torch.full((k,), n, dtype=dt))
                            for k, dt in ((3, torch.float32), (5, torch.int64), (3, torch.float32))])
    objects = hvd.allgather_object({"rank": r, "pad": "x" * r})
    if objects != [{"rank": q, "pad": "x" * q} for q in everyone]:
        failures.append(f"allgather_object: {objects}")
    (out / f"rank{r}.txt").write_text("\n".join(failures) if failures else "ok")
    hvd.shutdown()


if __name__ == "__main__":
    main()
