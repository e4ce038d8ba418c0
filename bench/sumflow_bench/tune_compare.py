"""Offline comparison of the search drivers (ByteScheduler Fig. 14): how many trials does
each need to come within 5% of the best configuration a grid search measured?

    python -m sumflow_bench.tune_compare GRID.json [--plot search.png] [--json out.json]
    python -m sumflow_bench.tune_compare --synthetic

GRID.json holds step times measured per configuration::

    {"configs": [{"partition_bytes": 1048576, "credit_bytes": 4194304,
                  "step_s": [0.171, 0.169, ...]}, ...],
     "meta": {...}}

A trial log (``.jsonl``) of an online grid run (``SUMFLOW_AUTOTUNE_METHOD=grid``) is
read the same way, each trial's measured steps being its samples. ``--synthetic``
replays against :mod:`sumflow.tune.synthetic` instead.

Each driver is replayed over many seeds: a trial of configuration c scores the trimmed
mean of `draws` step times drawn (seeded) from the samples of the grid point nearest c
(on the log scales). After each trial the driver's pick is the configuration with the
best score so far, as the online tuner would apply it, and it is judged by its true
value: the trimmed mean of all its grid point's samples, against the best grid point's.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sumflow.tune.score import trimmed_mean
from sumflow.tune.search import METHODS, GridSearch, Searcher, make_searcher
from sumflow.tune.space import Configuration, SearchSpace
from sumflow.tune.synthetic import SyntheticCluster


class Objective(Protocol):
    """What a replay measures against."""

    #: The space the drivers search.
    space: SearchSpace
    #: The best true value: the reference for "within 5%".
    best_s: float

    def sample(self, config: Configuration, rng: random.Random) -> float:
        """One measured step time of `config`."""
        ...

    def true_s(self, config: Configuration) -> float:
        """The step time `config` really has (what a pick is judged on)."""
        ...

    def grid(self) -> list[Configuration]:
        """The configurations grid search enumerates, in order."""
        ...


@dataclass(frozen=True)
class _Point:
    config: Configuration
    samples: tuple[float, ...]
    true_s: float


class GridObjective:
    """Measured step times per configuration; any configuration is answered by the
    nearest measured one on the log scales."""

    def __init__(self, points: Sequence[tuple[Configuration, Sequence[float]]]) -> None:
        if len(points) < 2:
            raise ValueError(f"a grid needs at least 2 measured configurations, not {len(points)}")
        for config, samples in points:
            if not samples:
                raise ValueError(f"{config.describe()} has no step times")
        self.space = SearchSpace(
            min(c.partition_bytes for c, _ in points),
            max(c.partition_bytes for c, _ in points),
            max(max(c.credit_partitions for c, _ in points), 1.0),
        )
        self._points = [
            _Point(c, tuple(float(x) for x in s), trimmed_mean(list(s))) for c, s in points
        ]
        self.best_s = min(p.true_s for p in self._points)

    def _nearest(self, config: Configuration) -> _Point:
        u, v = self.space.unit_point(config)

        def distance(p: _Point) -> float:
            pu, pv = self.space.unit_point(p.config)
            return (pu - u) ** 2 + (pv - v) ** 2

        return min(self._points, key=distance)

    def sample(self, config: Configuration, rng: random.Random) -> float:
        return rng.choice(self._nearest(config).samples)

    def true_s(self, config: Configuration) -> float:
        return self._nearest(config).true_s

    def grid(self) -> list[Configuration]:
        return sorted(
            (p.config for p in self._points), key=lambda c: (c.partition_bytes, c.credit_bytes)
        )


class SyntheticObjective:
    """:class:`sumflow.tune.synthetic.SyntheticCluster` over a search space; the best
    value is found on a fine grid."""

    def __init__(
        self, cluster: SyntheticCluster | None = None, space: SearchSpace | None = None
    ) -> None:
        self.cluster = cluster or SyntheticCluster()
        self.space = space or SearchSpace()
        self.best_s = min(self.cluster.step_time(c) for c in self.space.grid(64, 48))

    def sample(self, config: Configuration, rng: random.Random) -> float:
        return self.cluster.sample(config, rng)

    def true_s(self, config: Configuration) -> float:
        return self.cluster.step_time(config)

    def grid(self) -> list[Configuration]:
        return self.space.grid(6, 4)


def load_grid(path: str | Path) -> GridObjective:
    """The objective in GRID.json, or in the trial log of an online grid run (.jsonl)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    points: list[tuple[Configuration, list[float]]] = []
    try:
        if path.suffix == ".jsonl":
            for line in text.splitlines():
                entry = json.loads(line)
                if entry.get("event") == "trial":
                    points.append((Configuration.from_json(entry["config"]), entry["step_s"]))
        else:
            data = json.loads(text)
            if not isinstance(data, dict) or not isinstance(data.get("configs"), list):
                raise ValueError('expected {"configs": [...], "meta": {...}}')
            for i, entry in enumerate(data["configs"]):
                samples = entry.get("step_s") if isinstance(entry, dict) else None
                if not isinstance(samples, list) or not all(
                    isinstance(x, (int, float)) for x in samples
                ):
                    raise ValueError(f"configs[{i}] needs a list of numbers 'step_s'")
                points.append((Configuration.from_json(entry), samples))
    except (json.JSONDecodeError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    merged: dict[Configuration, list[float]] = {}
    for config, samples in points:
        merged.setdefault(config, []).extend(samples)
    return GridObjective(list(merged.items()))


def _searcher(method: str, objective: Objective, seed: int) -> Searcher:
    if method == "grid":
        return GridSearch(objective.grid(), "the measured configurations")
    return make_searcher(method, objective.space, seed)


def replay(
    objective: Objective, method: str, seed: int, trials: int, draws: int = 1
) -> list[float]:
    """The true value of the driver's pick after each of `trials` trials, as a multiple
    of the best (1.0 = the best configuration)."""
    searcher = _searcher(method, objective, seed)
    rng = random.Random(f"samples-{seed}")
    best: tuple[float, Configuration] | None = None
    out: list[float] = []
    for _ in range(trials):
        proposal = searcher.ask()
        if proposal is not None:
            score = trimmed_mean([objective.sample(proposal.config, rng) for _ in range(draws)])
            searcher.tell(proposal, score)
            if best is None or score < best[0]:
                best = (score, proposal.config)
        assert best is not None, "a driver proposed nothing at all"
        out.append(objective.true_s(best[1]) / objective.best_s)
    return out


@dataclass(frozen=True)
class MethodSummary:
    """How one driver did over all seeds."""

    method: str
    #: Per seed, the pick's ratio to the best after each trial.
    curves: list[list[float]]
    tolerance: float
    budget: int

    def trials_to_reach(self) -> list[float]:
        """Per seed, the first trial whose pick is within tolerance (inf: never)."""
        return [
            next((i + 1 for i, r in enumerate(c) if r <= 1 + self.tolerance), math.inf)
            for c in self.curves
        ]

    def fraction_within_budget(self) -> float:
        return sum(c[self.budget - 1] <= 1 + self.tolerance for c in self.curves) / len(self.curves)

    def median_trials(self) -> float:
        return statistics.median(self.trials_to_reach())

    def to_json(self) -> dict[str, Any]:
        reach = self.trials_to_reach()
        finite = [t for t in reach if math.isfinite(t)]
        return {
            "method": self.method,
            "seeds": len(self.curves),
            "fraction_within_tolerance_by_budget": self.fraction_within_budget(),
            "median_trials_to_tolerance": _finite_or_none(self.median_trials()),
            "mean_trials_to_tolerance_of_those_reaching": (
                statistics.mean(finite) if finite else None
            ),
            "never_reached": len(reach) - len(finite),
            "median_ratio_by_trial": [
                statistics.median(col) for col in zip(*self.curves, strict=True)
            ],
            "curves": self.curves,
        }


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def compare(
    objective: Objective,
    methods: Sequence[str] = METHODS,
    seeds: int = 40,
    trials: int = 15,
    budget: int = 10,
    tolerance: float = 0.05,
    draws: int = 1,
) -> list[MethodSummary]:
    """Every driver in `methods` replayed over `seeds` seeds (grid search once: it is
    deterministic)."""
    if not 1 <= budget <= trials:
        raise ValueError(f"budget must be in [1, trials={trials}], not {budget}")
    if seeds < 1 or draws < 1:
        raise ValueError("seeds and draws must be >= 1")
    out = []
    for method in methods:
        runs = 1 if method == "grid" else seeds
        curves = [replay(objective, method, seed, trials, draws) for seed in range(runs)]
        out.append(MethodSummary(method, curves, tolerance, budget))
    return out


def markdown(summaries: Sequence[MethodSummary], objective: Objective, source: str) -> str:
    """The comparison as a markdown table."""
    first = summaries[0]
    lines = [
        f"Search drivers replayed against {source}: best configuration "
        f"{objective.best_s * 1e3:.2f} ms/step; tolerance {first.tolerance:.0%}, budget "
        f"{first.budget} trials.",
        "",
        f"| method | seeds | within {first.tolerance:.0%} by trial {first.budget} | "
        "median trials to get there | pick after the budget (median) |",
        "|---|---|---|---|---|",
    ]
    for s in summaries:
        median = s.median_trials()
        shown = f"{median:g}" if math.isfinite(median) else f"> {len(s.curves[0])}"
        at_budget = statistics.median(c[s.budget - 1] for c in s.curves)
        lines.append(
            f"| {s.method} | {len(s.curves)} | {s.fraction_within_budget():.0%} | {shown} | "
            f"{at_budget:.3f}x the best |"
        )
    return "\n".join(lines) + "\n"


def plot(summaries: Sequence[MethodSummary], path: str | Path, title: str) -> None:
    """Best-so-far (the pick's true step time over the best) against trials: the median
    over seeds, with the 25th to 75th percentile shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for s in summaries:
        columns = list(zip(*s.curves, strict=True))
        x = list(range(1, len(columns) + 1))
        mid = [statistics.median(c) for c in columns]
        (line,) = ax.plot(
            x,
            mid,
            marker="o",
            markersize=3,
            label=f"{s.method} ({len(s.curves)} seeds)" if len(s.curves) > 1 else s.method,
        )
        if len(s.curves) > 1:
            q = [statistics.quantiles(c, n=4) for c in columns]
            ax.fill_between(
                x, [a for a, _, _ in q], [b for _, _, b in q], alpha=0.2, color=line.get_color()
            )
    first = summaries[0]
    ax.axhline(1 + first.tolerance, color="gray", linestyle="--", linewidth=1)
    ax.axvline(first.budget, color="gray", linestyle=":", linewidth=1)
    # Early picks can be several times the best; a log scale keeps the last percent,
    # where the methods differ, readable.
    ax.set_yscale("log")
    ax.set_xlabel("trials")
    ax.set_ylabel("step time of the best so far / the best")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sumflow_bench.tune_compare",
        description="Replays Bayesian optimisation, random and grid search against step "
        "times measured per configuration (or a synthetic model) and reports how fast each "
        "comes within a tolerance of the best (ByteScheduler Fig. 14).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("grid", nargs="?", help="GRID.json, or the .jsonl trial log of a grid run")
    p.add_argument("--synthetic", action="store_true", help="use the synthetic step-time model")
    p.add_argument("--methods", default=",".join(METHODS), help="drivers to compare")
    p.add_argument("--seeds", type=int, default=40, help="replays per driver")
    p.add_argument("--trials", type=int, default=15, help="trials per replay")
    p.add_argument("--budget", type=int, default=10, help="the trial budget judged")
    p.add_argument("--tolerance", type=float, default=0.05, help="'within' means this close")
    p.add_argument(
        "--draws",
        type=int,
        default=1,
        help="samples scored per trial (1 when the samples are whole trials' scores; "
        "the online tuner's measured steps when they are single steps)",
    )
    p.add_argument("--plot", help="write the best-so-far plot (PNG) here")
    p.add_argument("--json", help="write the results (JSON) here")
    args = p.parse_args(argv)
    if bool(args.grid) == args.synthetic:
        p.error("give GRID.json or --synthetic (one of them)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        print(f"unknown methods {unknown}: choose from {', '.join(METHODS)}", file=sys.stderr)
        return 2
    try:
        objective: Objective = SyntheticObjective() if args.synthetic else load_grid(args.grid)
        summaries = compare(
            objective, methods, args.seeds, args.trials, args.budget, args.tolerance, args.draws
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    source = "the synthetic model" if args.synthetic else str(args.grid)
    print(markdown(summaries, objective, source), end="")
    if args.plot:
        plot(summaries, args.plot, f"search cost: {Path(source).name}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "source": source,
                    "best_s": objective.best_s,
                    "budget": args.budget,
                    "tolerance": args.tolerance,
                    "draws": args.draws,
                    "methods": [s.to_json() for s in summaries],
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
