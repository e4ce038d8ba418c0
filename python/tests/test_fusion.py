"""Tensor fusion's layout without a job: the spans lazy allreduce cuts, and the gradient
pool's views. Fused training itself (the same parameters as unfused, the averages in
place) is checked across two workers in test_cross_barrier.py."""

from __future__ import annotations

import pytest
import torch

from sumflow import settings
from sumflow.torch.fusion import CUDA_DEFAULT_THRESHOLD, GradientPool, default_threshold, plan_spans


def test_a_span_closes_once_it_holds_theta() -> None:
    assert plan_spans([10, 10, 10, 10, 10], 25) == [range(0, 3), range(3, 5)]
    # Exactly theta closes the span; one large tensor is a span of its own.
    assert plan_spans([5, 20, 100, 1, 1], 25) == [range(0, 2), range(2, 3), range(3, 5)]
    assert plan_spans([1, 2, 3], 1 << 30) == [range(0, 3)]


def test_theta_zero_sends_every_tensor_alone_and_no_tensors_make_no_span() -> None:
    assert plan_spans([4, 0, 8], 0) == [range(0, 1), range(1, 2), range(2, 3)]
    assert plan_spans([], 100) == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_a_bad_theta_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="whole number of bytes >= 0"):
        plan_spans([1], bad)  # type: ignore[arg-type]


def test_theta_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    theta = settings.FUSION_THRESHOLD
    monkeypatch.delenv(theta.name, raising=False)
    assert theta.read() is None  # the optimizer's devices decide: default_threshold
    monkeypatch.setenv(theta.name, " 65536 ")
    assert theta.read() == 65536
    monkeypatch.setenv(theta.name, "64MB")
    with pytest.raises(ValueError, match="SUMFLOW_FUSION_THRESHOLD='64MB'"):
        theta.read()


def in_pool(pool: GradientPool, p: torch.nn.Parameter) -> bool:
    """Whether ``p.grad`` is its place in the pool: inside its span's memory, contiguous."""
    grad, span = p.grad, pool.span_of[id(p)]
    if grad is None or not grad.is_contiguous():
        return False
    start, item = span.flat.data_ptr(), span.flat.element_size()
    return start <= grad.data_ptr() and grad.data_ptr() + grad.numel() * item <= (
        start + span.flat.numel() * item
    )


def pool_of(params: list[torch.nn.Parameter], threshold: int) -> GradientPool:
    names = {p: f"p{i}" for i, p in enumerate(params)}
    priority = {p: i for i, p in enumerate(params)}
    return GradientPool(params[::-1], names, priority, threshold, "grad")


def test_gradients_become_views_of_one_pool_in_backward_order() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (6, 2, 3, 1)]
    params[1].grad = torch.full((2,), 7.0)
    pool = pool_of(params, 12)
    # Backward order p3, p2, p1, p0: 4 + 12 bytes close the first span; p1 and p0 follow.
    assert [s.name for s in pool.spans] == ["grad[p3..p2]", "grad[p1..p0]"]
    assert [s.priority for s in pool.spans] == [2, 0]
    first, second = pool.spans
    assert first.flat.data_ptr() + first.flat.numel() * 4 == second.flat.data_ptr()
    # A gradient it already had is kept, in the pool; the others get theirs on adoption.
    assert in_pool(pool, params[1])
    assert torch.equal(second.flat[:2], torch.full((2,), 7.0))
    assert params[0].grad is None
    for p in params:
        pool.adopt(p)
    assert all(in_pool(pool, p) for p in params)
    params[0].grad.fill_(1.0)
    assert torch.equal(second.flat[2:], torch.ones(6))


def test_a_gradient_put_elsewhere_moves_into_the_pool_once() -> None:
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    pool = pool_of(params, 0)
    # What autograd does after zero_grad(set_to_none=True): a fresh tensor.
    params[1].grad = torch.arange(4.0).view(2, 2)
    assert not in_pool(pool, params[1])
    pool.adopt(params[1])
    assert in_pool(pool, params[1])
    assert torch.equal(pool.spans[0].flat, torch.arange(4.0))
    assert params[1].grad.shape == (2, 2)
    # Names of single-gradient spans are those of unfused gradients.
    assert [s.name for s in pool.spans] == ["grad.p1", "grad.p0"]


def test_each_dtype_gets_its_own_pool() -> None:
    params = [
        torch.nn.Parameter(torch.zeros(2)),
        torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)),
        torch.nn.Parameter(torch.zeros(2)),
    ]
    pool = pool_of(params, 1 << 20)
    spans = {s.flat.dtype: s for s in pool.spans}
    assert spans.keys() == {torch.float32, torch.float64}
    assert spans[torch.float32].params == [params[2], params[0]]
    assert spans[torch.float64].params == [params[1]]


def test_zero_keeps_every_gradient_a_view_and_autograd_adds_into_the_pool() -> None:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    pool = pool_of(params, 1 << 20)
    params[1].grad = torch.full((2, 2), 5.0)  # put elsewhere by hand: moved into the pool
    pool.zero()
    views = [p.grad for p in params]
    assert all(in_pool(pool, p) for p in params)
    assert torch.equal(pool.spans[0].flat, torch.zeros(7))
    x = [torch.arange(3.0), torch.arange(4.0).view(2, 2)]
    for _ in range(2):
        pool.zero()
        sum((p * xi).sum() for p, xi in zip(params, x, strict=True)).backward()
        # The same tensors, in the pool, holding this backward's gradients only.
        assert all(p.grad is v for p, v in zip(params, views, strict=True))
        assert torch.equal(params[0].grad, x[0])
        assert torch.equal(params[1].grad, x[1])


def test_a_sparse_gradient_is_moved_into_the_pool_dense() -> None:
    table = torch.nn.Embedding(5, 2, sparse=True)
    pool = pool_of(list(table.parameters()), 0)
    table(torch.tensor([1, 3, 1])).sum().backward()
    assert table.weight.grad is not None
    assert table.weight.grad.is_sparse
    pool.adopt(table.weight)
    want = torch.zeros(5, 2)
    want[1], want[3] = 2.0, 1.0
    assert in_pool(pool, table.weight)
    assert torch.equal(table.weight.grad, want)


def test_fusion_is_on_by_default_only_for_gpu_parameters() -> None:
    cpu = [torch.nn.Parameter(torch.zeros(2))]
    assert default_threshold(torch.optim.SGD(cpu, lr=0.1)) == 0
    assert default_threshold(torch.optim.SparseAdam(cpu, lr=0.1)) == 0
    assert CUDA_DEFAULT_THRESHOLD == 4 << 20
    if torch.cuda.is_available():
        gpu = [torch.nn.Parameter(torch.zeros(2, device="cuda"))]
        assert default_threshold(torch.optim.SGD(gpu, lr=0.1)) == CUDA_DEFAULT_THRESHOLD
        assert default_threshold(torch.optim.SparseAdam(gpu, lr=0.1)) == 0


def test_sparse_adam_is_never_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    import sumflow.torch as hvd

    table = torch.nn.Embedding(4, 2, sparse=True)
    with pytest.raises(ValueError, match="with SparseAdam: fusion sums gradients dense"):
        hvd.DistributedOptimizer(
            torch.optim.SparseAdam(list(table.parameters())), fusion_threshold=64
        )
    # From the environment, fusion gives way (this process has no job, so the wrapping
    # goes no further than that). Horovod's test_sparse_embeddings runs it in a job.
    monkeypatch.setenv(settings.FUSION_THRESHOLD.name, "64")
    with (
        pytest.warns(UserWarning, match="is ignored for SparseAdam"),
        pytest.raises(ValueError, match="not initialised"),
    ):
        hvd.DistributedOptimizer(torch.optim.SparseAdam(list(table.parameters())))
