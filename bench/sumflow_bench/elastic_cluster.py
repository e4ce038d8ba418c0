"""Elastic training on an emulated cluster: a worker killed, a worker joining, against an
uninterrupted run, and the time each change of membership costs.

    sudo .venv/bin/python -m sumflow_bench.elastic_cluster --rate-mbit 1000 --cpu-servers 2

Builds n worker hosts and k CPU-server hosts (:mod:`sumflow_bench.netns`, every link shaped
to ``--rate-mbit``) and trains ``examples/train_digits_elastic.py`` through ``sumflow-run``'s
cluster form, once per seed in each mode:

- ``uninterrupted``: n workers from start to end;
- ``killed``: n workers, worker w2 kills itself (SIGKILL) at step ``--kill-at-step``; the
  others finish on n - 1;
- ``joined``: n - 1 workers; once the job has trained ``--join-after-epoch`` epochs the
  discovery script lists the n-th host, whose worker joins at the next commit.

Reports each run's final test accuracy and workers, the time from the kill to the
survivors' first step after it (failure detection, the new membership's coordinator and
servers, restoring and syncing the state), and the time from the interruption to the
resumed training as each worker logs it; writes results.json, results.md and elastic.png
to ``--out``.
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

from sumflow_bench.jobs import read_result, report, run_recorded, run_sumflow_job
from sumflow_bench.netns import EmulatedCluster, LinkShape

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits_elastic.py"
MODES = ("uninterrupted", "killed", "joined")
_KILLED = re.compile(r"killing w\d+ at step \d+ at ([0-9.]+)")
_RESUMED = re.compile(r"resumed in epoch \d+ as worker \d+ of \d+, ([0-9.]+) s after")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4, help="worker hosts n [4]")
    p.add_argument("--cpu-servers", type=int, default=2, help="CPU-server hosts k [2]")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="link rate [1000]")
    p.add_argument("--epochs", type=int, default=20, help="digits epochs per run [20]")
    p.add_argument(
        "--pause",
        type=float,
        default=0.05,
        help="seconds each step also sleeps, a stand-in for a larger model's compute, so "
        "that a joining worker's start-up fits in the job [0.05]",
    )
    p.add_argument("--kill-at-step", type=int, default=120, help="killed mode: when [120]")
    p.add_argument("--join-after-epoch", type=int, default=5, help="joined mode: when [5]")
    p.add_argument("--seeds", default="1,2,3", help="one run per seed and mode [1,2,3]")
    p.add_argument("--job-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=Path("bench/results/elastic-cluster"))
    args = p.parse_args(argv)
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds takes integers, e.g. 1,2,3, not {args.seeds!r}")
    if args.workers < 3 or args.cpu_servers < 0 or not args.seed_list:
        p.error("--workers must be at least 3, --cpu-servers at least 0, and a seed given")
    if not 0 < args.join_after_epoch < args.epochs:
        p.error("--join-after-epoch must come before the last epoch")
    return args


def discovery_script(path: Path, log: Path, hosts: list[str], join_after_epoch: int) -> None:
    """Lists all but the last host until the job's log shows the epoch, then all."""
    before = "\n".join(f"{h}:1" for h in hosts[:-1])
    after = "\n".join(f"{h}:1" for h in hosts)
    mark = f"epoch {join_after_epoch:>3}/"
    path.write_text(
        "#!/bin/sh\n"
        f"if grep -q '{mark}' '{log}' 2>/dev/null; then\ncat <<'E'\n{after}\nE\n"
        f"else\ncat <<'E'\n{before}\nE\nfi\n"
    )
    path.chmod(0o755)


def timings(log: Path) -> dict[str, Any]:
    """The kill's time and each worker's resume time, from a run's log."""
    text = log.read_text(errors="replace")
    killed = _KILLED.search(text)
    return {
        "killed_at": float(killed.group(1)) if killed else None,
        "resumed_after": [float(m) for m in _RESUMED.findall(text)],
    }


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
            "kill_at_step": args.kill_at_step,
            "join_after_epoch": args.join_after_epoch,
            "pause": args.pause,
            "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "runs": [],
    }
    shape = LinkShape(args.rate_mbit, mtu=9000)
    total = len(args.seed_list) * len(MODES)

    def jobs() -> None:
        with (
            tempfile.TemporaryDirectory(prefix="sumflow-bench-") as tmpdir,
            EmulatedCluster(n + k, shape, log=sys.stderr) as cl,
        ):
            workers, cpu = cl.hosts[:n], cl.hosts[n:]
            done = 0
            for seed in args.seed_list:
                for mode in MODES:
                    done += 1
                    print(f"[{done}/{total}] {mode}, seed {seed} ...", file=sys.stderr, flush=True)
                    out = Path(tmpdir) / f"{mode}-{seed}.json"
                    log = args.out / "logs" / f"{mode}-{seed}.log"
                    example = [sys.executable, str(EXAMPLE), "--epochs", str(args.epochs)]
                    example += ["--seed", str(seed), "--json", str(out)]
                    example += ["--pause", str(args.pause)]
                    launcher = ["--min-np", str(n - 1)]
                    hosts = workers
                    if mode == "killed":
                        example += ["--kill-worker", "w2", "--kill-at-step", str(args.kill_at_step)]
                    elif mode == "joined":
                        script = Path(tmpdir) / f"discover-{seed}.sh"
                        discovery_script(
                            script, log, [h.address for h in workers], args.join_after_epoch
                        )
                        launcher += ["--host-discovery-script", str(script)]
                        hosts = workers[:-1]
                    run_sumflow_job(
                        cl,
                        hosts,
                        cpu,
                        example,
                        what=f"digits, {mode}, seed {seed}",
                        log_path=log,
                        timeout=args.job_timeout,
                        launcher_args=launcher,
                    )
                    metrics = read_result(out, f"digits, {mode}, seed {seed}")
                    run = {"mode": mode, "seed": seed, **metrics, **timings(log)}
                    if run["killed_at"] is not None and run["changes"]:
                        run["kill_to_step"] = run["changes"][0]["first_step_at"] - run["killed_at"]
                    results["runs"].append(run)

    failed = run_recorded("elastic_cluster", args.out, results, jobs)
    if failed is not None:
        return failed
    return report(args.out, markdown(results), lambda path: plot(results, path), "elastic.png")


def markdown(results: dict[str, Any]) -> str:
    c = results["config"]
    runs = results["runs"]
    lines = [
        f"digits (train_digits_elastic.py), {c['epochs']} epochs, on {c['workers']} worker hosts "
        f"and {c['cpu_servers']} CPU-server hosts, links {c['rate_mbit']:.0f} Mbit/s; killed: "
        f"w2 at step {c['kill_at_step']}; joined: host {c['workers']} listed after epoch "
        f"{c['join_after_epoch']}; each step also sleeps {c['pause']:g} s",
        "",
        "| mode | seed | workers at the end | test accuracy | kill to first step | "
        "interruption to resumed (slowest worker) | job seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        kill = f"{r['kill_to_step']:.2f} s" if "kill_to_step" in r else "-"
        resumed = f"{max(r['resumed_after']):.2f} s" if r["resumed_after"] else "-"
        lines.append(
            f"| {r['mode']} | {r['seed']} | {r['workers']} | {r['accuracy']:.2%} | {kill} | "
            f"{resumed} | {r['seconds']:.1f} |"
        )
    lines += ["", "| mode | mean accuracy | vs uninterrupted |", "|---|---|---|"]
    base = statistics.mean(r["accuracy"] for r in runs if r["mode"] == "uninterrupted")
    for mode in MODES:
        accs = [r["accuracy"] for r in runs if r["mode"] == mode]
        if accs:
            mean = statistics.mean(accs)
            lines.append(f"| {mode} | {mean:.2%} | {100 * (mean - base):+.2f} points |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """Accuracy per run, and the recovery times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for i, mode in enumerate(MODES):
        accs = [100 * r["accuracy"] for r in runs if r["mode"] == mode]
        left.scatter([i] * len(accs), accs, label=mode)
    left.set_xticks(range(len(MODES)), MODES)
    left.set_ylabel("test accuracy (%)")
    left.set_title("final accuracy per run")
    kills = [r["kill_to_step"] for r in runs if "kill_to_step" in r]
    resumed = [
        max(r["resumed_after"]) for r in runs if r["resumed_after"] and r["mode"] == "killed"
    ]
    joins = [max(r["resumed_after"]) for r in runs if r["resumed_after"] and r["mode"] == "joined"]
    labels = ["kill to\nfirst step", "killed:\nresumed", "joined:\nresumed"]
    for i, values in enumerate((kills, resumed, joins)):
        right.scatter([i] * len(values), values)
    right.set_xticks(range(3), labels)
    right.set_ylabel("seconds")
    right.set_title("cost of a change of membership")
    c = results["config"]
    fig.suptitle(
        f"elastic digits, {c['workers']} hosts + {c['cpu_servers']} CPU servers, "
        f"{c['rate_mbit']:.0f} Mbit/s",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
