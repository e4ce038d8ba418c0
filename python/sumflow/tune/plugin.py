"""Online tuning for ``sumflow.torch.DistributedOptimizer``.

``DistributedOptimizer.step()`` calls :func:`after_step` once per step. With
``SUMFLOW_AUTOTUNE=1`` in every worker's environment (or after :func:`attach`), the first
call builds the worker's :class:`~sumflow.tune.online.OnlineTuner`; without either it
remembers that tuning is off and every later call returns at once.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import weakref
from pathlib import Path
from typing import Any

import torch

from sumflow.torch import _runtime, ops
from sumflow.tune import settings as tune_settings
from sumflow.tune.online import OnlineTuner
from sumflow.tune.search import make_searcher
from sumflow.tune.session import TuningSession
from sumflow.tune.settings import TuneSettings
from sumflow.tune.space import DEFAULT_FUSION_RANGE, Configuration
from sumflow.tune.store import TuningKey, TuningStore
from sumflow.tune.trial_log import TrialLog

#: Each optimizer's tuner; None once tuning was found to be off for it.
_tuners: weakref.WeakKeyDictionary[torch.optim.Optimizer, OnlineTuner | None] = (
    weakref.WeakKeyDictionary()
)

#: The schedulers that use the credit (docs/scheduling.md); for the others only the
#: partition size is tuned.
CREDIT_SCHEDULERS = ("bytescheduler", "prophet")

#: The name of the decision broadcast (ops adds its own prefix).
BROADCAST_NAME = "sumflow.autotune.decision"


def attach(optimizer: torch.optim.Optimizer, settings: TuneSettings | None = None) -> None:
    """Tunes partition size and credit while `optimizer` (a ``DistributedOptimizer``)
    trains, with `settings` (default: the ``SUMFLOW_AUTOTUNE*`` variables, whatever
    ``SUMFLOW_AUTOTUNE`` itself says). Every worker must call it, before the first
    ``step()``; only rank 0's settings are used."""
    if not hasattr(optimizer, "_sf_names"):
        raise TypeError(
            f"attach() needs a sumflow.torch.DistributedOptimizer, not {type(optimizer).__name__}"
        )
    if optimizer in _tuners:
        raise RuntimeError("this optimizer already has a tuner (attach() twice, or after step())")
    _tuners[optimizer] = _build(optimizer, settings or tune_settings.from_env())


def after_step(optimizer: torch.optim.Optimizer) -> None:
    """Called by ``DistributedOptimizer.step()`` after each step, on every worker."""
    try:
        tuner = _tuners[optimizer]
    except KeyError:
        tuner = (
            _build(optimizer, tune_settings.from_env()) if tune_settings.enabled_in_env() else None
        )
        _tuners[optimizer] = tuner
    if tuner is not None:
        tuner.after_step()


def _tensors(optimizer: Any) -> list[tuple[str, str, int]]:
    """(name, wire dtype, bytes) of every gradient the optimizer sums, in priority order
    (the gradients, not the spans fusion sends them in, which change with the threshold)."""
    return [
        (name, ops.DTYPES[dtype], math.prod(shape) * dtype.itemsize)
        for name, dtype, shape in optimizer._sf_sent(by_gradient=True)
    ]


def _fusion(optimizer: Any) -> int | None:
    """The optimizer's fusion threshold; None when it does not fuse."""
    pool = optimizer._sf_pool
    return None if pool is None else pool.threshold


def _start(schedule: dict[str, Any], fusion: int | None) -> Configuration | None:
    """The configuration the job runs now; None when its credit is not one the search can
    express (0, unbounded)."""
    partition = int(schedule["partition_bytes"])
    if schedule["scheduler"] not in CREDIT_SCHEDULERS:
        return Configuration(partition, partition, fusion)
    try:
        return Configuration(partition, int(schedule["credit_bytes"]), fusion)
    except ValueError:
        return None


class _Knobs:
    """The communication service's knobs and the optimizer's fusion threshold, set
    together at a trial boundary."""

    def __init__(self, service: Any, optimizer: Any) -> None:
        self._service = service
        self._optimizer = optimizer

    def reconfigure(
        self,
        partition_bytes: int | None = None,
        credit_bytes: int | None = None,
        fusion_bytes: int | None = None,
    ) -> None:
        self._service.reconfigure(partition_bytes=partition_bytes, credit_bytes=credit_bytes)
        if fusion_bytes is not None:
            self._optimizer._sf_set_fusion(fusion_bytes)


def _build(optimizer: Any, settings: TuneSettings) -> OnlineTuner:
    service = _runtime.current().service
    scheduler = str(service.schedule()["scheduler"])
    if scheduler == "fifo":
        # Every worker reaches this at its first step, so the job stops at once everywhere.
        raise ValueError(
            "SUMFLOW_AUTOTUNE: the fifo scheduler sends whole tensors without a credit, so it "
            "has no partition size or credit to tune; choose bytescheduler, prophet or p3 "
            "(SUMFLOW_SCHEDULER), or turn auto-tuning off"
        )

    def drain() -> None:
        # The service may not switch under a push_pull in flight. After a synchronous
        # step() none is; across the global barrier, step() returned before its sums did.
        if optimizer._sf_overlap is not None:
            optimizer._sf_overlap.wait_all("auto-tuning's trial boundary")

    def broadcast(obj: Any) -> Any:
        return ops.broadcast_object(obj, root_rank=0, name=BROADCAST_NAME)

    def open_session() -> TuningSession:
        schedule = service.schedule()
        tensors = _tensors(optimizer)
        fusion = _fusion(optimizer)
        key = TuningKey(
            tensors=tuple(tensors),
            workers=service.size,
            worker_machines=service.size // service.local_size,
            servers=service.num_servers,
            scheduler=str(schedule["scheduler"]),
            fusion=fusion is not None,
        )
        space = settings.space.capped(max((b for _, _, b in tensors), default=0) or 1)
        if fusion is None:
            space = space.with_fusion(0, 0)
        elif not space.tunes_fusion:
            space = space.with_fusion(*DEFAULT_FUSION_RANGE)
        if key.scheduler not in CREDIT_SCHEDULERS:
            # p3 sends one partition per server: the credit is not its to use, and trials
            # spent on it would measure noise.
            space = dataclasses.replace(space, max_credit_partitions=1.0)
        tuned = dataclasses.replace(settings, space=space)
        store = TuningStore(tuned.resolved_store_path())
        log_path = tuned.log_path or _default_log_path(store.path, key.digest())
        return TuningSession(
            tuned,
            make_searcher(tuned.method, tuned.space, tuned.seed),
            key,
            store,
            TrialLog(log_path),
            _start(schedule, fusion),
        )

    return OnlineTuner(
        _Knobs(service, optimizer), broadcast, drain, open_session if service.rank == 0 else None
    )


def _default_log_path(store_path: Path, digest: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return store_path.parent / "trials" / f"{digest}-{stamp}.jsonl"
