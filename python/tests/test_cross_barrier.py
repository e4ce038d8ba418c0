"""DistributedOptimizer(cross_barrier=True) across two worker processes, each with its own
data: the same parameters as the synchronous optimizer for every optimizer, with gradient
accumulation, both zero_grad modes, unused parameters and an LR scheduler; step() returning
before the sums; the forward blocking until its layer's update; timeouts and errors that
name the parameter. All of it comes from one job (see `ranks`); the generic per-parameter
path is also checked alone, for every optimizer of the installed torch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cross_barrier_worker import CASES, DELAY, HANG
from jobs import run_worker_processes

from sumflow.torch import per_parameter

WORKER = str(Path(__file__).with_name("cross_barrier_worker.py"))
#: The job's SUMFLOW_TIMEOUT: short, for the scenario whose update hangs longer.
TIMEOUT = 3.0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One job of two workers for every check below: starting one costs seconds."""
    tmp_path = tmp_path_factory.mktemp("cross_barrier")
    outcomes = run_worker_processes(
        tmp_path, 2, [WORKER, str(tmp_path)], 1, env={"SUMFLOW_TIMEOUT": str(TIMEOUT)}
    )
    for o in outcomes:
        assert o.returncode == 0, f"worker {o.rank} exited {o.returncode}:\n{o.stderr[-3000:]}"
    return [torch.load(tmp_path / f"rank{o.rank}.pt", weights_only=False) for o in outcomes]


def assert_same(got: Any, want: Any, where: str) -> None:
    """Bit-for-bit equality of nested dicts/lists of tensors and plain values."""
    if isinstance(want, dict):
        assert isinstance(got, dict), where
        assert got.keys() == want.keys(), (where, got.keys(), want.keys())
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), (where, (got - want).abs().max())
    else:
        assert got == want, (where, got, want)


def separable_optimizers() -> list[type[torch.optim.Optimizer]]:
    """Every optimizer this torch release has, but LBFGS (refused) and SparseAdam (sparse
    gradients only; sumflow sends dense ones)."""
    return [
        c
        for c in vars(torch.optim).values()
        if isinstance(c, type)
        and issubclass(c, torch.optim.Optimizer)
        and c not in (torch.optim.Optimizer, torch.optim.LBFGS, torch.optim.SparseAdam)
    ]


@pytest.mark.parametrize("cls", separable_optimizers(), ids=lambda c: c.__name__)
def test_one_parameter_at_a_time_equals_a_whole_step(cls: type[torch.optim.Optimizer]) -> None:
    """The generic per-parameter path, without a job: one-parameter views of an optimizer
    step its parameters exactly as its own step() does, state included."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64)) for _ in range(3)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    initial = [p.detach().clone() for p in params]
    whole = cls([{"params": params[:1], "lr": 0.02}, {"params": params[1:]}], lr=0.01)
    split = cls([{"params": twins[:1], "lr": 0.02}, {"params": twins[1:]}], lr=0.01)
    for _ in range(3):
        for p, t in zip(params, twins, strict=True):
            p.grad = torch.randn_like(p)
            t.grad = p.grad.clone()
        whole.step()
        for group in split.param_groups:
            hyper = per_parameter.hyperparameters(group)
            for index, t in enumerate(group["params"]):
                per_parameter.step_one(cls, split.__dict__, t, hyper, index, f"twin.{index}")
    assert_same(twins, params, "parameters")
    assert_same(split.state_dict(), whole.state_dict(), "state")
    assert all(not torch.equal(p, q) for p, q in zip(params, initial, strict=True)), "nothing moved"


def test_parameters_and_state_equal_the_synchronous_optimizer_exactly(
    ranks: list[dict[str, Any]],
) -> None:
    """Exact equality, not a tolerance: both optimizers step on the same averaged gradient
    (two addends sum the same in either order) and run the same torch code for each
    parameter (a CPU step is a loop over parameters), so nothing may differ by a bit."""
    results = [r["equivalence"] for r in ranks]
    for rank, got in enumerate(results):
        assert got.keys() == CASES.keys()
        for case, runs in got.items():
            where = f"rank {rank}, {case}"
            for variant in ("cross", "fused-sync", "fused-cross"):
                assert_same(
                    runs[variant]["model"], runs["sync"]["model"], f"{where} {variant}: parameters"
                )
                assert_same(
                    runs[variant]["optimizer"],
                    runs["sync"]["optimizer"],
                    f"{where} {variant}: state",
                )
            # The comparison means something only if training moved every parameter that
            # got a gradient, including those used every other step. (The unused module
            # moves only under weight decay; it is compared above all the same.)
            for k, v in runs["initial"].items():
                if not k.startswith("unused."):
                    assert not torch.equal(runs["cross"]["model"][k], v), f"{where}: {k} stayed"
    for case in CASES:
        assert_same(results[1][case]["cross"], results[0][case]["cross"], f"{case}: rank 1 vs 0")


def test_step_returns_at_once_forward_waits_and_failures_name_the_parameter(
    ranks: list[dict[str, Any]],
) -> None:
    assert DELAY < TIMEOUT / 2 < TIMEOUT < HANG
    got = ranks[0]["behaviour"]

    delayed = got["delayed_cross"]
    # Rank 1 held its first-layer gradient back for DELAY s: rank 0's step() returned
    # without waiting, left that layer as it was, and the next forward waited for it.
    assert delayed["step_s"] < DELAY / 2, delayed["step_s"]
    assert delayed["unchanged_after_step"]
    assert delayed["forward_s"] > DELAY / 2, delayed["forward_s"]
    assert delayed["updated_by_forward"]
    assert delayed["grads_zero"], "zero_grad() during the updates lost or kept a gradient"
    assert_same(delayed["model"], got["delayed_sync"]["model"], "delayed push: parameters")

    hang = got["hang"]["forward"]
    assert hang.startswith(
        f"SumflowTimeoutError: the forward of module '0' waited {TIMEOUT:g} s"
    ), hang
    for part in [
        "'hang.0.weight' (step 2, push_pull handle",
        "of 'DistributedOptimizer.grad.hang.0.weight'",
        "the update thread is running the optimizer for 'hang.0.weight'",
    ]:
        assert part in hang, (part, hang)
    assert got["hang"]["after"] == "no error", "a timeout must not break the optimizer"

    for where, raised in got["fail"].items():
        assert raised.startswith("ValueError: boom: FailingSGD refuses this update"), (
            where,
            raised,
        )
        if sys.version_info >= (3, 11):
            assert "update of 'fail.2.bias' (step 2" in raised, (where, raised)

    stale = got["stale"]
    assert stale.startswith("RuntimeError: a gradient of 'tied.proj.weight' was computed"), stale
    assert "outside the forward of the module that owns it" in stale, stale

    refusals = got["refusals"]
    assert refusals["lbfgs"].startswith("NotSeparableError: LBFGS updates all parameters")
    assert refusals["no_model"].startswith("ValueError: cross_barrier=True needs model=")
    assert refusals["orphan"].startswith("ValueError: cross_barrier: parameters ['param.")
    fusion = got["fusion"]
    assert fusion["pool_order"] == [True] * 3, fusion
    assert fusion["same_memory"] == [True] * 3, "the averages did not land in the gradients"
    assert fusion["averaged"] == [True] * 3, fusion
    # One span of the whole model, sent under its first and last gradients' names.
    assert fusion["sent"] == ["DistributedOptimizer.grad[pool.2.bias..pool.0.weight]"], fusion
    assert got["closure"].startswith("ValueError: step(closure) with cross_barrier")
    assert got["group_writer"].startswith(
        "NotSeparableError: GroupWriter.step wrote ['k'] of its parameter group"
    ), got["group_writer"]
