"""A worker process for test_retire.py: `python retire_worker.py OUTDIR`.

Runs many operations whose tensors cannot recur or change layout (unnamed allreduces,
allgathers of varying sizes, unnamed and named, unnamed reducescatters, alltoalls and
broadcasts, a name alternating between two shapes),
checks every result exactly, and writes OUTDIR/rank<r>.json: the failures (none expected)
and how many tensors this worker holds at the end, in Python and in the core.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

import sumflow.torch as hvd
from sumflow.torch import _runtime, declarations

UNNAMED_ALLREDUCES = 300
ALLGATHERS = 100
ALTERNATIONS = 60
OTHERS = 20


def main(out: Path) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    failures: list[str] = []
    try:
        for i in range(UNNAMED_ALLREDUCES):
            got = hvd.allreduce(torch.full((5,), float(rank + i)), op=hvd.Sum)
            want = torch.full((5,), float(sum(r + i for r in range(size))))
            if not torch.equal(got, want):
                failures.append(f"allreduce {i}: {got.tolist()} != {want.tolist()}")
        for i in range(ALLGATHERS):
            mine = torch.full((1 + (i + rank) % 4, 3), rank * 1000 + i, dtype=torch.int32)
            want = torch.cat(
                [
                    torch.full((1 + (i + r) % 4, 3), r * 1000 + i, dtype=torch.int32)
                    for r in range(size)
                ]
            )
            for label, name in (("unnamed", None), ("named", "rows")):
                got = hvd.allgather(mine, name=name)
                if not torch.equal(got, want):
                    failures.append(f"{label} allgather {i}: {got.tolist()} != {want.tolist()}")
        for i in range(OTHERS):
            whole = torch.arange(4 * size, dtype=torch.int32).reshape(2 * size, 2) + i
            got = hvd.reducescatter(whole, op=hvd.Sum)
            want = (whole * size)[2 * rank : 2 * rank + 2]
            if not torch.equal(got, want):
                failures.append(f"reducescatter {i}: {got.tolist()} != {want.tolist()}")
            sent = torch.full((size, 3), rank * 100 + i, dtype=torch.int64)
            got = hvd.alltoall(sent)
            want = torch.cat([torch.full((1, 3), r * 100 + i) for r in range(size)])
            if not torch.equal(got, want):
                failures.append(f"alltoall {i}: {got.tolist()} != {want.tolist()}")
            got = hvd.broadcast(torch.full((3,), float(rank + i)), root_rank=0)
            if not torch.equal(got, torch.full((3,), float(i))):
                failures.append(f"broadcast {i}: {got.tolist()}")
        for i in range(ALTERNATIONS):
            shape = (4,) if i % 2 == 0 else (2, 3)
            got = hvd.allreduce(torch.full(shape, float(rank + 1)), name="alternating", op=hvd.Sum)
            want = torch.full(shape, float(sum(r + 1 for r in range(size))))
            if not torch.equal(got, want):
                failures.append(f"alternating {i}: {got.tolist()} != {want.tolist()}")
    except Exception:
        failures.append(traceback.format_exc())
    report = {
        "failures": failures,
        "python_live": declarations.live(),
        "core_live": _runtime.current().service.live_tensors(),
    }
    hvd.shutdown()
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
