"""What an elastic job keeps across changes of membership: the committed state of
training, restored after a failure and given to workers that join.

``commit()`` copies the state in memory (no disk: the survivors hold it) and asks whether
the membership is about to change; ``restore()`` goes back to the last commit; ``sync()``
gives every worker rank 0's state, rank 0 being the oldest surviving worker
(``sumflow.launcher.membership``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from sumflow.torch import _runtime
from sumflow.torch.elastic.sampler import ElasticSampler


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by ``commit()`` on every worker at once when workers wait to join or must
    leave: ``sumflow.torch.elastic.run`` then forms the next membership. Training state is
    that of the commit, so nothing is restored."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the job's membership changes")
        self.skip_sync = skip_sync


class State:
    """The base of elastic states: commit, restore, sync, and callbacks run after every
    change of membership (to rescale a learning rate to the new number of workers, say)."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        #: Commits so far; ``run`` gives up when failures repeat with none in between.
        self.commits = 0

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Adds functions called, in order, after each change of membership."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Runs the reset callbacks (``run`` calls it once the new membership stands)."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Saves the state in memory, then raises HostsUpdatedInterrupt when the
        membership is about to change. Every worker must call it at the same points."""
        self.save()
        self.commits += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt, on every worker alike, when the launcher has
        workers waiting to join or leaving. Rank 0 asks; its answer is broadcast, so no
        worker goes on into a step the others left."""
        client = _runtime.elastic_client()
        rt = _runtime.running()
        if client is None or rt is None or rt.epoch is None:
            return  # a job whose membership is fixed
        from sumflow.torch.ops import broadcast_object

        pending = client.updates_pending(rt.epoch) if rt.service.rank == 0 else None
        if broadcast_object(pending, root_rank=0, name="sumflow.elastic.updates"):
            raise HostsUpdatedInterrupt()

    def save(self) -> None:
        """Copies the state to restore."""
        raise NotImplementedError

    def restore(self) -> None:
        """Goes back to the last saved state."""
        raise NotImplementedError

    def sync(self) -> None:
        """Gives every worker rank 0's state, then saves it."""
        raise NotImplementedError


class ObjectState(State):
    """Plain Python values as attributes (``state.epoch``, ``state.batch``), kept by deep
    copy and synchronised by ``broadcast_object``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._names = list(kwargs)
        self._saved: dict[str, Any] = {}
        for name, value in kwargs.items():
            setattr(self, name, value)
        self.save()

    if TYPE_CHECKING:
        # The values are attributes named by the caller (``state.epoch``).
        def __getattr__(self, name: str) -> Any: ...
        def __setattr__(self, name: str, value: Any) -> None: ...

    def _values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._names}

    def save(self) -> None:
        self._saved = copy.deepcopy(self._values())

    def restore(self) -> None:
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self, name, value)

    def sync(self) -> None:
        if self._names:
            from sumflow.torch.ops import broadcast_object

            values = broadcast_object(self._values(), root_rank=0, name="sumflow.elastic.state")
            for name, value in values.items():
                setattr(self, name, value)
        self.save()


class TorchState(ObjectState):
    """A model, its optimizer, any ``ElasticSampler`` and plain values, as Horovod's
    ``hvd.elastic.TorchState(model, optimizer, sampler=..., epoch=0, batch=0)``."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self._samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        for name, sampler in self._samplers.items():
            setattr(self, name, sampler)
        self._model_saved: dict[str, Any] | None = None
        self._optimizer_saved: dict[str, Any] | None = None
        self._samplers_saved: dict[str, dict[str, Any]] = {}
        values = {k: v for k, v in kwargs.items() if k not in self._samplers}
        super().__init__(**values)

    def save(self) -> None:
        super().save()
        if self.model is not None:
            self._model_saved = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._optimizer_saved = copy.deepcopy(self.optimizer.state_dict())
        self._samplers_saved = {k: s.state_dict() for k, s in self._samplers.items()}

    def restore(self) -> None:
        super().restore()
        if self.model is not None and self._model_saved is not None:
            self.model.load_state_dict(self._model_saved)
        if self.optimizer is not None and self._optimizer_saved is not None:
            self.optimizer.load_state_dict(self._optimizer_saved)
        for name, saved in self._samplers_saved.items():
            self._samplers[name].load_state_dict(saved)

    def sync(self) -> None:
        from sumflow.torch.optimizer import broadcast_optimizer_state, broadcast_parameters

        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for sampler in self._samplers.values():
            sampler.sync()
        super().sync()
