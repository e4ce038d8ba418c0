"""Simulated against measured: the emulated-cluster runs recorded in ``bench/results``
(``docs/benchmarks.md``) replayed in the simulator with the same profiles, scales,
bandwidth, n, k, scheduler and knobs.

What the emulation is, in the simulator's terms: every host a machine with one NIC of the
link rate iperf3 measured (``link.b_mbit`` of the results), MTU 9000 (the segment size), a
worker and its colocated server on one host talking over loopback, and the per-message
costs of sumflow's pipeline and the kernel's TCP stack on the 2-core machine that runs it
all, which :data:`EMULATION` states and the calibration table judges.

``python -m sumflow_bench.calibrate bench/results/schedulers-omp1-runD ... --plot out.png``
prints the comparison as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sumflow import _core, profiles
from sumflow.profiles import LayerProfile, ModelProfile, ParamSpec
from sumflow.sim import Cluster, Config, Network, Scheduling, simulate

#: The emulated network's costs other than bandwidth, set once for every run
#: (docs/simulator.md, "Calibration", has how each was chosen and what else was tried):
#:
#: - ``latency_us``: two veth hops and a bridge inside one machine.
#: - ``nic_queue_bytes``, ``nic_queue_spread``: a host's egress is one FIFO (tc's HTB with
#:   a pfifo leaf, ``sumflow_bench.netns``), and each TCP connection has its window's worth
#:   in it at a time, so connections share a host's link in bursts, not packet by packet.
#:   The emulation's kernel runs BBR, whose windows there (sampled with ``ss``) are 18-50
#:   jumbo segments, 160-450 KB, differing between connections and changing from one round
#:   trip to the next: flows into one server progress unevenly. Fitted within those bounds:
#:   512 KiB +- 90% (with fair downlinks a spread of 0.5-1.0 with 512 KiB-1 MiB fits alike;
#:   an even 1 MiB, the second pass's, leaves the tuned ResNet-50 runs 11-15% fast).
#: - ``message_overhead_us``: the sending process's time per message (the push or sum
#:   thread's system calls and wake-ups on a busy 2-core machine). Fitted: the tuned runs'
#:   8-45 KB partitions bound it to 0-50 us; the machine's recorded CPU utilisation puts
#:   all of a message's CPU time, both ends and the kernel, at about 70 us.
#: - ``fair_downlinks``: the flows into a host share its switch port about equally, as
#:   TCP's congestion control converges to (BBR here); in arrival order, the senders with
#:   more upstream capacity (a CPU server streaming sums) crowd out the rest and goodput at
#:   k = 2 came out 12-17% slow.
EMULATION = {
    "latency_us": 50.0,
    "message_overhead_us": 25.0,
    "nic_queue_bytes": 512 << 10,
    "nic_queue_spread": 0.9,
    "fair_downlinks": True,
}
#: The emulation's MTU (``--mtu``): the unit a link carries, and the switch ports
#: interleave arriving connections by.
EMULATED_SEGMENT_BYTES = 9000
#: A worker and its colocated server exchange data over loopback on the same machine.
LOOPBACK_GBPS = 20.0
#: Measured iterations simulated per run: with the compute jitter and the connections'
#: uneven shares every iteration differs, so the mean of as many as the benchmark times.
MEASURED_ITERATIONS = 15
#: The runtime's push window per server, in partitions of the job's starting size.
WINDOW_PARTITIONS = _core.DEFAULT_WINDOW_PARTITIONS


@dataclass(frozen=True)
class Measurement:
    """One measured run of the emulated cluster.

    Attributes:
        source: the results file.
        label: which run, for tables (profile, reference bandwidth, system, k).
        kind: ``training`` (train_worker) or ``goodput`` (sums of a gradient set, no
            compute).
        system: ``fifo``, ``p3``, ``bytescheduler``, ``prophet`` (sumflow's schedulers),
            ``ddp`` (DDP over gloo: ring all-reduce), or ``push_pull`` (goodput).
        profile: the scaled profile the run trained (or the goodput set).
        workers: n; ``k``: CPU-server hosts.
        link_gbps: the link rate iperf3 measured.
        scheduling: the scheduler's knobs as the run applied them.
        cross_barrier: whether the next forward waited layer by layer.
        measured_s: seconds per iteration in steady state (see :func:`iteration_s`), or
            per round (goodput: the median round).
        cpu: the machine's CPU utilisation during the run.
        cpu_limit: the harness's ``--cpu-flag``: above it, a run measured the shared CPUs
            more than the network, and the harness marks it over the limit.
        compute_jitter: how much the run's backward passes varied from one iteration to
            the next (coefficient of variation of ``backward_s``; 0 where not timed), the
            simulator's ``Config.compute_jitter``.
    """

    source: str
    label: str
    kind: str
    system: str
    profile: ModelProfile
    workers: int
    k: int
    link_gbps: float
    scheduling: Scheduling
    cross_barrier: bool
    measured_s: float
    cpu: float
    cpu_limit: float
    compute_jitter: float = 0.0

    @property
    def over_cpu_limit(self) -> bool:
        """Whether the harness flagged the run: not a measurement of the network."""
        return self.cpu > self.cpu_limit


def _scaled(run: dict[str, Any]) -> ModelProfile:
    """The run's profile, scaled as it was, with its times stretched to the compute the
    run measured (the sleeping model overruns its profile when the machine is busy;
    the simulator is judged on communication, not on that).

    Where a sumflow run also timed its backward passes (``backward_s``, train_worker since
    the third calibration pass), the framework's work between the layers' compute is added
    too, evenly over the layers that hand gradients over: gradient hooks and push_pull
    submission, which the sleeping model does on the CPU in line with its "GPU" time
    (about 1 ms a layer on the loaded 2-core machine; a real GPU's kernels would run
    while the CPU did this)."""
    base = profiles.builtin(run["profile_arg"])
    stretch = run["compute_ms"] / run["profile_compute_ms"] if run["profile_compute_ms"] else 1
    scaled = profiles.scale(
        base, size_scale=run["size_scale"], time_scale=run["time_scale"] * stretch
    )
    walls = run.get("backward_s")
    if not walls or run["system"] == "ddp-gloo":
        # DDP's backward() also waits for its buckets' all-reduce: not framework work.
        return scaled
    computing = sum(layer.backward_ms for layer in scaled.layers)
    handing = [layer for layer in scaled.layers if layer.params]
    extra = max(0.0, statistics.fmean(walls) * 1e3 - computing) / max(1, len(handing))
    layers = tuple(
        replace(layer, backward_ms=layer.backward_ms + extra) if layer.params else layer
        for layer in scaled.layers
    )
    return replace(scaled, layers=layers)


def _jitter(run: dict[str, Any]) -> float:
    """How much a sumflow run's backward passes varied: their coefficient of variation.

    The workers share two cores with the servers, so a worker is slower in some
    iterations than others, and the rounds wait for the slowest: a trace of ResNet-50 at
    2 Gbit/s has the same gradient ready on the four workers 26-44 ms apart (10th to 90th
    percentile), where identical simulated machines are 5 ms apart. Not for DDP, whose
    backward() also waits for its all-reduce."""
    walls = run.get("backward_s")
    if not walls or len(walls) < 2 or run["system"] == "ddp-gloo":
        return 0.0
    return min(1.0, float(statistics.pstdev(walls) / statistics.fmean(walls)))


def _scheduling(run: dict[str, Any]) -> tuple[str, Scheduling, bool]:
    if run["system"] == "ddp-gloo":
        # DDP's buckets close once they hold bucket_cap_mb (MiB), in backward order.
        bucket = round(run["bucket_cap_mb"] * 2**20)
        return "ddp", Scheduling(scheduler="fifo", fusion_bytes=bucket), False
    applied = (run.get("tuner") or {}).get("applied") or {}
    partition = applied.get("partition_bytes", run["partition_bytes"])
    credit = applied.get("credit_bytes")
    # The push window is set once, at the partition size the job starts with, and the
    # tuner's reconfigure changes only the partition size and the credit: a tuned run kept
    # its starting partition's window.
    window = WINDOW_PARTITIONS * run["partition_bytes"] if applied else None
    # The grid's runs name their credit (bytescheduler-p4096-c8192).
    named = re.search(r"-c(\d+)$", run.get("name", ""))
    if credit is None and named:
        credit = int(named[1])
    fusion = run.get("fusion_threshold") or 0
    kind = run["scheduler"]
    return (
        kind,
        Scheduling(
            scheduler=kind,
            partition_bytes=partition,
            credit_bytes=credit,
            window_bytes=window,
            fusion_bytes=fusion,
        ),
        bool(run["cross_barrier"]),
    )


def iteration_s(run: dict[str, Any]) -> float:
    """A training run's seconds per iteration in steady state, which is what the simulator
    reports: the mean of the iterations train_worker timed back to back (they tile the
    timed window from the first forward to the last step, so their mean is the period).

    Not the run's ``1 / iterations_per_s``: that window also holds the drain after the last
    step (train_worker waits for the last sums so that no communication escapes it), which
    is one iteration's communication tail spread over ``iterations`` iterations, 3-8% of an
    iteration of the cross-barrier runs here (0 for DDP, whose step waits)."""
    times = run.get("iteration_s")
    return statistics.fmean(times) if times else 1.0 / run["iterations_per_s"]


def _training(
    path: Path, data: dict[str, Any], link_gbps: float, cpu_limit: float
) -> list[Measurement]:
    out = []
    for cell in data.get("training", []):
        # The standard run (issue 5's) names its one reference bandwidth in the config.
        reference = cell.get("reference_gbit", data["config"].get("reference_gbit"))
        for run in cell.get("runs", [cell]):
            if run["system"] == "sumflow" and "scheduler" not in run:
                # Issue 5's runs predate the schedulers: a build the simulator does not
                # replay.
                continue
            system, scheduling, cross = _scheduling(run)
            k = 0 if system == "ddp" else run["k"]
            name = run.get("label", system)
            out.append(
                Measurement(
                    source=str(path),
                    label=f"{run['profile']} {reference:g}G {name}",
                    kind="training",
                    system=system,
                    profile=_scaled(run),
                    workers=run["workers"],
                    k=k,
                    link_gbps=link_gbps,
                    scheduling=scheduling,
                    cross_barrier=cross,
                    measured_s=iteration_s(run),
                    cpu=run.get("cpu") or 0.0,
                    cpu_limit=cpu_limit,
                    compute_jitter=_jitter(run),
                )
            )
    return out


def goodput_profile(total_bytes: int, tensors: int) -> ModelProfile:
    """The goodput benchmark's gradient set: `tensors` equal float32 tensors, no compute,
    all ready at once."""
    numel = total_bytes // tensors // 4
    return ModelProfile(
        name=f"goodput-{total_bytes // 10**6}MB",
        source="sumflow_bench.goodput_worker's gradient set",
        device="none",
        batch_size=1,
        sample="none",
        layers=(
            LayerProfile(
                "set", tuple(ParamSpec(f"t{i}", (numel,)) for i in range(tensors)), 0.0, 0.0
            ),
        ),
    )


def _goodput(
    path: Path, data: dict[str, Any], link_gbps: float, cpu_limit: float
) -> list[Measurement]:
    cfg = data["config"]
    out = []
    for run in data.get("goodput", {}).get("sumflow", []):
        out.append(
            Measurement(
                source=str(path),
                label=f"goodput {run['bytes'] // 10**6} MB k={run['k']}",
                kind="goodput",
                system="push_pull",
                profile=goodput_profile(run["bytes"], run["tensors"]),
                workers=run["workers"],
                k=run["k"],
                link_gbps=link_gbps,
                scheduling=Scheduling(partition_bytes=cfg["partition_bytes"]),
                cross_barrier=False,
                measured_s=statistics.median(run["round_seconds"]),
                cpu=run.get("cpu") or 0.0,
                cpu_limit=cpu_limit,
            )
        )
    return out


#: What a results argument may end with to keep only one kind of run.
KINDS = ("goodput", "training")


def measurements(path: str | Path) -> list[Measurement]:
    """Every run recorded in a results directory (or its ``results.json``); ``DIR:goodput``
    or ``DIR:training`` keeps one kind (a directory whose other runs were measured again
    since, with a changed build)."""
    kind = None
    text = str(path)
    head, sep, tail = text.rpartition(":")
    if sep and tail in KINDS:
        text, kind = head, tail
    elif sep and "/" not in tail:
        raise ValueError(f"{path}: after ':' give one of {', '.join(KINDS)}, not {tail!r}")
    p = Path(text)
    if p.is_dir():
        p = p / "results.json"
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: cannot read emulated-cluster results: {e}") from None
    link_gbps = data["link"]["b_mbit"] / 1e3
    cpu_limit = data["config"]["cpu_flag"]
    runs = _goodput(p, data, link_gbps, cpu_limit) + _training(p, data, link_gbps, cpu_limit)
    return [m for m in runs if kind is None or m.kind == kind]


def config_for(m: Measurement, **costs: float) -> Config:
    """The simulation of a measured run, with :data:`EMULATION`'s costs unless given."""
    c = {**EMULATION, **costs}
    network = Network(
        gbps=m.link_gbps,
        latency_us=c["latency_us"],
        message_overhead_us=c["message_overhead_us"],
        intra_gbps=LOOPBACK_GBPS,
        segment_bytes=EMULATED_SEGMENT_BYTES,
        nic_queue_bytes=int(c["nic_queue_bytes"]),
        nic_queue_spread=c["nic_queue_spread"],
        fair_downlinks=bool(c["fair_downlinks"]),
    )
    return Config(
        profile=m.profile,
        cluster=Cluster(machines=m.workers, cpu_machines=m.k),
        network=network,
        architecture="ring" if m.system == "ddp" else "byteps",
        scheduling=m.scheduling,
        cross_barrier=m.cross_barrier,
        warmup_iterations=3,
        iterations=MEASURED_ITERATIONS,
        compute_jitter=m.compute_jitter,
    )


@dataclass(frozen=True)
class Comparison:
    """A measured run and its simulation."""

    measurement: Measurement
    simulated_s: float

    @property
    def error(self) -> float:
        """Simulated over measured, less one: +0.05 is 5% slow."""
        return self.simulated_s / self.measured_s - 1.0

    @property
    def measured_s(self) -> float:
        return self.measurement.measured_s


def compare(ms: Sequence[Measurement], **costs: float) -> list[Comparison]:
    """Simulates every measured run with `costs` (see :func:`config_for`)."""
    return [Comparison(m, simulate(config_for(m, **costs)).iteration_s) for m in ms]


#: The calibration target: simulated within 10% of measured.
TARGET = 0.10


def _within(rows: Sequence[Comparison]) -> int:
    return sum(abs(c.error) <= TARGET for c in rows)


def _valid(rows: Sequence[Comparison]) -> list[Comparison]:
    """The runs that measured the network: under the harness's CPU limit."""
    return [c for c in rows if not c.measurement.over_cpu_limit]


def _summary(rows: Sequence[Comparison], key: str) -> list[str]:
    groups: dict[str, list[Comparison]] = {}
    for c in rows:
        name = c.measurement.system if key == "system" else Path(c.measurement.source).parent.name
        groups.setdefault(name, []).append(c)
    lines = [
        f"| {key} | runs | within 10% | under CPU limit: runs, within 10% | median error | "
        "median abs error | largest abs error |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, group in sorted(groups.items()):
        errors = [c.error for c in group]
        absolute = [abs(e) for e in errors]
        valid = _valid(group)
        lines.append(
            f"| {name} | {len(group)} | {_within(group)} | {len(valid)}, {_within(valid)} | "
            f"{statistics.median(errors):+.1%} | {statistics.median(absolute):.1%} | "
            f"{max(absolute):.1%} |"
        )
    return lines


def _repeatability(rows: Sequence[Comparison]) -> list[str]:
    """The configurations measured more than once (same run, knobs and barrier, in any
    results directory): how far apart the emulated cluster measured them, the noise the
    simulator's error is judged against. Empty when nothing was measured twice."""
    groups: dict[tuple[str, Scheduling, bool], list[Comparison]] = {}
    for c in rows:
        m = c.measurement
        groups.setdefault((m.label, m.scheduling, m.cross_barrier), []).append(c)
    repeated = [g for g in groups.values() if len(g) > 1]
    if not repeated:
        return []
    spreads = []
    lines = [
        "| run measured again | runs | measured s | spread | simulated s | "
        "simulated within 10% of a measurement |",
        "|---|---|---|---|---|---|",
    ]
    for group in repeated:
        measured = [c.measured_s for c in group]
        simulated = [c.simulated_s for c in group]
        spread = max(measured) / min(measured) - 1
        spreads.append(spread)
        near = sum(abs(c.error) <= TARGET for c in group)
        lines.append(
            f"| {group[0].measurement.label} | {len(group)} | {min(measured):.3f}-"
            f"{max(measured):.3f} | {spread:.1%} | {min(simulated):.3f}-{max(simulated):.3f} "
            f"| {near} of {len(group)} |"
        )
    head = (
        f"{len(repeated)} configurations measured more than once: measurements of one "
        f"configuration differ by {statistics.median(spreads):.1%} (median), at most "
        f"{max(spreads):.1%} (slowest over fastest, less one)."
    )
    return [head, "", *lines, ""]


def markdown(rows: Sequence[Comparison]) -> str:
    """The comparison as Markdown: a summary line, summaries by system and by results
    directory, then every run."""
    errors = [abs(c.error) for c in rows]
    valid = _valid(rows)
    summary = (
        f"{_within(rows)} of {len(rows)} runs within 10%; median |error| "
        f"{statistics.median(errors):.1%}, largest {max(errors):.1%} (error: simulated over "
        "measured seconds per iteration, less one). "
    )
    if valid:
        summary += (
            f"Of the {len(valid)} runs under the harness's CPU limit, {_within(valid)} within "
            f"10%, median |error| {statistics.median(abs(c.error) for c in valid):.1%}."
        )
    else:
        summary += "None of them is under the harness's CPU limit."
    lines = [
        summary,
        "",
        *_summary(rows, "system"),
        "",
        *_summary(rows, "results"),
        "",
        *_repeatability(rows),
        "| run | results | CPU | measured s | simulated s | error |",
        "|---|---|---|---|---|---|",
    ]
    for c in rows:
        m = c.measurement
        flag = " (over limit)" if m.over_cpu_limit else ""
        lines.append(
            f"| {m.label} | {Path(m.source).parent.name} | {m.cpu:.0%}{flag} | "
            f"{c.measured_s:.3f} | {c.simulated_s:.3f} | {c.error:+.1%} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[Comparison], path: str | Path) -> Path:
    """Simulated against measured seconds per iteration, log-log, with the +-10% band."""
    from sumflow.sim.plots import pyplot

    plt = pyplot()
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(6.4, 6.0))
    systems = sorted({c.measurement.system for c in rows})
    markers = dict(zip(systems, "os^vDPX*", strict=False))
    colours = dict(zip(systems, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for s in systems:
        for flagged in (False, True):
            pts = [
                c
                for c in rows
                if c.measurement.system == s and c.measurement.over_cpu_limit == flagged
            ]
            if not pts:
                continue
            # Runs over the harness's CPU limit are drawn hollow: they measured the CPUs.
            ax.scatter(
                [c.measured_s for c in pts],
                [c.simulated_s for c in pts],
                label=f"{s} (CPU over limit)" if flagged else s,
                marker=markers[s],
                s=28,
                facecolors="none" if flagged else colours[s],
                edgecolors=colours[s],
            )
    lo = min(min(c.measured_s, c.simulated_s) for c in rows) * 0.8
    hi = max(max(c.measured_s, c.simulated_s) for c in rows) * 1.25
    xs = [lo, hi]
    ax.plot(xs, xs, color="black", linewidth=0.8, label="simulated = measured")
    ax.fill_between(xs, [x * 0.9 for x in xs], [x * 1.1 for x in xs], color="grey", alpha=0.2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    # Plain seconds on both axes (log axes' default 3x10^-1 labels overlap), minor ticks
    # labelled at 2, 3 and 5 of each decade only.
    seconds = FuncFormatter(lambda v, _: f"{v:g}")
    some = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "235" else "")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(seconds)
        axis.set_minor_formatter(some)
    ax.set_xlabel("measured s per iteration (emulated cluster)")
    ax.set_ylabel("simulated s per iteration")
    ax.set_title("Simulator against the emulated cluster (grey: +-10%)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sumflow_bench.calibrate DIR...``: the table, and a plot with --plot."""
    ap = argparse.ArgumentParser(
        prog="python -m sumflow_bench.calibrate",
        description="Simulate the emulated-cluster runs recorded in bench/results and compare.",
    )
    ap.add_argument(
        "results",
        nargs="+",
        help="results directories (or results.json files); DIR:goodput or DIR:training keeps "
        "one kind of run",
    )
    ap.add_argument("--plot", help="write simulated-vs-measured to this PNG")
    ap.add_argument("--json", help="write every comparison to this JSON file")
    ap.add_argument("--latency-us", type=float, default=EMULATION["latency_us"])
    ap.add_argument("--overhead-us", type=float, default=EMULATION["message_overhead_us"])
    ap.add_argument("--nic-queue-bytes", type=int, default=EMULATION["nic_queue_bytes"])
    ap.add_argument("--nic-queue-spread", type=float, default=EMULATION["nic_queue_spread"])
    ap.add_argument(
        "--fair-downlinks",
        action=argparse.BooleanOptionalAction,
        default=EMULATION["fair_downlinks"],
        help="switch ports serve their connections in turn (default) or in arrival order",
    )
    args = ap.parse_args(argv)
    try:
        ms = [m for path in args.results for m in measurements(path)]
    except ValueError as e:
        ap.error(str(e))
    rows = compare(
        ms,
        latency_us=args.latency_us,
        message_overhead_us=args.overhead_us,
        nic_queue_bytes=args.nic_queue_bytes,
        nic_queue_spread=args.nic_queue_spread,
        fair_downlinks=args.fair_downlinks,
    )
    print(markdown(rows))
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {
                        "run": c.measurement.label,
                        "source": c.measurement.source,
                        "measured_s": c.measured_s,
                        "simulated_s": c.simulated_s,
                        "error": c.error,
                        "cpu": c.measurement.cpu,
                        "over_cpu_limit": c.measurement.over_cpu_limit,
                    }
                    for c in rows
                ],
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
