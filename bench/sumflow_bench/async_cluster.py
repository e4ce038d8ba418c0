"""Asynchronous against synchronous training on an emulated cluster, one worker slowed.

    sudo .venv/bin/python -m sumflow_bench.async_cluster --rate-mbit 1000 --cpu-servers 2

Builds n worker hosts and k CPU-server hosts (:mod:`sumflow_bench.netns`, every link shaped
to ``--rate-mbit``), then trains ``examples/train_digits.py`` through ``sumflow-run`` in its
cluster form, ``--repeats`` times each: synchronously (``DistributedOptimizer``, the
default) and asynchronously (``AsyncOptimizer``, BytePS §4.3), unbounded and under each
``--staleness`` bound, with worker ``--slow-rank`` made ``--slow-factor`` times slower (it
sleeps after each step). Reports each worker's steps per second in its own steps (the
waits at epoch ends left out), the fast workers' against synchronous training's, and the
test accuracy; writes results.json, results.md and async.png to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sumflow_bench.jobs import read_result, report, run_recorded, run_sumflow_job
from sumflow_bench.netns import EmulatedCluster, LinkShape

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4, help="worker hosts n [4]")
    p.add_argument("--cpu-servers", type=int, default=2, help="CPU-server hosts k [2]")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="link rate [1000]")
    p.add_argument("--epochs", type=int, default=20, help="digits epochs per run [20]")
    p.add_argument("--slow-rank", type=int, default=1, help="the slowed worker [1]")
    p.add_argument("--slow-factor", type=float, default=2.0, help="how much slower [2]")
    p.add_argument(
        "--staleness", default="2", help="bounds to run besides unbounded, comma-separated [2]"
    )
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode [2]")
    p.add_argument("--job-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=Path("bench/results/async-cluster"))
    args = p.parse_args(argv)
    try:
        bounds = [int(s) for s in args.staleness.split(",") if s]
    except ValueError:
        p.error(f"--staleness takes integers, e.g. 0,2, not {args.staleness!r}")
    args.modes = [("sync", None), ("async", None), *(("async", s) for s in bounds)]
    if args.workers < 2 or args.cpu_servers < 0 or args.repeats < 1:
        p.error("--workers must be at least 2, --cpu-servers at least 0, --repeats at least 1")
    if not 0 <= args.slow_rank < args.workers or args.slow_factor < 1:
        p.error("--slow-rank must be a worker and --slow-factor at least 1")
    return args


def label(mode: str, staleness: int | None) -> str:
    if mode == "sync":
        return "synchronous"
    return "asynchronous" if staleness is None else f"asynchronous, staleness {staleness}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    n, k = args.workers, args.cpu_servers
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(exist_ok=True)
    results: dict[str, Any] = {
        "config": {
            "workers": n,
            "cpu_servers": k,
            "rate_mbit": args.rate_mbit,
            "epochs": args.epochs,
            "slow_rank": args.slow_rank,
            "slow_factor": args.slow_factor,
            "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "runs": [],
    }
    shape = LinkShape(args.rate_mbit, mtu=9000)
    total = args.repeats * len(args.modes)

    def jobs() -> None:
        with (
            tempfile.TemporaryDirectory(prefix="sumflow-bench-") as tmpdir,
            EmulatedCluster(n + k, shape, log=sys.stderr) as cl,
        ):
            workers, cpu = cl.hosts[:n], cl.hosts[n:]
            done = 0
            for repeat in range(args.repeats):
                # Modes alternate within a repeat, so each sees the machine alike.
                for mode, staleness in args.modes:
                    done += 1
                    name = label(mode, staleness)
                    print(f"[{done}/{total}] {name} ...", file=sys.stderr, flush=True)
                    out = Path(tmpdir) / f"{mode}-{staleness}-{repeat}.json"
                    flags = [] if mode == "sync" else ["--asynchronous"]
                    if staleness is not None:
                        flags += ["--staleness", str(staleness)]
                    run_sumflow_job(
                        cl,
                        workers,
                        cpu,
                        [
                            *(sys.executable, str(EXAMPLE), "--epochs", str(args.epochs)),
                            *("--slow-rank", str(args.slow_rank)),
                            *("--slow-factor", str(args.slow_factor)),
                            *flags,
                            *("--json", str(out)),
                        ],
                        what=f"digits, {name}",
                        log_path=args.out / "logs" / f"{mode}-{staleness}-{repeat}.log",
                        timeout=args.job_timeout,
                    )
                    metrics = read_result(out, f"digits, {name}")
                    results["runs"].append(
                        {"mode": mode, "staleness": staleness, "repeat": repeat, **metrics}
                    )

    failed = run_recorded("async_cluster", args.out, results, jobs)
    if failed is not None:
        return failed
    return report(args.out, markdown(results), lambda path: plot(results, path), "async.png")


def fast_rate(run: dict[str, Any], slow: int) -> float:
    """The median steps per second of the workers not slowed."""
    rates: list[float] = run["steps_per_s_by_rank"]
    return statistics.median(r for i, r in enumerate(rates) if i != slow)


def markdown(results: dict[str, Any]) -> str:
    c = results["config"]
    slow = c["slow_rank"]
    sync = [fast_rate(r, slow) for r in results["runs"] if r["mode"] == "sync"]
    reference = statistics.median(sync)
    lines = [
        f"digits on {c['workers']} worker hosts and {c['cpu_servers']} CPU-server hosts, "
        f"links {c['rate_mbit']:.0f} Mbit/s, {c['epochs']} epochs; worker {slow} "
        f"{c['slow_factor']:g}x slower",
        "",
        "| training | run | steps/s by rank | fast workers vs synchronous | test accuracy |",
        "|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        rates = ", ".join(f"{v:.0f}" for v in r["steps_per_s_by_rank"])
        lines.append(
            f"| {label(r['mode'], r['staleness'])} | {r['repeat'] + 1} | {rates} | "
            f"{fast_rate(r, slow) / reference:.2f}x | {r['accuracy']:.2%} |"
        )
    return "\n".join(lines) + "\n"


def short(run: dict[str, Any]) -> str:
    """A run's mode for the plot's axis."""
    if run["mode"] == "sync":
        return "sync"
    return "async" if run["staleness"] is None else f"async s={run['staleness']}"


def plot(results: dict[str, Any], path: Path) -> None:
    """Each run's steps per second by rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    workers = results["config"]["workers"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / workers
    for w in range(workers):
        xs = [i + w * width for i in range(len(runs))]
        ax.bar(xs, [r["steps_per_s_by_rank"][w] for r in runs], width, label=f"worker {w}")
    ax.set_xticks(
        [i + width * (workers - 1) / 2 for i in range(len(runs))],
        [short(r) for r in runs],
        fontsize=8,
    )
    ax.set_ylabel("steps per second (own steps)")
    c = results["config"]
    ax.set_title(
        f"digits, {c['workers']} hosts + {c['cpu_servers']} CPU servers, "
        f"worker {c['slow_rank']} {c['slow_factor']:g}x slower"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
