"""A worker process for test_torch.py: `python torch_worker.py MODE OUTDIR`.

Each mode exercises part of sumflow.torch the way a training script does and saves what
the test checks to OUTDIR/rank<r>.pt.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

import sumflow.torch as hvd
from sumflow.torch import ops

STEPS = 20
BATCH = 8  # per worker


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    ).double()


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker `rank`'s share of step `step`'s global batch (BATCH * size rows)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH * size, 10, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (BATCH * size,), generator=g)
    return x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]


def make_optimizer(name: str, params: object) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True)  # type: ignore[arg-type]
    return torch.optim.Adam(params, lr=0.01)  # type: ignore[arg-type]


def train(opt_name: str, passes: int) -> dict[str, torch.Tensor]:
    m = model()
    base = make_optimizer(opt_name, m.parameters())
    # LR_SCHEDULER_FIRST=1: an LR scheduler (a constant one, so the result is unchanged)
    # created before wrapping, which patches base.step on the instance.
    lr_first = os.environ.get("LR_SCHEDULER_FIRST") == "1"
    schedule = torch.optim.lr_scheduler.LambdaLR(base, lambda _: 1.0) if lr_first else None
    # FUSION: a fusion threshold in bytes; PREDIVIDE: gradient_predivide_factor.
    fusion = {"fusion_threshold": int(os.environ["FUSION"])} if "FUSION" in os.environ else {}
    opt = hvd.DistributedOptimizer(
        base,
        named_parameters=m.named_parameters(),
        backward_passes_per_step=passes,
        gradient_predivide_factor=float(os.environ.get("PREDIVIDE", "1")),
        **fusion,
    )
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = batch(step, hvd.rank(), hvd.size())
        for chunk in range(passes):
            rows = slice(chunk * BATCH // passes, (chunk + 1) * BATCH // passes)
            # Mean over the worker's batch; averaged across workers = mean of the global batch.
            loss = torch.nn.functional.cross_entropy(m(x[rows]), y[rows]) / passes
            loss.backward()
        opt.step()
        if schedule is not None:
            schedule.step()
    out = {k: v.detach().clone() for k, v in m.state_dict().items()}
    # How many of the fused spans were sent by a prepared sum, and how many could not be.
    prepared = list(getattr(opt, "_sf_prepared", {}).values())
    out["prepared spans"] = torch.tensor([sum(map(bool, prepared)), prepared.count(False)])
    return out


def broadcasts() -> dict[str, object]:
    torch.manual_seed(hvd.rank())  # a different model on every worker
    m = torch.nn.Linear(5, 4)
    m.register_buffer("steps", torch.tensor(hvd.rank() * 10, dtype=torch.int64))
    m.register_buffer("mask", torch.tensor([hvd.rank() % 2 == 0, True]))
    opt = torch.optim.SGD(m.parameters(), lr=0.1 * (hvd.rank() + 1), momentum=0.9)
    m(torch.randn(2, 5)).sum().backward()
    opt.step()  # momentum buffers now differ per worker
    hvd.broadcast_parameters(m.state_dict(), root_rank=1)
    hvd.broadcast_optimizer_state(opt, root_rank=1)
    obj = hvd.broadcast_object(
        {"rank": hvd.rank(), "blob": list(range(hvd.rank() * 3))}, root_rank=1
    )
    return {
        "state": m.state_dict(),
        "lr": opt.param_groups[0]["lr"],
        "momentum": [opt.state[p]["momentum_buffer"] for p in m.parameters()],
        "object": obj,
    }


def collectives() -> dict[str, object]:
    r, n = hvd.rank(), hvd.size()
    out: dict[str, object] = {}
    t = torch.full((5,), float(r + 1))
    out["avg"] = hvd.allreduce(t, name="avg")
    out["sum"] = hvd.allreduce(t, name="sum", op=hvd.Sum)
    out["untouched"] = t
    ints = torch.full((3,), r + 1, dtype=torch.int64)
    hvd.allreduce_(ints, name="ints", op=hvd.Sum)
    out["ints"] = ints
    handles = [
        hvd.allreduce_async_(
            torch.full((1000,), float(i * n + r)), name=f"a{i}", op=hvd.Sum, priority=-i
        )
        for i in range(4)
    ]
    deadline = time.monotonic() + 60
    while not all(hvd.poll(h) for h in handles):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    out["async"] = [hvd.synchronize(h) for h in handles]
    half = torch.full((7,), 0.1 * (r + 1))
    out["fp16"] = hvd.allreduce(half, name="fp16", compression=hvd.Compression.fp16)
    # Beyond float16's 65504: at the cast (1e5) and in the sum (3 x 3e4); bfloat16 keeps both.
    big = torch.tensor([1e5, 3e4, float(r + 1)])
    for label, compression in (("fp16", hvd.Compression.fp16), ("bf16", hvd.Compression.bf16)):
        out[f"{label}_overflow"] = hvd.allreduce(
            big, name=f"{label}.overflow", op=hvd.Sum, compression=compression
        )
    noncontig = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (r + 1)
    hvd.allreduce_(noncontig, name="nc", op=hvd.Sum)
    out["noncontig"] = noncontig
    out["push_pull"] = hvd.push_pull(torch.ones(3) * (r + 1), average=False, name="pp")
    out["scaled"] = hvd.allreduce(
        torch.ones(2), name="scaled", op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5
    )
    errors = {}
    for label, call in {
        "adasum": lambda: hvd.allreduce(torch.ones(1), op=hvd.Adasum),
        "bool": lambda: hvd.allreduce(torch.ones(1, dtype=torch.bool)),
        "mismatch": lambda: hvd.allreduce(torch.ones(r + 1), name="mismatch"),
    }.items():
        try:
            call()
            errors[label] = "no error"
        except Exception as e:
            errors[label] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    hvd.barrier()
    return out


def ddp(use_hook: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())
    m = model()
    # Buckets of at most 500 bytes: DDP starts with one bucket of every gradient, and
    # torch 2.15 rebuilds them after the first step into two, in the order backward made
    # them (torch 2.1 keeps the one).
    net = DistributedDataParallel(m, bucket_cap_mb=0.0005)
    state = hvd.DDPHookState(net)
    # The buckets DDP hands the hook, per step: (size, parameters).
    handed: list[list[tuple[int, int]]] = []

    # Unannotated: DDP refuses a hook whose annotations are not its own types.
    def hook(s, bucket):  # type: ignore[no-untyped-def]
        handed[-1].append((bucket.buffer().numel(), len(bucket.parameters())))
        return hvd.ddp_hook(s, bucket)

    if use_hook:
        net.register_comm_hook(state, hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        handed.append([])
        opt.zero_grad()
        x, y = batch(step, hvd.rank(), hvd.size())
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    dist.destroy_process_group()
    out = {k: v.detach().clone() for k, v in m.state_dict().items()}
    # The buckets whose sums are prepared, and those of the first and last steps.
    out["prepared buckets"] = sorted(
        (key[2], key[6])
        for key, sent in state._prepared.values()
        if isinstance(sent, ops.PreparedSum)
    )
    out["first buckets"] = sorted(handed[0]) if use_hook else []
    out["last buckets"] = sorted(handed[-1]) if use_hook else []
    return out


def mismatch() -> None:
    m = torch.nn.Linear(4, 3 if hvd.rank() == 0 else 2)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters()
    )
    m(torch.randn(2, 4)).sum().backward()
    opt.step()


def shape_mismatch() -> None:
    """One size (1,024 weights), two shapes: summing them element by element would be
    wrong, so the declaration refuses it."""
    m = (
        torch.nn.Linear(32, 32, bias=False)
        if hvd.rank() == 0
        else torch.nn.Linear(64, 16, bias=False)
    )
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters()
    )
    m(torch.randn(2, m.in_features)).sum().backward()
    opt.step()


def crash() -> None:
    m = model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters()
    )
    for step in range(10_000):
        if step == 3 and hvd.rank() == hvd.size() - 1:
            print(f"worker {hvd.rank()} kills itself", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        x, y = batch(step % 20, hvd.rank(), hvd.size())
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()


def sync_batch_norm() -> dict[str, object]:
    """Two SyncBatchNorm layers over this worker's rows of a fixed batch (4 rows per
    worker): outputs, running statistics and the input's gradient of every worker's
    loss together, to compare with BatchNorm over the whole batch."""
    r = hvd.rank()
    gen = torch.Generator().manual_seed(5)
    whole = torch.randn(4 * hvd.size(), 3, 5, generator=gen)
    weights = torch.randn(4 * hvd.size(), 3, 5, generator=gen)
    layers = torch.nn.Sequential(hvd.SyncBatchNorm(3), hvd.SyncBatchNorm(3))
    mine = whole[4 * r : 4 * r + 4].clone().requires_grad_(True)
    out = layers(mine)
    (out * weights[4 * r : 4 * r + 4]).sum().backward()
    # The sum of the outputs does not depend on the input: its gradient must come out
    # as BatchNorm's does (zero, not rounding noise), as Horovod's own test checks.
    ints = torch.tensor([[r, r + 1], [r * 2, r * 2 + 1], [r * 3, r * 3 + 1], [r * 4, r * 4 + 1]])
    x = ints.float().unsqueeze(0).requires_grad_(True)
    hvd.SyncBatchNorm(4)(x).sum().backward()
    return {
        "out": out.detach(),
        "grad": mine.grad,
        "running_mean": layers[1].running_mean,
        "running_var": layers[1].running_var,
        "sum_grad": x.grad,
    }


def computed_twice() -> dict[str, str]:
    """A gradient computed a second time before step(), without gradient accumulation:
    what each optimizer raised, by variant. "sent": every gradient alone, sent by the
    first backward; "fused": one span of every gradient, of which the first backward
    (through the first layer only) made half."""
    out = {}
    for variant, fusion in (("sent", 0), ("fused", 1 << 20)):
        m = model()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1),
            named_parameters=m.named_parameters(),
            fusion_threshold=fusion,
        )
        x, _ = batch(0, hvd.rank(), hvd.size())
        m[0](x).sum().backward()
        try:
            m[0](x).sum().backward()
            out[variant] = "nothing raised"
        except RuntimeError as e:
            out[variant] = str(e)
        opt.synchronize()
    return out


def main() -> None:
    mode, outdir = sys.argv[1], Path(sys.argv[2])
    hvd.init()
    if mode.startswith("train-"):
        _, opt_name, passes = mode.split("-")
        result: object = train(opt_name, int(passes))
    elif mode == "broadcasts":
        result = broadcasts()
    elif mode == "collectives":
        result = collectives()
    elif mode in ("ddp-gloo", "ddp-sumflow"):
        result = ddp(mode == "ddp-sumflow")
    elif mode == "sync-batch-norm":
        result = sync_batch_norm()
    elif mode == "mismatch":
        result = mismatch()
    elif mode == "shape-mismatch":
        result = shape_mismatch()
    elif mode == "crash":
        result = crash()
    elif mode == "computed-twice":
        result = computed_twice()
    else:
        raise SystemExit(f"unknown mode {mode}")
    torch.save(result, outdir / f"rank{hvd.rank()}.pt")
    hvd.shutdown()


if __name__ == "__main__":
    main()
