"""Search drivers: which configuration to try next.

A driver proposes configurations (``ask``) and learns the score of each (``tell``); it
never measures anything itself, so the online tuner and the offline replay
(:mod:`sumflow_bench.tune_compare`) drive the same code. Three are provided: Bayesian
optimisation (:class:`sumflow.tune.bayes.BayesianSearch`, the default, as ByteScheduler
§4.3), and random and grid search, the baselines of ByteScheduler Fig. 14.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sumflow import settings
from sumflow.tune.space import Configuration, SearchSpace

#: The drivers by name (``SUMFLOW_AUTOTUNE_METHOD``'s choices).
METHODS = settings.TUNE_METHODS


@dataclass(frozen=True)
class Proposal:
    """A configuration to try, and why the driver chose it."""

    config: Configuration
    #: One line a person can read: why this configuration now.
    reason: str
    #: The same, as data for the trial log (e.g. the model's prediction at this point).
    detail: dict[str, Any] = field(default_factory=dict)
    #: The driver's own handle on this proposal (passed back with ``tell``).
    token: int = 0


class Searcher(Protocol):
    """What the tuner needs from a search driver."""

    #: Its name in logs and files: one of METHODS.
    method: str

    def ask(self) -> Proposal | None:
        """The next configuration to measure; None once there is nothing left to try."""
        ...

    def tell(self, proposal: Proposal, score: float) -> None:
        """The score (lower is better) measured for `proposal`."""
        ...

    def observe(self, config: Configuration, score: float) -> None:
        """A configuration measured without being proposed (the one the job started
        with); drivers that learn from results use it, the others ignore it."""
        ...


class RandomSearch:
    """Configurations drawn uniformly on the log scales, seeded."""

    method = "random"

    def __init__(self, space: SearchSpace, seed: int = 0) -> None:
        self._space = space
        self._rng = random.Random(seed)
        self._count = 0

    def ask(self) -> Proposal:
        self._count += 1
        config = self._space.from_unit(*(self._rng.random() for _ in range(self._space.dims)))
        return Proposal(
            config,
            f"random search: draw {self._count}, uniform on the log scales",
            {"kind": "random", "draw": self._count},
            self._count,
        )

    def tell(self, proposal: Proposal, score: float) -> None:
        del proposal, score  # Random search does not learn.

    def observe(self, config: Configuration, score: float) -> None:
        del config, score


class GridSearch:
    """Every configuration of a grid, in order, then nothing."""

    method = "grid"

    def __init__(self, points: Sequence[Configuration], shape: str = "") -> None:
        if not points:
            raise ValueError("a grid search needs at least one configuration")
        self._points = list(points)
        self._shape = f" ({shape})" if shape else ""
        self._next = 0

    @classmethod
    def of_space(
        cls,
        space: SearchSpace,
        partition_points: int = 6,
        credit_points: int = 4,
        fusion_points: int = 3,
    ) -> GridSearch:
        """The log-spaced grid of `space`, partition-major (`fusion_points` only where the
        space searches the fusion threshold)."""
        shape = f"{partition_points} partition sizes x {credit_points} credits"
        if space.tunes_fusion:
            shape += f" x {fusion_points} fusion thresholds"
        return cls(space.grid(partition_points, credit_points, fusion_points), shape)

    def ask(self) -> Proposal | None:
        if self._next >= len(self._points):
            return None
        i = self._next
        self._next += 1
        return Proposal(
            self._points[i],
            f"grid search: point {i + 1} of {len(self._points)}{self._shape}",
            {"kind": "grid", "point": i + 1, "of": len(self._points)},
            i,
        )

    def tell(self, proposal: Proposal, score: float) -> None:
        del proposal, score  # The grid is fixed in advance.

    def observe(self, config: Configuration, score: float) -> None:
        del config, score


def make_searcher(method: str, space: SearchSpace, seed: int = 0) -> Searcher:
    """The driver called `method` (one of METHODS) over `space`."""
    if method == "bo":
        # optuna is only needed for this driver: imported here, not at package import.
        try:
            from sumflow.tune.bayes import BayesianSearch
        except ImportError as e:
            raise ImportError(
                f"Bayesian optimisation needs optuna and scipy ({e}): pip install "
                "'sumflow[tune]', or choose SUMFLOW_AUTOTUNE_METHOD=random or grid"
            ) from e

        return BayesianSearch(space, seed=seed)
    if method == "random":
        return RandomSearch(space, seed=seed)
    if method == "grid":
        return GridSearch.of_space(space)
    raise ValueError(f"unknown search method {method!r}: choose one of {', '.join(METHODS)}")
