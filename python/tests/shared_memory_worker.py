"""A worker process for test_shared_memory.py, started by ``sumflow-run -np N`` on one
machine: ``python shared_memory_worker.py OUTDIR EXPECT`` with EXPECT ``shared`` (every
operation sums in the machine's shared memory: not a byte to a server), ``servers``
(``SUMFLOW_SHARED_MEMORY=off``: they go through the summation server) or ``machines``
(several emulated machines: what spans machines goes through the servers).

Runs every collective on integer and float data against its exact result; writes
OUTDIR/rank<r>.txt: "ok", or the failures.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

import sumflow.torch as hvd
from sumflow.torch import _runtime


def wire_total() -> int:
    per_key, untied = _runtime.current().service.wire_bytes()
    return sum(s + r for _, _, s, r in per_key) + untied[0] + untied[1]


def main() -> None:
    out, expect = Path(sys.argv[1]), sys.argv[2]
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    failures: list[str] = []

    def check(what: str, ok: bool) -> None:
        if not ok:
            failures.append(what)

    def terms(make: Callable[[int], torch.Tensor]) -> list[torch.Tensor]:
        return [make(r) for r in range(n)]

    before = wire_total()
    dtypes = (torch.int32, torch.int64, torch.float32, torch.float64, torch.float16, torch.bfloat16)
    for dtype in dtypes:
        for size in (1, 63, 1000, 65_537):

            def mine(r: int, dtype: torch.dtype = dtype, size: int = size) -> torch.Tensor:
                return ((torch.arange(size) % 11) - 5 + r).to(dtype)

            every = terms(mine)
            for op, ref in (
                (hvd.Sum, lambda ts: torch.stack(ts).sum(0)),
                (hvd.Min, lambda ts: torch.stack(ts).min(0).values),
                (hvd.Max, lambda ts: torch.stack(ts).max(0).values),
                (hvd.Product, lambda ts: torch.stack(ts).prod(0)),
            ):
                got = hvd.allreduce(mine(rank), op=op, name=f"r.{dtype}.{size}.{op}")
                want = ref([t.double() for t in every]).to(dtype)
                check(f"allreduce {op} {dtype} {size}", torch.equal(got, want))
        if dtype.is_floating_point:
            got = hvd.allreduce(torch.full((999,), float(rank), dtype=dtype), name=f"avg.{dtype}")
            want_avg = torch.full((999,), (n - 1) / 2, dtype=torch.float64)
            check(f"average {dtype}", torch.allclose(got.double(), want_avg))
    # Variable rows, 0 rows for worker 0.
    rows = hvd.allgather(torch.full((rank, 3), rank, dtype=torch.int32), name="g")
    want_rows = torch.cat([torch.full((r, 3), r, dtype=torch.int32) for r in range(n)])
    check("allgather", torch.equal(rows, want_rows))
    # Uneven splits: worker r sends j + 1 elements to worker j.
    splits = [j + 1 for j in range(n)]
    send = torch.cat([torch.full((j + 1,), 100 * rank + j) for j in range(n)])
    got, received = hvd.alltoall(send, splits=splits, name="a2a")
    want = torch.cat([torch.full((rank + 1,), 100 * r + rank) for r in range(n)])
    check("alltoall", torch.equal(got, want) and received.tolist() == [rank + 1] * n)
    share = hvd.reducescatter(torch.arange(n * 5 + 1) * (rank + 1), op=hvd.Sum, name="rs")
    full = torch.arange(n * 5 + 1) * sum(range(1, n + 1))
    first = [len(c) for c in torch.tensor_split(full, n)]
    start = sum(first[:rank])
    check("reducescatter", torch.equal(share, full[start : start + first[rank]]))
    b = hvd.broadcast(torch.arange(7) * (rank + 1), root_rank=n - 1, name="b")
    check("broadcast", torch.equal(b, torch.arange(7) * n))
    pair = hvd.ProcessSet([0, 1])
    hvd.add_process_set(pair)
    if rank in (0, 1):
        got = hvd.allreduce(torch.ones(10) * (rank + 1), op=hvd.Sum, name="pair", process_set=pair)
        check("process set", torch.equal(got, torch.full((10,), 3.0)))
    moved = wire_total() - before
    if expect == "shared":
        check(f"{moved} bytes crossed a socket; none should have", moved == 0)
    elif expect == "servers":
        check(f"only {moved} bytes crossed a socket", moved > 1 << 20)
    else:
        # Aggregated inside each machine first, each worker carries its share of its
        # machine's bytes (a small share of small tensors may be none).
        check("nothing crossed a socket", moved > 0)
    (out / f"rank{rank}.txt").write_text("ok" if not failures else "\n".join(failures))


if __name__ == "__main__":
    main()
