"""Fused against unfused gradients on loopback (GradientFlow's lazy allreduce, issue 7).

    python -m sumflow_bench.fusion --out bench/results/fusion-resnet50

Trains the sleeping model of a profile (ResNet-50 by default: 161 gradient tensors, most of
them batch-norm vectors of a few KB) with no compute (``--time-scale 0``), so an iteration
is the push_pull of every gradient plus the local SGD update, on one machine over
loopback: ``sumflow-run -np 4 --machine-per-worker`` (a colocated summation server per
worker, as the recorded runs had). Each
``--thresholds`` value (theta in bytes, 0 = unfused) is one job; the jobs run round after
round, interleaved, so drift on this shared machine hits every theta alike. Reported per
theta: the median iteration, its communication part (iteration less the local update,
nothing else runs), and the ratio of unfused to fused, per round and over rounds.
Results go to OUT/results.json, OUT/results.md and OUT/fusion.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sumflow import profiles
from sumflow.tune.space import format_bytes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docs)."""
    p = argparse.ArgumentParser(
        prog="python -m sumflow_bench.fusion", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument("--profile", default="resnet50", help="built-in profile or JSON [resnet50]")
    p.add_argument("--size-scale", type=float, default=1.0, help="tensor size factor [1]")
    p.add_argument("--workers", type=int, default=4, help="worker processes [4]")
    p.add_argument(
        "--thresholds",
        default="0,4194304",
        help="theta values in bytes, comma-separated; 0 is unfused [0,4194304]",
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds [3]")
    p.add_argument("--iterations", type=int, default=10, help="timed iterations per job [10]")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per job [3]")
    p.add_argument("--job-timeout", type=float, default=600.0, help="seconds per job [600]")
    p.add_argument("--out", type=Path, required=True, help="results directory")
    args = p.parse_args(argv)
    try:
        args.theta = [int(t) for t in args.thresholds.split(",") if t.strip()]
    except ValueError:
        p.error(f"--thresholds must be whole numbers of bytes, got {args.thresholds!r}")
    if 0 not in args.theta or len(args.theta) < 2 or min(args.theta) < 0:
        p.error("--thresholds needs 0 (unfused) and at least one theta > 0")
    if len(set(args.theta)) != len(args.theta):
        p.error("--thresholds repeats a value")
    if args.rounds < 1 or args.iterations < 1 or args.warmup < 0 or args.workers < 2:
        p.error("--rounds, --iterations >= 1, --warmup >= 0, --workers >= 2")
    return args


def spans_of(profile: profiles.ModelProfile, theta: int) -> int:
    """How many push_pulls a step sends with `theta` (tensors in backward order)."""
    from sumflow.torch.fusion import plan_spans

    sizes = [t.nbytes for layer in reversed(profile.layers) for t in reversed(layer.params)]
    return len(plan_spans(sizes, theta)) if theta else len(sizes)


def run_job(args: argparse.Namespace, theta: int, out: Path, log: Path) -> dict[str, Any]:
    """One job of `args.workers` workers with fusion threshold `theta`; its result."""
    cmd = [
        "sumflow-run",
        "-np",
        str(args.workers),
        "--machine-per-worker",
        "--",
        sys.executable,
        "-m",
        "sumflow_bench.train_worker",
        "--system",
        "sumflow",
        "--profile",
        args.profile,
        "--size-scale",
        repr(args.size_scale),
        "--time-scale",
        "0",
        "--fusion-threshold",
        str(theta),
        "--warmup",
        str(args.warmup),
        "--iterations",
        str(args.iterations),
        "--progress-every",
        str(args.iterations + args.warmup + 1),
        "--json",
        str(out),
    ]
    with log.open("w") as f:
        try:
            done = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.job_timeout, check=False
            )
        except subprocess.TimeoutExpired:
            raise SystemExit(
                f"fusion bench: the job with theta {theta} took over {args.job_timeout:g} s; "
                f"see {log}"
            ) from None
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(
            f"fusion bench: the job with theta {theta} exited {done.returncode}; "
            f"last lines of {log}:\n{tail}"
        )
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def summarize(
    runs: list[dict[str, Any]], thetas: list[int], profile: profiles.ModelProfile
) -> dict[str, Any]:
    """Per theta: medians over rounds; per round and overall: unfused / fused ratios."""
    per_theta = {}
    for theta in thetas:
        mine = [r for r in runs if r["theta"] == theta]
        per_theta[str(theta)] = {
            "push_pulls_per_step": spans_of(profile, theta),
            "iteration_ms": statistics.median(r["iteration_ms"] for r in mine),
            "communication_ms": statistics.median(r["communication_ms"] for r in mine),
            "communication_ms_range": [
                min(r["communication_ms"] for r in mine),
                max(r["communication_ms"] for r in mine),
            ],
        }
    rounds = sorted({r["round"] for r in runs})
    # Keyed by str(theta), as they read back from JSON.
    ratios: dict[str, list[float]] = {}
    for theta in thetas:
        if theta == 0:
            continue
        ratios[str(theta)] = []
        for rnd in rounds:
            base = next(r for r in runs if r["round"] == rnd and r["theta"] == 0)
            fused = next(r for r in runs if r["round"] == rnd and r["theta"] == theta)
            ratios[str(theta)].append(base["communication_ms"] / fused["communication_ms"])
    return {
        "per_theta": per_theta,
        "speedup_per_round": ratios,
        "speedup": {t: statistics.median(v) for t, v in ratios.items()},
    }


def markdown(results: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    s = results["summary"]
    lines = [
        f"{results['profile']} ({results['tensors']} tensors, "
        f"{results['param_bytes'] / 1e6:.1f} MB), {results['workers']} workers on loopback, "
        f"{results['rounds']} interleaved rounds of {results['iterations']} iterations; "
        "communication = iteration - local SGD update (nothing is computed).",
        "",
        "| theta | push_pulls per step | iteration (ms) | communication (ms, range) "
        "| unfused / fused (per round) |",
        "|---|---|---|---|---|",
    ]
    for key, row in s["per_theta"].items():
        lo, hi = row["communication_ms_range"]
        if key != "0":
            per_round = ", ".join(f"{x:.2f}" for x in s["speedup_per_round"][key])
            ratio = f"**{s['speedup'][key]:.2f}x** ({per_round})"
        else:
            ratio = "1"
        name = format_bytes(int(key)) if key != "0" else "0 (unfused)"
        lines.append(
            f"| {name} | {row['push_pulls_per_step']} | {row['iteration_ms']:.1f} "
            f"| {row['communication_ms']:.1f} ({lo:.1f}-{hi:.1f}) | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """Communication time per theta, each round's value as a dot over the median bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_theta = results["summary"]["per_theta"]
    thetas = [int(t) for t in per_theta]
    labels = [format_bytes(t) if t else "unfused" for t in thetas]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, [per_theta[str(t)]["communication_ms"] for t in thetas], color="#4c72b0")
    for i, t in enumerate(thetas):
        ys = [r["communication_ms"] for r in results["runs"] if r["theta"] == t]
        ax.scatter([i] * len(ys), ys, color="black", s=12, zorder=3)
    ax.set_ylabel("communication per iteration (ms)")
    ax.set_xlabel("fusion threshold theta")
    ax.set_title(
        f"{results['profile']}: {results['tensors']} gradients, "
        f"{results['workers']} workers, loopback"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    profile = profiles.load(args.profile)
    if args.size_scale != 1.0:
        profile = profiles.scale(profile, size_scale=args.size_scale, time_scale=0.0)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(exist_ok=True)
    runs: list[dict[str, Any]] = []
    jobs = args.rounds * len(args.theta)
    started = time.monotonic()
    for rnd in range(args.rounds):
        for theta in args.theta:
            done = len(runs)
            eta = (time.monotonic() - started) / done * (jobs - done) if done else None
            left = f", about {eta / 60:.0f} min left" if eta is not None else ""
            print(
                f"[{done + 1}/{jobs}{left}] round {rnd + 1}: theta {theta} "
                f"({spans_of(profile, theta)} push_pulls per step)",
                file=sys.stderr,
                flush=True,
            )
            key = f"theta{theta}-r{rnd}"
            res = run_job(
                args, theta, args.out / "logs" / f"{key}.json", args.out / "logs" / f"{key}.log"
            )
            iteration = res["iteration_median_s"] * 1e3
            runs.append(
                {
                    "round": rnd,
                    "theta": theta,
                    "iteration_ms": iteration,
                    "update_ms": res["update_ms"],
                    "communication_ms": iteration - res["update_ms"],
                }
            )
    results = {
        "profile": profile.name,
        "tensors": profile.num_tensors,
        "param_bytes": profile.param_bytes,
        "size_scale": args.size_scale,
        "workers": args.workers,
        "rounds": args.rounds,
        "iterations": args.iterations,
        "command": " ".join(["python -m sumflow_bench.fusion", *(argv or sys.argv[1:])]),
        "runs": runs,
    }
    results["summary"] = summarize(runs, args.theta, profile)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    (args.out / "results.md").write_text(text)
    plot(results, args.out / "fusion.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
