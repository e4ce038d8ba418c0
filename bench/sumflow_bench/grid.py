"""A grid search of bytescheduler's two knobs, partition size and credit, measured on the
emulated cluster: the reference the auto-tuner is judged against (issue 6: Bayesian
optimisation within 5% of the grid's best in at most 10 trials, ByteScheduler Fig. 14;
``python -m sumflow_bench.tune_compare GRID.json``).

The grid spans the tuner's own search space (:class:`sumflow.tune.space.SearchSpace`),
with partition sizes scaled like the tensors (:func:`sumflow_bench.matrix.tuning_space`):
partition sizes log-spaced over that range, credits log-spaced from 1 to the space's most
partitions (16), so every grid point is a configuration the tuner could choose. Every grid
point is one training job (bytescheduler across the global barrier), so every point starts
from the same state.

GRID.json::

    {"configs": [{"partition_bytes": int, "credit_bytes": int, "step_s": [seconds, ...]}],
     "meta": {"model": ..., "reference_gbit": ..., ...}}
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from sumflow.tune.space import SearchSpace
from sumflow_bench.matrix import System


def log_spaced(low: float, high: float, count: int) -> list[float]:
    """`count` values from `low` to `high` with equal ratios (their geometric mean for
    one)."""
    if count < 1 or not 0 < low <= high:
        raise ValueError(
            f"log_spaced needs count >= 1 and 0 < low <= high, got {count}, {low}, {high}"
        )
    if count == 1:
        return [math.sqrt(low * high)]
    ratio = (high / low) ** (1 / (count - 1))
    return [low * ratio**i for i in range(count)]


def grid_points(space: SearchSpace, partitions: int, credits: int) -> list[tuple[int, int]]:
    """(partition, credit) bytes, partitions outer: `partitions` sizes across `space`'s
    range and `credits` credits from 1 to its most partitions each, in whole pages;
    ValueError if rounding makes two points equal (a range too narrow for the count)."""
    points = []
    for p in log_spaced(space.min_partition_bytes, space.max_partition_bytes, partitions):
        for k in log_spaced(1.0, space.max_credit_partitions, credits):
            config = space.configuration(p, k)
            points.append((config.partition_bytes, config.credit_bytes))
    if len(set(points)) != len(points):
        raise ValueError(
            f"{partitions} x {credits} grid points over partitions of "
            f"{space.min_partition_bytes}-{space.max_partition_bytes} bytes are not distinct "
            "in whole pages: use fewer points"
        )
    return points


def grid_systems(points: list[tuple[int, int]], k: int) -> list[System]:
    """One bytescheduler system per grid point."""
    return [
        System(
            f"bytescheduler-p{p}-c{c}",
            f"bytescheduler partition {p} credit {c}",
            "sumflow",
            k,
            "bytescheduler",
            cross_barrier=True,
            partition_bytes=p,
            credit_bytes=c,
        )
        for p, c in points
    ]


def grid_json(cell: dict[str, Any], systems: list[System], meta: dict[str, Any]) -> dict[str, Any]:
    """GRID.json from the grid cell's runs (every run of a point: its step times are
    concatenated)."""
    configs = []
    for system in systems:
        runs = [r for r in cell["runs"] if r["name"] == system.name]
        if not runs:
            continue
        configs.append(
            {
                "partition_bytes": system.partition_bytes,
                "credit_bytes": system.credit_bytes,
                "step_s": [t for r in runs for t in r["iteration_s"]],
            }
        )
    meta = {
        **meta,
        "model": cell["model"],
        "reference_gbit": cell["reference_gbit"],
        "default_partition_bytes": cell["partition_bytes"],
        "scaling": cell["scaling"],
    }
    return {"configs": configs, "meta": meta}


def markdown(grid: dict[str, Any]) -> str:
    """The grid's median step times (ms) as a partition x credit table, the best marked."""
    configs = grid["configs"]
    if not configs:
        return "Grid search: no point was measured.\n"
    medians = {
        (c["partition_bytes"], c["credit_bytes"]): statistics.median(c["step_s"]) for c in configs
    }
    best = min(medians, key=lambda key: medians[key])
    ps = sorted({p for p, _ in medians})
    cs = sorted({c for _, c in medians})
    meta = grid["meta"]
    lines = [
        f"Grid search, bytescheduler on {meta['model']} at {meta['reference_gbit']:g} Gbit/s: "
        "median step time (ms); rows partition bytes, columns credit bytes; best in bold.",
        "",
        "| partition \\ credit | " + " | ".join(str(c) for c in cs) + " |",
        "|---|" + "---|" * len(cs),
    ]
    for p in ps:
        row = []
        for c in cs:
            if (p, c) not in medians:
                row.append("-")
                continue
            text = f"{medians[p, c] * 1e3:.0f}"
            row.append(f"**{text}**" if (p, c) == best else text)
        lines.append(f"| {p} | " + " | ".join(row) + " |")
    lines.append("")
    return "\n".join(lines)
