"""Training-benchmark worker: trains a sleeping model of a layer profile and times it.

Run on every worker process by a launcher:

    sumflow-run -np 2 --servers 1 python -m sumflow_bench.train_worker \\
        --system sumflow --profile resnet50 --size-scale 0.13 --time-scale 3.3 --json out.json
    sumflow-run -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29517 --shutdown-grace 1 \\
        python -m sumflow_bench.train_worker --system ddp-gloo --profile resnet50 ...

The model (:mod:`sumflow_bench.model`) sleeps each layer's forward and backward time of
the profile (``--profile``: a built-in name or a JSON file, then ``--size-scale`` and
``--time-scale``, see :func:`sumflow.profiles.scale`) and gives every parameter a
gradient, so an iteration takes the profile's compute plus whatever communication does
not overlap it. Systems:

- ``sumflow``: ``hvd.DistributedOptimizer`` around SGD, parameters broadcast from rank 0
  (the job comes from ``sumflow-run``'s environment); ``--partition-bytes`` sets
  ``SUMFLOW_PARTITION_BYTES``; ``--fusion-threshold`` fuses gradients (lazy allreduce);
  ``--cross-barrier`` crosses the global barrier (step() returns at once, each parameter
  is updated when its sum arrives, and the next forward waits per layer), so the order
  the scheduler (``SUMFLOW_SCHEDULER``) sends partitions in decides how much of the next
  forward overlaps communication; ``--compression SPEC`` sends gradients through a
  compressor (``Compression.parse``: ``fp16``, ``topk:ratio=0.01``...); ``--csc DENSITY``
  trains with ``CoarseSparseSGD`` instead (it communicates inside its step);
- ``ddp-gloo``: ``DistributedDataParallel`` over a gloo process group (env://:
  ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), ``--bucket-cap-mb`` (25).

An iteration is ``zero_grad``, forward, backward, step. Across the barrier, waiting moves
from step into the next forward's layers; the timed window ends once the last step's
parameters are all updated, so no communication escapes the measurement. The first one is
checked, not
timed: every gradient must be the exact average of the workers' (each worker's model has
its own gradient values; not checked when compression changes what arrives) and every
parameter must be equal on all workers (per-tensor
float64 sums compared with rank 0's via the system's own broadcast); any difference stops
the job with the tensor's name. Then ``--warmup`` iterations, a barrier, and
``--iterations`` timed ones. Rank 0 prints progress to stderr and writes ``--json``:
iterations/s (measured iterations over their wall time on rank 0), per-iteration times,
the time the model slept computing, and idle = iteration - compute, per rank too.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sumflow import profiles, settings
from sumflow_bench.model import SleepingModel, build_model, expected_average

SYSTEMS = ("sumflow", "ddp-gloo")
#: Variables torch.distributed's env:// rendezvous reads.
GLOO_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docs)."""
    p = argparse.ArgumentParser(
        prog="python -m sumflow_bench.train_worker",
        description=(__doc__ or "").split("\n\n")[0],
    )
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument(
        "--profile",
        required=True,
        help=f"built-in profile ({', '.join(profiles.names())}) or a profile JSON file",
    )
    p.add_argument("--size-scale", type=float, default=1.0, help="tensor size factor [1]")
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="compute time factor, 0 for none [1]"
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations after the check [3]")
    p.add_argument("--iterations", type=int, default=20, help="timed iterations [20]")
    p.add_argument("--json", type=Path, help="where rank 0 writes the results")
    p.add_argument(
        "--partition-bytes",
        type=int,
        help="sumflow: largest partition (SUMFLOW_PARTITION_BYTES) [sumflow's default]",
    )
    p.add_argument(
        "--cross-barrier",
        action="store_true",
        help="sumflow: cross the global barrier (parameters updated as their sums arrive)",
    )
    p.add_argument(
        "--fusion-threshold",
        type=int,
        default=0,
        help="sumflow: fuse gradients into spans of at least this many bytes, 0 for none [0]",
    )
    p.add_argument(
        "--compression",
        metavar="SPEC",
        help="sumflow: send gradients through this compressor (Compression.parse) [none]",
    )
    p.add_argument(
        "--csc",
        type=float,
        metavar="DENSITY",
        help="sumflow: train with CoarseSparseSGD sending this fraction of chunks [off]",
    )
    p.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="ddp-gloo: DDP bucket size [25]"
    )
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate [0.01]")
    p.add_argument(
        "--progress-every", type=int, default=10, help="rank 0's progress line period [10]"
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="ddp-gloo: rendezvous/collective timeout [300]"
    )
    args = p.parse_args(argv)
    for name in ("size_scale", "time_scale", "bucket_cap_mb", "lr", "timeout"):
        v = getattr(args, name)
        # A time scale of 0 is a model that computes nothing: communication alone.
        if not math.isfinite(v) or v < 0 or (v == 0 and name != "time_scale"):
            bound = ">= 0" if name == "time_scale" else "> 0"
            p.error(f"--{name.replace('_', '-')} must be {bound}, got {v}")
    if args.iterations < 1 or args.warmup < 0 or args.progress_every < 1:
        p.error("--iterations and --progress-every must be >= 1, --warmup >= 0")
    if args.partition_bytes is not None and args.partition_bytes < 4:
        p.error(f"--partition-bytes must be >= 4, got {args.partition_bytes}")
    if args.fusion_threshold < 0:
        p.error(f"--fusion-threshold must be >= 0, got {args.fusion_threshold}")
    if args.cross_barrier and args.system != "sumflow":
        p.error("--cross-barrier is sumflow's (DDP always waits for its buckets in backward)")
    if (args.compression is not None or args.csc is not None) and args.system != "sumflow":
        p.error("--compression and --csc are sumflow's")
    if args.csc is not None:
        if not 0.0 < args.csc <= 1.0:
            p.error(f"--csc must be in (0, 1], got {args.csc}")
        if args.cross_barrier or args.fusion_threshold or args.compression is not None:
            p.error("--csc communicates in its own step: no --cross-barrier, fusion or compression")
    if args.compression is not None:
        from sumflow.torch.compression import Compression

        try:
            Compression.parse(args.compression)
        except ValueError as e:
            p.error(f"--compression: {e}")
    return args


class CheckFailed(RuntimeError):
    """The first step's gradients or parameters are not what synchronous training gives."""


class System:
    """What the benchmark needs from a training system."""

    name: str
    rank: int
    size: int
    model: SleepingModel
    #: What forward is called on (the model itself, or its DDP wrapper).
    net: torch.nn.Module
    optimizer: torch.optim.Optimizer
    #: Whether gradients arrive as the exact average (no lossy compression).
    exact: bool = True

    def step(self) -> float:
        """Waits for gradient communication, then steps; returns the seconds of the local
        update alone."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def drain(self) -> None:
        """Returns once every parameter holds the last step's update."""

    def broadcast_(self, t: torch.Tensor, name: str) -> None:
        """Overwrites `t` with rank 0's, in place."""
        raise NotImplementedError

    def sum_(self, t: torch.Tensor, name: str) -> None:
        """Sums `t` over workers, in place."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Sumflow(System):
    """``sumflow.torch`` with Horovod's recipe."""

    name = "sumflow"
    #: The schedule the gradients were declared with (``CommunicationService.schedule``).
    schedule: dict[str, Any]

    def __init__(self, profile: profiles.ModelProfile, args: argparse.Namespace) -> None:
        if args.partition_bytes is not None:
            os.environ[settings.PARTITION_BYTES.name] = str(args.partition_bytes)
        import sumflow.torch as hvd
        from sumflow.torch import _runtime

        self.hvd = hvd
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.model = self.net = build_model(profile, seed=self.rank)
        self.cross_barrier = args.cross_barrier
        self.csc = args.csc is not None
        self.exact = not self.csc and args.compression in (None, "none")
        self.optimizer = self._optimizer(args)
        # The optimizer declared the gradients: the partition size they got (derived
        # unless --partition-bytes set one) and the credit, before any tuning.
        self.schedule = _runtime.current().service.schedule()
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)

    def _optimizer(self, args: argparse.Namespace) -> torch.optim.Optimizer:
        """CSC's optimizer, or SGD in a ``DistributedOptimizer``."""
        import sumflow.torch as hvd

        if self.csc:
            return hvd.CoarseSparseSGD(
                self.model.parameters(), lr=args.lr, density=args.csc, warmup_steps=0
            )
        opt = torch.optim.SGD(self.model.parameters(), lr=args.lr)
        crossing: dict[str, Any] = (
            {"cross_barrier": True, "model": self.model} if self.cross_barrier else {}
        )
        try:
            return hvd.DistributedOptimizer(
                opt,
                named_parameters=self.model.named_parameters(),
                fusion_threshold=args.fusion_threshold,
                compression=hvd.Compression.parse(args.compression or "none"),
                **crossing,
            )
        except TypeError as e:
            if not self.cross_barrier:
                raise
            raise SystemExit(
                f"train_worker --cross-barrier: this sumflow.torch cannot cross the global "
                f"barrier ({e})"
            ) from None

    def step(self) -> float:
        if self.csc:
            # CSC sends the important chunks and updates their weights in one step.
            started = time.perf_counter()
            self.optimizer.step()
            return time.perf_counter() - started
        if self.cross_barrier:
            # Returns at once: the updates happen as the sums arrive.
            started = time.perf_counter()
            self.optimizer.step()
            return time.perf_counter() - started
        # synchronize() then step() inside skip_synchronize() is what step() does; split,
        # so the local update's own time can be reported.
        self.optimizer.synchronize()  # type: ignore[attr-defined]
        started = time.perf_counter()
        with self.optimizer.skip_synchronize():  # type: ignore[attr-defined]
            self.optimizer.step()
        return time.perf_counter() - started

    def barrier(self) -> None:
        self.hvd.barrier()

    def drain(self) -> None:
        if self.cross_barrier:
            self.optimizer.synchronize()  # type: ignore[attr-defined]

    def broadcast_(self, t: torch.Tensor, name: str) -> None:
        self.hvd.broadcast_(t, root_rank=0, name=f"train_worker.{name}")

    def sum_(self, t: torch.Tensor, name: str) -> None:
        self.hvd.allreduce_(t, op=self.hvd.Sum, name=f"train_worker.{name}")

    def close(self) -> None:
        self.hvd.shutdown()


class DdpGloo(System):
    """``DistributedDataParallel`` over gloo."""

    name = "ddp-gloo"

    def __init__(self, profile: profiles.ModelProfile, args: argparse.Namespace) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        missing = [v for v in GLOO_ENV if not os.environ.get(v)]
        if missing:
            raise SystemExit(gloo_env_error(missing))
        self.dist = dist
        dist.init_process_group(
            "gloo", init_method="env://", timeout=datetime.timedelta(seconds=args.timeout)
        )
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.model = build_model(profile, seed=self.rank)
        # DDP broadcasts rank 0's parameters when it wraps the model.
        self.net = DistributedDataParallel(self.model, bucket_cap_mb=args.bucket_cap_mb)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=args.lr)

    def step(self) -> float:
        # DDP's backward returns only once every bucket is reduced.
        started = time.perf_counter()
        self.optimizer.step()
        return time.perf_counter() - started

    def barrier(self) -> None:
        self.dist.barrier()

    def broadcast_(self, t: torch.Tensor, name: str) -> None:
        self.dist.broadcast(t, src=0)

    def sum_(self, t: torch.Tensor, name: str) -> None:
        self.dist.all_reduce(t)

    def close(self) -> None:
        # Every rank is done with the group before any tears it down, and DDP's reducer
        # (which owns gloo work and threads) goes before the group does: tearing down in
        # another order aborted a rank now and then ("terminate called without an active
        # exception").
        self.dist.barrier()
        del self.net
        self.dist.destroy_process_group()


def gloo_env_error(missing: Sequence[str]) -> str:
    """The message for a ddp-gloo worker started without env:// rendezvous variables."""
    return (
        f"train_worker --system ddp-gloo: {', '.join(missing)} not set; torch.distributed's "
        f"env:// rendezvous needs {', '.join(GLOO_ENV)}. sumflow-run sets RANK and "
        "WORLD_SIZE; give the others with e.g. -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29517"
    )


def load_profile(args: argparse.Namespace) -> profiles.ModelProfile:
    """The profile named by ``--profile``, scaled unless both scales are 1."""
    profile = profiles.load(args.profile)
    if args.size_scale != 1.0 or args.time_scale != 1.0:
        profile = profiles.scale(profile, size_scale=args.size_scale, time_scale=args.time_scale)
    return profile


def iteration(system: System) -> tuple[float, float, float, float]:
    """One training iteration; returns its seconds, the seconds the model spent computing,
    the seconds of the local optimizer update, and the backward pass's wall seconds (its
    compute and the framework's work between layers: gradient hooks, handing gradients
    to communication; with sumflow it never waits for communication, DDP's backward()
    also waits for its last buckets' all-reduce)."""
    clock = system.model.clock
    started, computed = time.perf_counter(), clock.total_s
    system.optimizer.zero_grad()
    loss = system.net().sum()
    backward_started = time.perf_counter()
    loss.backward()
    backward = time.perf_counter() - backward_started
    update = system.step()
    return time.perf_counter() - started, clock.total_s - computed, update, backward


def check_first_step(system: System) -> None:
    """After the first step: every gradient is the average of the workers' first
    gradients (unless compression makes it another), and every parameter equals rank 0's.
    Raises CheckFailed naming the tensor."""
    want = expected_average(0, range(system.size))
    named = list(system.model.named_parameters())
    for name, p in named:
        if not system.exact:
            break
        if p.grad is None:
            raise CheckFailed(f"rank {system.rank}: parameter {name} has no gradient")
        lo, hi = torch.aminmax(p.grad)
        if not (
            math.isclose(lo.item(), want, rel_tol=1e-6)
            and math.isclose(hi.item(), want, rel_tol=1e-6)
        ):
            raise CheckFailed(
                f"rank {system.rank}: the gradient of {name} is in [{lo.item()!r}, "
                f"{hi.item()!r}] after the first step, not the average over "
                f"{system.size} workers, {want!r}"
            )
    # Float64 sums of float32 tensors are exact enough that equal tensors give equal sums
    # and a broadcast of them is a bit-exact copy.
    mine = torch.tensor([p.detach().sum(dtype=torch.float64).item() for _, p in named])
    root = mine.clone()
    system.broadcast_(root, "parameter_sums")
    differ = (mine != root).nonzero().flatten().tolist()
    if differ:
        i = differ[0]
        raise CheckFailed(
            f"rank {system.rank}: after the first step, {len(differ)} of {len(named)} "
            f"parameters differ from rank 0's, first {named[i][0]} (sum {mine[i].item()!r} "
            f"here, {root[i].item()!r} on rank 0)"
        )


def gather(system: System, values: Sequence[float], name: str) -> list[list[float]]:
    """Every rank's `values` (all of the same length), by rank."""
    table = torch.zeros(system.size, len(values), dtype=torch.float64)
    table[system.rank] = torch.tensor(values, dtype=torch.float64)
    system.sum_(table, name)
    return table.tolist()


def _describe(times: Sequence[float]) -> dict[str, float]:
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {"median": statistics.median(ordered), "p90": p90, "mean": statistics.fmean(ordered)}


def run(args: argparse.Namespace, profile: profiles.ModelProfile) -> dict[str, Any] | None:
    """Trains `profile`'s model and times it; returns rank 0's results (None on other
    ranks)."""
    system: System = Sumflow(profile, args) if args.system == "sumflow" else DdpGloo(profile, args)
    lead = system.rank == 0

    def log(line: str) -> None:
        if lead:
            print(
                f"train_worker[{system.name} {profile.name}]: {line}", file=sys.stderr, flush=True
            )

    log(
        f"{system.size} workers; {profile.summary()}; size x{args.size_scale:g}, "
        f"time x{args.time_scale:g}"
    )
    iteration(system)
    system.drain()
    check_first_step(system)
    checked = "gradients are the workers' average, " if system.exact else ""
    log(f"first step checked: {checked}parameters agree")
    # Start-up's objects (torch's import, the model) go to the collector's permanent
    # generation: its first full pass over them otherwise stalls one timed iteration of
    # every worker at the same step, for about half a second on the emulated cluster.
    gc.collect()
    gc.freeze()
    for _ in range(args.warmup):
        iteration(system)
    system.barrier()
    window = [time.time()]
    started = time.perf_counter()
    times, computes, updates, backwards = [], [], [], []
    for i in range(1, args.iterations + 1):
        t, c, u, b = iteration(system)
        times.append(t)
        computes.append(c)
        updates.append(u)
        backwards.append(b)
        if i % args.progress_every == 0 or i == args.iterations:
            elapsed = time.perf_counter() - started
            log(
                f"iteration {i}/{args.iterations}: {i / elapsed:.2f} it/s, last {t * 1e3:.0f} ms "
                f"(compute {c * 1e3:.0f} ms, idle {(t - c) * 1e3:.0f} ms)"
            )
    system.drain()
    wall = time.perf_counter() - started
    window.append(time.time())
    idles = [t - c for t, c in zip(times, computes, strict=True)]
    all_times = gather(system, times, "iteration_seconds")
    all_computes = gather(system, computes, "compute_seconds")
    system.close()
    if not lead:
        return None
    per_rank = [
        {
            "rank": r,
            "iteration_median_s": statistics.median(all_times[r]),
            "compute_median_s": statistics.median(all_computes[r]),
            "idle_median_s": statistics.median(
                [t - c for t, c in zip(all_times[r], all_computes[r], strict=True)]
            ),
        }
        for r in range(system.size)
    ]
    it = _describe(times)
    schedule = system.schedule if isinstance(system, Sumflow) else {}
    return {
        "system": system.name,
        "profile": profile.name,
        "profile_arg": args.profile,
        "size_scale": args.size_scale,
        "time_scale": args.time_scale,
        "workers": system.size,
        "param_bytes": profile.param_bytes,
        "tensors": profile.num_tensors,
        "profile_compute_ms": profile.compute_ms,
        "partition_bytes": schedule.get("partition_bytes"),
        "partition_derived": schedule.get("derived"),
        "partition_reason": schedule.get("partition_reason"),
        "credit_bytes": schedule.get("credit_bytes"),
        "fusion_threshold": args.fusion_threshold if system.name == "sumflow" else None,
        "compression": args.compression,
        "csc_density": args.csc,
        "cross_barrier": args.cross_barrier,
        "scheduler": settings.SCHEDULER.get() if system.name == "sumflow" else None,
        "bucket_cap_mb": args.bucket_cap_mb if system.name == "ddp-gloo" else None,
        "warmup": args.warmup,
        "iterations": args.iterations,
        "wall_s": wall,
        "iterations_per_s": args.iterations / wall,
        "iteration_median_s": it["median"],
        "iteration_p90_s": it["p90"],
        "compute_ms": statistics.median(computes) * 1e3,
        "idle_ms": statistics.median(idles) * 1e3,
        "update_ms": statistics.median(updates) * 1e3,
        "backward_ms": statistics.median(backwards) * 1e3,
        "iteration_s": times,
        "compute_s": computes,
        "idle_s": idles,
        "update_s": updates,
        "backward_s": backwards,
        "per_rank": per_rank,
        "checked": True,
        "window": window,
        "host": platform.node(),
        "torch": torch.__version__,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    # The model computes by sleeping, so torch's intra-op threads have nothing to do but
    # spin after each clone and fill, on cores the other emulated hosts need: with them, a
    # job of 4 workers on this 2-core machine spent 229-261 ms per iteration inside layers
    # whose profile says 100 (106 and 100 with one thread), and stretched the backward of
    # whichever workers were receiving sums meanwhile.
    torch.set_num_threads(1)
    try:
        profile = load_profile(args)
    except ValueError as e:
        print(f"train_worker: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        result = run(args, profile)
    except CheckFailed as e:
        print(f"train_worker: check failed: {e}", file=sys.stderr, flush=True)
        return 3
    if result is not None:
        print(
            f"train_worker[{result['system']} {result['profile']}]: "
            f"{result['iterations_per_s']:.3f} it/s over {result['workers']} workers; "
            f"iteration median {result['iteration_median_s'] * 1e3:.0f} ms "
            f"(p90 {result['iteration_p90_s'] * 1e3:.0f} ms), compute "
            f"{result['compute_ms']:.0f} ms, idle {result['idle_ms']:.0f} ms",
            flush=True,
        )
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.system == "ddp-gloo":
        # Skips the interpreter's teardown: a gloo thread still joinable in a static object
        # aborts a rank now and then at exit ("terminate called without an active
        # exception") after everything was measured and written, failing the job.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
