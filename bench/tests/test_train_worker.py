"""The sleeping model built from a profile (sumflow_bench.model) and the training-benchmark
worker (sumflow_bench.train_worker); only the last test starts processes."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sumflow import profiles
from sumflow.profiles import ModelProfile
from sumflow_bench import train_worker
from sumflow_bench.model import build_model, expected_average, gradient_value

#: ``sumflow-run``, from this interpreter.
LAUNCHER = [sys.executable, "-m", "sumflow.launcher"]


# ---- the sleeping model ------------------------------------------------------------------


def test_sleeping_model_backprops_in_reverse_with_every_gradient() -> None:
    p = profiles.scale(profiles.builtin("resnet50"), size_scale=0.001, time_scale=0.01)
    m = build_model(p, seed=2, record_order=True)
    names = dict(m.named_parameters())
    assert len(names) == p.num_tensors
    for step in range(2):
        m.zero_grad()
        m().sum().backward()
        assert m.trace == [layer.name for layer in reversed(p.layers)] * (step + 1)
        for spec, param in zip(p.params(), m.parameters(), strict=True):
            assert param.shape == spec.shape
            assert param.grad is not None
            assert param.grad.shape == param.shape
            assert bool((param.grad == gradient_value(step, 2)).all())
    # Without zero_grad gradients accumulate, as with any model.
    m().sum().backward()
    for param in m.parameters():
        assert param.grad is not None
        assert bool((param.grad == gradient_value(1, 2) + gradient_value(2, 2)).all())
    assert expected_average(0, range(3)) == gradient_value(0, 1)


def test_sleeping_model_takes_the_profiles_time() -> None:
    p = profiles.scale(profiles.builtin("transformer"), size_scale=0.001, time_scale=1.0)
    m = build_model(p)
    m().sum().backward()  # first touches of the gradient buffers
    want = p.compute_ms / 1e3
    walls = []
    # The best of three: a loaded machine can only lengthen a pass, never shorten it.
    for _ in range(3):
        start, computed = time.perf_counter(), m.clock.total_s
        m.zero_grad()
        m().sum().backward()
        walls.append(time.perf_counter() - start)
        assert want * 0.95 <= m.clock.total_s - computed <= walls[-1]
    assert min(walls) < want * 1.5, (walls, want)


# ---- the worker --------------------------------------------------------------------------


def test_train_worker_names_missing_rendezvous_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in train_worker.GLOO_ENV:
        monkeypatch.delenv(v, raising=False)
    args = train_worker.parse_args(["--system", "ddp-gloo", "--profile", "resnet50"])
    with pytest.raises(SystemExit, match="MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE not set"):
        train_worker.DdpGloo(profiles.builtin("resnet50"), args)


class FakeSystem(train_worker.System):
    """Rank 1 of 2 whose 'rank 0' holds `root_offset` more in every parameter."""

    def __init__(self, profile: ModelProfile, root_offset: float) -> None:
        self.name, self.rank, self.size = "fake", 1, 2
        self.model = self.net = build_model(profile, seed=1)
        self.root_offset = root_offset

    def broadcast_(self, t: torch.Tensor, name: str) -> None:
        t.add_(self.root_offset)


def test_first_step_check_names_the_tensor_that_is_wrong() -> None:
    p = profiles.scale(profiles.builtin("vgg16"), size_scale=1e-4, time_scale=0.0)
    system = FakeSystem(p, root_offset=0.0)
    system.net().sum().backward()
    # Rank 1's own gradients, never averaged with rank 0's.
    with pytest.raises(train_worker.CheckFailed, match=r"rank 1: the gradient of layers\.0\."):
        train_worker.check_first_step(system)
    for param in system.model.parameters():
        assert param.grad is not None
        param.grad.fill_(expected_average(0, range(2)))
    train_worker.check_first_step(system)
    system.root_offset = 1.0
    with pytest.raises(train_worker.CheckFailed, match="32 of 32 parameters differ from rank 0"):
        train_worker.check_first_step(system)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_train_worker_runs_both_systems_under_sumflow_run(tmp_path: Path) -> None:
    profile = profiles.scale(profiles.builtin("resnet50"), size_scale=1e-3, time_scale=0.05)
    path = profiles.save(profile, tmp_path / "tiny.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
    env.update(OMP_NUM_THREADS="1", RUST_LOG="warn")
    worker = [sys.executable, "-m", "sumflow_bench.train_worker", "--warmup", "1"]
    runs = {
        "sumflow": [
            "--servers", "1", "--",
            *worker, "--system", "sumflow", "--profile", str(path), "--iterations", "3",
        ],
        "ddp-gloo": [
            "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={_free_port()}",
            "--shutdown-grace", "1", "--",
            *worker, "--system", "ddp-gloo", "--profile", "resnet50",
            "--size-scale", "0.001", "--time-scale", "0.05", "--iterations", "3",
        ],
    }  # fmt: skip
    for system, argv in runs.items():
        out = tmp_path / f"{system}.json"
        proc = subprocess.run(
            [*LAUNCHER, "-np", "2", *argv, "--json", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "first step checked" in proc.stderr
        r = json.loads(out.read_text())
        assert (r["system"], r["profile"], r["workers"], r["iterations"]) == (
            system,
            "resnet50",
            2,
            3,
        )
        assert (r["tensors"], r["param_bytes"]) == (161, profile.param_bytes)
        assert r["profile_compute_ms"] == pytest.approx(profile.compute_ms)
        assert r["iterations_per_s"] == pytest.approx(3 / r["wall_s"])
        assert len(r["iteration_s"]) == len(r["compute_s"]) == len(r["idle_s"]) == 3
        for t, c, i in zip(r["iteration_s"], r["compute_s"], r["idle_s"], strict=True):
            assert 0 < c <= t
            assert i == pytest.approx(t - c)
        # The backward pass's wall time holds its share of the compute (and the hooks),
        # never more than the iteration.
        share = sum(layer.backward_ms for layer in profile.layers) / profile.compute_ms
        assert len(r["backward_s"]) == 3
        for t, c, b in zip(r["iteration_s"], r["compute_s"], r["backward_s"], strict=True):
            assert 0.9 * share * c <= b < t
        assert r["iteration_median_s"] <= r["iteration_p90_s"]
        assert [x["rank"] for x in r["per_rank"]] == [0, 1]
        assert all(math.isfinite(x["iteration_median_s"]) for x in r["per_rank"])
        assert r["checked"] is True
