"""What a simulation is asked, in the units people size clusters in (Gbit/s, microseconds,
machines), and its translation into the core's JSON (bytes per second, seconds).

Every default is stated here and in ``docs/simulator.md``; the scheduler's own defaults
(partition size, credit, push window) are the runtime's, left unset so the core applies
them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from sumflow import _core
from sumflow.profiles import BYTES_PER_ELEMENT, ModelProfile

#: The architectures the simulator knows (``docs/simulator.md``).
ARCHITECTURES = ("ring", "hierarchical", "ps", "colocated-ps", "byteps")
#: The runtime's schedulers (``docs/scheduling.md``).
SCHEDULERS = _core.SCHEDULERS


def _number(owner: str, name: str, value: Any, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{owner}.{name} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ValueError(f"{owner}.{name} must be >= 0, got {value!r}")


def _fraction(owner: str, name: str, value: Any, what: str) -> None:
    _number(owner, name, value, positive=False)
    if value > 1:
        raise ValueError(f"{owner}.{name} must be {what} from 0 to 1, got {value!r}")


def _count(owner: str, name: str, value: Any, *, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{owner}.{name} must be an integer >= {least}, got {value!r}")


@dataclass(frozen=True)
class Cluster:
    """n worker machines of g GPUs each, and k CPU machines (no GPUs) that can run
    summation servers.

    Attributes:
        machines: n, the worker machines.
        gpus_per_machine: g; every GPU trains a replica (data parallelism).
        cpu_machines: k; only ``ps`` and ``byteps`` use them.
    """

    machines: int
    gpus_per_machine: int = 1
    cpu_machines: int = 0

    def __post_init__(self) -> None:
        _count("Cluster", "machines", self.machines, least=1)
        _count("Cluster", "gpus_per_machine", self.gpus_per_machine, least=1)
        _count("Cluster", "cpu_machines", self.cpu_machines, least=0)

    @property
    def gpus(self) -> int:
        """Every GPU of the job: n x g."""
        return self.machines * self.gpus_per_machine


@dataclass(frozen=True)
class Network:
    """A full-bisection network: one full-duplex NIC per machine into a non-blocking switch.

    Attributes:
        gbps: a worker machine's NIC, Gbit/s in each direction.
        cpu_gbps: a CPU machine's NIC (default: the same as a worker machine's).
        latency_us: one-way latency through the switch, microseconds.
        message_overhead_us: sender time per data message before its first byte leaves
            (serialisation, system calls: ByteScheduler's per-partition overhead); it holds
            the message's connection, not the link.
        intra_gbps: between the GPUs of one machine, and between a worker and the
            summation server beside it (NVLink: 800 Gbit/s = 100 GB/s).
        segment_bytes: the unit in which a link interleaves its connections; smaller is
            closer to packet-level sharing and costs more events.
        nic_queue_bytes: bytes one connection may queue at its NIC ahead of the others'
            (what TCP's window lets it hand the kernel); up to one segment (the default, 0)
            the NIC serves connections segment by segment in turn, more sends bursts in
            the order they were written.
        nic_queue_spread: how unevenly connections share their NIC, from 0 (evenly, the
            default) to 1: each connection's allowance is drawn uniformly from
            ``nic_queue_bytes`` times 1 +- this, and again each time it has queued that
            much (TCP's windows differ between flows and change every round trip), so flows
            into one server progress unevenly and its rounds wait for the slowest.
        fair_downlinks: a switch port serves the connections arriving at it in turn, a
            segment each, as TCP's flows converge to equal shares of the link they
            bottleneck on; off (the default), in arrival order, so a sender with more
            upstream capacity takes more of the port.
        header_bytes: bytes of a message without payload (a push acknowledgement).
    """

    gbps: float = 25.0
    cpu_gbps: float | None = None
    latency_us: float = 10.0
    message_overhead_us: float = 50.0
    intra_gbps: float = 800.0
    segment_bytes: int = 16 * 1024
    nic_queue_bytes: int = 0
    nic_queue_spread: float = 0.0
    fair_downlinks: bool = False
    header_bytes: int = 64

    def __post_init__(self) -> None:
        _number("Network", "gbps", self.gbps, positive=True)
        if self.cpu_gbps is not None:
            _number("Network", "cpu_gbps", self.cpu_gbps, positive=True)
        _number("Network", "latency_us", self.latency_us, positive=False)
        _number("Network", "message_overhead_us", self.message_overhead_us, positive=False)
        _number("Network", "intra_gbps", self.intra_gbps, positive=True)
        _count("Network", "segment_bytes", self.segment_bytes, least=1)
        _count("Network", "nic_queue_bytes", self.nic_queue_bytes, least=0)
        _fraction("Network", "nic_queue_spread", self.nic_queue_spread, "a fraction")
        _count("Network", "header_bytes", self.header_bytes, least=0)
        if not isinstance(self.fair_downlinks, bool):
            raise ValueError(
                f"Network.fair_downlinks must be True or False, got {self.fair_downlinks!r}"
            )

    def to_core(self) -> dict[str, Any]:
        """The core's form: bytes per second and seconds."""
        cpu = self.gbps if self.cpu_gbps is None else self.cpu_gbps
        return {
            "bandwidth": self.gbps * 1e9 / 8,
            "cpu_bandwidth": cpu * 1e9 / 8,
            "latency_s": self.latency_us * 1e-6,
            "message_overhead_s": self.message_overhead_us * 1e-6,
            "intra_bandwidth": self.intra_gbps * 1e9 / 8,
            "segment_bytes": self.segment_bytes,
            "nic_queue_bytes": self.nic_queue_bytes,
            "nic_queue_spread": self.nic_queue_spread,
            "fair_downlinks": self.fair_downlinks,
            "header_bytes": self.header_bytes,
        }


@dataclass(frozen=True)
class Scheduling:
    """The runtime's scheduler and its knobs (``docs/scheduling.md``).

    Attributes:
        scheduler: ``fifo``, ``p3``, ``bytescheduler`` or ``prophet``.
        partition_bytes: partition size (None: the runtime's 4 MiB); ``fifo`` sends whole
            tensors.
        credit_bytes: unacknowledged bytes per server (None: the runtime's 2 partitions;
            0: unbounded).
        window_bytes: push window per server (None: the runtime's 4 partitions; 0:
            unbounded).
        prophet_stage_factor: Prophet's stage rule (0: every gap is a stage boundary).
        fusion_bytes: fuse gradients in backward order into push_pulls of at least this
            many bytes (0: none); DDP's buckets close the same way.
        priorities: a priority per tensor in declaration order, instead of the tensor's
            position in the model (lower goes first).
    """

    scheduler: str = "bytescheduler"
    partition_bytes: int | None = None
    credit_bytes: int | None = None
    window_bytes: int | None = None
    prophet_stage_factor: float = 0.0
    fusion_bytes: int = 0
    priorities: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(
                f"Scheduling.scheduler is {self.scheduler!r}: choose one of {', '.join(SCHEDULERS)}"
            )
        if self.partition_bytes is not None:
            _count("Scheduling", "partition_bytes", self.partition_bytes, least=BYTES_PER_ELEMENT)
        for name in ("credit_bytes", "window_bytes"):
            value = getattr(self, name)
            if value is not None:
                _count("Scheduling", name, value, least=0)
        _number("Scheduling", "prophet_stage_factor", self.prophet_stage_factor, positive=False)
        _count("Scheduling", "fusion_bytes", self.fusion_bytes, least=0)
        if self.priorities is not None and not all(
            isinstance(p, int) and not isinstance(p, bool) for p in self.priorities
        ):
            raise ValueError("Scheduling.priorities must be integers, one per tensor")


@dataclass(frozen=True)
class Config:
    """One simulation: a profiled model on a cluster, network, architecture and scheduler.

    Attributes:
        profile: the model (``sumflow.profiles``), timed for one GPU at its batch size.
        cluster: machines and GPUs.
        network: NICs, latency, per-message overhead.
        architecture: ``ring``, ``hierarchical``, ``ps`` (non-colocated), ``colocated-ps``
            or ``byteps`` (sumflow: Eq. 1/2 over colocated and CPU servers).
        scheduling: scheduler and knobs.
        intra_aggregation: reduce a machine's GPUs locally and push one copy per machine
            (BytePS §4.2); otherwise every GPU pushes its own over the shared NIC.
            Summation-server architectures only.
        cross_barrier: the next forward pass starts layer by layer as sums arrive
            (sumflow's optimizer); otherwise it waits for every sum.
        warmup_iterations: simulated before the measured ones (Prophet profiles them).
        iterations: measured iterations.
        compute_jitter: how much a worker machine's compute varies between iterations: the
            coefficient of variation of a factor (log-normal, mean 1) drawn per machine and
            iteration that stretches all its layers' times. 0 (default): every machine
            keeps the profile's times. Above 0, every worker machine is simulated.
        seed: seeds every draw (the compute jitter, ``Network.nic_queue_spread``): a
            simulation is reproducible.
        trace: record a timeline of the measured iterations.
        trace_machines: simulated machines to record (empty: all).
        trace_max_events: recording stops after this many events.
        exploit_symmetry: simulate one worker machine for all where that is exact; off only
            to check it.
    """

    profile: ModelProfile
    cluster: Cluster
    network: Network = field(default_factory=Network)
    architecture: str = "byteps"
    scheduling: Scheduling = field(default_factory=Scheduling)
    intra_aggregation: bool = True
    cross_barrier: bool = True
    warmup_iterations: int = 2
    iterations: int = 3
    compute_jitter: float = 0.0
    seed: int = 0
    trace: bool = False
    trace_machines: tuple[int, ...] = ()
    trace_max_events: int = 500_000
    exploit_symmetry: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.profile, ModelProfile):
            raise ValueError(
                f"Config.profile must be a sumflow.profiles.ModelProfile, got "
                f"{type(self.profile).__name__}"
            )
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"Config.architecture is {self.architecture!r}: choose one of "
                f"{', '.join(ARCHITECTURES)}"
            )
        _count("Config", "warmup_iterations", self.warmup_iterations, least=0)
        _count("Config", "iterations", self.iterations, least=1)
        _count("Config", "trace_max_events", self.trace_max_events, least=1)
        _count("Config", "seed", self.seed, least=0)
        if self.seed >= 2**64:
            raise ValueError(f"Config.seed must be below 2**64, got {self.seed}")
        _fraction("Config", "compute_jitter", self.compute_jitter, "a coefficient of variation")
        k = self.cluster.cpu_machines
        if k > 0 and self.architecture in ("ring", "hierarchical", "colocated-ps"):
            raise ValueError(
                f"{self.architecture} cannot use CPU machines (Cluster.cpu_machines = {k}): "
                "set it to 0, or choose 'byteps' to sum on them"
            )
        if k == 0 and self.architecture == "ps":
            raise ValueError(
                "a non-colocated PS sums only on CPU machines and Cluster.cpu_machines is 0: "
                "give it at least 1, or choose 'colocated-ps' or 'byteps'"
            )
        prio = self.scheduling.priorities
        if prio is not None and len(prio) != self.profile.num_tensors:
            raise ValueError(
                f"Scheduling.priorities has {len(prio)} entries and profile "
                f"'{self.profile.name}' {self.profile.num_tensors} tensors: give one per "
                "tensor, in declaration order"
            )

    def with_(self, **changes: Any) -> Config:
        """A copy with some fields changed (``dataclasses.replace``)."""
        return replace(self, **changes)

    def to_core(self) -> dict[str, Any]:
        """The core's JSON form (see ``crates/sim/src/config.rs``)."""
        s = self.scheduling
        return {
            "model": {
                "name": self.profile.name,
                "layers": [
                    {
                        "name": layer.name,
                        "forward_s": layer.forward_ms / 1e3,
                        "backward_s": layer.backward_ms / 1e3,
                        "tensors": [{"name": p.name, "bytes": p.nbytes} for p in layer.params],
                    }
                    for layer in self.profile.layers
                ],
            },
            "cluster": {
                "machines": self.cluster.machines,
                "gpus_per_machine": self.cluster.gpus_per_machine,
                "cpu_machines": self.cluster.cpu_machines,
            },
            "network": self.network.to_core(),
            "architecture": self.architecture,
            "schedule": {
                "scheduler": s.scheduler,
                "partition_bytes": s.partition_bytes,
                "credit_bytes": s.credit_bytes,
                "window_bytes": s.window_bytes,
                "prophet_stage_factor": s.prophet_stage_factor,
                "fusion_bytes": s.fusion_bytes,
                "priorities": None if s.priorities is None else list(s.priorities),
            },
            "training": {
                "intra_aggregation": self.intra_aggregation,
                "cross_barrier": self.cross_barrier,
                "warmup_iterations": self.warmup_iterations,
                "iterations": self.iterations,
                "compute_jitter": self.compute_jitter,
            },
            "trace": {
                "enabled": self.trace,
                "machines": list(self.trace_machines),
                "max_events": self.trace_max_events,
            },
            "exploit_symmetry": self.exploit_symmetry,
            "seed": self.seed,
        }

    def to_json(self) -> str:
        """:meth:`to_core` as JSON text."""
        return json.dumps(self.to_core())

    def describe(self) -> str:
        """One line: model, cluster, network, architecture, scheduler."""
        c, n = self.cluster, self.network
        cpu = "" if n.cpu_gbps is None else f", CPU machines {n.cpu_gbps:g} Gbit/s"
        return (
            f"{self.profile.name} on {c.machines} x {c.gpus_per_machine} GPUs"
            f"{f' + {c.cpu_machines} CPU machines' if c.cpu_machines else ''}, "
            f"{n.gbps:g} Gbit/s{cpu}, {self.architecture}, {self.scheduling.scheduler}"
        )
