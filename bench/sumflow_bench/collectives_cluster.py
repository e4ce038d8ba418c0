"""sumflow's allgather, reducescatter and alltoall against gloo on an emulated cluster.

    sudo .venv/bin/python -m sumflow_bench.collectives_cluster --rate-mbit 1000 --cpu-servers 0,4

Builds n worker hosts and up to max(k) CPU-server hosts (:mod:`sumflow_bench.netns`, every
link shaped to ``--rate-mbit``), then runs one job per k: :mod:`sumflow_bench.
collectives_vs_gloo` on every worker host, with a colocated summation server on each and
k CPU servers, gloo's process group on the same hosts, rounds of the two alternating (so
both see the same machine). Prints, and writes to ``--out`` (results.json, results.md,
collectives.png), each operation's median round and sumflow's speed as a ratio of gloo's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sumflow_bench.jobs import read_result, report, run_recorded, run_sumflow_job
from sumflow_bench.netns import EmulatedCluster, LinkShape

OPS = ("allgather", "reducescatter", "alltoall")
GLOO_PORT = 29517


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4, help="worker hosts n [4]")
    p.add_argument(
        "--workers-per-host",
        type=int,
        default=1,
        help="workers on each worker host G, as GPUs of one machine [1]",
    )
    p.add_argument("--cpu-servers", default="0,4", help="values of k to run, comma-separated [0,4]")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="link rate [1000]")
    p.add_argument("--megabytes", type=float, default=64.0, help="the set per worker [64]")
    p.add_argument("--reps", type=int, default=5, help="measured rounds of each [5]")
    p.add_argument(
        "--partition-bytes",
        type=int,
        help="sumflow's partition size (default: sumflow's own, as a user runs it)",
    )
    p.add_argument("--job-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=Path("bench/results/collectives-cluster"))
    args = p.parse_args(argv)
    try:
        args.ks = [int(k) for k in args.cpu_servers.split(",")]
    except ValueError:
        p.error(f"--cpu-servers takes integers, e.g. 0,4, not {args.cpu_servers!r}")
    if args.workers < 2 or any(k < 0 for k in args.ks):
        p.error("--workers must be at least 2 and every k at least 0")
    if args.workers_per_host < 1:
        p.error("--workers-per-host must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    n = args.workers
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(exist_ok=True)
    results: dict[str, Any] = {
        "config": {
            "workers": n,
            "workers_per_host": args.workers_per_host,
            "cpu_servers": args.ks,
            "rate_mbit": args.rate_mbit,
            "megabytes": args.megabytes,
            "reps": args.reps,
            "partition_bytes": args.partition_bytes,
            "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "runs": [],
    }
    # Jumbo frames, as GPU clusters use: per-packet costs are CPU time this machine lacks.
    shape = LinkShape(args.rate_mbit, mtu=9000)

    def jobs() -> None:
        with (
            tempfile.TemporaryDirectory(prefix="sumflow-bench-") as tmpdir,
            EmulatedCluster(n + max(args.ks), shape, log=sys.stderr) as cl,
        ):
            workers, spare = cl.hosts[:n], cl.hosts[n:]
            for k in args.ks:
                print(
                    f"[{k=}] sumflow and gloo on {n} hosts x {args.workers_per_host} workers ...",
                    file=sys.stderr,
                    flush=True,
                )
                out = Path(tmpdir) / f"k{k}.json"
                run_sumflow_job(
                    cl,
                    workers,
                    spare[:k],
                    [
                        *(sys.executable, "-m", "sumflow_bench.collectives_vs_gloo"),
                        *("--megabytes", str(args.megabytes), "--reps", str(args.reps)),
                        *("--json", str(out)),
                    ],
                    what=f"collectives k={k}",
                    log_path=args.out / "logs" / f"k{k}.log",
                    timeout=args.job_timeout,
                    per_host=args.workers_per_host,
                    launcher_args=[
                        *("-x", f"MASTER_ADDR={workers[0].address}"),
                        *("-x", f"MASTER_PORT={GLOO_PORT}"),
                        *("-x", "GLOO_SOCKET_IFNAME=eth0"),
                        *(
                            ("--partition-bytes", str(args.partition_bytes))
                            if args.partition_bytes
                            else ()
                        ),
                    ],
                )
                run = read_result(out, f"collectives k={k}")
                results["runs"].append({"k": k, **run["results"]})

    failed = run_recorded("collectives_cluster", args.out, results, jobs)
    if failed is not None:
        return failed
    return report(args.out, markdown(results), lambda path: plot(results, path), "collectives.png")


def markdown(results: dict[str, Any]) -> str:
    c = results["config"]
    lines = [
        f"{c['workers']} worker hosts x {c.get('workers_per_host', 1)} workers, links "
        f"{c['rate_mbit']:.0f} Mbit/s, "
        f"{c['megabytes']:.0f} MB per worker, median of {c['reps']} rounds, partitions "
        f"{c['partition_bytes'] or 'by default'}",
        "",
        "| k | operation | sumflow ms | gloo ms | sumflow/gloo speed |",
        "|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        for op in OPS:
            r = run[op]
            lines.append(
                f"| {run['k']} | {op} | {r['sumflow_s'] * 1e3:.0f} | {r['gloo_s'] * 1e3:.0f} | "
                f"{r['ratio']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """sumflow's speed as a ratio of gloo's, per operation, one bar per k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        xs = [j + i * width for j in range(len(OPS))]
        ax.bar(xs, [run[op]["ratio"] for op in OPS], width, label=f"k = {run['k']}")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(OPS))], OPS)
    ax.set_ylabel("sumflow speed / gloo's")
    c = results["config"]
    ax.set_title(
        f"{c['workers']} hosts x {c.get('workers_per_host', 1)} workers, "
        f"{c['rate_mbit']:.0f} Mbit/s links"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
