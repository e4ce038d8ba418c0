"""sumflow's discrete-event simulator: plan and explain data-parallel training at a scale
this machine cannot run (``docs/simulator.md``).

It replays a layer profile (``sumflow.profiles``) on n worker machines of g GPUs and k CPU
machines, under ring or hierarchical all-reduce, a non-colocated or colocated parameter
server, or sumflow/BytePS with any k, with the runtime's own schedulers (the Rust core
drives ``sumflow-plan``'s scheduler state machine and placement with simulated time), and
reports iteration time, throughput, GPU idle time, per-link utilisation and a Chrome-trace
timeline.

    from sumflow import profiles, sim

    cfg = sim.Config(
        profile=profiles.load("resnet50"),
        cluster=sim.Cluster(machines=128, gpus_per_machine=8, cpu_machines=64),
        network=sim.Network(gbps=100),
        architecture="byteps",
        scheduling=sim.Scheduling(scheduler="bytescheduler"),
    )
    result = sim.simulate(cfg)
    print(result.summary())

From the shell: ``sumflow sim --help``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

from sumflow import _core
from sumflow.sim.config import ARCHITECTURES, SCHEDULERS, Cluster, Config, Network, Scheduling
from sumflow.sim.result import Link, Result

__all__ = [
    "ARCHITECTURES",
    "SCHEDULERS",
    "Cluster",
    "Config",
    "Link",
    "Network",
    "Progress",
    "Result",
    "Scheduling",
    "print_progress",
    "simulate",
]


@dataclass(frozen=True)
class Progress:
    """How far a long simulation has got (reported about once a second).

    Attributes:
        iteration: iterations worker machine 0 has started.
        iterations: iterations in all (warm-up and measured).
        simulated_s: simulated time reached.
        events: events processed.
        wall_s: time taken so far.
    """

    iteration: int
    iterations: int
    simulated_s: float
    events: int
    wall_s: float


def print_progress(p: Progress) -> None:
    """Prints one line per report to stderr."""
    print(
        f"sumflow sim: iteration {p.iteration} of {p.iterations}, {p.simulated_s:.3f} s "
        f"simulated, {p.events:,} events in {p.wall_s:.1f} s",
        file=sys.stderr,
        flush=True,
    )


def simulate(config: Config, progress: Callable[[Progress], None] | None = None) -> Result:
    """Runs one simulation. `progress` is called about once a second of a long run.

    Raises ValueError for a configuration that cannot be simulated (the message names the
    field), and ``sumflow.SumflowError`` if the simulation stalls (a bug; the message says
    where it stood)."""
    callback = None
    if progress is not None:
        report = progress

        def callback(
            iteration: int, iterations: int, simulated_s: float, events: int, wall_s: float
        ) -> None:
            report(Progress(iteration, iterations, simulated_s, events, wall_s))

    raw = _core.simulate(config.to_json(), callback)
    return Result.from_report(config, json.loads(raw))
