"""Issue 6's targets for the scheduler benchmark, judged on measured iterations/s.

- tuned bytescheduler at least 1.3x fifo on VGG-16 at the lowest bandwidth;
- prophet at least 1.1x tuned bytescheduler at the two lowest bandwidths, and at least
  0.97x at the highest (every profile);
- the best sumflow scheduler at least 1.2x DDP/gloo on every profile at the lowest
  bandwidth.

A verdict is one comparison in one cell: its ratio, its threshold, and met or not; a cell
that lacks one of the two systems gives a verdict with no ratio ("not measured"), so a
partial run says what it could not judge instead of passing quietly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sumflow_bench.matrix import SCHEDULER_SYSTEMS

#: iterations/s by (model, reference Gbit/s), then by system name.
Rates = Mapping[tuple[str, float], Mapping[str, float]]

#: Every sumflow system of the scheduler benchmark (all but DDP).
SUMFLOW_SCHEDULERS = tuple(s for s in SCHEDULER_SYSTEMS if s != "ddp")


@dataclass(frozen=True)
class Verdict:
    """One target in one cell.

    Attributes:
        target: the target, in words.
        model: the profile.
        reference_gbit: the cell's bandwidth.
        system: the system judged (for "best scheduler", the best one measured).
        baseline: the system it is compared with.
        ratio: system's iterations/s over baseline's; None if either was not measured.
        threshold: the least ratio that meets the target.
    """

    target: str
    model: str
    reference_gbit: float
    system: str
    baseline: str
    ratio: float | None
    threshold: float

    @property
    def met(self) -> bool | None:
        """Met, not met, or None (not measured)."""
        return None if self.ratio is None else self.ratio >= self.threshold

    def line(self) -> str:
        """One line: ``met: prophet / bytescheduler-tuned = 1.12x (>= 1.1x) on vgg16 at 1
        Gbit/s``."""
        where = f"on {self.model} at {self.reference_gbit:g} Gbit/s"
        if self.ratio is None:
            return (
                f"not measured: {self.system} / {self.baseline} {where} (needs both; {self.target})"
            )
        word = "met" if self.met else "NOT met"
        return (
            f"{word}: {self.system} / {self.baseline} = {self.ratio:.2f}x "
            f"(target >= {self.threshold:g}x) {where}"
        )


def _ratio(rates: Rates, cell: tuple[str, float], system: str, baseline: str) -> float | None:
    got = rates.get(cell, {})
    if system not in got or baseline not in got or got[baseline] <= 0:
        return None
    return got[system] / got[baseline]


def _best_prophet(rates: Rates, cell: tuple[str, float]) -> str:
    """The faster of prophet with its defaults and tuned prophet, where both ran."""
    got = rates.get(cell, {})
    measured = [s for s in ("prophet", "prophet-tuned") if s in got]
    return max(measured, key=lambda s: got[s]) if measured else "prophet"


def verdicts(rates: Rates) -> list[Verdict]:
    """Every target's verdicts for the cells in `rates` (bandwidths and models are those
    measured; the lowest and highest bandwidth are among them)."""
    if not rates:
        return []
    gbits = sorted({g for _, g in rates})
    models = sorted({m for m, _ in rates})
    lowest, highest = gbits[0], gbits[-1]
    out = []
    if "vgg16" in models:
        target = "tuned bytescheduler >= 1.3x fifo on VGG-16 at the lowest bandwidth"
        cell = ("vgg16", lowest)
        out.append(
            Verdict(
                target,
                *cell,
                "bytescheduler-tuned",
                "fifo",
                _ratio(rates, cell, "bytescheduler-tuned", "fifo"),
                1.3,
            )
        )
    for model in models:
        for gbit in gbits[:2]:
            cell = (model, gbit)
            prophet = _best_prophet(rates, cell)
            out.append(
                Verdict(
                    "prophet >= 1.1x tuned bytescheduler at the two lowest bandwidths",
                    *cell,
                    prophet,
                    "bytescheduler-tuned",
                    _ratio(rates, cell, prophet, "bytescheduler-tuned"),
                    1.1,
                )
            )
        if len(gbits) > 2:
            cell = (model, highest)
            prophet = _best_prophet(rates, cell)
            out.append(
                Verdict(
                    "prophet >= 0.97x tuned bytescheduler at the highest bandwidth",
                    *cell,
                    prophet,
                    "bytescheduler-tuned",
                    _ratio(rates, cell, prophet, "bytescheduler-tuned"),
                    0.97,
                )
            )
    for model in models:
        cell = (model, lowest)
        got = rates.get(cell, {})
        measured = [s for s in SUMFLOW_SCHEDULERS if s in got]
        best = max(measured, key=lambda s: got[s]) if measured else "best scheduler"
        out.append(
            Verdict(
                "the best sumflow scheduler >= 1.2x DDP/gloo on every profile at the lowest "
                "bandwidth",
                *cell,
                best,
                "ddp",
                _ratio(rates, cell, best, "ddp") if measured else None,
                1.2,
            )
        )
    return out
