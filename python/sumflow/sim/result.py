"""What a simulation found: iteration time, throughput, GPU idle time, per-link utilisation,
and the timeline of the measured iterations."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sumflow.sim.config import Config

PathLike = str | Path


@dataclass(frozen=True)
class Link:
    """One direction of one simulated machine's NIC over the measured iterations.

    Attributes:
        machine: simulated machine index (worker machines first, then CPU machines).
        name: what it is, e.g. ``CPU machine 3`` or ``worker machines 0-127 (one simulated
            for all)``.
        stands_for: real machines it stands for.
        direction: ``up`` (NIC to switch) or ``down`` (switch to NIC).
        utilisation: busy fraction of the measured time.
        bytes_per_iteration: bytes carried per iteration (on one of the machines it stands
            for).
        busy_s_per_iteration: transmission time per iteration.
    """

    machine: int
    name: str
    stands_for: int
    direction: str
    utilisation: float
    bytes_per_iteration: float
    busy_s_per_iteration: float


@dataclass(frozen=True)
class Result:
    """A simulation's report.

    Attributes:
        config: what was simulated.
        iteration_s: mean time per measured iteration (forward start to forward start).
        iterations_s: each measured iteration.
        compute_s: forward + backward of one iteration on one GPU.
        gpu_idle_s: time per iteration the GPUs wait for communication.
        network_s: the busiest link's transmission time per iteration, the floor no
            schedule of these bytes beats (BytePS Table 1 / Eq. 6 on a uniform network).
        links: every simulated NIC direction.
        machines: simulated machines, by index.
        servers: summation servers and where they run.
        reduction: how the cluster was reduced for simulation, and why that is exact.
        placement: each server's share of the model against its Eq. 1/2 target.
        push_pulls: push_pull operations per iteration (tensors, or fused spans).
        partitions: partitions (and lane pieces) per iteration.
        events: simulation events processed.
        wall_s: how long the simulation took.
        trace_events: the timeline (see :meth:`save_trace`).
        trace_truncated: the timeline stopped at ``trace_max_events``.
    """

    config: Config
    iteration_s: float
    iterations_s: tuple[float, ...]
    compute_s: float
    gpu_idle_s: float
    network_s: float
    links: tuple[Link, ...]
    machines: tuple[str, ...]
    servers: tuple[str, ...]
    reduction: str
    placement: tuple[str, ...]
    push_pulls: int
    partitions: int
    events: int
    wall_s: float
    trace_events: tuple[dict[str, Any], ...]
    trace_truncated: bool

    @classmethod
    def from_report(cls, config: Config, report: dict[str, Any]) -> Result:
        """Builds a result from the core's JSON report."""
        return cls(
            config=config,
            iteration_s=report["iteration_s"],
            iterations_s=tuple(report["iterations_s"]),
            compute_s=report["compute_s"],
            gpu_idle_s=report["gpu_idle_s"],
            network_s=report["network_s"],
            links=tuple(Link(**link) for link in report["links"]),
            machines=tuple(report["machines"]),
            servers=tuple(report["servers"]),
            reduction=report["reduction"],
            placement=tuple(report["placement"]),
            push_pulls=report["push_pulls"],
            partitions=report["partitions"],
            events=report["events"],
            wall_s=report["wall_s"],
            trace_events=tuple(report["trace"]),
            trace_truncated=report["trace_truncated"],
        )

    @property
    def iterations_per_s(self) -> float:
        """Training iterations per second."""
        return 1.0 / self.iteration_s if self.iteration_s > 0 else float("inf")

    @property
    def throughput(self) -> float:
        """Samples per second over the whole job: every GPU's batch per iteration."""
        return self.config.profile.batch_size * self.config.cluster.gpus * self.iterations_per_s

    @property
    def gpu_idle_fraction(self) -> float:
        """Share of an iteration the GPUs wait."""
        return self.gpu_idle_s / self.iteration_s if self.iteration_s > 0 else 0.0

    def busiest(self, count: int = 3) -> list[Link]:
        """The most utilised NIC directions, busiest first."""
        return sorted(self.links, key=lambda link: -link.utilisation)[:count]

    def summary(self) -> str:
        """A few lines for people: the configuration, times, throughput, busiest links."""
        lines = [
            self.config.describe(),
            f"  iteration {self.iteration_s * 1e3:.2f} ms ({self.iterations_per_s:.3f} it/s, "
            f"{self.throughput:,.0f} samples/s); compute {self.compute_s * 1e3:.2f} ms, "
            f"GPU idle {self.gpu_idle_s * 1e3:.2f} ms ({self.gpu_idle_fraction:.0%})",
            f"  busiest link {self.network_s * 1e3:.2f} ms per iteration; "
            f"{self.push_pulls} push_pulls, {self.partitions} partitions per iteration",
        ]
        for link in self.busiest():
            lines.append(
                f"  {link.name} {link.direction}: {link.utilisation:.0%} busy, "
                f"{link.bytes_per_iteration / 1e6:.1f} MB per iteration"
            )
        lines.append(f"  simulated: {self.reduction}")
        lines.append(f"  {self.events:,} events in {self.wall_s:.2f} s")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Everything but the timeline, as JSON-ready data."""
        return {
            "config": self.config.describe(),
            "iteration_s": self.iteration_s,
            "iterations_s": list(self.iterations_s),
            "iterations_per_s": self.iterations_per_s,
            "throughput": self.throughput,
            "compute_s": self.compute_s,
            "gpu_idle_s": self.gpu_idle_s,
            "network_s": self.network_s,
            "links": [link.__dict__ for link in self.links],
            "machines": list(self.machines),
            "servers": list(self.servers),
            "reduction": self.reduction,
            "placement": list(self.placement),
            "push_pulls": self.push_pulls,
            "partitions": self.partitions,
            "events": self.events,
            "wall_s": self.wall_s,
        }

    def save_json(self, path: PathLike) -> Path:
        """Writes :meth:`to_dict` to `path`."""
        p = Path(path)
        p.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return p

    def save_trace(self, path: PathLike) -> Path:
        """Writes the timeline as a Chrome trace (``docs/tracing.md``'s format); the run
        must have had ``Config.trace`` on."""
        from sumflow.sim.timeline import write_trace

        return write_trace(self, Path(path))
