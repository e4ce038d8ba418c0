"""Auto-tuning of partition size and credit (ByteScheduler §4.3), online during training.

Turn it on with ``SUMFLOW_AUTOTUNE=1`` in every worker's environment, or call
:func:`attach` on every worker with explicit settings. Rank 0 measures each trial's step
time, chooses the next configuration by Bayesian optimisation (or random or grid search)
and broadcasts it; every worker switches at the same step. Every trial is logged with
the reason it was chosen, and the best configuration is stored for later runs of the
same model on the same cluster. See docs/autotune.md.

- :mod:`sumflow.tune.space`: the knobs and the search space;
- :mod:`sumflow.tune.search`, :mod:`sumflow.tune.bayes`: the search drivers;
- :mod:`sumflow.tune.score`: a trial's score from its step times;
- :mod:`sumflow.tune.session`, :mod:`sumflow.tune.online`, :mod:`sumflow.tune.plugin`:
  rank 0's decisions, the protocol every worker follows, the DistributedOptimizer glue;
- :mod:`sumflow.tune.store`, :mod:`sumflow.tune.trial_log`: persisted results and the
  trial log;
- :mod:`sumflow.tune.synthetic`: a step-time model to test tuners on without a cluster.

The offline comparison of BO with random and grid search is in the benchmark package
(``python -m sumflow_bench.tune_compare GRID.json``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sumflow.tune.settings import TuneSettings
from sumflow.tune.space import Configuration, SearchSpace

if TYPE_CHECKING:
    import torch


def attach(optimizer: torch.optim.Optimizer, settings: TuneSettings | None = None) -> None:
    """Tunes while `optimizer` (a ``sumflow.torch.DistributedOptimizer``) trains, with
    `settings` (default: from the ``SUMFLOW_AUTOTUNE*`` variables). Call it on every
    worker before the first ``step()``; rank 0's settings are the ones used."""
    # Imported here: the plugin needs torch and sumflow.torch, which import this package.
    from sumflow.tune import plugin

    plugin.attach(optimizer, settings)


__all__ = ["Configuration", "SearchSpace", "TuneSettings", "attach"]
