"""The emulated-cluster benchmark: what the papers measure, on one Linux machine.

    sudo python -m sumflow_bench.cluster            # n = 4, k = 0..4, three models

Builds an emulated cluster (:mod:`sumflow_bench.netns`: n worker hosts and up to k CPU
hosts, every link shaped to the same rate), then, side by side in one invocation:

1. a link check: iperf3 between two hosts in both directions at once, whose goodput is the
   B of the theory lines;
2. goodput (BytePS Fig. 12): sumflow push_pull for every k, gloo all_reduce once (it cannot
   use CPU hosts), against Eq. 6's optimum and Table 1's formulas;
3. training on scaled layer profiles (:mod:`sumflow.profiles`): sumflow's
   DistributedOptimizer (k = 0, and k = n) against DDP with gloo, in iterations/s; or,
   with ``--schedulers``, issue 6's comparison of sumflow's schedulers with DDP over
   profiles x ``--reference-gbits`` (:mod:`sumflow_bench.matrix`), or, with ``--grid``,
   bytescheduler over a grid of partition sizes x credits (:mod:`sumflow_bench.grid`).

Every run records the machine's CPU utilisation over its measured window and is flagged
when it passed ``--cpu-flag``: then the 2 CPUs, not the emulated network, may have set the
pace. Results go to ``--out``: results.json, results.md, the plots (goodput.png,
training.png or schedulers.png and idle.png) and a log per job. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sumflow import settings
from sumflow.tune.space import SearchSpace
from sumflow_bench import grid, matrix, report, schedreport, theory
from sumflow_bench.cpu import CpuSampler
from sumflow_bench.jobs import read_result, run_harness, run_sumflow_job, run_torch_job
from sumflow_bench.netns import (
    DEFAULT_SUBNET,
    ClusterError,
    ClusterUnavailable,
    EmulatedCluster,
    LinkShape,
    started,
)
from sumflow_bench.training import step_estimates, training_runs

GBIT = 1e9 / 8
IPERF_PORT = 5201


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sumflow_bench.cluster",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    net = p.add_argument_group("emulated network")
    net.add_argument("--workers", type=int, default=4, help="worker hosts n")
    net.add_argument(
        "--workers-per-host",
        type=int,
        default=1,
        help="worker processes G on each worker host (as one per GPU), for goodput and "
        "training; gloo's ring (and DDP) then spans all n x G of them, and sumflow aggregates "
        "inside each host first",
    )
    net.add_argument(
        "--cpu-servers",
        default="0,1,2,3,4",
        help="values of k (CPU-server hosts) to run, comma-separated",
    )
    net.add_argument("--rate-mbit", type=float, default=250.0, help="link rate B per direction")
    net.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per link (netem)")
    net.add_argument(
        "--mtu", type=int, default=9000, help="link MTU (jumbo frames, as in GPU clusters)"
    )
    net.add_argument("--subnet", default=DEFAULT_SUBNET, help="private subnet of the hosts")
    gp = p.add_argument_group("goodput")
    gp.add_argument("--megabytes", type=float, default=32.0, help="gradient set per round")
    gp.add_argument("--tensors", type=int, default=8, help="tensors in the set")
    gp.add_argument(
        "--goodput-model",
        help="sum a layer profile's parameter tensors instead of --megabytes/--tensors "
        "(e.g. resnet50: 161 tensors, 102 MB)",
    )
    gp.add_argument("--rounds", type=int, default=5, help="measured rounds per run")
    gp.add_argument("--warmup", type=int, default=2, help="rounds before measuring")
    gp.add_argument(
        "--partition-bytes",
        type=int,
        help="sumflow's partition size for goodput (default: sumflow's own, derived from "
        "the tensor set and the servers, as a user gets it)",
    )
    gp.add_argument(
        "-x",
        "--worker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a variable for sumflow's workers, goodput and training (repeatable), e.g. "
        "SUMFLOW_CPU_SERVER_CONNECTIONS=1 to compare with one connection per server",
    )
    tr = p.add_argument_group("training")
    tr.add_argument(
        "--models", default="vgg16,resnet50,transformer", help="layer profiles ('' skips)"
    )
    tr.add_argument(
        "--reference-gbits",
        "--reference-gbit",
        default="10",
        help="bandwidths of the real clusters whose communication/computation ratio is kept, "
        "comma-separated, in run order (each profile is one cell per bandwidth)",
    )
    tr.add_argument(
        "--train-partition-bytes",
        type=int,
        help="sumflow's partition size for training (default: sumflow's own, derived from "
        "each declaration as for a user who sets none; BytePS's 4 MiB scaled like the "
        "tensors is the cell's scaled_partition_bytes in results.json)",
    )
    tr.add_argument("--iterations", type=int, default=15, help="measured iterations per run")
    tr.add_argument("--warmup-iterations", type=int, default=3, help="iterations before measuring")
    sc = p.add_argument_group("scheduler benchmark (issue 6)")
    sc.add_argument(
        "--schedulers",
        help="compare these systems instead of the standard training runs, comma-separated "
        f"from {','.join(matrix.SCHEDULER_SYSTEMS)} (sumflow's schedulers cross the global "
        "barrier; bytescheduler-tuned is a tuning run, then a run reusing its best "
        "configuration; ddp is DDP over gloo)",
    )
    sc.add_argument(
        "--scheduler-k",
        type=int,
        default=0,
        help="CPU-server hosts for sumflow in the scheduler benchmark (0: the same machines as "
        "DDP)",
    )
    sc.add_argument(
        "--tune-trials",
        type=int,
        default=10,
        help="trials of a tuning run (SUMFLOW_AUTOTUNE_TRIALS), its starting configuration "
        "included",
    )
    sc.add_argument(
        "--tune-warmup-steps",
        type=int,
        default=2,
        help="steps after each switch of configuration before measuring "
        "(SUMFLOW_AUTOTUNE_WARMUP_STEPS)",
    )
    sc.add_argument(
        "--tune-measure-steps",
        type=int,
        default=5,
        help="steps measured per trial (SUMFLOW_AUTOTUNE_MEASURE_STEPS)",
    )
    sc.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of a cell's systems (interleaved), to see the noise; tables show medians",
    )
    gr = p.add_argument_group("grid search of bytescheduler's partition size x credit")
    gr.add_argument(
        "--grid",
        type=Path,
        metavar="GRID.json",
        help="instead of the training comparison, measure bytescheduler (with --scheduler-k "
        "CPU-server hosts) on --grid-model at the lowest --reference-gbits over a "
        "log-spaced grid of partition sizes x credits across the tuner's search space "
        "(scaled) and write GRID.json (for python -m sumflow_bench.tune_compare); --iterations "
        "per point",
    )
    gr.add_argument("--grid-model", default="vgg16", help="the grid's layer profile")
    gr.add_argument("--grid-partitions", type=int, default=6, help="partition sizes in the grid")
    gr.add_argument("--grid-credits", type=int, default=5, help="credits in the grid")
    out = p.add_argument_group("output")
    out.add_argument(
        "--out", type=Path, default=Path("bench/results/cluster"), help="output folder"
    )
    out.add_argument(
        "--cpu-flag", type=float, default=0.8, help="flag runs above this CPU utilisation"
    )
    out.add_argument("--job-timeout", type=float, default=300.0, help="seconds one job may take")
    out.add_argument("--skip-goodput", action="store_true", help="run only the training part")
    out.add_argument("--link-seconds", type=float, default=3.0, help="iperf3 duration")
    args = p.parse_args(argv)
    try:
        args.ks = sorted({int(k) for k in args.cpu_servers.split(",") if k.strip()})
    except ValueError:
        p.error(f"--cpu-servers {args.cpu_servers!r}: give comma-separated integers")
    try:
        args.models = matrix.parse_list(args.models, "--models")
        args.gbits = matrix.parse_gbits(args.reference_gbits)
        args.scheduler_names = (
            matrix.parse_schedulers(args.schedulers) if args.schedulers is not None else None
        )
    except ValueError as e:
        p.error(str(e))
    if args.workers_per_host < 1:
        p.error("--workers-per-host must be at least 1")
    if args.workers < 2:
        p.error("--workers must be at least 2")
    if any(k < 0 for k in args.ks) or not args.ks:
        p.error("--cpu-servers needs values >= 0")
    if args.rounds < 1 or args.iterations < 1:
        p.error("--rounds and --iterations must be at least 1")
    if args.warmup_iterations < 0:
        p.error("--warmup-iterations must be at least 0")
    if min(args.tune_trials, args.tune_measure_steps, args.repeats) < 1:
        p.error("--tune-trials, --tune-measure-steps and --repeats must be at least 1")
    if args.tune_warmup_steps < 0:
        p.error("--tune-warmup-steps must be at least 0")
    args.tune_iterations = matrix.tune_iterations(
        args.tune_trials, args.tune_warmup_steps, args.tune_measure_steps
    )
    if args.scheduler_k < 0:
        p.error("--scheduler-k must be at least 0")
    if args.scheduler_names is not None and not args.models:
        p.error("--schedulers needs at least one profile in --models")
    if args.grid is not None and args.scheduler_names is not None:
        p.error("--grid and --schedulers are separate runs: give one")
    if args.grid_partitions < 1 or args.grid_credits < 1:
        p.error("--grid-partitions and --grid-credits must be at least 1")
    # A host's NIC here is a veth, which reports 10 Gbit/s whatever tc shapes it to: the
    # workers are told the shaped rate, as a real NIC of that speed would tell them (the
    # derived partition size's link floor and its log line read it). -x overrides it.
    link = settings.LINK_GBITS.name
    if not any(item.startswith(f"{link}=") for item in args.worker_env):
        args.worker_env.append(f"{link}={args.rate_mbit / 1000:g}")
    return args


class Progress:
    """Numbered steps on stderr with the elapsed time and, for steps given an estimate,
    the time left: the estimates still to run, rescaled by how long the estimated steps
    done so far took against their estimates."""

    def __init__(self, total: int, estimate_s: float = 0.0) -> None:
        self.total, self.done, self.start = total, 0, time.monotonic()
        self.left_s = estimate_s
        self.estimated_done_s = 0.0
        self.took_s = 0.0
        self._current: tuple[float, float] | None = None

    def step(self, text: str, estimate_s: float = 0.0) -> None:
        now = time.monotonic()
        if self._current is not None:
            estimated, started = self._current
            self.estimated_done_s += estimated
            self.took_s += now - started
        self._current = (estimate_s, now) if estimate_s > 0 else None
        self.done += 1
        eta = ""
        if estimate_s > 0 or self.left_s > 0:
            pace = self.took_s / self.estimated_done_s if self.estimated_done_s else 1.0
            eta = f", about {duration(self.left_s * pace)} left"
            self.left_s = max(0.0, self.left_s - estimate_s)
        elapsed = now - self.start
        print(
            f"[{self.done}/{self.total} {elapsed:5.0f} s{eta}] {text}", file=sys.stderr, flush=True
        )


def duration(seconds: float) -> str:
    """``95 s``, ``12 min``: seconds below two minutes, minutes above."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def link_check(cluster: EmulatedCluster, seconds: float) -> dict[str, Any]:
    """iperf3 between hosts 1 and 2, both directions at once."""
    if shutil.which("iperf3") is None:
        raise ClusterUnavailable("the link check needs iperf3: apt install iperf3")
    a, b = cluster.hosts[0], cluster.hosts[1]
    server = ["iperf3", "-s", "-1", "-B", b.address, "-p", str(IPERF_PORT)]
    with started(cluster, b, server, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
        time.sleep(0.5)
        client = [
            "iperf3",
            "-c",
            b.address,
            "-p",
            str(IPERF_PORT),
            "-t",
            f"{seconds:g}",
            "-J",
            "--bidir",
        ]
        done = subprocess.run(
            cluster.command(a, client), capture_output=True, text=True, timeout=seconds + 30
        )
    if done.returncode != 0:
        raise ClusterError(f"iperf3 failed: {done.stdout[-500:]} {done.stderr[-500:]}")
    return parse_iperf(json.loads(done.stdout), cluster.shape.rate_mbit, seconds)


def parse_iperf(data: dict[str, Any], rate_mbit: float, seconds: float) -> dict[str, Any]:
    """The link check's figures from ``iperf3 -J --bidir`` output: the goodput received in
    each direction, their mean as B, and B against the configured rate."""
    end = data["end"]
    forward = end["sum_received"]["bits_per_second"] / 1e6
    reverse = end["sum_received_bidir_reverse"]["bits_per_second"] / 1e6
    b = (forward + reverse) / 2
    return {
        "seconds": seconds,
        "forward_mbit": forward,
        "reverse_mbit": reverse,
        "b_mbit": b,
        "ratio": b / rate_mbit,
    }


def _with_cpu(result: dict[str, Any], sampler: CpuSampler) -> dict[str, Any]:
    start, end = result["window"]
    result["cpu"] = sampler.utilisation(start, end)
    seconds = sampler.seconds(start, end)
    rounds = result.get("round_seconds")
    if seconds is not None and rounds:
        # Core-seconds the whole cluster spends per GB of gradients summed (on every
        # worker), per role: the samples' span scaled to the window's.
        scale = (end - start) / seconds.pop("wall") / (len(rounds) * result["bytes"] / 1e9)
        result["cpu_seconds_per_gb"] = {role: s * scale for role, s in seconds.items()}
    return result


def _cpu_line(run: dict[str, Any], gloo: dict[str, Any]) -> str:
    """Where a run's CPU went, per GB of gradients, against gloo's in the same run."""
    mine, theirs = run.get("cpu_seconds_per_gb"), gloo.get("cpu_seconds_per_gb")
    if not mine or not theirs:
        return ""
    parts = ", ".join(f"{role} {s:.2f}" for role, s in mine.items() if role != "busy")
    return (
        f"\n      CPU per GB summed: {mine['busy']:.2f} core-s "
        f"({mine['busy'] / theirs['busy']:.2f}x gloo's): {parts}"
    )


class PortCounter:
    """Bytes through each worker host's switch port over one job, per round of the
    gradient set (the job's whole traffic, start-up included, over its warm-up and
    measured rounds): what issue 23's "bytes each host's NIC carries" counts."""

    def __init__(self, cluster: EmulatedCluster, hosts: Sequence[Any], rounds: int) -> None:
        self._cluster, self._hosts, self._rounds = cluster, hosts, rounds
        self._before = cluster.port_bytes()

    def per_round(self) -> dict[str, Any]:
        """Per worker host: bytes sent and received per round; and the largest of them."""
        after = self._cluster.port_bytes()
        hosts = {}
        for h in self._hosts:
            (s0, r0), (s1, r1) = self._before[h.address], after[h.address]
            hosts[h.address] = {
                "sent": (s1 - s0) / self._rounds,
                "received": (r1 - r0) / self._rounds,
            }
        most = max(max(v["sent"], v["received"]) for v in hosts.values())
        return {"hosts": hosts, "most": most}


def _start_line(run: dict[str, Any]) -> str:
    """How far apart the workers left each round's barrier (median over the rounds): the
    round time, the slowest worker's, includes it."""
    spreads = run.get("start_spread_seconds")
    if not spreads:
        return ""
    return f", workers started within {statistics.median(spreads) * 1e3:.0f} ms"


def _nic_line(run: dict[str, Any], what: str) -> str:
    nic = run["nic_bytes"]
    return (
        f"\n      worker NICs per round: at most {nic['most'] / 1e6:.2f} MB each way, "
        f"{run['nic_vs_model']:.3f}x {what}"
    )


def goodput_runs(
    args: argparse.Namespace,
    cluster: EmulatedCluster,
    sampler: CpuSampler,
    b: float,
    tmp: Path,
    progress: Progress,
) -> dict[str, Any]:
    """gloo all_reduce once, then sumflow push_pull for every k."""
    n = args.workers
    workers, spare = cluster.hosts[:n], cluster.hosts[n:]
    logs = args.out / "logs"
    worker = [
        *(sys.executable, "-m", "sumflow_bench.goodput_worker"),
        *("--megabytes", str(args.megabytes), "--tensors", str(args.tensors)),
        *("--rounds", str(args.rounds), "--warmup", str(args.warmup)),
        *(("--model", args.goodput_model) if args.goodput_model else ()),
    ]
    progress.step("goodput: gloo all_reduce")
    out = tmp / "goodput-gloo.json"
    rounds = args.warmup + args.rounds
    ports = PortCounter(cluster, workers, rounds)
    run_torch_job(
        cluster,
        workers,
        [*worker, "--system", "gloo", "--json", str(out)],
        what="goodput gloo",
        log_path=logs / "goodput-gloo.log",
        timeout=args.job_timeout,
        per_host=args.workers_per_host,
    )
    gloo = _with_cpu(read_result(out, "goodput gloo"), sampler)
    gloo["goodput_gbit"] = gloo["goodput_bytes_per_s"] / GBIT
    m = gloo["bytes"]
    gloo["nic_bytes"] = ports.per_round()
    # A ring over n x G ranks, each host's G adjacent: every host sends 2(nG - 1)/(nG) M.
    ranks = n * args.workers_per_host
    gloo["nic_vs_model"] = gloo["nic_bytes"]["most"] / (2 * (ranks - 1) * m / ranks)
    per_gb = gloo.get("cpu_seconds_per_gb")
    print(
        f"    gloo all_reduce: {gloo['goodput_gbit']:.3f} Gbit/s per worker"
        + (f", {per_gb['busy']:.2f} core-s per GB summed" if per_gb else "")
        + _start_line(gloo)
        + _nic_line(gloo, "a ring's traffic"),
        file=sys.stderr,
        flush=True,
    )
    runs = []
    for k in args.ks:
        progress.step(f"goodput: sumflow push_pull, k = {k}")
        out = tmp / f"goodput-sumflow-k{k}.json"
        ports = PortCounter(cluster, workers, rounds)
        run_sumflow_job(
            cluster,
            workers,
            spare[:k],
            [*worker, "--system", "sumflow", "--json", str(out)],
            what=f"goodput sumflow k={k}",
            log_path=logs / f"goodput-sumflow-k{k}.log",
            timeout=args.job_timeout,
            per_host=args.workers_per_host,
            launcher_args=[
                *(("--partition-bytes", str(args.partition_bytes)) if args.partition_bytes else ()),
                *(a for item in args.worker_env for a in ("-x", item)),
            ],
        )
        run = _with_cpu(read_result(out, f"goodput sumflow k={k}"), sampler)
        run["k"] = k
        run["goodput_gbit"] = run["goodput_bytes_per_s"] / GBIT
        run["optimum_gbit"] = theory.goodput(m, theory.optimal_time(n, k, m, b)) / GBIT
        run["vs_optimum"] = run["goodput_gbit"] / run["optimum_gbit"]
        run["vs_gloo"] = run["goodput_gbit"] / gloo["goodput_gbit"]
        run["nic_bytes"] = ports.per_round()
        # Eq. 6's traffic: what each worker machine's NIC carries each way at the optimum.
        run["nic_vs_model"] = run["nic_bytes"]["most"] / theory.optimal_time(n, k, m, 1.0)
        if "cpu_seconds_per_gb" in run and "cpu_seconds_per_gb" in gloo:
            run["cpu_vs_gloo"] = (
                run["cpu_seconds_per_gb"]["busy"] / gloo["cpu_seconds_per_gb"]["busy"]
            )
        print(
            f"    sumflow k={k}: {run['goodput_gbit']:.3f} Gbit/s per worker, "
            f"{run['vs_optimum']:.2f}x the optimum, {run['vs_gloo']:.2f}x gloo{_start_line(run)}"
            f"{_cpu_line(run, gloo)}{_nic_line(run, 'Eq. 6 traffic')}",
            file=sys.stderr,
            flush=True,
        )
        runs.append(run)
    return {
        "gloo": gloo,
        "sumflow": runs,
        "allreduce_theory_gbit": theory.goodput(m, theory.allreduce_time(n, m, b)) / GBIT,
    }


def grid_space(args: argparse.Namespace) -> SearchSpace:
    """The tuner's search space for the grid's cell, partitions scaled like its tensors."""
    scales = matrix.cell_scales(matrix.Cell(args.grid_model, min(args.gbits)), args.rate_mbit)
    low, high = matrix.tuning_space(scales.size_scale)
    return SearchSpace(low, high, SearchSpace().max_credit_partitions)


def training_plan(args: argparse.Namespace) -> list[matrix.Step]:
    """The training jobs: the grid search's with ``--grid``, the scheduler benchmark's
    with ``--schedulers``, else the standard comparison (DDP, sumflow k = 0, sumflow k = n
    when CPU hosts exist). ValueError if a cell cannot be scaled."""
    if args.grid is not None:
        cell = matrix.Cell(args.grid_model, min(args.gbits))
        points = grid.grid_points(grid_space(args), args.grid_partitions, args.grid_credits)
        systems = grid.grid_systems(points, args.scheduler_k)
        return matrix.plan([cell.model], [cell.reference_gbit], systems)
    if args.scheduler_names is not None:
        systems = matrix.scheduler_systems(args.scheduler_names, args.scheduler_k)
    else:
        systems = matrix.standard_systems(min(args.workers, max(args.ks)))
    return matrix.plan(args.models, args.gbits, systems, args.repeats)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        steps = training_plan(args)
        _, estimates = step_estimates(args, steps)
    except ValueError as e:
        print(f"sumflow_bench.cluster: {e}", file=sys.stderr)
        return 2
    cpu_hosts = max(
        [*(args.ks if not (args.skip_goodput or args.grid) else ()), *(s.system.k for s in steps)]
    )
    hosts = args.workers + cpu_hosts
    if steps:
        print(
            f"training: {len(steps)} jobs, about {duration(sum(estimates))} (estimated "
            "from the links' rate and the profiles' compute)",
            file=sys.stderr,
        )
    goodput = not (args.skip_goodput or args.grid)
    progress = Progress(1 + (1 + len(args.ks) if goodput else 0) + len(steps), sum(estimates))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(exist_ok=True)
    results: dict[str, Any] = {
        "config": {
            "workers": args.workers,
            "workers_per_host": args.workers_per_host,
            "cpu_servers": args.ks,
            "cpu_hosts": cpu_hosts,
            "rate_mbit": args.rate_mbit,
            "delay_ms": args.delay_ms,
            "mtu": args.mtu,
            "megabytes": args.megabytes,
            "tensors": args.tensors,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "partition_bytes": args.partition_bytes,
            "worker_env": args.worker_env,
            "reference_gbits": args.gbits,
            "schedulers": args.scheduler_names,
            "grid": None if args.grid is None else str(args.grid),
            "scheduler_k": args.scheduler_k,
            "iterations": args.iterations,
            "warmup_iterations": args.warmup_iterations,
            "tune_trials": args.tune_trials,
            "tune_warmup_steps": args.tune_warmup_steps,
            "tune_measure_steps": args.tune_measure_steps,
            "tune_iterations": args.tune_iterations,
            "repeats": args.repeats,
            "estimated_training_s": sum(estimates),
            "cpu_flag": args.cpu_flag,
            "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    }
    started = time.monotonic()

    def jobs() -> None:
        shape = LinkShape(args.rate_mbit, delay_ms=args.delay_ms, mtu=args.mtu)
        with (
            tempfile.TemporaryDirectory(prefix="sumflow-bench-") as tmpdir,
            EmulatedCluster(hosts, shape, subnet=args.subnet, log=sys.stderr) as cluster,
            CpuSampler(processes=True) as sampler,
        ):
            tmp = Path(tmpdir)
            progress.step("link check (iperf3)")
            results["link"] = link_check(cluster, args.link_seconds)
            link = results["link"]
            print(
                f"    {link['forward_mbit']:.0f} / {link['reverse_mbit']:.0f} Mbit/s "
                f"({link['ratio']:.3f}x the configured rate)",
                file=sys.stderr,
            )
            b = link["b_mbit"] * 1e6 / 8
            if not (args.skip_goodput or args.grid):
                results["goodput"] = goodput_runs(args, cluster, sampler, b, tmp, progress)
            if steps:
                results["training"] = []
                training_runs(args, cluster, sampler, tmp, progress, steps, results["training"])
            if args.grid is not None:
                systems = [s.system for s in steps]
                results["grid"] = write_grid(args, results, systems, grid_space(args))

    def save() -> None:
        results["config"]["took_s"] = time.monotonic() - started
        if len(results) > 1:
            write_outputs(results, args.out)

    return run_harness("cluster", jobs, save) or 0


def write_grid(
    args: argparse.Namespace,
    results: dict[str, Any],
    systems: list[matrix.System],
    space: SearchSpace,
) -> dict[str, Any]:
    """GRID.json from the grid run's one cell and its `systems` (the grid points, in the
    tuner's `space`); returns it."""
    (cell,) = results["training"]
    meta = {
        "workers": args.workers,
        "cpu_servers": args.scheduler_k,
        "rate_mbit": args.rate_mbit,
        "space": space.to_json(),
        "iterations": args.iterations,
        "warmup_iterations": args.warmup_iterations,
        "command": results["config"]["command"],
        "date": results["config"]["date"],
    }
    data = grid.grid_json(cell, systems, meta)
    args.grid.parent.mkdir(parents=True, exist_ok=True)
    args.grid.write_text(json.dumps(data, indent=1) + "\n")
    print(f"grid search: {len(data['configs'])} points in {args.grid}", file=sys.stderr)
    return data


def write_outputs(results: dict[str, Any], out: Path) -> None:
    """results.json, results.md and the plots of whatever finished."""
    (out / "results.json").write_text(json.dumps(results, indent=1))
    scheduler_run = results["config"].get("schedulers") is not None
    grid_run = "grid" in results
    text = report.markdown(results)
    if scheduler_run and results.get("training"):
        text += "\n" + schedreport.markdown(results)
    if results.get("grid"):
        text += "\n" + grid.markdown(results["grid"])
    (out / "results.md").write_text(text)
    plots: list[tuple[str, Callable[[dict[str, Any], Path], None], str]] = [
        ("goodput", report.plot_goodput, "goodput.png")
    ]
    if scheduler_run:
        plots += [
            ("training", schedreport.plot_rates, "schedulers.png"),
            ("training", schedreport.plot_idle, "idle.png"),
        ]
    elif not grid_run:
        plots.append(("training", report.plot_training, "training.png"))
    for key, plot, name in plots:
        if results.get(key):
            plot(results, out / name)
    print(f"results in {out}/ (results.md, results.json, *.png, logs/)", file=sys.stderr)
    if scheduler_run and results.get("training"):
        for line in schedreport.verdict_lines(results):
            print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
