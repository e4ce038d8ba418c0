"""sumflow.torch across worker processes: DistributedOptimizer against one process on the
whole batch, broadcasts, Horovod's collectives, the DDP hook against DDP with gloo, and
failures (declaration mismatch, a killed worker)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from jobs import Outcome, free_port_pair, run_worker_processes
from torch_worker import BATCH, STEPS, batch, make_optimizer, model

WORKER = str(Path(__file__).with_name("torch_worker.py"))
# The test model is float64: the only difference between a distributed run and one process
# is the order of summation, far below this.
ATOL = 1e-10


def run(
    tmp_path: Path, workers: int, mode: str, cpu_servers: int = 1, **kw: object
) -> list[Outcome]:
    argv = [WORKER, mode, str(tmp_path)]
    return run_worker_processes(tmp_path, workers, argv, cpu_servers, **kw)  # type: ignore[arg-type]


def results(tmp_path: Path, outcomes: list[Outcome]) -> list[object]:
    for o in outcomes:
        assert o.returncode == 0, f"worker {o.rank} exited {o.returncode}:\n{o.stderr[-3000:]}"
    return [torch.load(tmp_path / f"rank{o.rank}.pt", weights_only=False) for o in outcomes]


def reference(opt_name: str, workers: int) -> dict[str, torch.Tensor]:
    """One process taking the same steps on the concatenated global batch."""
    m = model()
    opt = make_optimizer(opt_name, m.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        xs, ys = zip(*(batch(step, r, workers) for r in range(workers)), strict=True)
        torch.nn.functional.cross_entropy(m(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return m.state_dict()


def trains_like_one_process(tmp_path: Path, env: dict[str, str]) -> list[Outcome]:
    """Two workers train SGD with ``env`` set; both end with one process's parameters.
    Returns their outcomes, for what else the test checks."""
    want = reference("sgd", 2)
    outcomes = run(tmp_path, 2, "train-sgd-1", env=env)
    for got in results(tmp_path, outcomes):
        assert isinstance(got, dict)
        for k, v in want.items():
            assert torch.allclose(got[k], v, rtol=0, atol=ATOL), (k, (got[k] - v).abs().max())
    return outcomes


@pytest.mark.parametrize(
    ("workers", "opt_name", "passes", "machines"),
    [
        (2, "sgd", 1, None),
        (4, "sgd", 1, None),
        (2, "adam", 1, None),
        (2, "sgd", 2, None),
        # Two workers on each of two machines (local ranks 0 and 1 on each; the
        # gradients span both machines, so they go through the servers), and four
        # workers on one machine (summed in its shared memory).
        (4, "sgd", 1, 2),
        (4, "adam", 1, 1),
    ],
    ids=["2-sgd", "4-sgd", "2-adam", "2-sgd-accumulate", "2x2-sgd", "1x4-adam"],
)
def test_distributed_optimizer_equals_one_process_on_the_whole_batch(
    tmp_path: Path, workers: int, opt_name: str, passes: int, machines: int | None
) -> None:
    want = reference(opt_name, workers)
    outcomes = run(tmp_path, workers, f"train-{opt_name}-{passes}", machines=machines)
    for got in results(tmp_path, outcomes):
        assert isinstance(got, dict)
        for k, v in want.items():
            assert torch.allclose(got[k], v, rtol=0, atol=ATOL), (k, (got[k] - v).abs().max())
    assert BATCH % passes == 0


@pytest.mark.parametrize(
    ("env", "prepared"),
    [({"FUSION": "256"}, [2, 0]), ({"FUSION": "256", "PREDIVIDE": "2"}, [0, 2])],
    ids=["prepared", "predivided"],
)
def test_fused_spans_are_sent_by_prepared_sums_where_they_can_be(
    tmp_path: Path, env: dict[str, str], prepared: list[int]
) -> None:
    # The model's gradients make two spans of at least 256 B. A span whose gradients are
    # scaled before they are sent (a predivide factor) is sent by the general path, each
    # step anew; either way the workers train as one process.
    for got in results(tmp_path, trains_like_one_process(tmp_path, env)):
        assert isinstance(got, dict)
        assert got["prepared spans"].tolist() == prepared


def test_prepared_sums_on_machines_of_two_workers_train_as_one_process(tmp_path: Path) -> None:
    # Two machines of two workers (local ranks 0 and 1): the spans' prepared sums go
    # through each machine's shared memory first, then the servers.
    want = reference("sgd", 4)
    outcomes = run(tmp_path, 4, "train-sgd-1", machines=2, env={"FUSION": "256"})
    for got in results(tmp_path, outcomes):
        assert isinstance(got, dict)
        for k, v in want.items():
            assert torch.allclose(got[k], v, rtol=0, atol=ATOL), (k, (got[k] - v).abs().max())
        assert got["prepared spans"].tolist() == [2, 0]


def test_a_gradient_computed_twice_before_step_is_refused_naming_it(tmp_path: Path) -> None:
    (got,) = results(tmp_path, run(tmp_path, 1, "computed-twice", cpu_servers=0))
    assert isinstance(got, dict)
    # The first layer's bias or weight, whichever autograd computes first.
    again = (
        r"the gradient of DistributedOptimizer\.grad\.0\.(bias|weight) was computed again "
        r"before step\(\) or synchronize\(\) used the previous one; with gradient "
        r"accumulation pass backward_passes_per_step"
    )
    for variant in ("sent", "fused"):
        assert re.match(again, got[variant]), (variant, got[variant])


def test_an_lr_scheduler_created_before_wrapping_does_not_bypass_the_averaging(
    tmp_path: Path,
) -> None:
    # torch's LR schedulers patch optimizer.step on the instance, whose attributes the
    # wrapper shares: without care, step() would skip synchronizing and each worker would
    # train on its own batch only.
    trains_like_one_process(tmp_path, {"LR_SCHEDULER_FIRST": "1"})


def test_broadcasts_make_every_worker_equal_the_root(tmp_path: Path) -> None:
    got = results(tmp_path, run(tmp_path, 3, "broadcasts"))
    root = got[1]
    assert isinstance(root, dict)
    assert root["object"] == {"rank": 1, "blob": [0, 1, 2]}
    assert root["lr"] == pytest.approx(0.2)
    assert int(root["state"]["steps"]) == 10
    assert root["state"]["mask"].tolist() == [False, True]
    for r in got:
        assert isinstance(r, dict)
        assert r["object"] == root["object"]
        assert r["lr"] == root["lr"]
        for k, v in root["state"].items():
            assert torch.equal(r["state"][k], v), k
        for a, b in zip(r["momentum"], root["momentum"], strict=True):
            assert torch.equal(a, b)


def test_horovod_collectives(tmp_path: Path) -> None:
    n = 3
    for r, out in enumerate(results(tmp_path, run(tmp_path, n, "collectives", cpu_servers=2))):
        assert isinstance(out, dict)
        assert torch.equal(out["avg"], torch.full((5,), 2.0))
        assert torch.equal(out["sum"], torch.full((5,), 6.0))
        assert torch.equal(out["untouched"], torch.full((5,), float(r + 1))), (
            "allreduce is out of place"
        )
        assert torch.equal(out["ints"], torch.full((3,), 6, dtype=torch.int64))
        for i, t in enumerate(out["async"]):
            assert torch.equal(t, torch.full((1000,), float(sum(i * n + q for q in range(n)))))
        assert out["fp16"].dtype == torch.float32
        assert torch.allclose(out["fp16"], torch.full((7,), 0.2), atol=1e-3)
        # float16 overflows to inf (which GradScaler detects), whether at the cast or in
        # the servers' sum; the small element stays exact, and bfloat16 does not overflow.
        fp16, bf16 = out["fp16_overflow"], out["bf16_overflow"]
        assert fp16.dtype == bf16.dtype == torch.float32
        assert torch.equal(fp16[:2], torch.full((2,), float("inf"))), fp16
        assert fp16[2] == 6.0
        assert torch.allclose(bf16, torch.tensor([3e5, 9e4, 6.0]), rtol=1e-2), bf16
        want_nc = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * 6
        assert torch.equal(out["noncontig"], want_nc)
        assert torch.equal(out["push_pull"], torch.full((3,), 6.0))
        assert torch.equal(out["scaled"], torch.full((2,), 3.0))
        errors = out["errors"]
        for label, kind, hint in [
            ("adasum", "ValueError", "power-of-two number of workers"),
            ("bool", "TypeError", "torch.bool"),
            (
                "mismatch",
                "HorovodInternalError",
                "[1] on worker 0; [2] on worker 1; [3] on worker 2",
            ),
        ]:
            assert errors[label].startswith(kind), errors[label]
            assert hint in errors[label], errors[label]


def test_ddp_hook_matches_ddp_with_gloo(tmp_path: Path) -> None:
    (tmp_path / "gloo").mkdir()
    (tmp_path / "hook").mkdir()
    gloo = results(
        tmp_path / "gloo",
        run_worker_processes(tmp_path, 2, [WORKER, "ddp-gloo", str(tmp_path / "gloo")], 1),
    )
    hook = results(
        tmp_path / "hook",
        run_worker_processes(tmp_path, 2, [WORKER, "ddp-sumflow", str(tmp_path / "hook")], 1),
    )
    for g, h in zip(gloo, hook, strict=True):
        assert isinstance(g, dict)
        assert isinstance(h, dict)
        for k in g:
            if isinstance(g[k], torch.Tensor):
                assert torch.allclose(g[k], h[k], rtol=0, atol=ATOL), k
        # Every bucket of the last step was summed whole by a prepared sum, and none other
        # is kept: the buckets cover the model's 227 elements in 4 parameters.
        assert h["prepared buckets"] == h["last buckets"], h
        assert sum(n for n, _ in h["last buckets"]) == 227
        assert sum(p for _, p in h["last buckets"]) == 4
        if h["first buckets"] != h["last buckets"]:
            # DDP rebuilt its buckets after the first step (torch 2.15: the second layer's
            # gradients with the first layer's bias, 67 elements, and the first layer's
            # weight, 160): the first step's one bucket was let go.
            assert h["last buckets"] == [(67, 3), (160, 1)], h
        else:
            assert torch.__version__ < "2.15", "torch 2.15 rebuilds the buckets"


def test_sync_batch_norm_equals_batch_norm_over_the_whole_batch(tmp_path: Path) -> None:
    n = 3
    outs = results(tmp_path, run(tmp_path, n, "sync-batch-norm"))
    gen = torch.Generator().manual_seed(5)
    whole = torch.randn(4 * n, 3, 5, generator=gen)
    weights = torch.randn(4 * n, 3, 5, generator=gen)
    layers = torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3))
    x = whole.clone().requires_grad_(True)
    want = layers(x)
    (want * weights).sum().backward()
    assert x.grad is not None
    for r, out in enumerate(outs):
        assert isinstance(out, dict)
        rows = slice(4 * r, 4 * r + 4)
        assert torch.allclose(out["out"], want[rows].detach(), atol=1e-5), r
        assert torch.allclose(out["grad"], x.grad[rows], atol=1e-5), r
        assert torch.allclose(out["running_mean"], layers[1].running_mean, atol=1e-6), r
        assert torch.allclose(out["running_var"], layers[1].running_var, atol=1e-5), r
    ints = torch.stack(
        [
            torch.tensor([[r, r + 1], [r * 2, r * 2 + 1], [r * 3, r * 3 + 1], [r * 4, r * 4 + 1]])
            for r in range(n)
        ]
    ).float()
    x = ints.clone().requires_grad_(True)
    torch.nn.BatchNorm1d(4)(x).mean(dim=0).sum().backward()
    assert x.grad is not None
    for r, out in enumerate(outs):
        assert isinstance(out, dict)
        # Horovod's tolerance: its test averages the workers' gradients against this.
        assert torch.allclose(out["sum_grad"][0] / n, x.grad[r], 1e-6), (r, out["sum_grad"])


def test_declaration_mismatch_reaches_every_worker_naming_the_tensor(tmp_path: Path) -> None:
    for o in run(tmp_path, 2, "mismatch"):
        assert o.returncode != 0
        assert "DeclarationMismatchError" in o.stderr, o.stderr[-2000:]
        assert "DistributedOptimizer.grad.weight" in o.stderr, o.stderr[-2000:]


def test_one_size_in_two_shapes_is_a_declaration_mismatch_naming_both(tmp_path: Path) -> None:
    for o in run(tmp_path, 2, "shape-mismatch"):
        assert o.returncode != 0
        err = o.stderr[-3000:]
        assert "DeclarationMismatchError" in err, err
        assert "'DistributedOptimizer.grad.weight'" in err, err
        assert "shaped [32, 32] by worker 0" in err, err
        assert "shaped [16, 64] by worker 1" in err, err


def test_a_killed_worker_is_named_by_the_others_within_the_heartbeat_timeout(
    tmp_path: Path,
) -> None:
    heartbeat = 2.0
    started = time.monotonic()
    outcomes = run(tmp_path, 3, "crash", heartbeat_timeout=heartbeat, timeout=90.0)
    elapsed = time.monotonic() - started
    assert outcomes[2].returncode == -9
    for o in outcomes[:2]:
        assert o.returncode not in (0, None), o.stderr[-2000:]
        assert "NodeFailedError" in o.stderr, o.stderr[-2000:]
        assert "worker 2" in o.stderr, o.stderr[-2000:]
    # Start-up (three torch imports on two cores) plus detection; far below the 300 s an
    # operation waits before timing out.
    assert elapsed < 60, elapsed


def test_workers_started_by_torchrun(tmp_path: Path) -> None:
    """torchrun's RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT are enough: rank 0
    starts the coordinator and local rank 0 the machine's summation server."""
    port = free_port_pair()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
    env["SUMFLOW_JOB_TOKEN"] = "torchrun-test-token-0123456789"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            WORKER,
            "collectives",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert torch.equal(got["sum"], torch.full((5,), 3.0))
        assert torch.equal(got["avg"], torch.full((5,), 1.5))


def test_a_torch_release_without_what_the_plugin_calls_is_refused_on_import() -> None:
    from sumflow.torch import _requires

    _requires.check()  # this torch has it
    with pytest.raises(ImportError, match=r"needs torch 2\.1 or later .*this is torch "):
        _requires.check(object)
