"""Bayesian optimisation of partition size and credit together (ByteScheduler §4.3), and
of the fusion threshold where the optimizer fuses, with optuna's Gaussian-process sampler.

Step time as a function of the knobs is unknown, not smooth (partition counts are
rounded, §4.1) and noisy, so it is modelled by a Gaussian process (Matern 5/2 kernel, one
length scale per knob, a fitted noise level) and the next configuration is the one that
maximises expected improvement over the best step time so far. The GP models the log of
the step time: bad configurations can be ten times slower than good ones, and on a linear
scale they would set the model's scale and flatten the few percent that separate the
good ones. The first few trials are
a scrambled Halton design, spread over the space, because a GP fitted to one or two points
says nothing about the rest. Why optuna rather than scikit-optimize or
bayesian-optimization: docs/autotune.md.

Each proposal says why it was chosen: for GP trials, the model's predicted step time
there, its uncertainty, and the expected improvement that made it win. optuna has no
public API for these, so the sampler's documented override point, ``_optimize_acqf``, is
used to see the acquisition function it built; the exact optuna release is pinned.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import optuna
import torch
from optuna.distributions import BaseDistribution, FloatDistribution
from optuna.samplers import GPSampler
from optuna.trial import TrialState
from scipy.stats import qmc

from sumflow.tune.search import Proposal
from sumflow.tune.space import Configuration, SearchSpace

#: Observations before the GP takes over: one more than the knobs, the fewest that say
#: something about each; the initial design tops up those the tuner measured itself
#: (the job's starting configuration), so 7 of a 10-trial budget are chosen by the model.
#: (On the synthetic model, 16 seeds: 2, 3 and 4 all came within 5% by trial 10 on every
#: seed, after a median of 4, 5 and 4.5 trials; random search on 13 of 16.)
STARTUP_TRIALS = 3


class _ExplainingGPSampler(GPSampler):
    """optuna's GPSampler, keeping the acquisition function and the point it chose."""

    last_choice: tuple[Any, np.ndarray] | None = None

    def _optimize_acqf(self, acqf: Any, best_params: np.ndarray | None) -> np.ndarray:
        chosen = super()._optimize_acqf(acqf, best_params)
        self.last_choice = (acqf, chosen)
        return chosen


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    """optuna logs every trial at INFO; the tuner's own log says more, so silence it
    while the tuner calls optuna (and only then: the user's own studies keep theirs)."""
    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(before)


class BayesianSearch:
    """GP + expected improvement over (log partition size, log credit multiple), seeded."""

    method = "bo"

    def __init__(
        self, space: SearchSpace, seed: int = 0, startup_trials: int = STARTUP_TRIALS
    ) -> None:
        if startup_trials < 1:
            raise ValueError(f"startup_trials must be >= 1, not {startup_trials}")
        self._space = space
        self._startup = startup_trials
        self._distributions: dict[str, BaseDistribution] = {
            "partition_bytes": FloatDistribution(
                float(space.min_partition_bytes), float(space.max_partition_bytes), log=True
            ),
            "credit_partitions": FloatDistribution(
                1.0, float(space.max_credit_partitions), log=True
            ),
        }
        if space.tunes_fusion:
            self._distributions["fusion_bytes"] = FloatDistribution(
                float(space.min_fusion_bytes), float(space.max_fusion_bytes), log=True
            )
        self._sampler = _ExplainingGPSampler(
            seed=seed, n_startup_trials=startup_trials, warn_independent_sampling=False
        )
        self._design = qmc.Halton(d=space.dims, scramble=True, seed=seed)
        self._design_used = 0
        with _quiet_optuna():
            self._study = optuna.create_study(direction="minimize", sampler=self._sampler)
        self._trials: dict[int, optuna.trial.Trial] = {}

    def _completed(self) -> list[float]:
        """The log step times measured so far."""
        return [
            t.value
            for t in self._study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.value is not None
        ]

    def ask(self) -> Proposal:
        seen = self._completed()
        self._sampler.last_choice = None
        design = len(seen) < self._startup
        with _quiet_optuna():
            if design:
                unit = self._design.random(1)[0]
                self._design_used += 1
                point = self._space.from_unit(*(float(x) for x in unit))
                self._study.enqueue_trial(self._params(point))
            trial = self._study.ask(self._distributions)
        self._trials[trial.number] = trial
        config = self._space.configuration(
            trial.params["partition_bytes"],
            trial.params["credit_partitions"],
            trial.params.get("fusion_bytes"),
        )
        if design:
            reason = (
                f"initial design: Halton point {self._design_used}, spread over the space "
                f"until the Gaussian process has {self._startup} observations (it has "
                f"{len(seen)})"
            )
            detail: dict[str, Any] = {"kind": "initial-design", "observations": len(seen)}
        else:
            detail = self._explain(seen)
            low, high = detail["predicted_range_s"]
            reason = (
                f"the Gaussian process over {len(seen)} measured trials predicts "
                f"{detail['predicted_step_s'] * 1e3:.1f} ms here (1 sigma: {low * 1e3:.1f} to "
                f"{high * 1e3:.1f} ms); its expected improvement, "
                f"{detail['expected_improvement'] * 100:.2g}% over the best "
                f"{math.exp(min(seen)) * 1e3:.1f} ms, is the largest in the space "
                f"(length scales: {_describe_scales(detail['length_scales'])})"
            )
        return Proposal(config, reason, detail, trial.number)

    def _explain(self, seen: list[float]) -> dict[str, Any]:
        """The GP's view of the point it chose. optuna standardises and sign-flips what it
        is told, here log step times: y = -(ln t - mean) / std."""
        assert self._sampler.last_choice is not None
        acqf, x = self._sampler.last_choice
        values = np.asarray(seen, dtype=float)
        mean, std = float(values.mean()), max(float(values.std()), 1e-10)
        with torch.no_grad():
            xt = torch.from_numpy(np.asarray(x, dtype=np.float64))
            m, var = acqf._gpr.posterior(xt)
            log_ei = float(acqf.eval_acqf(xt))
        log_t = mean - float(m) * std
        sd = math.sqrt(max(float(var), 0.0)) * std
        # The GP's length scales are in the unit cube optuna normalises log values to;
        # a knob whose range is a single value is not modelled at all.
        space = self._space
        octaves = [
            ("partition_octaves", math.log2(space.max_partition_bytes / space.min_partition_bytes)),
            ("credit_octaves", math.log2(space.max_credit_partitions)),
        ]
        if space.tunes_fusion:
            octaves.append(
                ("fusion_octaves", math.log2(space.max_fusion_bytes / space.min_fusion_bytes))
            )
        modelled = [(name, o) for name, o in octaves if o > 0]
        scales = {
            name: float(ls) * o for (name, o), ls in zip(modelled, acqf.length_scales, strict=True)
        }
        return {
            "kind": "gp-expected-improvement",
            "observations": len(seen),
            "predicted_step_s": math.exp(log_t),
            "predicted_range_s": [math.exp(log_t - sd), math.exp(log_t + sd)],
            # EI of the log step time; exp(-EI) is the step time it expects as a fraction
            # of the best one.
            "expected_improvement": 1 - math.exp(-math.exp(log_ei) * std),
            "length_scales": scales,
        }

    def tell(self, proposal: Proposal, score: float) -> None:
        trial = self._trials.pop(proposal.token)
        with _quiet_optuna():
            self._study.tell(trial, math.log(score))

    def _params(self, config: Configuration) -> dict[str, float]:
        """`config` as optuna's parameters, clamped to the bounds page rounding may cross."""
        space = self._space
        params = {
            "partition_bytes": min(
                max(float(config.partition_bytes), float(space.min_partition_bytes)),
                float(space.max_partition_bytes),
            ),
            "credit_partitions": min(
                max(config.credit_partitions, 1.0), float(space.max_credit_partitions)
            ),
        }
        if space.tunes_fusion and config.fusion_bytes is not None:
            params["fusion_bytes"] = min(
                max(float(config.fusion_bytes), float(space.min_fusion_bytes)),
                float(space.max_fusion_bytes),
            )
        return params

    def observe(self, config: Configuration, score: float) -> None:
        if not self._space.contains(config):
            return
        with _quiet_optuna():
            self._study.add_trial(
                optuna.trial.create_trial(
                    params=self._params(config),
                    distributions=self._distributions,
                    value=math.log(score),
                )
            )


def _describe_scales(scales: dict[str, float]) -> str:
    """``'3.4 octaves of partition size, 1.2 octaves of credit'``: how far apart two
    configurations may be and still, to the model, perform alike."""
    knob = {
        "partition_octaves": "partition size",
        "credit_octaves": "credit",
        "fusion_octaves": "fusion threshold",
    }
    return ", ".join(f"{v:.2g} octaves of {knob[k]}" for k, v in scales.items())
