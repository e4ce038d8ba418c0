"""sumflow._core.CommunicationService: sums against a reference over the test matrix, and
its errors."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest
import torch
from jobs import local_job

import sumflow
from sumflow.torch.ops import DTYPES

WAIT = 60.0
# 1 element, small, a multiple of the 64 KiB partition size used here, and not a multiple.
SIZES = [1, 1000, 3 * 16384, 5 * 16384 + 3]
PARTITION = 64 << 10


def contribution(rank: int, elements: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Worker `rank`'s data: small integers, so every float sum is exact in every dtype."""
    g = torch.Generator().manual_seed(rank * 1000 + salt)
    return torch.randint(-8, 9, (elements,), generator=g).to(dtype)


def reference(workers: int, elements: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    return sum(contribution(r, elements, torch.float64, salt) for r in range(workers))


def exchange(
    svc: sumflow._core.CommunicationService, tensors: dict[str, torch.Tensor], average: bool
) -> None:
    """push_pull every tensor at once (all in flight together), then waits for all."""
    handles = []
    for prio, (name, t) in enumerate(tensors.items()):
        tid = svc.declare(name, DTYPES[t.dtype], t.numel())
        handles.append(
            svc.push_pull(tid, t, t.data_ptr(), t.numel() * t.element_size(), prio, average)
        )
    for h in handles:
        svc.wait(h, WAIT)


# (workers, CPU-only servers, colocated): every n in 1-4 with k in 0-3 colocated, and the
# non-colocated PS with 1-3 CPU servers.
MATRIX = [(n, k, True) for n, k in itertools.product(range(1, 5), range(4))] + [
    (n, k, False) for n, k in itertools.product(range(1, 5), range(1, 4))
]


@pytest.mark.parametrize(
    ("workers", "cpu_servers", "colocated"),
    MATRIX,
    ids=[f"n{n}-k{k}-{'colocated' if c else 'noncolocated'}" for n, k, c in MATRIX],
)
def test_push_pull_matches_the_reference(
    tmp_path: Path, workers: int, cpu_servers: int, colocated: bool
) -> None:
    def body(svc: sumflow._core.CommunicationService) -> None:
        assert svc.size == workers
        for rnd in range(2):  # a second round reuses the declarations and keys
            tensors = {
                f"{DTYPES[dt]}-{n}": contribution(svc.rank, n, dt, salt=rnd)
                for dt in DTYPES
                for n in SIZES
            }
            exchange(svc, tensors, average=False)
            for name, got in tensors.items():
                want = reference(workers, got.numel(), got.dtype, salt=rnd)
                assert torch.equal(got.to(torch.float64), want), name

    with local_job(tmp_path, workers, cpu_servers, colocated=colocated) as job:
        job.run_workers(body, partition_bytes=PARTITION)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_average_of_random_floats(tmp_path: Path, dtype: torch.dtype) -> None:
    workers, n = 3, 70_001

    def data(rank: int) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)

    want = sum(data(r) for r in range(workers)) / workers

    def body(svc: sumflow._core.CommunicationService) -> torch.Tensor:
        t = data(svc.rank).to(dtype)
        exchange(svc, {"avg": t}, average=True)
        return t

    with local_job(tmp_path, workers, 1) as job:
        results = job.run_workers(body, partition_bytes=PARTITION)
    for got in results:
        if dtype == torch.float32:
            # Summed in f32 from f32 inputs: relative 1e-6 of the reference.
            assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6)
        elif dtype == torch.float64:
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
        else:
            # Inputs rounded to 16 bits, summed in f32, rounded once: within one rounding of
            # the inputs' error.
            exact = sum(data(r).to(dtype).double() for r in range(workers)) / workers
            eps = torch.finfo(dtype).eps
            assert torch.allclose(got.double(), exact, rtol=eps, atol=eps)
        assert torch.equal(got, results[0]), "every worker gets the same bits"


def test_large_tensor(tmp_path: Path) -> None:
    """64 MB of f32 in 4 MB partitions over 2 workers, 2 colocated and 1 CPU server."""
    elements = 16 << 20

    def body(svc: sumflow._core.CommunicationService) -> bool:
        t = torch.full((elements,), float(svc.rank + 1))
        t[-1] = 7.0
        exchange(svc, {"big": t}, average=False)
        return bool((t[:-1] == 3.0).all()) and float(t[-1]) == 14.0

    with local_job(tmp_path, 2, 1) as job:
        assert job.run_workers(body) == [True, True]


def test_declaration_mismatch_names_the_tensor_and_reaches_every_worker(tmp_path: Path) -> None:
    def body(svc: sumflow._core.CommunicationService) -> str:
        elements = 100 if svc.rank == 0 else 101

        def declare_and_sum() -> None:
            tid = svc.declare("layer1.weight", "f32", elements)
            # The other worker's declaration may come later: the next operation fails.
            t = torch.zeros(elements)
            svc.wait(svc.push_pull(tid, t, t.data_ptr(), t.numel() * 4), WAIT)
            svc.barrier(WAIT)

        with pytest.raises(sumflow.DeclarationMismatchError) as info:
            declare_and_sum()
        return str(info.value)

    with local_job(tmp_path, 2, 0) as job:
        messages = job.run_workers(body)
    for m in messages:
        for part in ("layer1.weight", "100", "101", "worker 0", "worker 1"):
            assert part in m, m


def test_workers_with_different_partition_sizes_fail_at_once_naming_it(tmp_path: Path) -> None:
    """Workers that would cut tensors differently fail (the one declaring second already
    while joining, the other at its next operation) instead of waiting for keys that never
    come."""

    def sum_once(svc: sumflow._core.CommunicationService) -> None:
        tid = svc.declare("w", "f32", 1000)
        t = torch.zeros(1000)
        svc.wait(svc.push_pull(tid, t, t.data_ptr(), t.numel() * 4), WAIT)
        svc.barrier(WAIT)

    messages: list[str] = ["", ""]
    with local_job(tmp_path, 2, 0) as job:

        def worker(i: int) -> None:
            try:
                svc = job.service(i, partition_bytes=4096 if i == 0 else 8192)
                try:
                    sum_once(svc)
                finally:
                    svc.shutdown("test done")
            except sumflow.DeclarationMismatchError as e:
                messages[i] = str(e)

        started = time.monotonic()
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert time.monotonic() - started < WAIT / 2, "it failed by timing out"
    for m in messages:
        for part in ("SUMFLOW_PARTITION_BYTES", "4096", "8192", "worker 0", "worker 1"):
            assert part in m, messages


def test_bad_arguments_raise_value_error(tmp_path: Path) -> None:
    def body(svc: sumflow._core.CommunicationService) -> None:
        tid = svc.declare("x", "f32", 10)
        t = torch.zeros(10)
        with pytest.raises(ValueError, match="declared as f32 x 10"):
            svc.push_pull(tid, t, t.data_ptr(), 36)
        with pytest.raises(ValueError, match="never declared"):
            svc.push_pull(tid + 100, t, t.data_ptr(), 40)
        with pytest.raises(ValueError, match="unknown dtype 'float8'"):
            svc.declare("y", "float8", 10)
        i = torch.zeros(10, dtype=torch.int32)
        iid = svc.declare("i", "i32", 10)
        with pytest.raises(ValueError, match="averaging integers"):
            svc.push_pull(iid, i, i.data_ptr(), 40, 0, True)
        with pytest.raises(ValueError, match="timeout must be a positive"):
            svc.wait(1, -1.0)
        with pytest.raises(ValueError, match="unknown handle"):
            svc.wait(12345, 1.0)
        # A push_pull is in flight until its sum is complete, which needs every worker's
        # push: worker 1 pushes only once worker 0 has tried a second one.
        if svc.rank == 0:
            h = svc.push_pull(tid, t, t.data_ptr(), 40)
            with pytest.raises(sumflow.SumflowError, match="already has a push_pull in flight"):
                svc.push_pull(tid, t, t.data_ptr(), 40)
            svc.barrier(WAIT)
        else:
            svc.barrier(WAIT)
            h = svc.push_pull(tid, t, t.data_ptr(), 40)
        svc.wait(h, WAIT)
        svc.barrier(WAIT)

    with local_job(tmp_path, 2, 0) as job:
        job.run_workers(body)


def test_cuda_staging_says_why_the_driver_cannot_be_used(tmp_path: Path) -> None:
    """Where torch sees no GPU, the core cannot stage CUDA tensors either, says why, and
    refuses a staged push_pull with that reason instead of queueing a copy."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: test_cuda.py runs the driver's staging")

    def body(svc: sumflow._core.CommunicationService) -> None:
        why = svc.cuda_staging_unavailable()
        assert why is not None
        assert why == svc.cuda_staging_unavailable()
        assert "libcuda.so.1" in why or "cuInit" in why, why
        tid = svc.declare("staged", "f32", 10)
        t = torch.zeros(10)
        with pytest.raises(sumflow.SumflowError, match="CUDA driver"):
            svc.push_pull_after_copy("staged", t, 1 << 40, 0, 0, tid, t, t.data_ptr(), 40)
        # Nothing was issued: the tensor sums as usual.
        svc.wait(svc.push_pull(tid, t, t.data_ptr(), 40), WAIT)

    with local_job(tmp_path, 1, 0) as job:
        job.run_workers(body)


def test_a_dead_server_fails_the_wait_naming_it(tmp_path: Path) -> None:
    with local_job(tmp_path, 1, 1, heartbeat_timeout=2.0) as job:
        # A job of one worker sums in its own memory; through the server, it needs it.
        svc = job.service(0, heartbeat_timeout=2.0, shared_memory=False)
        try:
            tid = svc.declare("w", "f32", 1 << 20)
            t = torch.ones(1 << 20)
            svc.wait(svc.push_pull(tid, t, t.data_ptr(), 4 << 20), WAIT)
            for p in job.procs[1:]:
                p.kill()

            def keep_summing() -> None:
                for _ in range(100):
                    svc.wait(svc.push_pull(tid, t, t.data_ptr(), 4 << 20), WAIT)

            with pytest.raises(sumflow.SumflowError) as info:
                keep_summing()
            assert isinstance(info.value, (sumflow.NodeFailedError, sumflow.SumflowTimeoutError)), (
                info.value
            )
            assert "server" in str(info.value)
        finally:
            svc.shutdown("test done")


def test_a_wait_times_out_naming_the_tensor_and_releases_the_gil(tmp_path: Path) -> None:
    """Worker 1 never pushes: worker 0's wait times out, and while it blocks another
    thread of the process keeps running Python."""
    done = threading.Event()
    ticks = 0

    def spin() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1

    def body(svc: sumflow._core.CommunicationService) -> float:
        if svc.rank == 1:
            assert done.wait(WAIT)
            return 0.0
        t = torch.zeros(4)
        h = svc.push_pull(svc.declare("lonely", "f32", 4), t, t.data_ptr(), 16)
        spinner = threading.Thread(target=spin)
        spinner.start()
        try:
            with pytest.raises(sumflow.SumflowTimeoutError, match="tensor 'lonely': timed out"):
                svc.wait(h, 1.0)
            return ticks
        finally:
            done.set()
            spinner.join()

    with local_job(tmp_path, 2, 0) as job:
        spun, _ = job.run_workers(body)
    assert spun > 1000, f"only {spun} iterations ran while wait blocked"
