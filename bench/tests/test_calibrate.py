"""The calibration (sumflow_bench.calibrate): the emulated-cluster runs recorded in
bench/results replayed in the simulator, and the calibration set within 10% of them."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from sumflow.sim import simulate
from sumflow_bench import calibrate as cal

#: The recorded runs, beside this package.
RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_calibration_reads_the_recorded_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = cal.measurements(RESULTS / "schedulers-omp1-runD")
    systems = {m.system for m in runs}
    assert {"fifo", "p3", "bytescheduler", "prophet", "ddp"} <= systems
    assert all(m.workers == 4 and m.measured_s > 0 for m in runs)
    tuned = [m for m in runs if "tuned" in m.label]
    assert tuned
    assert all(m.scheduling.credit_bytes for m in tuned)
    goodput = cal.measurements(RESULTS / "cluster")
    assert [m.k for m in goodput if m.kind == "goodput"] == [0, 1, 2, 3, 4]
    first = cal.compare(goodput[:1])[0]
    assert first.simulated_s > 0
    assert math.isfinite(first.error)
    table = tmp_path / "calibration.json"
    assert cal.main([str(RESULTS / "cluster"), "--json", str(table)]) == 0
    assert "runs within 10%" in capsys.readouterr().out
    assert len(json.loads(table.read_text())) == len(goodput)


def test_calibration_counts_runs_over_the_cpu_limit_apart() -> None:
    runs = cal.measurements(RESULTS / "grid")
    flagged = [m for m in runs if m.over_cpu_limit]
    # The grid's 4 KiB partitions kept the machine's two cores over the harness's 80%.
    assert flagged
    assert all(m.cpu > m.cpu_limit == 0.8 for m in flagged)
    assert all(m.scheduling.partition_bytes == 4096 for m in flagged[:5])
    # One run each side of the limit, each simulated 20% slow: the summary counts both
    # as misses, and only the one under the limit as a valid run.
    under, over = runs[10], flagged[0]
    assert not under.over_cpu_limit
    rows = [cal.Comparison(m, m.measured_s * 1.2) for m in (under, over)]
    text = cal.markdown(rows)
    assert text.startswith("0 of 2 runs within 10%")
    assert "Of the 1 runs under the harness's CPU limit, 0 within 10%" in text
    rows = [cal.Comparison(under, under.measured_s), cal.Comparison(over, over.measured_s * 2)]
    assert "Of the 1 runs under the harness's CPU limit, 1 within 10%" in cal.markdown(rows)


def test_calibration_measures_the_steady_state_iteration_not_the_drain() -> None:
    # Three iterations of 1.0, 1.2 and 1.1 s, then 0.6 s waiting for the last sums: the
    # window's 3.9 s over 3 iterations is not what the simulator's iteration time means.
    run = {"iteration_s": [1.0, 1.2, 1.1], "iterations_per_s": 3 / 3.9}
    assert cal.iteration_s(run) == pytest.approx(1.1)
    recorded = json.loads((RESULTS / "schedulers-omp1-runD" / "results.json").read_text())
    runs = [r for cell in recorded["training"] for r in cell["runs"]]
    drained = [r for r in runs if r["cross_barrier"]]
    assert drained
    assert all(cal.iteration_s(r) < 1 / r["iterations_per_s"] for r in drained)


def test_a_tuned_run_is_replayed_with_its_starting_partitions_push_window() -> None:
    # The tuner changes the partition size and the credit, never the push window the job
    # began with (4 partitions of the starting size): the calibration must replay that.
    runs = cal.measurements(RESULTS / "fusion-k4")
    (tuned,) = [m for m in runs if m.label.startswith("transformer 1G bytescheduler tuned")]
    assert tuned.scheduling.partition_bytes == 24576
    assert tuned.scheduling.window_bytes == cal.WINDOW_PARTITIONS * 563840
    untuned = [m for m in runs if "tuned" not in m.label and m.system != "ddp"]
    assert untuned
    assert all(m.scheduling.window_bytes is None for m in untuned)
    with_window = cal.compare([tuned])[0].simulated_s
    fixed = replace(tuned, scheduling=replace(tuned.scheduling, window_bytes=None))
    without = cal.compare([fixed])[0].simulated_s
    # Four 24 KiB partitions per server cannot cover a sum's round trip: 20% slower.
    assert without > 1.15 * with_window


def test_a_runs_iteration_to_iteration_variation_is_replayed_as_compute_jitter() -> None:
    run = {"system": "sumflow", "backward_s": [0.09, 0.11, 0.10, 0.10]}
    cv = statistics.pstdev(run["backward_s"]) / statistics.fmean(run["backward_s"])
    assert cal._jitter(run) == pytest.approx(cv)
    # Untimed, timed once, and DDP's (its backward waits for the all-reduce): none.
    assert cal._jitter({"system": "sumflow"}) == 0.0
    assert cal._jitter({"system": "sumflow", "backward_s": [0.1]}) == 0.0
    assert cal._jitter({**run, "system": "ddp-gloo"}) == 0.0
    # A recorded run with timed backward passes is simulated with its jitter, over as
    # many iterations as the benchmark times, and the rounds wait for the slowest worker.
    (m,) = [
        m
        for m in cal.measurements(RESULTS / "calibration-omp1:training")
        if m.label == "transformer 2G prophet k=4"
    ]
    assert m.compute_jitter > 0.1
    cfg = cal.config_for(m)
    assert (cfg.compute_jitter, cfg.iterations) == (m.compute_jitter, cal.MEASURED_ITERATIONS)
    # The emulation's connections share their hosts' links unevenly (BBR's windows).
    assert cfg.network.nic_queue_spread == cal.EMULATION["nic_queue_spread"] > 0
    assert cfg.network.fair_downlinks
    steady = simulate(replace(cfg, compute_jitter=0.0)).iteration_s
    assert simulate(cfg).iteration_s > steady


@pytest.mark.parametrize(
    "sitting",
    [
        ("calibration-omp1", "calibration-tuned-omp1"),
        # Measured again after the emulation's settings were fitted on the first sitting.
        ("holdout-omp1", "holdout-tuned-omp1"),
    ],
)
def test_the_calibration_set_is_simulated_within_ten_percent(sitting: tuple[str, ...]) -> None:
    # Issue 8's target, kept: a change to the simulator or to the emulation's settings
    # that moves any of these runs more than 10% from what the emulated cluster measured
    # fails here (docs/simulator.md, "Calibration").
    ms = [m for name in sitting for m in cal.measurements(RESULTS / name)]
    assert len(ms) == 43
    rows = cal.compare(ms)
    off = [f"{c.measurement.label}: {c.error:+.1%}" for c in rows if abs(c.error) > cal.TARGET]
    assert not off, off


def test_calibration_shows_how_far_apart_repeated_measurements_are() -> None:
    runs = [
        m
        for m in cal.measurements(RESULTS / "transformer-ddp-omp1")
        if m.label.startswith("transformer 1G DDP")
    ]
    assert len(runs) == 3
    rows = [cal.Comparison(m, 1.0) for m in runs]
    text = cal.markdown(rows)
    measured = sorted(m.measured_s for m in runs)
    spread = measured[-1] / measured[0] - 1
    assert "1 configurations measured more than once" in text
    row = f"| transformer 1G DDP/gloo | 3 | {measured[0]:.3f}-{measured[-1]:.3f} | {spread:.1%} |"
    assert row in text
    assert "None of them is under" not in text
    over = [cal.Comparison(replace(m, cpu=0.95), 1.0) for m in runs]
    assert "None of them is under the harness's CPU limit." in cal.markdown(over)


def test_calibration_keeps_one_kind_of_run_when_asked() -> None:
    root = RESULTS / "cluster"
    every = cal.measurements(root)
    goodput = cal.measurements(f"{root}:goodput")
    training = cal.measurements(f"{root}:training")
    assert goodput
    assert training
    assert {m.kind for m in goodput} == {"goodput"}
    assert {m.kind for m in training} == {"training"}
    assert len(goodput) + len(training) == len(every)
    with pytest.raises(ValueError, match="give one of goodput, training"):
        cal.measurements(f"{root}:ddp")


def test_a_runs_backward_wall_time_spreads_its_framework_work_over_the_layers() -> None:
    # A resnet50 run whose backward passes took 30 ms longer than their compute: the
    # replayed profile's backward holds the 30 ms, evenly over the layers with gradients.
    run = {
        "system": "sumflow",
        "profile_arg": "resnet50",
        "size_scale": 0.1,
        "time_scale": 1.0,
        "compute_ms": 300.0,
        "profile_compute_ms": 300.0,
    }
    plain = cal._scaled(run)
    computing = sum(layer.backward_ms for layer in plain.layers)
    timed = cal._scaled({**run, "backward_s": [(computing + 20) / 1e3, (computing + 40) / 1e3]})
    handing = [layer for layer in plain.layers if layer.params]
    assert sum(layer.backward_ms for layer in timed.layers) == pytest.approx(computing + 30)
    for before, after in zip(plain.layers, timed.layers, strict=True):
        extra = 30 / len(handing) if before.params else 0.0
        assert after.backward_ms == pytest.approx(before.backward_ms + extra)
        assert after.forward_ms == before.forward_ms
    # A backward faster than its compute (timer rounding) adds nothing, and DDP's, which
    # also waits for its all-reduce, is not taken as framework work.
    assert cal._scaled({**run, "backward_s": [computing / 2e3]}) == plain
    ddp = {**run, "system": "ddp-gloo", "backward_s": [(computing + 20) / 1e3]}
    assert cal._scaled(ddp) == plain
