"""How a job tunes: the budget, the trial length, the method, where results go, and the
``SUMFLOW_AUTOTUNE*`` variables that set them. Only rank 0 reads them: it decides and
tells the other workers, so workers started with different values cannot disagree."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from sumflow.tune.search import METHODS
from sumflow.tune.space import SearchSpace
from sumflow.tune.store import default_path

#: SUMFLOW_AUTOTUNE values: off, on (reuse a stored result when there is one), retune.
OFF = ("", "0", "false", "no", "off")
ON = ("1", "true", "yes", "on")
RETUNE = "retune"


@dataclass(frozen=True)
class TuneSettings:
    """Everything rank 0's tuner is configured with (defaults: docs/autotune.md)."""

    #: "bo" (Bayesian optimisation), "random" or "grid".
    method: str = "bo"
    #: Trials at most, the job's starting configuration included.
    max_trials: int = 10
    #: Stop after this many seconds of tuning even with trials left (None: no limit).
    max_seconds: float | None = None
    #: Steps run after each switch before measuring (new partitions are declared and
    #: placed, buffers grow, queues settle).
    warmup_steps: int = 3
    #: Steps measured per trial; the score is their trimmed mean.
    measure_steps: int = 10
    seed: int = 0
    space: SearchSpace = field(default_factory=SearchSpace)
    #: Tune even when the store holds a result for this job.
    retune: bool = False
    #: The file of tuned configurations (None: SUMFLOW_AUTOTUNE_FILE or the cache).
    store_path: Path | None = None
    #: The JSON-lines trial log (None: next to the store, one file per tuning run).
    log_path: Path | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, not {self.method!r}")
        for name, low in (("max_trials", 1), ("warmup_steps", 0), ("measure_steps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, not {value!r}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be positive (or None), not {self.max_seconds}")

    def resolved_store_path(self) -> Path:
        return self.store_path if self.store_path is not None else default_path()


def enabled_in_env() -> bool:
    """Whether ``SUMFLOW_AUTOTUNE`` turns tuning on (``1`` or ``retune``)."""
    return _mode() != "off"


def _mode() -> str:
    raw = os.environ.get("SUMFLOW_AUTOTUNE", "").strip().lower()
    if raw in OFF:
        return "off"
    if raw in ON:
        return "on"
    if raw == RETUNE:
        return RETUNE
    raise ValueError(
        f"SUMFLOW_AUTOTUNE={raw!r}: use 1 (tune, or reuse a stored result), retune (tune "
        "even if a result is stored) or 0"
    )


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _float(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def _bytes_range(name: str, default: tuple[int, int]) -> tuple[int, int]:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        low, high = (int(part) for part in raw.split(":"))
    except ValueError:
        raise ValueError(f"{name}={raw!r}: give MIN:MAX in bytes, e.g. 65536:33554432") from None
    return low, high


def from_env(base: TuneSettings | None = None) -> TuneSettings:
    """`base` (default: the defaults) with what the ``SUMFLOW_AUTOTUNE*`` variables set."""
    base = base or TuneSettings()
    low, high = _bytes_range(
        "SUMFLOW_AUTOTUNE_PARTITION_BYTES",
        (base.space.min_partition_bytes, base.space.max_partition_bytes),
    )
    credit = _float("SUMFLOW_AUTOTUNE_MAX_CREDIT_PARTITIONS")
    fusion = _bytes_range(
        "SUMFLOW_AUTOTUNE_FUSION_BYTES",
        (base.space.min_fusion_bytes, base.space.max_fusion_bytes),
    )
    space = SearchSpace(
        low,
        high,
        base.space.max_credit_partitions if credit is None else credit,
        *fusion,
    )
    log = os.environ.get("SUMFLOW_AUTOTUNE_LOG", "").strip()
    seconds = _float("SUMFLOW_AUTOTUNE_SECONDS")
    return dataclasses.replace(
        base,
        method=os.environ.get("SUMFLOW_AUTOTUNE_METHOD", "").strip() or base.method,
        max_trials=_int("SUMFLOW_AUTOTUNE_TRIALS", base.max_trials),
        max_seconds=base.max_seconds if seconds is None else seconds,
        warmup_steps=_int("SUMFLOW_AUTOTUNE_WARMUP_STEPS", base.warmup_steps),
        measure_steps=_int("SUMFLOW_AUTOTUNE_MEASURE_STEPS", base.measure_steps),
        seed=_int("SUMFLOW_AUTOTUNE_SEED", base.seed),
        space=space,
        retune=base.retune or _mode() == RETUNE,
        log_path=Path(log).expanduser() if log else base.log_path,
    )
