"""CPU summation servers added to and removed from a running job, against fresh jobs at
each number of servers, on an emulated cluster.

    sudo .venv/bin/python -m sumflow_bench.elastic_servers --rate-mbit 1000 --schedule 2,4,3

Builds n worker hosts and as many CPU-server hosts as the schedule's largest k
(:mod:`sumflow_bench.netns`, every link shaped to ``--rate-mbit``). One elastic job
(``sumflow-run --server-discovery-script``) sums an ``--megabytes`` gradient set round
after round (:mod:`sumflow_bench.elastic_goodput_worker`, sums checked exactly every
round); its discovery script lists the schedule's first k CPU hosts, then, each time rank
0 has finished ``--rounds`` more rounds, the next k's: the workers switch at their next
commit, into a membership with the Eq. 1/2 placement for that k. Then a fresh job at each
k runs ``--rounds`` rounds. Goodput (the set's bytes per second per worker, BytePS
Fig. 12) is the median over a membership's rounds after its first ``--settle``; each
phase of the elastic job is compared with the fresh job at its k and with Eq. 6. Writes
results.json, results.md and elastic-servers.png to ``--out``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sumflow_bench.jobs import report, run_recorded, run_sumflow_job
from sumflow_bench.netns import EmulatedCluster, LinkShape
from sumflow_bench.theory import optimal_time

_ROUND = re.compile(r"ROUND (\d+) epoch (\d+) seconds ([0-9.]+)")
_EPOCH = re.compile(r"epoch (\d+): \d+ workers \(.*\)(?:, (\d+) CPU servers?)?")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4, help="worker hosts n [4]")
    p.add_argument("--schedule", default="2,4,3", help="CPU servers k, phase by phase [2,4,3]")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="link rate [1000]")
    p.add_argument("--megabytes", type=float, default=64.0, help="gradient set [64]")
    p.add_argument("--rounds", type=int, default=12, help="rounds per phase [12]")
    p.add_argument("--settle", type=int, default=2, help="rounds left out per phase [2]")
    p.add_argument("--job-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=Path("bench/results/elastic-servers"))
    args = p.parse_args(argv)
    try:
        args.ks = [int(k) for k in args.schedule.split(",") if k]
    except ValueError:
        p.error(f"--schedule takes integers, e.g. 2,4,3, not {args.schedule!r}")
    if args.workers < 2 or not args.ks or min(args.ks) < 0 or len(args.ks) < 2:
        p.error("--workers must be at least 2 and --schedule list at least 2 values of k >= 0")
    if args.rounds <= args.settle + 2 or args.settle < 0:
        p.error("--rounds must exceed --settle by at least 3")
    return args


def server_script(path: Path, log: Path, hosts: list[str], ks: list[int], rounds: int) -> None:
    """Lists ks[i] CPU hosts once rank 0 has logged round i * rounds - 1 (phase i)."""
    lines = ["#!/bin/sh"]
    for i in range(len(ks) - 1, 0, -1):
        listed = "\n".join(hosts[: ks[i]])
        lines.append(
            f"if grep -q 'ROUND {i * rounds - 1} ' '{log}' 2>/dev/null; then\n"
            f"cat <<'E'\n{listed}\nE\nexit 0\nfi"
        )
    lines.append("cat <<'E'\n" + "\n".join(hosts[: ks[0]]) + "\nE")
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)


def phases(log: Path, settle: int) -> list[dict[str, Any]]:
    """Per membership epoch: its k (from the launcher's line) and its rounds' times."""
    text = log.read_text(errors="replace")
    ks = {int(m.group(1)): int(m.group(2) or 0) for m in _EPOCH.finditer(text)}
    rounds: dict[int, list[float]] = {}
    for m in _ROUND.finditer(text):
        rounds.setdefault(int(m.group(2)), []).append(float(m.group(3)))
    return [
        {"epoch": e, "k": ks.get(e), "rounds": len(ts), "median_s": statistics.median(ts[settle:])}
        for e, ts in sorted(rounds.items())
        if len(ts) > settle
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    n, kmax = args.workers, max(args.ks)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(exist_ok=True)
    nbytes = args.megabytes * 1e6
    rate = args.rate_mbit * 1e6 / 8
    results: dict[str, Any] = {
        "config": {
            "workers": n,
            "schedule": args.ks,
            "rate_mbit": args.rate_mbit,
            "megabytes": args.megabytes,
            "rounds": args.rounds,
            "settle": args.settle,
            "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "elastic": [],
        "fresh": {},
    }
    worker = [sys.executable, "-m", "sumflow_bench.elastic_goodput_worker"]
    worker += ["--megabytes", str(args.megabytes)]

    def jobs() -> None:
        with (
            tempfile.TemporaryDirectory(prefix="sumflow-bench-") as tmpdir,
            EmulatedCluster(n + kmax, LinkShape(args.rate_mbit, mtu=9000), log=sys.stderr) as cl,
        ):
            workers, cpu = cl.hosts[:n], cl.hosts[n:]
            log = args.out / "logs" / "elastic.log"
            script = Path(tmpdir) / "servers.sh"
            server_script(script, log, [h.address for h in cpu], args.ks, args.rounds)
            total = args.rounds * len(args.ks) + args.rounds // 2
            print(f"elastic job, k = {args.schedule} ...", file=sys.stderr, flush=True)
            run_sumflow_job(
                cl,
                workers,
                [],
                [*worker, "--rounds", str(total)],
                what="the elastic job",
                log_path=log,
                timeout=args.job_timeout,
                launcher_args=["--min-np", str(n), "--server-discovery-script", str(script)],
            )
            results["elastic"] = phases(log, args.settle)
            for k in sorted(set(args.ks)):
                print(f"fresh job, k = {k} ...", file=sys.stderr, flush=True)
                fresh_log = args.out / "logs" / f"fresh-k{k}.log"
                run_sumflow_job(
                    cl,
                    workers,
                    cpu[:k],
                    [*worker, "--rounds", str(args.rounds)],
                    what=f"a fresh job at k = {k}",
                    log_path=fresh_log,
                    timeout=args.job_timeout,
                )
                [phase] = phases(fresh_log, args.settle)
                results["fresh"][str(k)] = phase["median_s"]

    failed = run_recorded("elastic_servers", args.out, results, jobs)
    if failed is not None:
        return failed
    for phase in results["elastic"]:
        k = phase["k"]
        phase["goodput_mb_s"] = nbytes / phase["median_s"] / 1e6
        fresh = results["fresh"].get(str(k))
        phase["vs_fresh"] = fresh / phase["median_s"] if fresh else None
        phase["vs_eq6"] = optimal_time(n, k, nbytes, rate) / phase["median_s"]
    return report(
        args.out, markdown(results), lambda path: plot(results, path), "elastic-servers.png"
    )


def markdown(results: dict[str, Any]) -> str:
    c = results["config"]
    lines = [
        f"{c['megabytes']:g} MB summed round after round by {c['workers']} worker hosts, links "
        f"{c['rate_mbit']:.0f} Mbit/s; one elastic job whose CPU servers go "
        f"{' -> '.join(str(k) for k in c['schedule'])}, against a fresh job at each k "
        f"(median round after the first {c['settle']} of each membership)",
        "",
        "| membership | k | rounds | goodput (MB/s per worker) | vs a fresh job at k | vs Eq. 6 |",
        "|---|---|---|---|---|---|",
    ]
    for p in results["elastic"]:
        vs_fresh = f"{p['vs_fresh']:.2f}x" if p["vs_fresh"] else "-"
        lines.append(
            f"| epoch {p['epoch']} | {p['k']} | {p['rounds']} | {p['goodput_mb_s']:.1f} | "
            f"{vs_fresh} | {p['vs_eq6']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """Each membership's goodput next to the fresh job's at its k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = results["config"]
    nbytes = c["megabytes"] * 1e6
    phases_ = results["elastic"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    xs = range(len(phases_))
    ax.bar([x - 0.2 for x in xs], [p["goodput_mb_s"] for p in phases_], 0.4, label="elastic job")
    fresh = [nbytes / results["fresh"][str(p["k"])] / 1e6 for p in phases_]
    ax.bar([x + 0.2 for x in xs], fresh, 0.4, label="fresh job at that k")
    ax.set_xticks(list(xs), [f"epoch {p['epoch']}\nk = {p['k']}" for p in phases_])
    ax.set_ylabel("goodput (MB/s per worker)")
    ax.set_title(
        f"CPU servers changed mid-job, {c['workers']} workers, {c['rate_mbit']:.0f} Mbit/s",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
