"""A worker process for test_collectives.py: `python wire_bytes_worker.py OUTDIR`.

Counts, at the sockets, the bytes each collective moves between this worker and the
summation servers, and checks that they are what the operation needs and no more: an
allgather pushes only this worker's rows and takes only the others', a broadcast's root
takes nothing, a reducescatter takes back only its own rows, an alltoall moves only the
blocks to and from this worker. Writes OUTDIR/rank<r>.txt: "ok", or the failures.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

import sumflow.torch as hvd
from sumflow.torch import _runtime

#: Frame headers, meta blocks, agreement tables, skips and notices: a few KiB at most.
SLACK = 16 * 1024
ROW = 4096  # elements of float32 per row: 16 KiB


def counted() -> tuple[int, int]:
    per_key, untied = _runtime.current().service.wire_bytes()
    return (
        sum(s for _, _, s, _ in per_key) + untied[0],
        sum(r for _, _, _, r in per_key) + untied[1],
    )


def moved(run: Callable[[], object]) -> tuple[int, int]:
    """Bytes sent and received by this worker during `run`, its second call (the first
    declares and initialises the keys)."""
    run()
    hvd.barrier()
    before = counted()
    run()
    after = counted()
    return after[0] - before[0], after[1] - before[1]


def main() -> None:
    out = Path(sys.argv[1])
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    failures: list[str] = []

    def check(what: str, got: tuple[int, int], sent: int, received: int) -> None:
        ok = sent <= got[0] <= sent + SLACK and received <= got[1] <= received + SLACK
        if not ok:
            failures.append(
                f"{what}: sent {got[0]}, received {got[1]}; expected {sent} and {received} "
                f"(+ at most {SLACK})"
            )

    rows = [2 + q for q in range(n)]  # worker q holds 2 + q rows
    row_bytes = ROW * 4
    mine = torch.full((rows[r], ROW), float(r))
    got = moved(lambda: hvd.allgather(mine, name="ag"))
    others = sum(rows) - rows[r]
    check("allgather", got, rows[r] * row_bytes, others * row_bytes)

    whole = torch.full((8, ROW), float(r))
    got = moved(lambda: hvd.broadcast(whole, 0, name="bc"))
    if r == 0:
        check("broadcast (root)", got, 8 * row_bytes, 0)
    else:
        check("broadcast", got, 0, 8 * row_bytes)

    total = 4 * n + 1  # rows, not divisible by n: the lower ranks take one more
    whole = torch.full((total, ROW), float(r))
    got = moved(lambda: hvd.reducescatter(whole, name="rs", op=hvd.Sum))
    own = hvd.collectives.reducescatter_rows(total, n)[r]
    check("reducescatter", got, total * row_bytes, own * row_bytes)

    splits = [(r + q) % 3 + 1 for q in range(n)]  # rows from this worker to worker q
    send = torch.full((sum(splits), ROW), float(r))
    got = moved(lambda: hvd.alltoall(send, torch.tensor(splits), name="a2a"))
    incoming = sum((q + r) % 3 + 1 for q in range(n)) - splits[r]
    check("alltoall", got, (sum(splits) - splits[r]) * row_bytes, incoming * row_bytes)

    out.joinpath(f"rank{r}.txt").write_text("\n".join(failures) or "ok")
    hvd.shutdown()


if __name__ == "__main__":
    main()
