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

from sumflow.tune.space import Configuration, SearchSpace
from sumflow_bench import (
    cluster,
    cpu,
    goodput_worker,
    grid,
    jobs,
    matrix,
    netns,
    report,
    schedreport,
    targets,
    theory,
    train_worker,
    training,
)

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


def test_the_goodput_set_is_equal_tensors_or_a_models_parameters() -> None:
    equal = goodput_worker.make_tensors(64, 8)
    assert len(equal) == 8
    assert sum(t.numel() for t in equal) * 4 == 64_000_000
    resnet = goodput_worker.model_tensors("resnet50")
    assert len(resnet) == 161
    assert 100e6 < sum(t.numel() for t in resnet) * 4 < 105e6
    args = goodput_worker.parse_args(["--system", "sumflow", "--model", "resnet50"])
    assert args.model == "resnet50"


def test_parse_iperf_uses_received_goodput_both_ways() -> None:
    link = cluster.parse_iperf(IPERF_BIDIR, 250.0, 3.0)
    assert link["forward_mbit"] == pytest.approx(246)
    assert link["reverse_mbit"] == pytest.approx(248)
    assert link["b_mbit"] == pytest.approx(247)
    assert link["ratio"] == pytest.approx(247 / 250)


def test_cpu_jiffies_and_window() -> None:
    stat = "cpu  100 5 50 800 40 0 5 0 0 0\ncpu0 1 2 3 4\ncpu1 5 6 7 8\nintr 1 2\n"
    ticks = cpu.TICKS
    busy, total = cpu.read_cpu_seconds(stat, "6.00 11.50\n")
    # Two CPUs for 6 s, less idle and iowait: the busy fields (160 ticks) play no part.
    assert total == pytest.approx(12.0)
    assert busy == pytest.approx(12.0 - 840 / ticks)
    sampler = cpu.CpuSampler()
    sampler._times = [0.0, 1.0, 2.0, 3.0]
    sampler._samples = [(0, 0), (50, 100), (150, 200), (160, 300)]
    assert sampler.utilisation(0.5, 2.5) == pytest.approx(1.0)  # samples 1..2
    assert sampler.utilisation(0.0, 3.0) == pytest.approx(160 / 300)
    assert sampler.utilisation(1.2, 1.8) is None
    with cpu.CpuSampler(interval=0.01) as live:
        # Longer than a few jiffies (10 ms each), or /proc/stat may not have moved at all.
        spent = time.process_time()
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            sum(range(10_000))
        spent = time.process_time() - spent
    assert live.utilisation(0, 1e12) is not None
    # The machine was busy at least while this process was (to the files' 10 ms).
    seconds = live.seconds(0, 1e12)
    assert seconds is not None
    assert seconds["busy"] >= spent - 0.05


def test_cpu_by_role() -> None:
    assert cpu.role_of("python -m sumflow_bench.goodput_worker --system gloo") == "workers"
    launcher = "python -m sumflow.launcher -H a:1 -- python -m sumflow_bench.goodput_worker"
    assert cpu.role_of(launcher) == "launcher"
    assert cpu.role_of("/venv/bin/sumflow-server --port 0") == "servers"
    assert cpu.role_of("/venv/bin/python /venv/bin/sumflow-run -np 2 python t.py") == "launcher"
    # The launcher's temporary directory in the coordinator's arguments.
    coordinator = "python /venv/bin/sumflow-coordinator --addr-file /tmp/sumflow-run-ab12/addr"
    assert cpu.role_of(coordinator) == "coordinator"
    assert cpu.role_of("bash") is None
    before = {1: ("workers", "ns-a", 100), 2: ("servers", "ns-a", 50), 3: ("servers", "ns-c", 10)}
    after = {
        1: ("workers", "ns-a", 300),
        2: ("servers", "ns-a", 150),
        3: ("servers", "ns-c", 60),
        4: ("coordinator", "ns-a", 5),  # started in between: counted from zero
    }
    ticks = cpu.TICKS
    assert cpu.by_role(before, after) == {
        "workers": pytest.approx(200 / ticks),
        "colocated servers": pytest.approx(100 / ticks),
        "CPU servers": pytest.approx(50 / ticks),
        "coordinator": pytest.approx(5 / ticks),
    }
    sampler = cpu.CpuSampler(processes=True)
    sampler._times = [0.0, 1.0]
    sampler._samples = [(0.0, 0.0), (5.0, 8.0)]
    sampler._processes = [before, after]
    seconds = sampler.seconds(0.0, 1.0)
    assert seconds is not None
    assert seconds["busy"] == pytest.approx(5.0)
    assert seconds["other"] == pytest.approx(5.0 - 355 / ticks)
    assert sampler.seconds(0.2, 0.8) is None


def test_a_forked_child_is_seen_again_once_it_execs_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's remote wrapper forks the worker: until it execs, the child has the
    wrapper's command line. A role cached from that moment would count the worker as the
    launcher for the whole run (and its colocated server as a CPU server)."""
    proc = tmp_path / "proc"
    (proc / "123" / "ns").mkdir(parents=True)
    (proc / "123" / "ns" / "net").symlink_to(tmp_path / "net:[4026531840]")

    def process(comm: str, cmdline: str, jiffies: int) -> None:
        fields = ["S"] + ["0"] * 10 + [str(jiffies), "0"] + ["0"] * 6 + ["777"]
        (proc / "123" / "stat").write_text(f"123 ({comm}) {' '.join(fields)}\n")
        (proc / "123" / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode())

    monkeypatch.setattr(cpu, "PROC", proc)
    cache: dict[tuple[int, str, str], tuple[str, str] | None] = {}
    process("sh", "sh -c ... sumflow-run /work env python -m sumflow_bench.goodput_worker", 3)
    assert cpu.read_processes(cache)[123][0] == "launcher"
    process("python3", "python -m sumflow_bench.goodput_worker --system sumflow", 90)
    assert cpu.read_processes(cache)[123][:1] == ("workers",)
    assert cpu.read_processes(cache)[123][2] == 90


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
    # The workers are told the shaped link rate (the veths report 10 Gbit/s), unless -x does.
    assert args.worker_env == ["SUMFLOW_LINK_GBITS=0.25"]
    assert cluster.parse_args(["--rate-mbit", "1000"]).worker_env == ["SUMFLOW_LINK_GBITS=1"]
    told = cluster.parse_args(["-x", "SUMFLOW_LINK_GBITS=5", "-x", "A=1"]).worker_env
    assert told == ["SUMFLOW_LINK_GBITS=5", "A=1"]
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


def skip_without_namespaces() -> None:
    """Skips the test, saying why, where this machine cannot run the emulated cluster."""
    reason = netns.unavailable_reason()
    if reason is None and subprocess.run(["which", "iperf3"], capture_output=True).returncode:
        reason = "iperf3 is not installed"
    if reason is not None:
        print(f"skipping the emulated run: {reason}")
        pytest.skip(reason)


def test_two_host_emulated_run(tmp_path: Path) -> None:
    skip_without_namespaces()
    out = tmp_path / "out"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "sumflow_bench.cluster"),
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
        # Nothing can beat the link: the optimum for n = 2, k = 0 is B (2(n-1)/n = 1). The
        # shaped rate is the bound: iperf3's reading of it can fall short on a busy machine.
        assert 0 < run["goodput_gbit"] < 1.05 * max(link["b_mbit"], 400) / 1e3
        # Each host's switch port carries M each way per round (Eq. 6 and a ring of two
        # agree), plus the frames' headers and the job's start-up.
        assert 1.0 < run["nic_vs_model"] < 1.15, run["nic_bytes"]
    (model,) = results["training"]
    assert [r["label"] for r in model["runs"]] == ["DDP/gloo", "sumflow k=0"]
    assert all(r["iterations_per_s"] > 0 and r["checked"] for r in model["runs"])
    assert {"results.md", "goodput.png", "training.png"} <= {p.name for p in out.iterdir()}
    # Torn down: no namespace of the harness is left behind.
    assert netns.namespaces_with_prefix() == []


# ----------------------------------------------------------------------------------------
# The scheduler benchmark (issue 6): options, plan, verdicts, report, grid
# ----------------------------------------------------------------------------------------

ALL_SYSTEMS = "fifo,p3,bytescheduler,bytescheduler-tuned,prophet,ddp"


def test_scheduler_options() -> None:
    args = cluster.parse_args(["--schedulers", ALL_SYSTEMS, "--reference-gbits", "1, 2,5,10"])
    assert args.scheduler_names == ALL_SYSTEMS.split(",")
    assert args.gbits == [1.0, 2.0, 5.0, 10.0]
    # The standard run: no schedulers, one bandwidth; the old spelling still works.
    standard = cluster.parse_args(["--reference-gbit", "25"])
    assert standard.scheduler_names is None
    assert standard.gbits == [25.0]
    assert cluster.parse_args([]).gbits == [10.0]
    for bad, message in (
        (["--schedulers", "fifo,bytesched"], "unknown 'bytesched'"),
        (["--schedulers", "fifo,fifo"], "fifo more than once"),
        (["--schedulers", ""], "empty"),
        (["--reference-gbits", "1,x"], "comma-separated numbers"),
        (["--reference-gbits", "0"], "> 0"),
        (["--reference-gbits", "1,1"], "more than once"),
        (["--schedulers", "fifo", "--grid", "g.json"], "separate runs"),
        (["--schedulers", "fifo", "--models", ""], "at least one profile"),
        (["--repeats", "0"], "--repeats"),
        (["--scheduler-k", "-1"], "--scheduler-k"),
    ):
        with pytest.raises(ValueError, match=message):
            matrix_error(bad)


def matrix_error(argv: list[str]) -> None:
    """parse_args(argv), turning argparse's exit into a ValueError with its message."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            cluster.parse_args(argv)
        except SystemExit:
            raise ValueError(err.getvalue()) from None


def test_plan_runs_a_cells_systems_back_to_back_lowest_bandwidth_first() -> None:
    systems = matrix.scheduler_systems(ALL_SYSTEMS.split(","), k=0)
    steps = matrix.plan(["vgg16", "resnet50"], [1, 10], systems, repeats=2)
    cells = list(dict.fromkeys((s.cell.model, s.cell.reference_gbit) for s in steps))
    assert cells == [("vgg16", 1), ("resnet50", 1), ("vgg16", 10), ("resnet50", 10)]
    # Each cell's steps are contiguous: tuning first, then the systems round after round.
    first = [s for s in steps if s.cell == matrix.Cell("vgg16", 1)]
    assert steps[: len(first)] == first
    assert first[0].tune
    assert first[0].system.name == "bytescheduler-tuned"
    names = [s.system.name for s in first[1:]]
    assert names == ALL_SYSTEMS.split(",") * 2
    assert [s.repeat for s in first[1:]] == [0] * 6 + [1] * 6
    assert len(steps) == 4 * (1 + 6 * 2)
    assert len({s.key for s in steps}) == len(steps)  # log and result files never collide
    by_name = {s.name: s for s in systems}
    assert by_name["ddp"].kind == "ddp-gloo"
    assert not by_name["ddp"].cross_barrier
    assert by_name["prophet"].scheduler == "prophet"
    assert by_name["prophet"].cross_barrier
    assert by_name["bytescheduler-tuned"].scheduler == "bytescheduler"
    assert [s.label for s in matrix.standard_systems(4)] == [
        "DDP/gloo",
        "sumflow k=0",
        "sumflow k=4",
    ]
    with pytest.raises(ValueError, match="repeats"):
        matrix.plan(["vgg16"], [1], systems, repeats=0)


def test_compute_aim_and_estimates() -> None:
    assert matrix.compute_aim_s(10) == pytest.approx(0.3)  # the standard run's
    assert matrix.compute_aim_s(40) == pytest.approx(0.3)
    assert matrix.compute_aim_s(5) == pytest.approx(0.15)
    assert matrix.compute_aim_s(1) == pytest.approx(0.1)
    # The communication/computation ratio is the reference's whatever the aim: halving the
    # bandwidth doubles the bytes per second of compute.
    ratios = []
    for gbit in (1, 2, 5, 10):
        s = matrix.cell_scales(matrix.Cell("vgg16", gbit), 250.0)
        ratios.append(s.param_bytes / s.compute_s * gbit)
    assert max(ratios) / min(ratios) == pytest.approx(1.0, rel=0.01)
    cell = matrix.Cell("vgg16", 1)
    scales = matrix.cell_scales(cell, 250.0)
    (fifo,) = matrix.scheduler_systems(["fifo"], 0)
    one = matrix.estimate_seconds(
        matrix.Step(cell, fifo), scales, workers=4, rate_mbit=250, iterations=10,
        tune_iterations=50,
    )  # fmt: skip
    tune = matrix.estimate_seconds(
        matrix.Step(cell, fifo, tune=True), scales, workers=4, rate_mbit=250, iterations=10,
        tune_iterations=50,
    )  # fmt: skip
    comm = 1.5 * scales.param_bytes / (250e6 / 8)
    assert one == pytest.approx(matrix.JOB_OVERHEAD_S + 10 * (scales.compute_s + comm))
    assert tune > one


def fake_run(name: str, label: str, rate: float, idle_ms: float, repeat: int = 0) -> dict[str, Any]:
    return {
        "name": name, "label": label, "iterations_per_s": rate, "idle_ms": idle_ms,
        "compute_ms": 100.0, "cpu": 0.4, "repeat": repeat, "iteration_s": [1 / rate] * 3,
    }  # fmt: skip


def fake_cell(model: str, gbit: float, rates: dict[str, float]) -> dict[str, Any]:
    systems = {s.name: s for s in matrix.scheduler_systems(ALL_SYSTEMS.split(","), 0)}
    cell = {
        "cell": matrix.Cell(model, gbit), "model": model, "reference_gbit": gbit,
        "megabytes": 10.0, "compute_s": 0.1, "partition_bytes": 100_000, "scaling": "why",
        "runs": [
            fake_run(name, systems[name].label, rate, 1000 / rate - 100)
            for name, rate in rates.items()
        ],
        "tuning": [],
    }  # fmt: skip
    return training.finish_cell(cell)


def test_cells_summarise_repeats_and_ratios() -> None:
    cell = {
        "cell": matrix.Cell("vgg16", 1), "model": "vgg16", "reference_gbit": 1,
        "runs": [
            fake_run("fifo", "fifo", 1.0, 900), fake_run("ddp", "DDP/gloo", 0.5, 1900),
            fake_run("fifo", "fifo", 1.4, 600, 1), fake_run("ddp", "DDP/gloo", 0.7, 1300, 1),
            fake_run("fifo", "fifo", 1.3, 700, 2), fake_run("ddp", "DDP/gloo", 0.6, 1500, 2),
        ],
        "tuning": [],
    }  # fmt: skip
    done = training.finish_cell(cell)
    assert "cell" not in done  # results stay JSON
    fifo = done["summary"]["fifo"]
    assert (fifo["runs"], fifo["iterations_per_s"], fifo["idle_ms"]) == (3, 1.3, 700)
    assert (fifo["min_iterations_per_s"], fifo["max_iterations_per_s"]) == (1.0, 1.4)
    assert list(done["summary"]) == ["fifo", "ddp"]
    assert done["runs"][0]["vs_ddp"] == pytest.approx(1.0 / 0.6)
    assert done["runs"][1]["vs_fifo"] == pytest.approx(0.5 / 1.3)


def fake_scheduler_results() -> dict[str, Any]:
    cells = []
    for gbit in (1, 2, 5, 10):
        for model in ("vgg16", "resnet50"):
            low = gbit <= 2
            rates = {
                "fifo": 1.0, "p3": 0.9, "bytescheduler": 1.2,
                "bytescheduler-tuned": 1.35 if model == "vgg16" else 1.25,
                "prophet": 1.5 if low else 1.3, "ddp": 1.1,
            }  # fmt: skip
            cells.append(fake_cell(model, gbit, rates))
    config = {"partition_bytes": 65536, "credit_bytes": 262144}
    cells[0]["tuning"].append(
        {"name": "bytescheduler-tuned", "label": "bytescheduler tuned", "iterations_per_s": 1.1,
         "tuner": {"events": ["start", "trial", "finish"], "applied": config,
                   "trials": [{"score_s": 1.0}] + [{"score_s": 0.8}] * 6}}
    )  # fmt: skip
    cells[0]["runs"][3]["tuner"] = {"events": ["start", "reuse"], "applied": config}
    return {
        "config": {
            "workers": 4, "cpu_servers": [0], "rate_mbit": 250.0, "mtu": 9000, "delay_ms": 0.0,
            "cpu_flag": 0.8, "schedulers": ALL_SYSTEMS.split(","), "scheduler_k": 0,
            "iterations": 20, "warmup_iterations": 3, "repeats": 1,
        },
        "link": {"seconds": 3, "forward_mbit": 250, "reverse_mbit": 250, "b_mbit": 250,
                 "ratio": 1.0},
        "training": cells,
    }  # fmt: skip


def test_verdicts() -> None:
    rates = schedreport.rates(fake_scheduler_results())
    verdicts = targets.verdicts(rates)
    by = {(v.baseline, v.threshold, v.model, v.reference_gbit): v for v in verdicts}
    tuned = by["fifo", 1.3, "vgg16", 1]
    assert tuned.met
    assert tuned.ratio == pytest.approx(1.35)
    assert by["bytescheduler-tuned", 1.1, "vgg16", 1].ratio == pytest.approx(1.5 / 1.35)
    assert by["bytescheduler-tuned", 1.1, "vgg16", 2].met
    # At the highest bandwidth prophet need only stay near: 1.3 / 1.35 = 0.963 < 0.97.
    assert by["bytescheduler-tuned", 0.97, "vgg16", 10].met is False
    assert by["bytescheduler-tuned", 0.97, "resnet50", 10].met  # 1.3 / 1.25
    assert ("bytescheduler-tuned", 1.1, "vgg16", 5) not in by  # only the two lowest
    best = by["ddp", 1.2, "resnet50", 1]
    assert best.system == "prophet"
    assert best.ratio == pytest.approx(1.5 / 1.1)
    assert best.met
    assert len(verdicts) == 1 + 2 * 3 + 2
    assert (
        "NOT met: prophet / bytescheduler-tuned = 0.96x"
        in by["bytescheduler-tuned", 0.97, "vgg16", 10].line()
    )
    # A cell without the baseline cannot be judged, and says so.
    partial = targets.verdicts({("vgg16", 1.0): {"fifo": 1.0, "prophet": 1.2}})
    unjudged = [v for v in partial if v.met is None]
    assert {v.baseline for v in unjudged} == {"fifo", "bytescheduler-tuned", "ddp"}
    assert all(v.line().startswith("not measured") for v in unjudged)
    assert targets.verdicts({}) == []
    # Tuned prophet, where it ran and was faster, is the one judged.
    cell = {"fifo": 1.0, "prophet": 1.0, "prophet-tuned": 1.2, "bytescheduler-tuned": 1.0}
    judged = [v for v in targets.verdicts({("vgg16", 1.0): cell}) if v.threshold == 1.1]
    assert [(v.system, v.ratio) for v in judged] == [("prophet-tuned", pytest.approx(1.2))]
    (tuned,) = matrix.scheduler_systems(["prophet-tuned"], 4)
    assert (tuned.scheduler, tuned.tuned, tuned.label) == ("prophet", True, "prophet tuned k=4")


def test_scheduler_report_and_plots(tmp_path: Path) -> None:
    results = fake_scheduler_results()
    text = schedreport.markdown(results)
    assert "| profile | system | 1 Gbit/s | 2 Gbit/s | 5 Gbit/s | 10 Gbit/s |" in text
    assert "| vgg16 | fifo | 1.00 | 1.00 | 1.00 | 1.00 |" in text
    assert "| | prophet | 1.50 | 1.50 | 1.30 | 1.30 |" in text
    # ratios to fifo / to DDP; DDP's own row has 1.00x to itself.
    assert "| | DDP/gloo | 1.10x / 1.00x |" in text
    assert (
        "| vgg16 | 1 | bytescheduler tuned | 7 | partition 65536 B, credit 262144 B "
        "(4 partitions) | 1.25x | reused it |"
    ) in text
    assert "- met: bytescheduler-tuned / fifo = 1.35x (target >= 1.3x) on vgg16 at 1 Gbit/s" in (
        text
    )
    assert text.count("NOT met") == 1
    # 10 MB over 4 workers' ring: 1.5 x 10 MB at 31.25 MB/s = 0.48 s, 0.1 s of compute hidden.
    assert schedreport.ceiling(results, results["training"][0]) == pytest.approx(1 / 0.48)
    assert "| | *ceiling: Eq. 6 communication, compute hidden* | 2.08 | 2.08 |" in text
    assert "| | *ceiling* | 2.08x / 1.89x |" in text
    # The whole output: the link part, then this; the standard training table is left out.
    full = report.markdown(results)
    assert "vs DDP/gloo |" not in full
    cluster.write_outputs(results, tmp_path)
    for name in ("schedulers.png", "idle.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "training.png").exists()
    assert "**Targets**" in (tmp_path / "results.md").read_text()


def test_repeated_runs_show_their_range() -> None:
    results = fake_scheduler_results()
    cell = results["training"][0]
    cell["runs"].append(fake_run("fifo", "fifo", 0.8, 1150, repeat=1))
    results["training"][0] = training.finish_cell({**cell, "cell": None})
    results["config"]["repeats"] = 2
    text = schedreport.markdown(results)
    assert "| vgg16 | fifo | 0.90 (0.80-1.00) |" in text
    assert "2 runs per system" in text


def test_job_arguments_of_a_tuned_system(tmp_path: Path) -> None:
    args = cluster.parse_args(
        ["--schedulers", ALL_SYSTEMS, "-x", "SUMFLOW_X=1", "--out", str(tmp_path)]
    )
    assert args.tune_iterations == 10 * (2 + 5) + matrix.TUNE_SLACK_ITERATIONS
    systems = {s.name: s for s in matrix.scheduler_systems(ALL_SYSTEMS.split(","), 0)}
    cell = {"size_scale": 0.1, "time_scale": 0.5, "bucket_cap_mb": 2.5, "partition_bytes": 4096}
    step = matrix.Step(matrix.Cell("vgg16", 1), systems["bytescheduler-tuned"], tune=True)
    argv = training.worker_argv(args, step, cell, tmp_path / "o.json")
    assert argv[argv.index("--iterations") + 1] == str(args.tune_iterations)
    assert argv[argv.index("--warmup") + 1] == "0"
    assert "--cross-barrier" in argv
    assert argv[argv.index("--partition-bytes") + 1] == "4096"
    store, log = training.tuner_files(args, step)
    # 64 KiB and 32 MiB scaled by 0.1, in whole pages: 6553.6 -> 8192, 3355443 -> 3354624.
    assert training.sumflow_env(args, step, cell) == [
        "-x", "SUMFLOW_X=1", "-x", "SUMFLOW_LINK_GBITS=0.25",
        "-x", "SUMFLOW_SCHEDULER=bytescheduler",
        "-x", "SUMFLOW_AUTOTUNE=1", "-x", f"SUMFLOW_AUTOTUNE_FILE={store}",
        "-x", f"SUMFLOW_AUTOTUNE_LOG={log}",
        "-x", "SUMFLOW_AUTOTUNE_PARTITION_BYTES=8192:3354624",
        "-x", "SUMFLOW_AUTOTUNE_TRIALS=10", "-x", "SUMFLOW_AUTOTUNE_WARMUP_STEPS=2",
        "-x", "SUMFLOW_AUTOTUNE_MEASURE_STEPS=5",
    ]  # fmt: skip
    # The measured run: the same store (it reuses what tuning stored), its own log.
    measured = matrix.Step(step.cell, step.system)
    assert training.tuner_files(args, measured) == (store, log.with_name(f"{measured.key}.jsonl"))
    env = training.sumflow_env(args, measured, cell)
    assert f"SUMFLOW_AUTOTUNE_FILE={store}" in env
    ddp = training.worker_argv(args, matrix.Step(step.cell, systems["ddp"]), cell, tmp_path)
    assert "--cross-barrier" not in ddp
    assert ddp[ddp.index("--bucket-cap-mb") + 1] == "2.5"
    fifo = training.sumflow_env(args, matrix.Step(step.cell, systems["fifo"]), cell)
    assert fifo[-1] == "SUMFLOW_SCHEDULER=fifo"
    assert not any("AUTOTUNE" in item for item in fifo)
    assert "--fusion-threshold" not in argv
    (fused,) = matrix.scheduler_systems(["bytescheduler-fusion"], 0)
    assert (fused.scheduler, fused.cross_barrier, fused.fusion) == ("bytescheduler", True, True)
    fused_argv = training.worker_argv(args, matrix.Step(step.cell, fused), cell, tmp_path)
    # Spans as large as the cell's partitions.
    assert fused_argv[fused_argv.index("--fusion-threshold") + 1] == "4096"
    assert matrix.tuning_space(1e-6) == (4096, 4096)  # never below a page
    # With no size given, sumflow derives its own, as for a user who sets none; fused
    # spans are BytePS's 4 MiB scaled like the tensors.
    derived = {**cell, "partition_bytes": None, "scaled_partition_bytes": 8192}
    plain = training.worker_argv(
        args, matrix.Step(step.cell, systems["bytescheduler"]), derived, tmp_path
    )
    assert "--partition-bytes" not in plain
    fused_derived = training.worker_argv(args, matrix.Step(step.cell, fused), derived, tmp_path)
    assert "--partition-bytes" not in fused_derived
    assert fused_derived[fused_derived.index("--fusion-threshold") + 1] == "8192"
    fp16, topk, csc = matrix.scheduler_systems(
        ["bytescheduler-fp16", "bytescheduler-topk", "csc"], 0
    )
    fp16_argv = training.worker_argv(args, matrix.Step(step.cell, fp16), cell, tmp_path)
    assert fp16_argv[fp16_argv.index("--compression") + 1] == "fp16"
    assert "--cross-barrier" in fp16_argv
    topk_argv = training.worker_argv(args, matrix.Step(step.cell, topk), cell, tmp_path)
    assert topk_argv[topk_argv.index("--compression") + 1] == "topk:ratio=0.01"
    csc_argv = training.worker_argv(args, matrix.Step(step.cell, csc), cell, tmp_path)
    assert csc_argv[csc_argv.index("--csc") + 1] == "0.15"
    assert "--cross-barrier" not in csc_argv
    train_worker.parse_args(csc_argv[3:])  # a command line train_worker accepts


def test_tuner_log_is_read_into_trials(tmp_path: Path) -> None:
    config = {"partition_bytes": 8192, "credit_bytes": 32768}
    log = tmp_path / "t.jsonl"
    log.write_text(
        "\n".join(
            json.dumps(e)
            for e in (
                {"event": "start", "time": 1},
                {"event": "propose", "trial": 1},
                {"event": "trial", "trial": 1, "config": config, "score_s": 0.5,
                 "reason": "start", "step_s": [0.5]},
                {"event": "finish", "best": {"trial": 1, "config": config, "score_s": 0.5}},
            )
        ) + "\n"
    )  # fmt: skip
    got = training.read_tuner_log(log)
    assert got["events"] == ["start", "propose", "trial", "finish"]
    assert got["trials"] == [
        {"trial": 1, "config": config, "score_s": 0.5, "reason": "start", "step_s": [0.5]}
    ]
    assert got["applied"] == config
    reuse = tmp_path / "r.jsonl"
    reuse.write_text(json.dumps({"event": "reuse", "config": config}) + "\n")
    assert training.read_tuner_log(reuse) == {"events": ["reuse"], "trials": [], "applied": config}
    assert training.read_tuner_log(tmp_path / "none.jsonl")["applied"] is None


def test_progress_reports_time_left(capsys: pytest.CaptureFixture[str]) -> None:
    progress = cluster.Progress(3, estimate_s=600.0)
    progress.step("link check")
    progress.step("a", 300.0)
    progress._current = (300.0, progress._current[1] - 100.0)  # type: ignore[index]
    progress.step("b", 300.0)
    lines = capsys.readouterr().err.splitlines()
    assert "about 10 min left] link check" in lines[0]
    assert "about 10 min left] a" in lines[1]
    # "a" took a third of its estimate, so the 300 s left are about 100 s.
    assert "about 100 s left] b" in lines[2]


def test_grid_points_span_the_tuners_space_and_make_grid_json() -> None:
    space = SearchSpace(8192, 262144, 16.0)
    points = grid.grid_points(space, partitions=6, credits=5)
    ps = sorted({p for p, _ in points})
    assert ps == [8192, 16384, 32768, 65536, 131072, 262144]
    assert sorted({c // p for p, c in points}) == [1, 2, 4, 8, 16]
    assert len(points) == 30
    # Every point is one the tuner could choose.
    assert all(space.contains(Configuration(p, c)) for p, c in points)
    with pytest.raises(ValueError, match="not distinct"):
        grid.grid_points(SearchSpace(4096, 8192, 16.0), partitions=5, credits=2)
    systems = grid.grid_systems(points[:2], k=0)
    assert systems[0].credit_bytes == 8192
    assert systems[0].partition_bytes == 8192
    assert systems[0].scheduler == "bytescheduler"
    cell = {
        "model": "vgg16", "reference_gbit": 1.0, "partition_bytes": 65536, "scaling": "why",
        "runs": [
            {**fake_run(systems[0].name, "", 2.0, 0), "iteration_s": [0.5, 0.6]},
            {**fake_run(systems[1].name, "", 2.0, 0), "iteration_s": [0.4, 0.45]},
        ],
    }  # fmt: skip
    data = grid.grid_json(cell, systems, {"workers": 4})
    assert data["configs"][1] == {
        "partition_bytes": 8192, "credit_bytes": 16384, "step_s": [0.4, 0.45]
    }  # fmt: skip
    assert data["meta"]["workers"] == 4
    assert data["meta"]["model"] == "vgg16"
    text = grid.markdown(data)
    assert "| 8192 | 550 | **425** |" in text
    # What the tuner's comparison reads.
    path_data = compare_grid(data)
    assert path_data.best_s == pytest.approx(0.425)


def compare_grid(data: dict[str, Any]) -> Any:
    """GRID.json `data` loaded by the tuner's comparison."""
    import tempfile

    from sumflow_bench import tune_compare as compare

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "GRID.json"
        path.write_text(json.dumps(data))
        return compare.load_grid(path)


def test_two_host_scheduler_run(tmp_path: Path) -> None:
    """The scheduler benchmark end to end, small: one job, prophet across the barrier."""
    skip_without_namespaces()
    out = tmp_path / "out"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "sumflow_bench.cluster", "--skip-goodput"),
            *("--workers", "2", "--rate-mbit", "400", "--link-seconds", "1"),
            *("--schedulers", "prophet", "--models", "resnet50", "--reference-gbits", "10"),
            *("--iterations", "3", "--warmup-iterations", "1"),
            *("--subnet", "10.213.0.0/24", "--job-timeout", "120", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (cell,) = json.loads((out / "results.json").read_text())["training"]
    (run,) = cell["runs"]
    assert run["scheduler"] == "prophet"
    assert run["cross_barrier"]
    assert run["checked"]
    assert run["iterations_per_s"] > 0
    assert "**Targets**" in (out / "results.md").read_text()
    assert "not measured" in done.stderr  # no fifo, tuned bytescheduler or DDP in this run
    assert {"schedulers.png", "idle.png"} <= {p.name for p in out.iterdir()}
    assert netns.namespaces_with_prefix() == []
