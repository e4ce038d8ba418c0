"""Adasum (``op=hvd.Adasum``): the combination itself, and allreduce and
DistributedOptimizer with it on jobs of 2 and 4 workers (adasum_worker.py checks every
result against the combination of all workers' inputs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jobs import assert_every_worker_reported_ok, run_worker_processes

from sumflow.torch import adasum
from sumflow.torch.compression import Compression

WORKER = str(Path(__file__).with_name("adasum_worker.py"))


def test_orthogonal_tensors_add_and_equal_ones_average() -> None:
    a = torch.tensor([3.0, 0.0, 0.0])
    b = torch.tensor([0.0, 4.0, 0.0])
    assert torch.equal(adasum.combine(torch.stack([a, b])), a + b)
    assert torch.equal(adasum.combine(torch.stack([a, a])), a)
    assert torch.equal(adasum.combine(torch.stack([torch.zeros(3), b])), b)
    assert torch.equal(adasum.combine(torch.stack([a])), a)


def test_the_pair_formula_and_the_tree_over_ranks() -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 10, generator=g, dtype=torch.float64)

    def by_hand(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dot = float(x @ y)
        return (1 - dot / (2 * float(x @ x))) * x + (1 - dot / (2 * float(y @ y))) * y

    want = by_hand(by_hand(rows[0], rows[1]), by_hand(rows[2], rows[3]))
    assert torch.allclose(adasum.combine(rows), want, rtol=1e-12, atol=0)
    half = adasum.combine(rows.to(torch.float16))
    assert half.dtype == torch.float16
    assert torch.allclose(half.double(), want, rtol=1e-2, atol=1e-2)


def test_what_adasum_cannot_combine_is_refused_naming_why() -> None:
    with pytest.raises(ValueError, match="power-of-two number of workers"):
        adasum.check("t", torch.zeros(2), 3, Compression.none)
    with pytest.raises(TypeError, match=r"not torch\.int64"):
        adasum.check("t", torch.zeros(2, dtype=torch.int64), 2, Compression.none)
    with pytest.raises(ValueError, match="no compression"):
        adasum.check("t", torch.zeros(2), 2, Compression.fp16)
    with pytest.raises(ValueError, match="power-of-two number of tensors"):
        adasum.combine(torch.zeros(3, 2))


@pytest.mark.parametrize(("workers", "cpu_servers"), [(2, 1), (4, 0)])
def test_allreduce_and_the_delta_optimizer_equal_the_combination(
    tmp_path: Path, workers: int, cpu_servers: int
) -> None:
    outcomes = run_worker_processes(tmp_path, workers, [WORKER, str(tmp_path)], cpu_servers)
    assert_every_worker_reported_ok(tmp_path, outcomes)
