"""Rank 0's side of online tuning: what to run next, when to stop, what to keep.

It decides only from what it is given (the step times each trial measured, a clock), and
does no communication: :mod:`sumflow.tune.online` carries its decisions to every worker.
The first trial measures the configuration the job started with, so every trial is
compared with it and tuning can never leave the job slower than it started (the best
measured configuration is applied at the end). Then the search driver proposes until the
budget (trials, seconds) is spent or the driver has nothing left to try.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sumflow.tune.score import STATISTIC, trimmed_mean
from sumflow.tune.search import Proposal, Searcher
from sumflow.tune.settings import TuneSettings
from sumflow.tune.space import Configuration
from sumflow.tune.store import TunedResult, TuningKey, TuningStore
from sumflow.tune.trial_log import TrialLog, faster_than, ms

_NO_START = "a credit the search space cannot express (unbounded?), not measured"


@dataclass(frozen=True)
class Decision:
    """What every worker does at a trial boundary: switch to `apply` (None: keep the
    current configuration), then run `steps` steps to the next boundary (None: tuning is
    over, no more boundaries)."""

    apply: Configuration | None
    steps: int | None

    def to_wire(self) -> dict[str, Any]:
        """As plain data for the broadcast (no sumflow classes in the pickle)."""
        return {"apply": self.apply.to_json() if self.apply else None, "steps": self.steps}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Decision:
        apply = data["apply"]
        return cls(Configuration.from_json(apply) if apply else None, data["steps"])


@dataclass(frozen=True)
class _Measured:
    number: int
    config: Configuration
    score_s: float


class TuningSession:
    """One tuning run on rank 0."""

    def __init__(
        self,
        settings: TuneSettings,
        searcher: Searcher,
        key: TuningKey,
        store: TuningStore,
        log: TrialLog,
        start: Configuration | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._searcher = searcher
        self._key = key
        self._store = store
        self._log = log
        self._start = start
        self._clock = clock
        self._started = clock()
        self._overhead = 0.0
        self._trial_started = self._started
        self._last_trial_s = 0.0
        self._running: tuple[Configuration, Proposal | None] | None = None
        self._measured: list[_Measured] = []
        self._baseline_score: float | None = None

    @property
    def trial_steps(self) -> int:
        return self._settings.warmup_steps + self._settings.measure_steps

    def add_overhead(self, seconds: float) -> None:
        """Time the workers spent at a boundary (draining, deciding, switching)."""
        self._overhead += seconds

    def _best(self) -> _Measured | None:
        return min(self._measured, key=lambda m: m.score_s, default=None)

    def begin(self) -> Decision:
        """The decision at the first boundary: reuse, measure the start, or propose."""
        s = self._settings
        budget = f"{s.max_trials} trials" + (
            f" or {s.max_seconds:g} s" if s.max_seconds is not None else ""
        )
        self._log.record(
            "start",
            f"tuning with {s.method} over {s.space.describe()}, for at most {budget}; each "
            f"trial runs {s.warmup_steps} warm-up + {s.measure_steps} measured steps; the job "
            f"started with {self._start.describe() if self._start else _NO_START}; "
            f"trial log: {self._log.path}",
            key=self._key.to_json(),
            key_digest=self._key.digest(),
            space=s.space.to_json(),
            method=s.method,
            max_trials=s.max_trials,
            max_seconds=s.max_seconds,
            warmup_steps=s.warmup_steps,
            measure_steps=s.measure_steps,
            seed=s.seed,
            statistic=STATISTIC,
            start=self._start,
        )
        if not s.retune:
            stored = self._store.load(self._key)
            if stored is not None:
                self._log.record(
                    "reuse",
                    f"using {stored.best.describe()} from {self._store.path} (tuned "
                    f"{stored.tuned_at} with {stored.method} in {stored.trials} trials: "
                    f"{ms(stored.score_s)}/step"
                    f"{faster_than(stored.score_s, stored.baseline_score_s)}); "
                    "SUMFLOW_AUTOTUNE=retune tunes again",
                    config=stored.best,
                    stored=stored.to_json(),
                )
                return Decision(stored.best, None)
        self._trial_started = self._clock()
        if self._start is not None:
            self._running = (self._start, None)
            self._log.record(
                "propose",
                f"trial 1/{s.max_trials}: {self._start.describe()}; why: the configuration "
                "the job started with, measured first so every trial is compared with it",
                trial=1,
                config=self._start,
                reason="the configuration the job started with",
                detail={"kind": "start"},
            )
            return Decision(None, self.trial_steps)
        return self._propose()

    def end_trial(self, step_times: list[float]) -> Decision:
        """The decision at a later boundary, given the step times since the last one."""
        s = self._settings
        if self._running is None:
            raise RuntimeError(
                "end_trial() with no trial running (before begin(), or after the last decision)"
            )
        if len(step_times) != self.trial_steps:
            raise ValueError(
                f"a trial runs {self.trial_steps} steps, but {len(step_times)} step times "
                "were given"
            )
        now = self._clock()
        self._last_trial_s = now - self._trial_started
        config, proposal = self._running
        self._running = None
        measured = step_times[s.warmup_steps :]
        score = trimmed_mean(measured)
        number = len(self._measured) + 1
        self._measured.append(_Measured(number, config, score))
        if proposal is None:
            self._baseline_score = score
            self._searcher.observe(config, score)
        else:
            self._searcher.tell(proposal, score)
        best = self._best()
        assert best is not None
        self._log.record(
            "trial",
            f"trial {number}/{s.max_trials}: {config.describe()} -> {ms(score)}/step "
            f"({len(measured)} steps, {ms(min(measured))} to {ms(max(measured))}); best: "
            f"trial {best.number}, {ms(best.score_s)}"
            f"{faster_than(best.score_s, self._baseline_score)}",
            trial=number,
            config=config,
            reason=proposal.reason if proposal else "the configuration the job started with",
            detail=proposal.detail if proposal else {"kind": "start"},
            warmup_step_s=step_times[: s.warmup_steps],
            step_s=measured,
            score_s=score,
            statistic=STATISTIC,
            best={"trial": best.number, "config": best.config, "score_s": best.score_s},
            trial_s=self._last_trial_s,
            elapsed_s=now - self._started,
        )
        if len(self._measured) >= s.max_trials:
            return self._finish(f"all {s.max_trials} trials measured")
        if s.max_seconds is not None and now - self._started + self._last_trial_s > s.max_seconds:
            return self._finish(
                f"another trial ({self._last_trial_s:.1f} s like the last) would pass the "
                f"{s.max_seconds:g} s budget"
            )
        return self._propose()

    def _propose(self) -> Decision:
        s = self._settings
        proposal = self._searcher.ask()
        if proposal is None:
            return self._finish(f"{s.method} search has nothing left to try")
        number = len(self._measured) + 1
        self._running = (proposal.config, proposal)
        self._trial_started = self._clock()
        self._log.record(
            "propose",
            f"trial {number}/{s.max_trials}: {proposal.config.describe()}; why: {proposal.reason}",
            trial=number,
            config=proposal.config,
            reason=proposal.reason,
            detail=proposal.detail,
        )
        return Decision(proposal.config, self.trial_steps)

    def _finish(self, why: str) -> Decision:
        best = self._best()
        assert best is not None
        elapsed = self._clock() - self._started
        result = TunedResult(
            best=best.config,
            score_s=best.score_s,
            trials=len(self._measured),
            method=self._settings.method,
            baseline=self._start if self._baseline_score is not None else None,
            baseline_score_s=self._baseline_score,
            trial_log=str(self._log.path or ""),
        )
        try:
            self._store.save(self._key, result)
            stored = f"stored in {self._store.path}"
        except (OSError, ValueError) as e:
            # The job has its configuration either way; only later runs lose it.
            stored = f"NOT stored ({e})"
        self._log.record(
            "finish",
            f"done ({why}): applying trial {best.number}, {best.config.describe()}, "
            f"{ms(best.score_s)}/step{faster_than(best.score_s, self._baseline_score)}; "
            f"{stored}; tuning took {elapsed:.1f} s, "
            f"{self._overhead:.2f} s of it switching and deciding",
            why=why,
            best={"trial": best.number, "config": best.config, "score_s": best.score_s},
            baseline_score_s=self._baseline_score,
            trials=len(self._measured),
            elapsed_s=elapsed,
            overhead_s=self._overhead,
            store=str(self._store.path),
            stored=stored.startswith("stored"),
        )
        return Decision(best.config, None)
