"""``sumflow sim``: the simulator from the shell.

    sumflow sim run --profile resnet50 --machines 128 --gpus 8 --cpu-machines 64 --gbps 100
    sumflow sim cpu-sweep --profile vgg16 --machines 32 --gpus 8 --cpu-machines 0,8,16,32
    sumflow sim schedulers --profile resnet50 --machines 16 --gbps-list 1,2,5,10,25

``run`` simulates one configuration and prints a summary (``--json``, ``--trace``);
``cpu-sweep`` compares sumflow/BytePS with k CPU machines against an all-reduce baseline
(and the non-colocated PS), ``schedulers`` compares the schedulers across bandwidths;
both print a table and, with ``--plot``, draw it. Every option is in ``--help``;
docs/simulator.md explains the model. The replay of emulated-cluster runs is in the
benchmark package: ``python -m sumflow_bench.calibrate``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sumflow import profiles
from sumflow.sim import (
    ARCHITECTURES,
    SCHEDULERS,
    Cluster,
    Config,
    Network,
    Scheduling,
    print_progress,
    simulate,
)
from sumflow.sim.result import Result


def _list_of(kind: type, what: str) -> Callable[[str], list[Any]]:
    """An argparse type: comma-separated values of `kind` (`what` names them in errors)."""

    def parse(text: str) -> list[Any]:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what}, got {text!r}"
            ) from None

    return parse


_ints = _list_of(int, "integers")
_floats = _list_of(float, "numbers")


def _common(p: argparse.ArgumentParser, *, cluster_k: bool = True, gbps: bool = True) -> None:
    d = Network()
    g = p.add_argument_group("model and cluster")
    g.add_argument(
        "--profile",
        required=True,
        help=f"a built-in profile ({', '.join(profiles.names())}) or a profile JSON file",
    )
    g.add_argument("--machines", type=int, required=True, help="worker machines n")
    g.add_argument("--gpus", type=int, default=1, help="GPUs per worker machine g (1)")
    if cluster_k:
        g.add_argument("--cpu-machines", type=int, default=0, help="CPU machines k (0)")
    n = p.add_argument_group("network")
    if gbps:
        n.add_argument(
            "--gbps", type=float, default=d.gbps, help=f"worker NIC, Gbit/s ({d.gbps:g})"
        )
    n.add_argument("--cpu-gbps", type=float, help="CPU machines' NIC, Gbit/s (as --gbps)")
    n.add_argument("--latency-us", type=float, default=d.latency_us, help=f"({d.latency_us:g})")
    n.add_argument(
        "--overhead-us",
        type=float,
        default=d.message_overhead_us,
        help=f"per-message sender CPU time ({d.message_overhead_us:g})",
    )
    n.add_argument(
        "--intra-gbps",
        type=float,
        default=d.intra_gbps,
        help=f"inside a machine ({d.intra_gbps:g})",
    )
    n.add_argument(
        "--segment-bytes",
        type=int,
        default=d.segment_bytes,
        help=f"link interleaving unit ({d.segment_bytes})",
    )
    s = p.add_argument_group("communication")
    s.add_argument("--architecture", choices=ARCHITECTURES, default="byteps")
    s.add_argument("--scheduler", choices=SCHEDULERS, default="bytescheduler")
    s.add_argument("--partition-bytes", type=int, help="partition size (the runtime's 4 MiB)")
    s.add_argument("--credit-bytes", type=int, help="credit per server (2 partitions)")
    s.add_argument("--window-bytes", type=int, help="push window per server (4 partitions)")
    s.add_argument("--fusion-bytes", type=int, default=0, help="fuse gradients (0: off)")
    s.add_argument(
        "--no-aggregation",
        action="store_true",
        help="every GPU pushes its own copy (no reduce inside the machine)",
    )
    s.add_argument(
        "--no-cross-barrier",
        action="store_true",
        help="the next forward waits for every sum (PyTorch's global barrier)",
    )
    r = p.add_argument_group("run")
    r.add_argument("--warmup", type=int, default=2, help="warm-up iterations (2)")
    r.add_argument("--iterations", type=int, default=3, help="measured iterations (3)")
    r.add_argument(
        "--compute-jitter",
        type=float,
        default=0.0,
        help="how much each worker machine's compute varies between iterations, as a "
        "coefficient of variation (0: none; 0.1: a slower or faster iteration by ~10%%)",
    )
    r.add_argument("--seed", type=int, default=0, help="seeds every random draw (0)")
    r.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _config(args: argparse.Namespace, **override: object) -> Config:
    values = {
        "k": getattr(args, "cpu_machines", 0),
        "gbps": getattr(args, "gbps", Network().gbps),
        "architecture": args.architecture,
        "scheduler": args.scheduler,
        "fusion_bytes": args.fusion_bytes,
        **override,
    }
    return Config(
        profile=profiles.load(args.profile),
        cluster=Cluster(args.machines, args.gpus, values["k"]),
        network=Network(
            gbps=values["gbps"],
            cpu_gbps=args.cpu_gbps,
            latency_us=args.latency_us,
            message_overhead_us=args.overhead_us,
            intra_gbps=args.intra_gbps,
            segment_bytes=args.segment_bytes,
        ),
        architecture=values["architecture"],
        scheduling=Scheduling(
            scheduler=values["scheduler"],
            partition_bytes=args.partition_bytes,
            credit_bytes=args.credit_bytes,
            window_bytes=args.window_bytes,
            fusion_bytes=values["fusion_bytes"],
        ),
        intra_aggregation=not args.no_aggregation,
        cross_barrier=not args.no_cross_barrier,
        warmup_iterations=args.warmup,
        iterations=args.iterations,
        compute_jitter=args.compute_jitter,
        seed=args.seed,
        trace=bool(getattr(args, "trace", None)),
    )


def _run_one(args: argparse.Namespace, cfg: Config) -> Result:
    return simulate(cfg, None if args.quiet else print_progress)


def _cmd_run(args: argparse.Namespace) -> int:
    result = _run_one(args, _config(args))
    print(result.summary())
    if args.json:
        result.save_json(args.json)
    if args.trace:
        print(f"trace: {result.save_trace(args.trace)} (open it in ui.perfetto.dev)")
    return 0


def _cmd_cpu_sweep(args: argparse.Namespace) -> int:
    fusion = round(args.baseline_fusion_mb * 2**20)
    baseline = _run_one(
        args, _config(args, k=0, architecture=args.baseline, scheduler="fifo", fusion_bytes=fusion)
    )
    byteps: dict[int, Result] = {}
    ps: dict[int, Result] = {}
    print(f"baseline {args.baseline} all-reduce: {baseline.iteration_s * 1e3:.2f} ms per iteration")
    print("| k | sumflow/BytePS ms | speedup | non-colocated PS ms | speedup |")
    print("|---|---|---|---|---|")
    for k in args.cpu_machines:
        byteps[k] = _run_one(args, _config(args, k=k, architecture="byteps"))
        row = f"| {k} | {byteps[k].iteration_s * 1e3:.2f} | "
        row += f"{baseline.iteration_s / byteps[k].iteration_s:.2f}x | "
        if k > 0:
            ps[k] = _run_one(args, _config(args, k=k, architecture="ps"))
            row += (
                f"{ps[k].iteration_s * 1e3:.2f} | {baseline.iteration_s / ps[k].iteration_s:.2f}x |"
            )
        else:
            row += "- | - |"
        print(row)
    if args.plot:
        from sumflow.sim.plots import plot_cpu_sweep

        print(f"plot: {plot_cpu_sweep(byteps, baseline, args.plot, ps)}")
    return 0


def _cmd_schedulers(args: argparse.Namespace) -> int:
    table: dict[str, list[Result]] = {s: [] for s in args.schedulers}
    for gbps in args.gbps_list:
        for s in args.schedulers:
            table[s].append(_run_one(args, _config(args, gbps=gbps, scheduler=s)))
    head = " | ".join(f"{g:g} Gbit/s" for g in args.gbps_list)
    print(f"iterations/s\n| scheduler | {head} |")
    print("|---|" + "---|" * len(args.gbps_list))
    for s, rs in table.items():
        print(f"| {s} | " + " | ".join(f"{r.iterations_per_s:.3f}" for r in rs) + " |")
    if args.plot:
        from sumflow.sim.plots import plot_schedulers

        print(f"plot: {plot_schedulers(table, args.plot)}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The ``sumflow sim`` argument parser."""
    ap = argparse.ArgumentParser(
        prog="sumflow sim",
        description="Simulate data-parallel training on a cluster (docs/simulator.md).",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate one configuration")
    _common(run)
    run.add_argument("--json", help="write the result (without the timeline) to this file")
    run.add_argument("--trace", help="write a Chrome trace of the measured iterations here")
    run.set_defaults(func=_cmd_run)
    cpu = sub.add_parser("cpu-sweep", help="speedup against the number of CPU machines")
    _common(cpu, cluster_k=False)
    cpu.add_argument("--cpu-machines", type=_ints, required=True, help="values of k, e.g. 0,4,8,16")
    cpu.add_argument(
        "--baseline",
        choices=("ring", "hierarchical"),
        default="hierarchical",
        help="the all-reduce the speedups are over (hierarchical: reduce inside each "
        "machine, ring across machines)",
    )
    cpu.add_argument(
        "--baseline-fusion-mb",
        type=float,
        default=25.0,
        help="the baseline's fusion buckets, MiB (25: DDP's default)",
    )
    cpu.add_argument("--plot", help="write the figure to this PNG")
    cpu.set_defaults(func=_cmd_cpu_sweep)
    sch = sub.add_parser("schedulers", help="the schedulers against bandwidth")
    _common(sch, gbps=False)
    sch.add_argument("--gbps-list", type=_floats, required=True, help="e.g. 1,2,5,10,25")
    sch.add_argument(
        "--schedulers",
        type=lambda t: [s for s in t.split(",") if s],
        default=list(SCHEDULERS),
        help=f"({','.join(SCHEDULERS)})",
    )
    sch.add_argument("--plot", help="write the figure to this PNG")
    sch.set_defaults(func=_cmd_schedulers)
    return ap


#: What ``sumflow sim calibrate`` says since the calibration left the library.
MOVED_CALIBRATE = (
    "sumflow sim: calibrate is now python -m sumflow_bench.calibrate (the benchmark "
    "package, bench/ in the repository: pip install ./bench)"
)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``sumflow sim`` with `argv` (default: ``sys.argv[1:]``); returns the exit
    status. A configuration that cannot be simulated exits with status 2 and says why."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        # The calibration replays the benchmark harness's recorded runs, so it moved with
        # the harness out of the library; say where rather than fail as an unknown command.
        print(MOVED_CALIBRATE, file=sys.stderr)
        return 2
    ap = parser()
    args = ap.parse_args(argv)
    command: Callable[[argparse.Namespace], int] = args.func
    try:
        return command(args)
    except ValueError as e:
        ap.exit(2, f"sumflow sim: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
