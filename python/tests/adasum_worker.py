"""A worker process for test_adasum.py: `python adasum_worker.py OUTDIR`.

Combines tensors by Adasum (``allreduce(op=Adasum)`` and ``DistributedOptimizer(op=Adasum)``)
on data each worker can also compute for every other worker, checks every result against
``adasum.combine`` of all workers' inputs (bit for bit: the same operations in the same
order), and writes OUTDIR/rank<r>.txt: "ok", or the failures, one per line.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

import sumflow.torch as hvd
from sumflow.torch import adasum


def data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Worker `rank`'s tensor: random, partly shared between workers (so that the pairs'
    dot products are neither 0 nor their norms)."""
    shared = torch.Generator().manual_seed(seed)
    own = torch.Generator().manual_seed(seed * 100 + rank + 1)
    common = torch.randn(shape, generator=shared, dtype=torch.float64)
    return (common + torch.randn(shape, generator=own, dtype=torch.float64)).to(dtype)


def reference(size: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    rows = torch.stack([data(r, shape, dtype, seed).reshape(-1) for r in range(size)])
    return adasum.combine(rows).reshape(shape)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.fc1 = torch.nn.Linear(6, 5)
        self.fc2 = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 * step + rank))


def updates_by_hand(size: int, steps: int, lr: float, passes: int) -> list[torch.Tensor]:
    """The parameters Adasum's delta optimizer gives after `steps` steps of SGD, computed
    here for every worker: each worker's update from the common start, combined."""
    model = Model()
    params = [p.detach().clone() for p in model.parameters()]
    for step in range(steps):
        deltas: list[list[torch.Tensor]] = []
        for r in range(size):
            local = Model()
            with torch.no_grad():
                for q, p in zip(local.parameters(), params, strict=True):
                    q.copy_(p)
            for k in range(passes):
                local(batch(r, step * passes + k)).square().sum().backward()
            pairs = zip(params, local.parameters(), strict=True)
            deltas.append([(p - lr * q.grad) - p for p, q in pairs])
        params = [
            p + adasum.combine(torch.stack([d[i].reshape(-1) for d in deltas])).reshape(p.shape)
            for i, p in enumerate(params)
        ]
    return params


def check_failed_step_keeps_local_values(rank: int, failures: list[str]) -> None:
    """A combination that fails (here: its wait, on this worker only) leaves each
    parameter at its locally updated value, not at the bare update."""
    from sumflow.torch import ops

    model = Model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=[(f"fail.{n}", p) for n, p in model.named_parameters()],
        op=hvd.Adasum,
    )
    model(batch(rank, 0)).square().sum().backward()
    pairs = zip(Model().parameters(), model.parameters(), strict=True)
    local = [p - 0.1 * q.grad for p, q in pairs]
    real = ops.synchronize

    def lost(handle: int) -> object:
        raise RuntimeError("a peer was lost")

    ops.synchronize = lost
    try:
        opt.step()
        failures.append("a failed combination did not raise")
    except RuntimeError:
        for p, want in zip(model.parameters(), local, strict=True):
            if not torch.allclose(p.detach(), want.detach(), rtol=1e-6, atol=1e-7):
                failures.append(f"after a failed step: {p} != {want}")
    finally:
        ops.synchronize = real


def main() -> int:
    out = Path(sys.argv[1])
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    failures: list[str] = []

    def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            failures.append(f"{what}: got {got.flatten()[:4]} want {want.flatten()[:4]}")

    try:
        for seed, dtype in enumerate((torch.float32, torch.float64, torch.float16, torch.bfloat16)):
            shape = (3, 17)
            want = reference(size, shape, dtype, seed)
            mine = data(rank, shape, dtype, seed)
            check(f"allreduce {dtype}", hvd.allreduce(mine, op=hvd.Adasum, name=f"a.{seed}"), want)
            inplace = mine.clone()
            hvd.allreduce_(inplace, op=hvd.Adasum, name=f"b.{seed}")
            check(f"allreduce_ {dtype}", inplace, want)
        # A grouped allreduce combines each tensor on its own.
        shapes = [(5,), (2, 3), (7,)]
        group = [data(rank, shape, torch.float32, 20 + i) for i, shape in enumerate(shapes)]
        wants = [reference(size, shape, torch.float32, 20 + i) for i, shape in enumerate(shapes)]
        for i, got in enumerate(hvd.grouped_allreduce(group, op=hvd.Adasum, name="grouped")):
            check(f"grouped {i}", got, wants[i])
        hvd.grouped_allreduce_(group, op=hvd.Adasum, name="grouped_")
        for i, got in enumerate(group):
            check(f"grouped_ {i}", got, wants[i])
        # Scaling factors apply around the combination, as Horovod applies them.
        mine = data(rank, (40,), torch.float32, 9)
        handle = hvd.allreduce_async(
            mine, op=hvd.Adasum, name="scaled", prescale_factor=0.5, postscale_factor=3.0
        )
        rows = torch.stack([data(r, (40,), torch.float32, 9) for r in range(size)])
        check("scaled", hvd.synchronize(handle), adasum.combine(rows * 0.5) * 3.0)
        # Equal tensors combine to themselves; every worker ends bit-for-bit equal.
        same = torch.linspace(-1, 1, 33)
        check("equal", hvd.allreduce(same, op=hvd.Adasum, name="equal"), same)
        # An integer tensor is refused before anything is sent, and the job goes on.
        try:
            hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum, name="ints")
            failures.append("an int32 tensor was combined")
        except TypeError as e:
            if "float16, bfloat16, float32 and float64" not in str(e):
                failures.append(f"int32: unclear error {e}")

        for passes, opt_name in ((1, "sgd"), (2, "sgd2")):
            model = Model()
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                named_parameters=[(f"{opt_name}.{n}", p) for n, p in model.named_parameters()],
                op=hvd.Adasum,
                backward_passes_per_step=passes,
            )
            for step in range(3):
                opt.zero_grad()
                for k in range(passes):
                    model(batch(rank, step * passes + k)).square().sum().backward()
                if step == 1:
                    # Horovod's idiom for clipping: the updates are in after synchronize().
                    opt.synchronize()  # type: ignore[attr-defined]
                    with opt.skip_synchronize():  # type: ignore[attr-defined]
                        opt.step()
                else:
                    opt.step()
            want_params = updates_by_hand(size, 3, 0.1, passes)
            for (n, p), w in zip(model.named_parameters(), want_params, strict=True):
                if not torch.allclose(p.detach(), w, rtol=1e-6, atol=1e-7):
                    failures.append(f"DistributedOptimizer {opt_name} {n}: {p} != {w}")
        check_failed_step_keeps_local_values(rank, failures)
        try:
            hvd.DistributedOptimizer(
                torch.optim.SGD(Model().parameters(), lr=0.1), op=hvd.Adasum, num_groups=2
            )
            failures.append("Adasum with groups was accepted")
        except ValueError as e:
            if "groups" not in str(e):
                failures.append(f"groups: unclear error {e}")
    except Exception:
        failures.append(traceback.format_exc())
    (out / f"rank{rank}.txt").write_text("\n".join(failures) or "ok")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
