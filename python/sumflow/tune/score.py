"""A trial's score: one number, seconds per step, from the step times measured in it.

The score is a trimmed mean: the mean step time after dropping the fastest and the
slowest TRIM of the measured steps. Training time is a sum of step times, so the quantity
to minimise is the mean. A plain mean, though, lets one stall that has nothing to do with
the configuration (a garbage collection, a checkpoint written on the machine, a
retransmission) decide a trial; the median ignores those, but also hides a cost that a
configuration pays on a minority of its steps (say, a window stall every third step), and
the minimum rewards luck. Trimming 10% from each end keeps every cost that recurs in more
than a tenth of the steps and drops the rare outliers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: Fraction of the measured steps dropped from each end.
TRIM = 0.1

#: How the statistic is named in logs and files.
STATISTIC = f"trimmed mean ({TRIM:.0%} of steps dropped from each end)"


def trimmed_mean(samples: Sequence[float], trim: float = TRIM) -> float:
    """The mean of `samples` without the floor(trim * n) smallest and largest."""
    if not samples:
        raise ValueError("no step times to score: a trial needs at least one measured step")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), not {trim}")
    bad = [s for s in samples if not (math.isfinite(s) and s >= 0)]
    if bad:
        raise ValueError(f"step times must be finite and non-negative; got {bad[:3]}")
    k = math.floor(trim * len(samples))
    kept = sorted(samples)[k : len(samples) - k]
    return sum(kept) / len(kept)
