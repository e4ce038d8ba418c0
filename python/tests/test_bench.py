"""The emulated-cluster harness: its formulas, parsing and reports, and a 2-host smoke run
(when this machine allows network namespaces; skipped with the reason otherwise)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sumflow.bench import cluster, cpu, jobs, netns, report, theory

GB = 1e9


# ----------------------------------------------------------------------------------------
# Theory: BytePS Table 1, Eq. 1, 2, 6, 7
# ----------------------------------------------------------------------------------------


def test_table_1() -> None:
    m, b = 100e6, 1.25e9
    assert theory.allreduce_time(8, m, b) == pytest.approx(2 * 7 * m / (8 * b))
    assert theory.colocated_ps_time(8, m, b) == theory.allreduce_time(8, m, b)
    # Non-colocated PS: CPU machines are the bottleneck below k = n, the NIC at k >= n.
    assert theory.noncolocated_ps_time(8, 2, m, b) == pytest.approx(4 * m / b)
    assert theory.noncolocated_ps_time(8, 8, m, b) == pytest.approx(m / b)
    assert theory.noncolocated_ps_time(8, 16, m, b) == pytest.approx(m / b)
    # "if k <= n/2, [non-colocated PS becomes] slower than all-reduce" (§2.3)
    assert theory.noncolocated_ps_time(8, 4, m, b) > theory.allreduce_time(8, m, b)
    assert theory.noncolocated_ps_time(8, 5, m, b) < theory.allreduce_time(8, m, b)
    with pytest.raises(ValueError, match="at least one CPU machine"):
        theory.noncolocated_ps_time(8, 0, m, b)


def test_eq_6_meets_the_baselines_at_the_ends() -> None:
    m, b = 64e6, 1e9
    for n in (2, 4, 8, 32):
        # k = 0: all-reduce (and colocated PS); k = n: non-colocated PS, M/B.
        assert theory.optimal_time(n, 0, m, b) == pytest.approx(theory.allreduce_time(n, m, b))
        assert theory.optimal_time(n, n, m, b) == pytest.approx(m / b)
        assert theory.optimal_time(n, 2 * n, m, b) == pytest.approx(m / b)  # k > n: no help
        times = [theory.optimal_time(n, k, m, b) for k in range(n + 1)]
        assert times == sorted(times, reverse=True)
        for k in range(1, n + 1):
            assert theory.optimal_time(n, k, m, b) <= theory.noncolocated_ps_time(n, k, m, b)
    assert theory.optimal_time(1, 3, m, b) == 0


def test_eq_1_and_2_split_the_whole_model_and_balance_the_machines() -> None:
    for n in (2, 4, 8, 32):
        for k in range(0, n + 1):
            cpu_share, gpu_share = theory.cpu_server_share(n, k), theory.gpu_server_share(n, k)
            assert k * cpu_share + n * gpu_share == pytest.approx(1.0)  # Eq. 5
            if k:
                # At the optimum a GPU machine (Eq. 3) and a CPU machine take equally long;
                # a CPU machine moves its share to and from all n workers, so n * share
                # (Eq. 4 as printed omits the n; with it, Eq. 1 and 2 and Eq. 6 follow).
                t_g = 1 + (n - 2) * gpu_share
                assert n * cpu_share == pytest.approx(t_g)
                assert t_g == pytest.approx(theory.optimal_time(n, k, 1.0, 1.0))
    assert theory.gpu_server_share(4, 4) == 0  # k = n: pure non-colocated PS


def test_eq_7_paper_example() -> None:
    gamma_a, gamma_p = theory.acceleration_ratios(32, 16)
    # The paper prints 1.46 and 1.52: 1504/1024 = 1.469 and 1504/992 = 1.516, truncated.
    assert gamma_a == pytest.approx(1504 / 1024)
    assert gamma_p == pytest.approx(1504 / 992)
    assert math.floor(gamma_a * 100) == 146
    assert round(gamma_p, 2) == 1.52
    # k = n = 4, the harness's standard run: the optimum is 1.5x all-reduce.
    assert theory.acceleration_ratios(4, 4)[0] == pytest.approx(1.5)
    with pytest.raises(ValueError, match=r"Eq\. 7"):
        theory.acceleration_ratios(4, 0)


def test_bad_theory_inputs() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        theory.optimal_time(4, 1, 1.0, 0.0)
    with pytest.raises(ValueError, match="CPU machines"):
        theory.optimal_time(4, -1, 1.0, 1.0)
    assert theory.goodput(10.0, 0.0) == math.inf


# ----------------------------------------------------------------------------------------
# Parsing and reports
# ----------------------------------------------------------------------------------------

IPERF_BIDIR = {
    "end": {
        "sum_sent": {"bits_per_second": 251e6},
        "sum_received": {"bits_per_second": 246e6},
        "sum_sent_bidir_reverse": {"bits_per_second": 250e6},
        "sum_received_bidir_reverse": {"bits_per_second": 248e6},
    }
}


def test_parse_iperf_uses_received_goodput_both_ways() -> None:
    link = cluster.parse_iperf(IPERF_BIDIR, 250.0, 3.0)
    assert link["forward_mbit"] == pytest.approx(246)
    assert link["reverse_mbit"] == pytest.approx(248)
    assert link["b_mbit"] == pytest.approx(247)
    assert link["ratio"] == pytest.approx(247 / 250)


def test_cpu_jiffies_and_window() -> None:
    busy, total = cpu.read_jiffies("cpu  100 5 50 800 40 0 5 0 0 0\ncpu0 1 2 3 4\n")
    assert (busy, total) == (160, 1000)  # idle and iowait are not busy
    sampler = cpu.CpuSampler()
    sampler._times = [0.0, 1.0, 2.0, 3.0]
    sampler._samples = [(0, 0), (50, 100), (150, 200), (160, 300)]
    assert sampler.utilisation(0.5, 2.5) == pytest.approx(1.0)  # samples 1..2
    assert sampler.utilisation(0.0, 3.0) == pytest.approx(160 / 300)
    assert sampler.utilisation(1.2, 1.8) is None
    with cpu.CpuSampler(interval=0.01) as live:
        # Longer than a few jiffies (10 ms each), or /proc/stat may not have moved at all.
        deadline = time.monotonic() + 0.05
        while time.monotonic() < deadline:
            sum(range(10_000))
    assert live.utilisation(0, 1e12) is not None


def test_link_shape_validation() -> None:
    with pytest.raises(ValueError, match="rate_mbit"):
        netns.LinkShape(0)
    with pytest.raises(ValueError, match="mtu"):
        netns.LinkShape(100, mtu=100)
    with pytest.raises(ValueError, match="delay_ms"):
        netns.LinkShape(100, delay_ms=-1)
    shape = netns.LinkShape(1000)
    assert shape.rate_bytes == 125e6
    assert shape.burst_bytes() >= 65536 + 1500


def test_arguments() -> None:
    args = cluster.parse_args(["--cpu-servers", "4,0,2,2", "--models", "vgg16, resnet50"])
    assert args.ks == [0, 2, 4]
    assert args.models == ["vgg16", "resnet50"]
    assert cluster.parse_args(["--models", ""]).models == []
    for bad in (["--cpu-servers", "x"], ["--workers", "1"], ["--cpu-servers", "-1"]):
        with pytest.raises(SystemExit):
            cluster.parse_args(bad)


def fake_results() -> dict[str, Any]:
    n, b = 4, 247e6 / 8
    m = 32e6
    runs = []
    for k in (0, 4):
        opt = theory.goodput(m, theory.optimal_time(n, k, m, b)) * 8 / GB
        good = 0.95 * opt
        runs.append(
            {"k": k, "goodput_gbit": good, "optimum_gbit": opt, "vs_optimum": 0.95,
             "vs_gloo": good / 0.16, "cpu": 0.5 if k == 0 else 0.9}
        )  # fmt: skip
    train_runs = [
        {"label": "DDP/gloo", "iterations_per_s": 1.0, "vs_ddp": 1.0, "compute_ms": 300,
         "idle_ms": 500, "cpu": 0.3},
        {"label": "sumflow k=0", "iterations_per_s": 1.2, "vs_ddp": 1.2, "compute_ms": 300,
         "idle_ms": 400, "cpu": None},
    ]  # fmt: skip
    return {
        "config": {
            "workers": n, "cpu_servers": [0, 4], "rate_mbit": 250.0, "mtu": 9000,
            "delay_ms": 0.0, "cpu_flag": 0.8,
        },
        "link": {"seconds": 3, "forward_mbit": 246, "reverse_mbit": 248, "b_mbit": 247,
                 "ratio": 0.988},
        "goodput": {
            "gloo": {"goodput_gbit": 0.16, "cpu": 0.1},
            "sumflow": runs,
            "allreduce_theory_gbit": theory.goodput(m, theory.allreduce_time(n, m, b)) * 8 / GB,
        },
        "training": [{"model": "resnet50", "megabytes": 8.4, "runs": train_runs}],
    }  # fmt: skip


def test_markdown_report_flags_cpu_bound_runs() -> None:
    text = report.markdown(fake_results())
    rows = [line for line in text.splitlines() if line.startswith("| sumflow push_pull")]
    assert len(rows) == 2
    assert "(over limit)" not in rows[0]
    assert "90% (over limit)" in rows[1]
    assert "**0.95x**" in rows[0]
    assert "| resnet50 (8.4 MB) | sumflow k=0 | 1.20 | **1.20x** |" in text
    assert "n/a" in text  # a run without a CPU figure says so
    assert "247 Mbit/s" in text


def test_plots_are_written(tmp_path: Path) -> None:
    results = fake_results()
    report.plot_goodput(results, tmp_path / "g.png")
    report.plot_training(results, tmp_path / "t.png")
    for name in ("g.png", "t.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_jobs_fail_with_the_reason_and_the_last_lines(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin"}
    ok = jobs._run("ok", [("[a] ", ["sh", "-c", "echo fine"], env)], tmp_path / "ok.log", 10)
    assert ok.seconds < 10
    assert (tmp_path / "ok.log").read_text() == "[a] fine\n"
    failing = [
        ("[a] ", ["sh", "-c", "echo about to fail; exit 3"], env),
        ("[b] ", ["sleep", "30"], env),
    ]
    with pytest.raises(jobs.JobFailed, match="exited with status 3") as e:
        jobs._run("job x", failing, tmp_path / "x.log", 20)
    assert "[a] about to fail" in str(e.value)
    assert e.value.args[0].startswith("job x")
    with pytest.raises(jobs.JobFailed, match=r"ran past its 0\.5 s limit"):
        jobs._run("slow", [("", ["sleep", "30"], env)], tmp_path / "s.log", 0.5)


# ----------------------------------------------------------------------------------------
# A 2-host emulated run
# ----------------------------------------------------------------------------------------


def test_two_host_emulated_run(tmp_path: Path) -> None:
    reason = netns.unavailable_reason()
    if reason is None and subprocess.run(["which", "iperf3"], capture_output=True).returncode:
        reason = "iperf3 is not installed"
    if reason is not None:
        print(f"skipping the emulated run: {reason}")
        pytest.skip(reason)
    out = tmp_path / "out"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "sumflow.bench.cluster"),
            *("--workers", "2", "--cpu-servers", "0", "--rate-mbit", "400"),
            *("--megabytes", "4", "--rounds", "2", "--warmup", "1", "--link-seconds", "1"),
            *("--models", "resnet50", "--iterations", "3", "--warmup-iterations", "1"),
            *("--subnet", "10.212.0.0/24", "--job-timeout", "120", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    link = results["link"]
    assert 0.8 < link["ratio"] < 1.05, link  # the shaping holds
    gloo, (sumflow,) = results["goodput"]["gloo"], results["goodput"]["sumflow"]
    for run in (gloo, sumflow):
        assert run["workers"] == 2
        assert run["bytes"] == 4_000_000
        # Nothing can beat the link: the optimum for n = 2, k = 0 is B (2(n-1)/n = 1).
        assert 0 < run["goodput_gbit"] < 1.05 * link["b_mbit"] / 1e3
    (model,) = results["training"]
    assert [r["label"] for r in model["runs"]] == ["DDP/gloo", "sumflow k=0"]
    assert all(r["iterations_per_s"] > 0 and r["checked"] for r in model["runs"])
    assert {"results.md", "goodput.png", "training.png"} <= {p.name for p in out.iterdir()}
    # Torn down: no namespace of the harness is left behind.
    assert netns.namespaces_with_prefix() == []
