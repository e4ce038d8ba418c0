"""The training benchmark's plan: which systems run on which (profile, bandwidth) cells, in
what order, and about how long that takes.

A *cell* is one layer profile scaled for one reference bandwidth (``--reference-gbits``);
a *system* is one way of training it (DDP over gloo, sumflow with a scheduler, ...). The
systems of a cell run back to back, so they are compared under the same load on this
shared machine; cells are ordered by bandwidth first (as given, lowest first by default),
so a run cut short still has every profile at the bandwidths that came first.
``bytescheduler-tuned`` (and ``prophet-tuned``) is two jobs: a tuning run, then the
measured run that reuses the configuration the tuner persisted.

Everything here is pure: :func:`plan` and :func:`estimate_seconds` are tested without a
network.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sumflow import profiles
from sumflow.tune.space import ALIGN, SearchSpace
from sumflow_bench.scaling import EmulationScales, scales_for_emulation

#: The scheduler benchmark's systems, in the order a cell runs them (issue 6).
SCHEDULER_SYSTEMS = (
    "fifo",
    "p3",
    "bytescheduler",
    "bytescheduler-tuned",
    "bytescheduler-fusion",
    "prophet",
    "prophet-tuned",
    "bytescheduler-fp16",
    "bytescheduler-topk",
    "csc",
    "ddp",
)
#: The compressing systems' settings (issue 7): a Compression.parse spec, or CSC's density.
FP16 = "fp16"
TOPK = "topk:ratio=0.01"
CSC_DENSITY = 0.15
#: The schedulers a ``-tuned`` system can tune: those with a credit.
TUNABLE = ("bytescheduler", "prophet")
#: What SUMFLOW_SCHEDULER selects in sumflow's communication service.
CORE_SCHEDULERS = ("fifo", "p3", "bytescheduler", "prophet")
#: Scaled compute per iteration at 10 Gbit/s and above, and the least it is lowered to.
COMPUTE_AT_10G_S = 0.3
LEAST_COMPUTE_S = 0.1


@dataclass(frozen=True)
class System:
    """One way of training a cell.

    Attributes:
        name: the system's id in results (``fifo``, ``ddp``, ``sumflow``...).
        label: its name in tables and plots.
        kind: the train_worker ``--system`` (``sumflow`` or ``ddp-gloo``).
        k: CPU-server hosts (sumflow only).
        scheduler: SUMFLOW_SCHEDULER, or None for the core's default.
        cross_barrier: train with the optimizer that crosses the global barrier.
        tuned: preceded by a tuning run whose best configuration the measured run reuses.
        partition_bytes: SUMFLOW_PARTITION_BYTES, or None for the cell's (sumflow's derived
            size unless --train-partition-bytes sets one).
        credit_bytes: SUMFLOW_CREDIT_BYTES, or None for the scheduler's default.
        fusion: fuse gradients (lazy allreduce) into spans of at least the partition size.
        compression: gradients sent through this compressor (a ``Compression.parse`` spec).
        csc_density: train with ``CoarseSparseSGD`` sending this fraction of chunks.
    """

    name: str
    label: str
    kind: str
    k: int = 0
    scheduler: str | None = None
    cross_barrier: bool = False
    tuned: bool = False
    partition_bytes: int | None = None
    credit_bytes: int | None = None
    fusion: bool = False
    compression: str | None = None
    csc_density: float | None = None


@dataclass(frozen=True)
class Cell:
    """One profile at one reference bandwidth (Gbit/s)."""

    model: str
    reference_gbit: float

    @property
    def key(self) -> str:
        """A name for files: ``vgg16-1g``."""
        return f"{self.model}-{self.reference_gbit:g}g"


@dataclass(frozen=True)
class Step:
    """One job of the plan: `system` trains `cell`, measured or (``tune``) tuning."""

    cell: Cell
    system: System
    repeat: int = 0
    tune: bool = False

    @property
    def key(self) -> str:
        """A name for files: ``vgg16-1g-bytescheduler-tuned-r0`` (``-tune`` for tuning)."""
        return f"{self.cell.key}-{self.system.name}-r{self.repeat}" + ("-tune" if self.tune else "")

    @property
    def what(self) -> str:
        """What the step does, for progress lines and errors."""
        repeat = f" (repeat {self.repeat + 1})" if self.repeat else ""
        doing = "tuning" if self.tune else "training"
        return (
            f"{doing} {self.cell.model} at {self.cell.reference_gbit:g} Gbit/s: "
            f"{self.system.label}{repeat}"
        )


def parse_list(text: str, what: str) -> list[str]:
    """Comma-separated names, blanks dropped; ValueError for duplicates."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{what} names {', '.join(dup)} more than once")
    return names


def parse_schedulers(text: str) -> list[str]:
    """``--schedulers``: names from :data:`SCHEDULER_SYSTEMS`; ValueError naming any other."""
    names = parse_list(text, "--schedulers")
    unknown = [n for n in names if n not in SCHEDULER_SYSTEMS]
    if unknown:
        raise ValueError(
            f"--schedulers: unknown {', '.join(map(repr, unknown))}; choose from "
            f"{','.join(SCHEDULER_SYSTEMS)}"
        )
    if not names:
        raise ValueError(f"--schedulers is empty; choose from {','.join(SCHEDULER_SYSTEMS)}")
    return names


def parse_gbits(text: str) -> list[float]:
    """``--reference-gbits``: positive numbers, in the order given (the run order)."""
    try:
        values = [float(v) for v in parse_list(text, "--reference-gbits")]
    except ValueError as e:
        if "more than once" in str(e):
            raise
        raise ValueError(f"--reference-gbits {text!r}: give comma-separated numbers") from None
    if not values or any(not v > 0 or v == float("inf") for v in values):
        raise ValueError(f"--reference-gbits {text!r}: give one or more numbers > 0")
    return values


def scheduler_systems(names: Sequence[str], k: int) -> list[System]:
    """The scheduler benchmark's systems for `names` (see :data:`SCHEDULER_SYSTEMS`), the
    sumflow ones with `k` CPU-server hosts and crossing the global barrier (scheduling
    only matters when the next forward can start before every sum has arrived)."""
    suffix = f" k={k}" if k else ""
    systems = []
    for name in names:
        if name == "ddp":
            systems.append(System("ddp", "DDP/gloo", "ddp-gloo"))
        elif name.endswith("-tuned") and name.removesuffix("-tuned") in TUNABLE:
            base = name.removesuffix("-tuned")
            label = f"{base} tuned{suffix}"
            systems.append(System(name, label, "sumflow", k, base, cross_barrier=True, tuned=True))
        elif name == "bytescheduler-fusion":
            systems.append(
                System(
                    name,
                    f"bytescheduler fused{suffix}",
                    "sumflow",
                    k,
                    "bytescheduler",
                    cross_barrier=True,
                    fusion=True,
                )
            )
        elif name in ("bytescheduler-fp16", "bytescheduler-topk"):
            spec = FP16 if name.endswith("fp16") else TOPK
            label = f"bytescheduler {spec}{suffix}"
            systems.append(
                System(name, label, "sumflow", k, "bytescheduler", True, compression=spec)
            )
        elif name == "csc":
            # CoarseSparseSGD communicates inside its own step: it cannot cross the barrier.
            label = f"CSC density {CSC_DENSITY:g}{suffix}"
            systems.append(
                System(name, label, "sumflow", k, "bytescheduler", csc_density=CSC_DENSITY)
            )
        else:
            systems.append(System(name, f"{name}{suffix}", "sumflow", k, name, cross_barrier=True))
    return systems


def standard_systems(k_extra: int) -> list[System]:
    """The standard training comparison: DDP/gloo, sumflow on the same machines (k = 0),
    and, if `k_extra` > 0, sumflow with that many CPU-server hosts added."""
    systems = [
        System("ddp", "DDP/gloo", "ddp-gloo"),
        System("sumflow-k0", "sumflow k=0", "sumflow"),
    ]
    if k_extra:
        systems.append(System(f"sumflow-k{k_extra}", f"sumflow k={k_extra}", "sumflow", k_extra))
    return systems


def plan(
    models: Sequence[str],
    reference_gbits: Sequence[float],
    systems: Sequence[System],
    repeats: int = 1,
) -> list[Step]:
    """Every job, in run order: cells by bandwidth (as given), then by model; within a
    cell, the tuning runs first, then the systems in order, `repeats` rounds of them (so
    repeats of one system are spread over the cell's time, not back to back)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    steps = []
    for gbit in reference_gbits:
        for model in models:
            cell = Cell(model, gbit)
            steps += [Step(cell, s, tune=True) for s in systems if s.tuned]
            steps += [Step(cell, s, r) for r in range(repeats) for s in systems]
    return steps


def compute_aim_s(reference_gbit: float) -> float:
    """Scaled compute per iteration for a cell: 0.3 s at 10 Gbit/s and above (the standard
    run's), lowered in proportion below that down to 0.1 s.

    Only the communication/compute ratio must be the real cluster's, and it is whatever the
    compute time (:func:`sumflow_bench.scaling.scales_for_emulation`); at 1 Gbit/s it is 10x
    the 10 Gbit/s one, so at a fixed 0.3 s the lowest bandwidths would take 10x longer per
    iteration. Not below 0.1 s: sleeps, per-message latencies and Python overheads, which
    are not scaled, must stay small against the compute."""
    return max(LEAST_COMPUTE_S, min(COMPUTE_AT_10G_S, COMPUTE_AT_10G_S * reference_gbit / 10))


def cell_scales(cell: Cell, rate_mbit: float) -> EmulationScales:
    """The scales of `cell` on links of `rate_mbit` (see :func:`compute_aim_s`)."""
    return scales_for_emulation(
        profiles.load(cell.model),
        reference_gbps=cell.reference_gbit,
        emulated_gbps=rate_mbit / 1e3,
        aim_s=compute_aim_s(cell.reference_gbit),
    )


#: Iterations a tuning run trains beyond its trials' steps: the checked first step, and
#: the steps before the tuner's first boundary.
TUNE_SLACK_ITERATIONS = 5


def tune_iterations(trials: int, warmup_steps: int, measure_steps: int) -> int:
    """Iterations a tuning run needs for the tuner to finish its `trials` (each
    `warmup_steps` + `measure_steps` steps) and persist the best."""
    return trials * (warmup_steps + measure_steps) + TUNE_SLACK_ITERATIONS


def tuning_space(size_scale: float) -> tuple[int, int]:
    """The tuner's partition range (SUMFLOW_AUTOTUNE_PARTITION_BYTES) for tensors scaled
    by `size_scale`: its default range, sized for real links, scaled like the partitions
    of the real cluster (whole pages, at least one)."""
    default = SearchSpace()

    def scaled(n: int) -> int:
        return max(ALIGN, round(n * size_scale / ALIGN) * ALIGN)

    return scaled(default.min_partition_bytes), scaled(default.max_partition_bytes)


#: Seconds a job takes beyond its iterations: starting 4 Python processes that import
#: torch, rendezvous, teardown (15-20 s on the 2-core development VM under load).
JOB_OVERHEAD_S = 15.0


def estimate_seconds(
    step: Step,
    scales: EmulationScales,
    *,
    workers: int,
    rate_mbit: float,
    iterations: int,
    tune_iterations: int,
) -> float:
    """About how long `step` takes: the job's overhead plus its iterations, each the
    compute plus the all-reduce-equivalent traffic (2(n-1)/n of the model over a link, the
    bytes of a ring and of colocated summation) not overlapped. Pessimistic for systems
    that overlap well; the progress lines rescale it by what the run has measured."""
    link_bytes_per_s = rate_mbit * 1e6 / 8
    comm_s = 2 * (workers - 1) / workers * scales.param_bytes / link_bytes_per_s
    per_iteration = scales.compute_s + comm_s
    count = tune_iterations if step.tune else iterations
    return JOB_OVERHEAD_S + count * per_iteration
