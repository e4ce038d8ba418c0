"""The harness's training benchmark: real training loops on sleeping layer-profile models.

The plan (:mod:`sumflow_bench.matrix`) lists the jobs: for every (profile, reference
bandwidth) cell, the scales that keep the real cluster's communication/computation ratio
on the emulated network, then every system on the same hosts, back to back. The standard
run compares DDP with gloo, sumflow on the same machines (k = 0) and sumflow with k = n
CPU-server hosts; ``--schedulers`` compares sumflow's schedulers (issue 6) with DDP.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from sumflow import settings
from sumflow_bench.cpu import CpuSampler
from sumflow_bench.jobs import read_result, run_sumflow_job, run_torch_job
from sumflow_bench.matrix import Cell, Step, cell_scales, estimate_seconds, tuning_space
from sumflow_bench.netns import EmulatedCluster
from sumflow_bench.scaling import EmulationScales


class _Progress(Protocol):
    def step(self, text: str, estimate_s: float = 0.0) -> None: ...


def step_estimates(
    args: argparse.Namespace, steps: Sequence[Step]
) -> tuple[dict[Cell, EmulationScales], list[float]]:
    """Every cell's scales, and every step's estimated seconds (ValueError if a cell cannot
    be scaled: the emulated network is too fast for that profile and bandwidth)."""
    scales: dict[Cell, EmulationScales] = {}
    for step in steps:
        if step.cell not in scales:
            scales[step.cell] = cell_scales(step.cell, args.rate_mbit)
    estimates = [
        estimate_seconds(
            step,
            scales[step.cell],
            workers=args.workers,
            rate_mbit=args.rate_mbit,
            iterations=1 + args.warmup_iterations + args.iterations,
            tune_iterations=args.tune_iterations,
        )
        for step in steps
    ]
    return scales, estimates


def training_runs(
    args: argparse.Namespace,
    cluster: EmulatedCluster,
    sampler: CpuSampler,
    tmp: Path,
    progress: _Progress,
    steps: Sequence[Step],
    cells: list[dict[str, Any]],
) -> None:
    """Runs `steps` in order; appends each cell's results to `cells` as soon as the cell
    is done, and the unfinished cell's when a job fails or the run is stopped (so what was
    measured is kept)."""
    scales, estimates = step_estimates(args, steps)
    current: dict[str, Any] | None = None
    try:
        for step, estimate in zip(steps, estimates, strict=True):
            if current is None or current["cell"] != step.cell:
                if current is not None:
                    cells.append(finish_cell(current))
                current = new_cell(step.cell, scales[step.cell], args)
                print(f"    {current['scaling']}", file=sys.stderr, flush=True)
            progress.step(step.what, estimate)
            result = run_step(args, cluster, sampler, tmp, step, current)
            if step.tune:
                current["tuning"].append(result)
            else:
                current["runs"].append(result)
                print(
                    f"    {step.system.label}: {result['iterations_per_s']:.2f} iterations/s, "
                    f"idle {result['idle_ms']:.0f} ms per iteration",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        # The cell in progress too: what it measured before a failure or an interrupt.
        if current is not None:
            cells.append(finish_cell(current))


def new_cell(cell: Cell, scales: EmulationScales, args: argparse.Namespace) -> dict[str, Any]:
    """A cell's result record before its runs."""
    return {
        "cell": cell,
        "model": cell.model,
        "reference_gbit": cell.reference_gbit,
        "megabytes": scales.param_bytes / 1e6,
        "size_scale": scales.size_scale,
        "time_scale": scales.time_scale,
        "compute_s": scales.compute_s,
        # None: sumflow derives a size from the declaration, as for a user who sets none.
        "partition_bytes": args.train_partition_bytes,
        "scaled_partition_bytes": scales.partition_bytes,
        "bucket_cap_mb": scales.bucket_cap_mb,
        "scaling": scales.reason,
        "runs": [],
        "tuning": [],
    }


def finish_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """The cell's per-system summary (median over repeats) and every run's ratios to DDP
    and to fifo, where the cell has them."""
    del cell["cell"]
    cell["summary"] = summarize(cell["runs"])
    for base in ("ddp", "fifo"):
        if base in cell["summary"]:
            ref = cell["summary"][base]["iterations_per_s"]
            for run in cell["runs"]:
                run[f"vs_{base}"] = run["iterations_per_s"] / ref
    return cell


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system (by name, in run order): median iterations/s over its runs, their
    spread, and the median idle time per iteration."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["name"] for r in runs):
        mine = [r for r in runs if r["name"] == name]
        rates = [r["iterations_per_s"] for r in mine]
        out[name] = {
            "label": mine[0]["label"],
            "runs": len(mine),
            "iterations_per_s": statistics.median(rates),
            "min_iterations_per_s": min(rates),
            "max_iterations_per_s": max(rates),
            "idle_ms": statistics.median(r["idle_ms"] for r in mine),
            "compute_ms": statistics.median(r["compute_ms"] for r in mine),
            "cpu": max((r["cpu"] for r in mine if r.get("cpu") is not None), default=None),
        }
    return out


def worker_argv(args: argparse.Namespace, step: Step, cell: dict[str, Any], out: Path) -> list[str]:
    """The train_worker command line of `step`."""
    system = step.system
    iterations = args.tune_iterations if step.tune else args.iterations
    argv = [
        *(sys.executable, "-m", "sumflow_bench.train_worker", "--profile", step.cell.model),
        *("--size-scale", repr(cell["size_scale"]), "--time-scale", repr(cell["time_scale"])),
        *("--iterations", str(iterations)),
        *("--warmup", "0" if step.tune else str(args.warmup_iterations)),
        *("--system", system.kind, "--json", str(out)),
    ]
    if system.kind == "ddp-gloo":
        return [*argv, "--bucket-cap-mb", repr(cell["bucket_cap_mb"])]
    partition = system.partition_bytes or cell["partition_bytes"]
    if partition is not None:
        argv += ["--partition-bytes", str(partition)]
    if system.fusion:
        # A span as large as a partition (BytePS's 4 MiB scaled where sumflow derives
        # the size): small gradients stop costing a key each, and no span is coarser than
        # what the scheduler already sends.
        threshold = partition or cell["scaled_partition_bytes"]
        argv += ["--fusion-threshold", str(threshold)]
    if system.cross_barrier:
        argv.append("--cross-barrier")
    if system.compression is not None:
        argv += ["--compression", system.compression]
    if system.csc_density is not None:
        argv += ["--csc", repr(system.csc_density)]
    return argv


def tuner_files(args: argparse.Namespace, step: Step) -> tuple[Path, Path]:
    """Where a tuned system's tuner keeps its best configuration (one file per cell and
    system, shared by the tuning run and the measured run) and where `step` logs."""
    folder = args.out / "tuned"
    return folder / f"{step.cell.key}-{step.system.name}.json", folder / f"{step.key}.jsonl"


def sumflow_env(args: argparse.Namespace, step: Step, cell: dict[str, Any]) -> list[str]:
    """``-x NAME=VALUE`` settings of a sumflow job: the user's (``-x``), then the
    scheduler and credit, then for a tuned system the auto-tuner's. Both of its runs tune
    "or reuse a stored result" (``SUMFLOW_AUTOTUNE=1``) with the same file: the tuning run
    starts without one (:func:`run_step` removes it) and tunes, the measured run finds the
    tuning run's best and applies it. The tuner's partition range is its default scaled
    like the tensors."""
    env = list(args.worker_env)
    system = step.system
    if system.scheduler is not None:
        env.append(f"{settings.SCHEDULER.name}={system.scheduler}")
    if system.credit_bytes is not None:
        env.append(f"{settings.CREDIT_BYTES.name}={system.credit_bytes}")
    if system.tuned:
        store, log = tuner_files(args, step)
        low, high = tuning_space(cell["size_scale"])
        env += [
            f"{settings.AUTOTUNE.name}=1",
            f"{settings.AUTOTUNE_FILE.name}={store}",
            f"{settings.AUTOTUNE_LOG.name}={log}",
            f"{settings.AUTOTUNE_PARTITION_BYTES.name}={low}:{high}",
            f"{settings.AUTOTUNE_TRIALS.name}={args.tune_trials}",
            f"{settings.AUTOTUNE_WARMUP_STEPS.name}={args.tune_warmup_steps}",
            f"{settings.AUTOTUNE_MEASURE_STEPS.name}={args.tune_measure_steps}",
        ]
    return [a for item in env for a in ("-x", item)]


def read_tuner_log(path: Path) -> dict[str, Any]:
    """What a tuner's JSON-lines log says: its events in order, the trials (configuration,
    score, why it was tried) and the configuration it finished with or reused."""
    events: list[dict[str, Any]] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    trials = [
        {k: e.get(k) for k in ("trial", "config", "score_s", "reason", "step_s")}
        for e in events
        if e.get("event") == "trial"
    ]
    applied = None
    for e in events:
        if e.get("event") == "finish":
            applied = e["best"]["config"]
        elif e.get("event") == "reuse":
            applied = e["config"]
    return {"events": [e.get("event") for e in events], "trials": trials, "applied": applied}


def run_step(
    args: argparse.Namespace,
    cluster: EmulatedCluster,
    sampler: CpuSampler,
    tmp: Path,
    step: Step,
    cell: dict[str, Any],
) -> dict[str, Any]:
    """Runs one job; returns its result (train_worker's JSON plus the plan's labels)."""
    n = args.workers
    workers, spare = cluster.hosts[:n], cluster.hosts[n:]
    system = step.system
    out = tmp / f"train-{step.key}.json"
    log_path = args.out / "logs" / f"train-{step.key}.log"
    argv = worker_argv(args, step, cell, out)
    store, log = tuner_files(args, step)
    if system.tuned:
        store.parent.mkdir(parents=True, exist_ok=True)
        log.unlink(missing_ok=True)
        if step.tune:
            # A tuning run starts from nothing; with a stale file it would reuse instead.
            store.unlink(missing_ok=True)
    if system.kind == "ddp-gloo":
        run_torch_job(
            cluster,
            workers,
            argv,
            what=step.what,
            log_path=log_path,
            timeout=args.job_timeout,
            per_host=args.workers_per_host,
        )
    else:
        run_sumflow_job(
            cluster,
            workers,
            spare[: system.k],
            argv,
            what=step.what,
            log_path=log_path,
            timeout=args.job_timeout,
            per_host=args.workers_per_host,
            launcher_args=sumflow_env(args, step, cell),
        )
    run = read_result(out, step.what)
    run.update(name=system.name, label=system.label, k=system.k, repeat=step.repeat)
    run["cpu"] = sampler.utilisation(*run["window"])
    if system.tuned:
        run["tuner"] = {"store": str(store), "log": str(log), **read_tuner_log(log)}
    if step.tune:
        # What the tuner tried is in the log; the result keeps only its summary.
        for key in ("iteration_s", "compute_s", "idle_s", "update_s", "backward_s", "per_rank"):
            run.pop(key, None)
    run["finished"] = time.strftime("%H:%M:%S")
    return run
