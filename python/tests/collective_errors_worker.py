"""A worker process for test_collectives.py: `python collective_errors_worker.py OUTDIR`.

Makes bad calls (workers disagreeing on one operation, bad arguments, a name reused while
in flight), checks each fails with the right exception and message on this worker, and
that a good operation after each still works; writes OUTDIR/rank<r>.txt ("ok" or the
failures)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

import sumflow.torch as hvd


def main() -> None:
    out = Path(sys.argv[1])
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    failures: list[str] = []

    def fails(
        label: str, kind: type[BaseException], words: list[str], call: Callable[[], object]
    ) -> None:
        try:
            call()
        except kind as e:
            missing = [w for w in words if w not in str(e)]
            if missing:
                failures.append(f"{label}: {type(e).__name__} {e!s} lacks {missing}")
        except Exception as e:
            failures.append(f"{label}: {type(e).__name__} {e}, not {kind.__name__}")
        else:
            failures.append(f"{label}: no error")
        # The job goes on: a good operation right after.
        got = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"after.{label}")
        if not torch.equal(got, torch.full((2,), float(n))):
            failures.append(f"after {label}: {got}")

    others = ", ".join(str(q) for q in range(1, n))
    fails(
        "shape",
        hvd.HorovodInternalError,
        ["allreduce.shape", "shape", "[3] on worker 0", f"[4] on workers {others}"],
        lambda: hvd.allreduce(torch.ones(3 if r == 0 else 4), name="shape"),
    )
    fails(
        "dtype",
        RuntimeError,
        ["dtype", "torch.int32", "torch.float32"],
        lambda: hvd.allreduce(
            torch.ones(3, dtype=torch.int32 if r == 0 else torch.float32), name="dtype"
        ),
    )
    fails(
        "op",
        RuntimeError,
        ["op"],
        lambda: hvd.allreduce(torch.ones(3), name="op", op=hvd.Sum if r == 0 else hvd.Max),
    )
    fails("root", RuntimeError, ["root"], lambda: hvd.broadcast(torch.ones(3), r % 2, name="root"))
    fails(
        "gather_rank",
        RuntimeError,
        ["allgather", "shape after the first dimension"],
        lambda: hvd.allgather(torch.ones(2, 3 + (r == 0)), name="gather_rank"),
    )
    fails("root_range", ValueError, ["root_rank 7"], lambda: hvd.broadcast(torch.ones(1), 7))
    fails(
        "splits_sum",
        ValueError,
        ["add up to"],
        lambda: hvd.alltoall(torch.ones(5), torch.ones(n, dtype=torch.int32)),
    )
    fails(
        "splits_type",
        ValueError,
        ["int32 or int64"],
        lambda: hvd.alltoall(torch.ones(n), torch.ones(n)),
    )
    fails(
        "splits_len",
        ValueError,
        [f"for {n} workers"],
        lambda: hvd.alltoall(torch.ones(n), torch.ones(n + 1, dtype=torch.int32)),
    )
    fails("scalar", ValueError, ["scalar"], lambda: hvd.reducescatter(torch.tensor(1.0)))
    fails(
        "complex",
        TypeError,
        ["torch.complex64"],
        lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64)),
    )
    fails(
        "adasum",
        ValueError,
        ["Adasum", "power-of-two number of workers"],
        lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum),
    )
    fails(
        "unregistered",
        ValueError,
        ["not registered", "add_process_set"],
        lambda: hvd.allreduce(torch.ones(2), process_set=hvd.ProcessSet([0])),
    )
    # Odd workers call an operation of a set they are not in; even ones broadcast from a
    # root outside it (the same label, so the good operation after it matches).
    evens = hvd.add_process_set(range(0, n, 2))
    if r % 2:
        fails(
            "outside_the_set",
            ValueError,
            [f"worker {r} is not a member"],
            lambda: hvd.allreduce(torch.ones(2), process_set=evens),
        )
    else:
        fails(
            "outside_the_set",
            ValueError,
            ["root_rank 1 is not a member"],
            lambda: hvd.broadcast(torch.ones(2), 1, process_set=evens),
        )
    fails("bad_rank", ValueError, [f"ranks [{n}]"], lambda: hvd.add_process_set([0, n]))

    def in_flight() -> None:
        h = hvd.allreduce_async(torch.ones(3), name="twice")
        try:
            hvd.allreduce_async(torch.ones(3), name="twice")
        finally:
            hvd.synchronize(h)

    fails("in_flight", ValueError, ["already in flight"], in_flight)
    (out / f"rank{r}.txt").write_text("\n".join(failures) if failures else "ok")
    hvd.shutdown()


if __name__ == "__main__":
    main()
