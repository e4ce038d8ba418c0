"""sumflow push_pull against torch.distributed's gloo all_reduce on a ResNet-50 gradient set.

Every worker holds ResNet-50's 161 parameter tensors as float32 "gradients" (25.6M
elements, 102.2 MB; the shapes are derived below from the architecture itself) and sums
them across the workers three ways, in the same run, with rounds alternating after a
warm-up:

- **sumflow**: ``push_pull_async`` on every tensor in the order backward produces them
  (classifier first), each with its layer's priority (input side first), then
  ``synchronize`` on every handle: the way ``DistributedOptimizer`` uses it;
- **gloo**: ``torch.distributed.all_reduce`` per tensor (all issued with ``async_op``,
  then waited for), as Horovod-style per-tensor all-reduce does;
- **gloo bucketed**: the tensors flattened, in the same order, into buckets of at most
  25 MiB each, as DistributedDataParallel does (``bucket_cap_mb=25``); copying into and
  out of the buckets is part of the round.

Each round starts after a barrier; a round's time is the slowest worker's. Goodput is the
gradient bytes summed per second per worker (each worker's whole gradient set per round).
Every method's first round is checked against the exact sum.

    sumflow-run -np 4 --machine-per-worker --servers 2 python -m sumflow_bench.pushpull_vs_gloo \\
        --json pushpull.json --plot pushpull.png

``--methods sumflow,gloo-bucketed`` runs a subset; ``--cpu-profile`` also reports, per
round, the CPU time, page faults and context switches of every thread of every process of
the job (from /proc), to show where the time goes.

gloo rendezvous uses ``MASTER_ADDR``/``MASTER_PORT`` when they are set (torchrun);
otherwise (``sumflow-run`` sets neither) rank 0 opens a TCPStore on a free loopback port
and sends the port to the others with ``broadcast_object``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

import sumflow.torch as hvd
from sumflow_bench.cpu import read_cpu_seconds

#: Element count of ResNet-50's parameters (torchvision's resnet50, 1000 classes).
RESNET50_ELEMENTS = 25_557_032
MB = 1e6


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """ResNet-50's parameter tensors, named and ordered as ``torchvision.models.resnet50()
    .named_parameters()`` gives them: the 7x7 stem, then bottleneck blocks (1x1, 3x3, 1x1
    convolutions of widths 64 to 512, expansion 4, a 1x1 projection shortcut in each
    stage's first block), each convolution followed by its batch norm's scale and shift,
    then the classifier. 161 tensors, 25,557,032 elements."""
    shapes: list[tuple[str, tuple[int, ...]]] = []

    def conv_bn(conv: str, bn: str, cin: int, cout: int, k: int) -> None:
        shapes.append((f"{conv}.weight", (cout, cin, k, k)))
        shapes.append((f"{bn}.weight", (cout,)))
        shapes.append((f"{bn}.bias", (cout,)))

    conv_bn("conv1", "bn1", 3, 64, 7)
    cin = 64
    for stage, (blocks, width) in enumerate([(3, 64), (4, 128), (6, 256), (3, 512)], start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            conv_bn(f"{p}.conv1", f"{p}.bn1", cin, width, 1)
            conv_bn(f"{p}.conv2", f"{p}.bn2", width, width, 3)
            conv_bn(f"{p}.conv3", f"{p}.bn3", width, width * 4, 1)
            if b == 0:
                conv_bn(f"{p}.downsample.0", f"{p}.downsample.1", cin, width * 4, 1)
            cin = width * 4
    shapes.append(("fc.weight", (1000, cin)))
    shapes.append(("fc.bias", (1000,)))
    return shapes


@dataclass
class GradientSet:
    """A flat float32 buffer and the per-tensor views into it (in model order)."""

    flat: torch.Tensor
    tensors: list[torch.Tensor]

    @classmethod
    def allocate(cls, shapes: Sequence[tuple[int, ...]]) -> GradientSet:
        """A zeroed buffer holding tensors of ``shapes``."""
        sizes = [_numel(s) for s in shapes]
        flat = torch.zeros(sum(sizes), dtype=torch.float32)
        tensors = []
        offset = 0
        for shape, n in zip(shapes, sizes, strict=True):
            tensors.append(flat[offset : offset + n].view(shape))
            offset += n
        return cls(flat, tensors)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def pattern(elements: int, rank: int) -> torch.Tensor:
    """What worker ``rank`` contributes: small integers (exact in float32 when summed)."""
    return (torch.arange(elements, dtype=torch.int64) % 1021 + rank).to(torch.float32)


def check_sum(result: torch.Tensor, mine: torch.Tensor, rank: int, size: int, what: str) -> None:
    """Raises unless ``result`` is exactly the sum over workers of what each contributed
    (worker r contributes ``pattern(n, r)``; ``mine`` is this worker's)."""
    expected = (mine - rank) * size + size * (size - 1) // 2
    if not torch.equal(result, expected):
        bad = int((result != expected).nonzero()[0].item())
        raise AssertionError(
            f"{what}: wrong sum at element {bad}: {result[bad].item()} instead of "
            f"{expected[bad].item()}"
        )


@dataclass
class Buckets:
    """DDP-style buckets: consecutive tensors (in the order given) flattened into buffers
    of at most ``cap_bytes`` each (a tensor larger than that gets a bucket of its own)."""

    members: list[list[int]]
    buffers: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def plan(cls, tensors: Sequence[torch.Tensor], order: Sequence[int], cap_bytes: int) -> Buckets:
        """Buckets over ``tensors`` taken in ``order``."""
        members: list[list[int]] = []
        current: list[int] = []
        current_bytes = 0
        for i in order:
            nbytes = tensors[i].numel() * tensors[i].element_size()
            if current and current_bytes + nbytes > cap_bytes:
                members.append(current)
                current, current_bytes = [], 0
            current.append(i)
            current_bytes += nbytes
        if current:
            members.append(current)
        buffers = [
            torch.empty(sum(tensors[i].numel() for i in m), dtype=torch.float32) for m in members
        ]
        return cls(members, buffers)


def sumflow_round(grads: GradientSet, names: Sequence[str], order: Sequence[int]) -> None:
    """push_pull_async every tensor in backward order with its layer's priority (lower is
    more urgent: the input side), then synchronize all."""
    handles = [
        hvd.push_pull_async(grads.tensors[i], average=False, name=names[i], priority=i)
        for i in order
    ]
    for h in handles:
        hvd.synchronize(h)


def gloo_round(grads: GradientSet, order: Sequence[int]) -> None:
    """all_reduce (sum) per tensor, all in flight, then wait for all."""
    works = [dist.all_reduce(grads.tensors[i], async_op=True) for i in order]
    for w in works:
        assert w is not None
        w.wait()


def gloo_bucketed_round(grads: GradientSet, buckets: Buckets) -> None:
    """Copy each bucket's tensors into its buffer and all_reduce it as soon as it is
    full, as DDP does; after all are done, copy the sums back."""
    works = []
    for members, buffer in zip(buckets.members, buckets.buffers, strict=True):
        offset = 0
        for i in members:
            n = grads.tensors[i].numel()
            buffer[offset : offset + n].copy_(grads.tensors[i].view(-1))
            offset += n
        works.append(dist.all_reduce(buffer, async_op=True))
    for members, buffer, work in zip(buckets.members, buckets.buffers, works, strict=True):
        assert work is not None
        work.wait()
        offset = 0
        for i in members:
            n = grads.tensors[i].numel()
            grads.tensors[i].view(-1).copy_(buffer[offset : offset + n])
            offset += n


def init_gloo(rank: int, size: int, timeout_s: float) -> str:
    """Starts torch.distributed with gloo; returns how the rendezvous was found."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        dist.init_process_group(
            "gloo", init_method="env://", rank=rank, world_size=size, timeout=timeout
        )
        return f"env:// {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    # sumflow-run sets no MASTER_ADDR/MASTER_PORT: rank 0 listens on a port the kernel
    # picks and tells the others through sumflow. Everything stays on loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    host = "127.0.0.1"
    if rank == 0:
        store = dist.TCPStore(
            host, 0, size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        port = hvd.broadcast_object(store.port, root_rank=0, name="gloo.port")
    else:
        port = hvd.broadcast_object(None, root_rank=0, name="gloo.port")
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    return f"TCPStore {host}:{port} (port from rank 0 via broadcast_object)"


def num_servers() -> int | None:
    """The job's summation servers, when the plugin tells (not part of Horovod's API)."""
    try:
        from sumflow.torch import _runtime

        return int(_runtime.current().service.num_servers)
    except (ImportError, AttributeError, ValueError):
        return None


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(path: str) -> list[str]:
    """The fields of a /proc stat file after the command name (field 3 onwards)."""
    with open(path) as f:
        text = f.read()
    return text[text.rindex(")") + 2 :].split()


def _role(pid: int, root: int) -> str:
    """What a process of the job is, from its command line."""
    if pid == root:
        return "launcher"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return "other"
    line = " ".join(argv)
    if "sumflow-server" in line or "run_server" in line:
        return "server"
    if "sumflow-coordinator" in line or "run_coordinator" in line:
        return "coordinator"
    # The worker runs it as a module (python -m) or as a file, by its path.
    if any(a.endswith(("sumflow_bench.pushpull_vs_gloo", "pushpull_vs_gloo.py")) for a in argv):
        return "worker"
    return "other"


#: The counters a profile adds up per thread, in this order.
COUNTERS = ("user s", "sys s", "page faults", "context switches")
#: A profile's reading: per (pid, tid), the thread's role, group and COUNTERS.
Snapshot = dict[tuple[int, int], tuple[str, str, list[float]]]


class CpuProfile:
    """CPU time, minor page faults and context switches of every thread of every process
    of this job on this machine (the descendants of this worker's parent, the launcher),
    read from /proc (Linux only). Threads are grouped by role (worker, server,
    coordinator, launcher) and by thread name with digits dropped (``sumflow-recv-3``
    counts as ``sumflow-recv-#``)."""

    def __init__(self) -> None:
        self.root = os.getppid()
        self.totals: dict[str, dict[tuple[str, str], list[float]]] = {}
        self.walls: dict[str, float] = {}
        self.rounds: dict[str, int] = {}

    def _processes(self) -> dict[int, str]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    ppid = int(_stat_fields(f"/proc/{entry}/stat")[1])
                except (OSError, ValueError, IndexError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
        found: dict[int, str] = {}
        todo = [self.root]
        while todo:
            pid = todo.pop()
            found[pid] = _role(pid, self.root)
            todo.extend(children.get(pid, []))
        return found

    def snapshot(self) -> Snapshot:
        """(pid, tid) -> (role, thread group, the COUNTERS so far)."""
        out = {}
        for pid, role in self._processes().items():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                task = f"/proc/{pid}/task/{tid}"
                try:
                    with open(f"{task}/comm") as f:
                        name = f.read().strip()
                    fields = _stat_fields(f"{task}/stat")
                    with open(f"{task}/status") as f:
                        switches = sum(
                            int(line.split()[1]) for line in f if "ctxt_switches" in line
                        )
                except (OSError, ValueError):
                    continue
                group = "".join("#" if c.isdigit() else c for c in name)
                while "##" in group:
                    group = group.replace("##", "#")
                counters = [
                    int(fields[11]) / CLOCK_TICKS,
                    int(fields[12]) / CLOCK_TICKS,
                    float(fields[7]),
                    float(switches),
                ]
                out[(pid, int(tid))] = (role, group, counters)
        # The whole machine (busy, exact: see read_cpu_seconds; and steal), to tell what
        # other processes and the hypervisor took meanwhile.
        with open("/proc/stat") as f:
            stat = f.read()
        busy = read_cpu_seconds(stat)[0]
        cpu = [int(v) / CLOCK_TICKS for v in stat.split("\n", 1)[0].split()[1:]]
        out[(0, 0)] = ("machine", "all", [busy, cpu[7] if len(cpu) > 7 else 0.0, 0.0, 0.0])
        return out

    def add(self, method: str, before: Snapshot, after: Snapshot, wall: float) -> None:
        """Adds what was spent between two snapshots to ``method``'s totals."""
        totals = self.totals.setdefault(method, {})
        for key, (role, group, now) in after.items():
            then = before.get(key, (role, group, [0.0] * len(COUNTERS)))[2]
            row = totals.setdefault((role, group), [0.0] * len(COUNTERS))
            for i, (a, b) in enumerate(zip(now, then, strict=True)):
                row[i] += a - b
        self.walls[method] = self.walls.get(method, 0.0) + wall
        self.rounds[method] = self.rounds.get(method, 0) + 1

    def per_round(self, method: str) -> dict[tuple[str, str], list[float]]:
        """(role, thread group) -> the COUNTERS per round of ``method``."""
        n = self.rounds[method]
        return {k: [v / n for v in row] for k, row in self.totals[method].items()}

    def report(self) -> str:
        """Markdown: per method, per round, by role and by thread group."""
        cores = os.cpu_count() or 1
        lines = []
        for method in self.totals:
            rows = self.per_round(method)
            busy, steal = rows.pop(("machine", "all"), [0.0, 0.0])[:2]
            wall = self.walls[method] / self.rounds[method]
            cpu = sum(r[0] + r[1] for r in rows.values())
            lines.append(
                f"\n{method}: {wall:.3f} s wall per round (barrier to barrier), "
                f"{cpu:.3f} CPU s per round = {cpu / wall / cores:.0%} of {cores} cores; "
                f"other processes on the machine {max(0.0, busy - cpu):.3f} CPU s, "
                f"steal {steal:.3f} s"
            )
            lines.append("\n| role | thread | " + " | ".join(COUNTERS) + " |")
            lines.append("|---|---|" + "---|" * len(COUNTERS))
            by_role: dict[str, list[float]] = {}
            for (role, _), row in rows.items():
                total = by_role.setdefault(role, [0.0] * len(COUNTERS))
                for i, v in enumerate(row):
                    total[i] += v
            for role, total in sorted(by_role.items(), key=lambda x: -(x[1][0] + x[1][1])):
                if total[0] + total[1] < 0.0005:
                    continue
                cells = " | ".join(f"**{_fmt(v)}**" for v in total)
                lines.append(f"| **{role}** | all | {cells} |")
                for (r, group), row in sorted(rows.items(), key=lambda x: -(x[1][0] + x[1][1])):
                    if r == role and row[0] + row[1] >= 0.005:
                        lines.append(f"| {role} | {group} | {' | '.join(_fmt(v) for v in row)} |")
        return "\n".join(lines)


def _fmt(value: float) -> str:
    return f"{value:.3f}" if value < 100 else f"{value:,.0f}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m sumflow_bench.pushpull_vs_gloo",
        description="sumflow push_pull vs gloo all_reduce on ResNet-50's gradient set",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--reps", type=int, default=10, help="timed rounds of each method")
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed rounds of each method first (>= 1)"
    )
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="gloo bucket cap, MiB")
    parser.add_argument("--timeout", type=float, default=300.0, help="gloo timeout, seconds")
    parser.add_argument("--json", type=Path, help="write the measurements to this JSON file")
    parser.add_argument("--plot", type=Path, help="write a box plot of goodput to this PNG")
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated methods to run, of " + ", ".join(METHODS),
    )
    parser.add_argument(
        "--cpu-profile",
        action="store_true",
        help="also report where CPU time goes in each method's rounds: every thread of "
        "every process of the job on this machine, from /proc (adds a barrier after each "
        "round; Linux only)",
    )
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 1:
        parser.error("--reps and --warmup must be at least 1")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown or not args.methods:
        parser.error(f"--methods: choose from {', '.join(METHODS)} (not {', '.join(unknown)})")
    return args


Method = tuple[str, Callable[[], None], GradientSet]
#: The methods on the command line, and their labels in the output.
METHODS = {"sumflow": "sumflow", "gloo": "gloo", "gloo-bucketed": "gloo bucketed"}


def describe(times: Sequence[float], nbytes: int) -> dict[str, float]:
    """Summary of per-round times: median and best round, goodput per worker."""
    median = statistics.median(times)
    best = min(times)
    return {
        "median_s": median,
        "best_s": best,
        "median_goodput_MBps": nbytes / median / MB,
        "best_goodput_MBps": nbytes / best / MB,
    }


def plot(path: Path, results: dict[str, list[float]], nbytes: int, title: str) -> None:
    """A box plot of per-round goodput per worker, one box per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    data = [[nbytes / t / MB for t in results[m]] for m in labels]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.boxplot(data, tick_labels=labels, showmeans=False, widths=0.5)
    for x, values in enumerate(data, start=1):
        ax.scatter([x] * len(values), values, s=10, alpha=0.5, color="tab:blue", zorder=3)
        ax.annotate(
            f"{statistics.median(values):.0f}",
            (x + 0.28, statistics.median(values)),
            va="center",
            fontsize=9,
        )
    ax.set_ylabel("goodput per worker (MB/s, higher is better)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status."""
    args = parse_args(argv)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    use_gloo = any(m.startswith("gloo") for m in args.methods)
    rendezvous = init_gloo(rank, size, args.timeout) if use_gloo else "not used"
    servers = num_servers()

    named = resnet50_shapes()
    names = [f"grad.{n}" for n, _ in named]
    shapes = [s for _, s in named]
    elements = sum(_numel(s) for s in shapes)
    assert len(shapes) == 161, len(shapes)
    assert elements == RESNET50_ELEMENTS, elements
    nbytes = elements * 4
    backward = list(reversed(range(len(shapes))))  # the classifier's gradient comes first

    mine = pattern(elements, rank)
    methods: list[Method] = []
    for method in METHODS:
        if method not in args.methods:
            continue
        grads = GradientSet.allocate(shapes)
        run: Callable[[], None]
        if method == "sumflow":
            run = functools.partial(sumflow_round, grads, names, backward)
        elif method == "gloo":
            run = functools.partial(gloo_round, grads, backward)
        else:
            buckets = Buckets.plan(grads.tensors, backward, int(args.bucket_mb * 1024 * 1024))
            run = functools.partial(gloo_bucketed_round, grads, buckets)
        methods.append((METHODS[method], run, grads))
    bucket_count = len(
        Buckets.plan(methods[0][2].tensors, backward, int(args.bucket_mb * 1024 * 1024)).members
    )

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    log(
        f"ResNet-50 gradient set: {len(shapes)} float32 tensors, {elements:,} elements, "
        f"{nbytes / MB:.1f} MB per worker; {size} workers, "
        f"{servers if servers is not None else '?'} summation servers; gloo: {rendezvous}, "
        f"{bucket_count} buckets of at most {args.bucket_mb:g} MiB"
    )

    profile = CpuProfile() if args.cpu_profile else None

    def timed(label: str, run: Callable[[], None], grads: GradientSet) -> float:
        grads.flat.copy_(mine)
        hvd.barrier()
        if profile is None or rank != 0:
            start = time.perf_counter()
            run()
            elapsed = time.perf_counter() - start
        else:
            before = profile.snapshot()
            start = time.perf_counter()
            run()
            elapsed = time.perf_counter() - start
        if profile is not None:
            # Every worker's round is over: what the job's threads used is this round's.
            hvd.barrier()
            if rank == 0 and measuring:
                profile.add(label, before, profile.snapshot(), time.perf_counter() - start)
        return elapsed

    def slowest(local: Sequence[float], name: str) -> list[float]:
        """Per method, the slowest worker's time: every worker's times summed into a
        (workers x methods) table."""
        table = torch.zeros(size, len(local), dtype=torch.float64)
        table[rank] = torch.tensor(local, dtype=torch.float64)
        table = hvd.allreduce(table, op=hvd.Sum, name=name)
        return [float(v) for v in table.max(dim=0).values]

    measuring = False
    for w in range(args.warmup):
        local = []
        for label, run, grads in methods:
            local.append(timed(label, run, grads))
            if w == 0:
                check_sum(grads.flat, mine, rank, size, label)
        times = slowest(local, "bench.times")
        log(
            f"warm-up {w + 1}/{args.warmup}: "
            + ", ".join(f"{m[0]} {t:.3f} s" for m, t in zip(methods, times, strict=True))
            + ("; every sum checked exactly" if w == 0 else "")
        )

    results: dict[str, list[float]] = {m[0]: [] for m in methods}
    measuring = True
    for r in range(args.reps):
        local = [timed(label, run, grads) for label, run, grads in methods]
        times = slowest(local, "bench.times")
        for (label, _, _), t in zip(methods, times, strict=True):
            results[label].append(t)
        log(
            f"round {r + 1}/{args.reps}: "
            + " | ".join(
                f"{m[0]} {t:.3f} s ({nbytes / t / MB:.0f} MB/s)"
                for m, t in zip(methods, times, strict=True)
            )
        )

    summary = {label: describe(times, nbytes) for label, times in results.items()}
    ref = summary.get("sumflow")
    ratios = {
        label: {
            "median": ref["median_goodput_MBps"] / s["median_goodput_MBps"],
            "best": ref["best_goodput_MBps"] / s["best_goodput_MBps"],
        }
        for label, s in summary.items()
        if label != "sumflow" and ref is not None
    }
    if rank == 0:
        print()
        print(
            "| method | median round | median goodput per worker | best goodput per worker "
            "| sumflow / method, median | sumflow / method, best |"
        )
        print("|---|---|---|---|---|---|")
        for label, s in summary.items():
            r_med = f"**{ratios[label]['median']:.2f}x**" if label in ratios else "-"
            r_best = f"{ratios[label]['best']:.2f}x" if label in ratios else "-"
            print(
                f"| {label} | {s['median_s']:.3f} s | {s['median_goodput_MBps']:.0f} MB/s "
                f"| {s['best_goodput_MBps']:.0f} MB/s | {r_med} | {r_best} |"
            )
        report = {
            "workers": size,
            "servers": servers,
            "tensors": len(shapes),
            "elements": elements,
            "bytes_per_worker": nbytes,
            "bucket_mib": args.bucket_mb,
            "gloo_buckets": bucket_count,
            "reps": args.reps,
            "warmup": args.warmup,
            "round_seconds": results,
            "summary": summary,
            "ratio_sumflow_over": ratios,
        }
        if profile is not None:
            print("\nCPU time per round, every process of the job on this machine:")
            print(profile.report())
            report["cpu_profile"] = {
                method: {
                    " / ".join(k): (
                        dict(zip(COUNTERS, row, strict=True))
                        if k != ("machine", "all")
                        else {"busy s": row[0], "steal s": row[1]}
                    )
                    for k, row in profile.per_round(method).items()
                }
                for method in profile.totals
            }
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
            print(f"\nwrote {args.json}")
        if args.plot is not None:
            title = (
                f"ResNet-50 gradients ({nbytes / MB:.0f} MB), {size} workers, "
                f"{servers if servers is not None else '?'} summation servers, loopback\n"
                + ", ".join(f"sumflow / {k}: {v['median']:.2f}x" for k, v in ratios.items())
                + (" (medians)" if ratios else "")
            )
            plot(args.plot, results, nbytes, title)
            print(f"wrote {args.plot}")
    if use_gloo:
        dist.destroy_process_group()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
