"""A grid search of bytescheduler's two knobs, partition size and credit, measured on the
emulated cluster: the reference the auto-tuner is judged against (issue 6: Bayesian
optimisation within 5% of the grid's best in at most 10 trials, ByteScheduler Fig. 14;
``python -m sumflow.tune.compare GRID.json``).

Both knobs are log-spaced around the cell's default partition size (4 MiB scaled like the
tensors, :func:`sumflow.bench.matrix.cell_scales`): partitions from 1/8x to 4x of it,
credits from 1x to 16x of it. Every grid point is one training job (bytescheduler across
the global barrier), so every point starts from the same state.

GRID.json::

    {"configs": [{"partition_bytes": int, "credit_bytes": int, "step_s": [seconds, ...]}],
     "meta": {"model": ..., "reference_gbit": ..., ...}}
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from sumflow.bench.matrix import System

#: Partition sizes span these factors of the cell's default partition size.
PARTITION_FACTORS = (1 / 8, 4.0)
#: Credits span these factors of the cell's default partition size.
CREDIT_FACTORS = (1.0, 16.0)


def log_spaced(low: float, high: float, count: int) -> list[int]:
    """`count` sizes from `low` to `high` (bytes) with equal ratios, rounded to whole
    64-byte lines (at least 64); ValueError if they would not be distinct."""
    if count < 1 or not 0 < low <= high:
        raise ValueError(
            f"log_spaced needs count >= 1 and 0 < low <= high, got {count}, {low}, {high}"
        )
    if count == 1:
        return [max(64, round(math.sqrt(low * high) / 64) * 64)]
    ratio = (high / low) ** (1 / (count - 1))
    values = [max(64, round(low * ratio**i / 64) * 64) for i in range(count)]
    if len(set(values)) != count:
        raise ValueError(f"{count} sizes from {low:.0f} to {high:.0f} bytes are not distinct")
    return values


def grid_points(partition_bytes: int, partitions: int, credits: int) -> list[tuple[int, int]]:
    """(partition, credit) pairs, partitions outer, around the default `partition_bytes`."""
    ps = log_spaced(
        partition_bytes * PARTITION_FACTORS[0], partition_bytes * PARTITION_FACTORS[1], partitions
    )
    cs = log_spaced(
        partition_bytes * CREDIT_FACTORS[0], partition_bytes * CREDIT_FACTORS[1], credits
    )
    return [(p, c) for p in ps for c in cs]


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
