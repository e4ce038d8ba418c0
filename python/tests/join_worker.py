"""A worker process for test_join.py: `python join_worker.py OUTDIR`.

Each worker in turn joins (``hvd.join()``) first while the others run allreduces (Sum and
Average, int32 and float32), which count the joined worker as zeros, and allgathers (named
and unnamed) and a broadcast, which must fail on them; every worker's join returns the same
last rank, never the worker that joined first, and an unnamed allgather after it works.
Afterwards every operation works as before, under names used before the joins too (the
servers' round offsets). Writes OUTDIR/rank<r>.txt: "ok", or the failures, one per line.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

import sumflow.torch as hvd


def main() -> None:
    out = Path(sys.argv[1])
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    failures: list[str] = []

    def expect(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype or not torch.equal(got, want):
            failures.append(f"{label}: got {got.tolist()}, want {want.tolist()}")

    def own(r: int, dtype: torch.dtype) -> torch.Tensor:
        return (torch.arange(6) * 5 + r * 7 - 4).to(dtype)

    def everyone_but(joined: int, dtype: torch.dtype) -> torch.Tensor:
        return sum((own(r, dtype) for r in range(size) if r != joined), torch.zeros(6, dtype=dtype))

    # Names used before any join: their keys' rounds go on across the joins.
    for dtype in (torch.int32, torch.float32):
        got = hvd.allreduce(own(rank, dtype), name=f"reused.{dtype}", op=hvd.Sum)
        expect(f"before joins, Sum {dtype}", got, everyone_but(-1, dtype))

    lasts = []
    for joiner in range(size):
        if rank == joiner:
            last = hvd.join()
        else:
            for step in range(2):
                for dtype in (torch.int32, torch.float32):
                    label = f"joiner {joiner} step {step} {dtype}"
                    total = everyone_but(joiner, dtype)
                    got = hvd.allreduce(own(rank, dtype), name=f"reused.{dtype}", op=hvd.Sum)
                    expect(f"{label} Sum", got, total)
                    got = hvd.allreduce(own(rank, dtype), name=f"joined.{step}.{dtype}")
                    want = (
                        total / size
                        if dtype.is_floating_point
                        else torch.div(total, size, rounding_mode="trunc")
                    )
                    expect(f"{label} Average", got, want.to(dtype))
            gathers = [
                ("allgather", lambda: hvd.allgather(torch.tensor([rank]), name="gathered")),
                ("broadcast", lambda: hvd.broadcast(torch.zeros(2), 0, name="broadcasted")),
                # Unnamed: the joined worker makes no such call, yet after join() every
                # worker's next unnamed call must meet the others' (Horovod's own tests).
                ("unnamed allgather", lambda: hvd.allgather(torch.tensor([rank]))),
            ]
            for kind, call in gathers:
                try:
                    call()
                    failures.append(f"joiner {joiner}: {kind} did not raise")
                except hvd.HorovodInternalError as e:
                    for words in (f"worker {joiner} has joined", "needs every worker"):
                        if words not in str(e):
                            failures.append(f"joiner {joiner}: {kind}'s error lacks {words!r}: {e}")
            last = hvd.join()
        lasts.append(last)
        if not 0 <= last < size or last == joiner:
            failures.append(f"joiner {joiner} (joined first): join() returned {last}")
        got = hvd.allgather(torch.tensor([rank]))
        expect(f"joiner {joiner}: unnamed allgather after join", got, torch.arange(size))

    # Every worker got the same last ranks, and everything works again.
    gathered = hvd.allgather(torch.tensor([lasts]), name="lasts")
    if not all(torch.equal(row, gathered[0]) for row in gathered):
        failures.append(f"join() returned different ranks: {gathered.tolist()}")
    for dtype in (torch.int32, torch.float32):
        got = hvd.allreduce(own(rank, dtype), name=f"reused.{dtype}", op=hvd.Sum)
        expect(f"after joins, Sum {dtype}", got, everyone_but(-1, dtype))
        got = hvd.allreduce(own(rank, dtype), name=f"joined.0.{dtype}", op=hvd.Sum)
        expect(f"after joins, a name of the joins {dtype}", got, everyone_but(-1, dtype))
    got = hvd.allgather(torch.tensor([rank, rank * 10]), name="gathered")
    expect("after joins, allgather", got, torch.tensor([[r, r * 10] for r in range(size)]).view(-1))
    got = hvd.broadcast(torch.full((2,), float(rank)), 1, name="broadcasted")
    expect("after joins, broadcast", got, torch.full((2,), 1.0))
    hvd.barrier()
    (out / f"rank{rank}.txt").write_text("\n".join(failures) or "ok")
    hvd.shutdown()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        out = Path(sys.argv[1])
        rank = hvd.rank() if hvd.is_initialized() else -1
        (out / f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
