"""How a job tunes: the budget, the trial length, the method, where results go. The
``SUMFLOW_AUTOTUNE*`` variables that set them, and their defaults, are in the one table
of settings (:mod:`sumflow.settings`); this is the tuner's view of them. Only rank 0 reads
them: it decides and tells the other workers, so workers started with different values
cannot disagree."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sumflow import settings
from sumflow.tune.search import METHODS
from sumflow.tune.space import SearchSpace
from sumflow.tune.store import default_path


@dataclass(frozen=True)
class TuneSettings:
    """Everything rank 0's tuner is configured with (defaults: docs/settings.md)."""

    #: "bo" (Bayesian optimisation), "random" or "grid".
    method: str = settings.AUTOTUNE_METHOD.default
    #: Trials at most, the job's starting configuration included.
    max_trials: int = settings.AUTOTUNE_TRIALS.default
    #: Stop after this many seconds of tuning even with trials left (None: no limit).
    max_seconds: float | None = None
    #: Steps run after each switch before measuring (new partitions are declared and
    #: placed, buffers grow, queues settle).
    warmup_steps: int = settings.AUTOTUNE_WARMUP_STEPS.default
    #: Steps measured per trial; the score is their trimmed mean.
    measure_steps: int = settings.AUTOTUNE_MEASURE_STEPS.default
    seed: int = settings.AUTOTUNE_SEED.default
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
    return settings.AUTOTUNE.read() != "off"


def from_env(base: TuneSettings | None = None) -> TuneSettings:
    """`base` (default: the defaults) with what the ``SUMFLOW_AUTOTUNE*`` variables set."""
    base = base or TuneSettings()
    space = base.space
    partitions = settings.AUTOTUNE_PARTITION_BYTES.get()
    if partitions is not None:
        low, high = partitions
        space = _checked(
            settings.AUTOTUNE_PARTITION_BYTES,
            lambda: dataclasses.replace(space, min_partition_bytes=low, max_partition_bytes=high),
        )
    space = dataclasses.replace(
        space,
        max_credit_partitions=settings.AUTOTUNE_MAX_CREDIT_PARTITIONS.read_or(
            space.max_credit_partitions
        ),
    )
    fusion = settings.AUTOTUNE_FUSION_BYTES.get()
    if fusion is not None:
        space = _checked(settings.AUTOTUNE_FUSION_BYTES, lambda: space.with_fusion(*fusion))
    log = settings.AUTOTUNE_LOG.read()
    return dataclasses.replace(
        base,
        method=settings.AUTOTUNE_METHOD.read_or(base.method),
        max_trials=settings.AUTOTUNE_TRIALS.read_or(base.max_trials),
        max_seconds=settings.AUTOTUNE_SECONDS.read_or(base.max_seconds),
        warmup_steps=settings.AUTOTUNE_WARMUP_STEPS.read_or(base.warmup_steps),
        measure_steps=settings.AUTOTUNE_MEASURE_STEPS.read_or(base.measure_steps),
        seed=settings.AUTOTUNE_SEED.read_or(base.seed),
        space=space,
        retune=base.retune or settings.AUTOTUNE.read() == "retune",
        log_path=Path(log).expanduser() if log else base.log_path,
    )


def _checked(variable: settings.Variable[Any], build: Callable[[], SearchSpace]) -> SearchSpace:
    """The space `build` makes from `variable`'s value; the space's refusal (sizes below a
    page) is reported as the variable's error."""
    try:
        return build()
    except ValueError as e:
        raise variable.invalid(variable.raw() or "", str(e)) from None
