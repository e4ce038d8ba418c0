"""One worker of test_cuda.py's jobs: every collective on CUDA tensors, checked exactly;
DistributedOptimizer (fused, per gradient, accumulating, crossing the barrier) and the
DDP comm hook against one process on the whole batch.

Workers share the machine's GPUs (local rank modulo the device count: two processes on
one GPU are fine for correctness). Writes "ok" to <out>/rank<r>.txt when every check
passed.

    python cuda_worker.py OUT
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import sumflow.torch as hvd
from sumflow.torch import _runtime

#: Element counts not divisible by 2, 3 or 4 workers (nor by a partition), and one large.
SIZES = [1, 7, 1001, (1 << 20) + 3]
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
]


def data(rank: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Small integers (exact in every dtype after summing over a few workers)."""
    values = (torch.arange(n, dtype=torch.int64) % 13) + rank + 1
    return values.to(device=device, dtype=dtype)


def check_sums(rank: int, size: int, device: torch.device) -> None:
    for dtype in DTYPES:
        for n in SIZES:
            x = data(rank, n, dtype, device)
            out = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dtype}.{n}")
            want = sum(data(r, n, torch.float64, device) for r in range(size))
            assert out.device == device, (out.device, device)
            assert torch.equal(out.double(), want), f"Sum {dtype} n={n}"
            y = data(rank, n, dtype, device)
            hvd.allreduce_(y, op=hvd.Average, name=f"avg.{dtype}.{n}")
            mean = want / size
            if not dtype.is_floating_point:
                mean = mean.trunc()
            tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
            assert torch.allclose(y.double(), mean, rtol=tol), f"Average {dtype} n={n}"


def check_many_in_flight(rank: int, size: int, device: torch.device) -> None:
    """Forty sums in flight at once, synchronized in reverse order, twice under the same
    names (pinned buffers are reused)."""
    for rnd in range(2):
        xs = [data(rank + rnd, 4099 + i, torch.float32, device) for i in range(40)]
        handles = [hvd.allreduce_async_(x, op=hvd.Sum, name=f"many.{i}") for i, x in enumerate(xs)]
        for i in reversed(range(40)):
            hvd.synchronize(handles[i])
            want = sum(data(r + rnd, 4099 + i, torch.float64, device) for r in range(size))
            assert torch.equal(xs[i].double(), want), f"in flight {i} round {rnd}"


def gpu_cycles(seconds: float, device: torch.device) -> int:
    """How many cycles of ``torch.cuda._sleep`` keep the GPU busy for `seconds`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    trial = 10_000_000
    start.record()
    torch.cuda._sleep(trial)
    end.record()
    end.synchronize()
    return int(trial * seconds * 1e3 / max(start.elapsed_time(end), 1e-3))


def check_hook_does_not_block(device: torch.device) -> None:
    """DistributedOptimizer's gradient hook returns while the GPU still computes the
    gradient: with half a second of GPU work queued before it, backward returns at once
    (the copy to host memory and the sum wait for the GPU, not the hook)."""
    model = torch.nn.Linear(1024, 1024, bias=False).to(device)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=[("busy", model.weight)]
    )
    x = torch.ones(8, 1024, device=device)
    model(x).sum().backward()  # buffers pinned, tensors declared
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize(device)
    torch.cuda._sleep(gpu_cycles(0.5, device))
    start = time.perf_counter()
    model(x).sum().backward()
    returned = time.perf_counter() - start
    opt.synchronize()
    waited = time.perf_counter() - start
    assert returned < 0.1 < waited, f"backward took {returned:.3f} s of {waited:.3f} s"
    # d(sum(W x))/dW is the batch's column sums: 8 everywhere, on every worker.
    assert model.weight.grad is not None
    assert torch.equal(model.weight.grad, torch.full_like(model.weight, 8.0)), "busy"
    opt.zero_grad()


def check_staging_path() -> None:
    """The core's staging through the CUDA driver is the one used (by default), not a
    silent fallback to the Python thread."""
    want = os.environ.get("SUMFLOW_CUDA_STAGING", "driver") != "python"
    got = _runtime.current().driver_staging
    assert got is want, f"staged through the driver: {got}, expected {want}"


def check_caller_stream(rank: int, size: int, device: torch.device) -> None:
    """A tensor produced on a stream of the caller's own, behind GPU work: its copy waits
    for that stream (not the default one), and the sum lands in order on it."""
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(gpu_cycles(0.2, device))
        x = data(rank, 4099, torch.float32, device) * 1
        out = hvd.allreduce(x, op=hvd.Sum, name="caller-stream")
        later = out * 2
    torch.cuda.synchronize(device)
    want = sum(data(r, 4099, torch.float64, device) for r in range(size))
    assert torch.equal(out.double(), want), "caller's stream"
    assert torch.equal(later.double(), 2 * want), "after the sum, on the caller's stream"


def check_strided(rank: int, size: int, device: torch.device) -> None:
    """A tensor whose elements are not laid out contiguously is summed in place."""
    n = 64 * 33
    x = data(rank, n, torch.float32, device).reshape(64, 33).t()
    assert not x.is_contiguous()
    hvd.allreduce_(x, op=hvd.Sum, name="strided")
    want = sum(data(r, n, torch.float64, device) for r in range(size)).reshape(64, 33).t()
    assert torch.equal(x.double(), want), "strided"


def check_compression(rank: int, size: int, device: torch.device) -> None:
    x = data(rank, 1001, torch.float32, device)
    out = hvd.allreduce(x, op=hvd.Sum, name="fp16", compression=hvd.Compression.fp16)
    want = sum(data(r, 1001, torch.float64, device) for r in range(size))
    assert out.dtype == torch.float32
    assert out.device == device
    assert torch.equal(out.double(), want), "fp16 compression"


def check_relays(rank: int, size: int, device: torch.device) -> None:
    x = data(rank, 1001, torch.float32, device) if rank == 1 else torch.zeros(1001, device=device)
    hvd.broadcast_(x, root_rank=1, name="bcast")
    assert torch.equal(x, data(1, 1001, torch.float32, device)), "broadcast"
    rows = torch.full((rank + 1, 3), float(rank), device=device)
    gathered = hvd.allgather(rows, name="gather")
    want = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(size)]).to(device)
    assert gathered.device == device, "allgather"
    assert torch.equal(gathered, want), "allgather"
    blocks = torch.arange(size * 2, dtype=torch.float32, device=device) + 100 * rank
    got = hvd.alltoall(blocks, name="a2a")
    want = torch.tensor(
        [100 * r + 2 * rank + j for r in range(size) for j in range(2)], dtype=torch.float32
    ).to(device)
    assert got.device == device, "alltoall"
    assert torch.equal(got, want), "alltoall"
    table = torch.ones(size * 2, 5, device=device) * (rank + 1)
    mine = hvd.reducescatter(table, op=hvd.Sum, name="rs")
    total = size * (size + 1) / 2
    assert mine.device == device
    assert torch.equal(mine, torch.full((2, 5), total, device=device))


def check_adasum(rank: int, size: int, device: torch.device) -> None:
    """Adasum on CUDA tensors (power-of-two jobs only): combined on the host, the result
    back on the tensor's device, every worker's parameters equal after a delta step."""
    if size & (size - 1):
        return
    from sumflow.torch import adasum

    rows = torch.stack([data(r, 777, torch.float32, torch.device("cpu")) for r in range(size)])
    got = hvd.allreduce(data(rank, 777, torch.float32, device), op=hvd.Adasum, name="adasum")
    assert got.device == device, "adasum device"
    assert torch.equal(got.cpu(), adasum.combine(rows)), "adasum"
    model = torch.nn.Linear(5, 3).to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        op=hvd.Adasum,
    )
    model(torch.randn(4, 5, device=device) * (rank + 1)).sum().backward()
    opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).reshape(1, -1)
    every = hvd.allgather(flat, name="adasum.params")
    assert torch.equal(every, flat.expand(size, -1)), "adasum optimizer: workers differ"


def two_models(device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A small model and a copy of it with the same parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(33, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5)
    ).to(device)
    reference = torch.nn.Sequential(
        torch.nn.Linear(33, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5)
    ).to(device)
    reference.load_state_dict(model.state_dict())
    return model, reference


def check_optimizer(
    rank: int,
    size: int,
    device: torch.device,
    passes: int,
    fusion: int | None = None,
    cross_barrier: bool = False,
) -> None:
    """DistributedOptimizer on a CUDA model equals one process on the whole batch, also
    accumulating `passes` backward passes per step; by default in fused spans (on by
    default for CUDA parameters), or with `fusion` as the threshold (0: per gradient);
    with `cross_barrier`, each parameter updated as its own sum arrives."""
    model, reference = two_models(device)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=[
            (f"p{passes}.{fusion}.{cross_barrier}.{n}", p) for n, p in model.named_parameters()
        ],
        backward_passes_per_step=passes,
        fusion_threshold=fusion,
        cross_barrier=cross_barrier,
        model=model if cross_barrier else None,
    )
    pool = opt._sf_pool  # type: ignore[attr-defined]
    assert (pool is None) == (fusion == 0), f"fusion {fusion}: pool {pool}"
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    rows = 8 * passes
    for _ in range(5):
        batch = torch.randn(size * rows, 33, generator=gen).to(device)
        target = torch.randn(size * rows, 5, generator=gen).to(device)
        opt.zero_grad()
        for k in range(passes):
            mine = slice(rank * rows + 8 * k, rank * rows + 8 * k + 8)
            loss = torch.nn.functional.mse_loss(model(batch[mine]), target[mine])
            (loss / passes).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(batch), target).backward()
        ref_opt.step()
    if cross_barrier:
        opt.synchronize()  # the last updates are done before the parameters are read
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"parameter {name}, {passes} passes"


def check_ddp_hook(rank: int, size: int, device: torch.device) -> None:
    """DistributedDataParallel with sumflow's comm hook on a CUDA model equals one process
    on the whole batch (DDP's own process group, gloo, only broadcasts at the start)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        model, reference = two_models(device)
        net = DistributedDataParallel(model)
        buckets = [0]

        # No annotations: DDP checks those it finds against its own types.
        def counted(state, bucket):
            buckets[0] += 1
            return hvd.ddp_hook(state, bucket)

        net.register_comm_hook(hvd.DDPHookState(net, name="cuda-ddp"), counted)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        gen = torch.Generator().manual_seed(2)
        for _ in range(5):
            batch = torch.randn(size * 8, 33, generator=gen).to(device)
            target = torch.randn(size * 8, 5, generator=gen).to(device)
            mine = slice(rank * 8, rank * 8 + 8)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(batch[mine]), target[mine]).backward()
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(reference(batch), target).backward()
            ref_opt.step()
        # DDP's own all-reduce would give the same parameters: the hook must have run.
        assert buckets[0] >= 5, f"sumflow's hook ran for {buckets[0]} buckets in 5 steps"
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"DDP hook: parameter {name}"
    finally:
        dist.destroy_process_group()


def main() -> int:
    out = Path(sys.argv[1])
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    check_sums(rank, size, device)
    check_staging_path()
    check_caller_stream(rank, size, device)
    check_strided(rank, size, device)
    check_many_in_flight(rank, size, device)
    check_hook_does_not_block(device)
    check_compression(rank, size, device)
    check_relays(rank, size, device)
    check_optimizer(rank, size, device, passes=1)
    check_optimizer(rank, size, device, passes=2)
    check_optimizer(rank, size, device, passes=1, fusion=0)
    check_optimizer(rank, size, device, passes=2, fusion=256)
    check_optimizer(rank, size, device, passes=1, cross_barrier=True)
    check_optimizer(rank, size, device, passes=1, fusion=0, cross_barrier=True)
    check_ddp_hook(rank, size, device)
    check_adasum(rank, size, device)
    hvd.shutdown()
    (out / f"rank{rank}.txt").write_text("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
