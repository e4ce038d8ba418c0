"""Asynchronous training through the summation service (BytePS §4.3, Fig. 11b).

The optimizer stays on the workers, as in synchronous training, but nobody waits for the
others' gradients: each worker updates its own parameters, pushes the difference (the
*delta*: its parameters after its step, less the value it last pulled), and the servers
add it at once to the parameters they keep, whatever the other workers have pushed; the
worker then continues from the servers' latest parameters, every worker's deltas so far
included. By BytePS's Theorem 2 this is Asynchronous Parallel with the update ``w <- w +
f(g)`` computed on the workers: the same parameters, given the same order of pushes and
pulls, as a parameter server that runs the optimizer.

Use it where workers run at different speeds (stragglers, mixed hardware) and the model
tolerates stale gradients; synchronous ``DistributedOptimizer`` is the default for a
reason (asynchrony slows convergence per step). ``staleness`` bounds the asynchrony
(stale-synchronous parallel): a worker's step r waits until every worker has pushed its
step r - staleness, so no worker runs more than ``staleness`` steps ahead of the slowest;
0 is the synchronous schedule with deltas.

Every parameter is a tensor of its own on the servers (placed together over them by Eq. 1
and 2), sent uncompressed from host memory: CUDA parameters are copied to the host and
back each step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch

from sumflow.torch import _runtime, declarations
from sumflow.torch.optimizer import wrapping

#: The largest staleness bound the wire carries (its maximum means "none").
MAX_STALENESS = (1 << 32) - 2


@dataclass(eq=False)
class _Slot:
    """One parameter's exchange: its tensor id, the value last pulled (host memory), and
    the buffer its delta goes out in and the latest value comes back in."""

    param: torch.Tensor
    tid: int
    base: torch.Tensor
    delta: torch.Tensor


class _AsyncOptimizer(torch.optim.Optimizer):
    """The methods ``AsyncOptimizer`` adds to the wrapped optimizer's class."""

    _sf_slots: list[_Slot]
    _sf_staleness: int | None
    _sf_steps: int

    def _sf_setup(self, named: dict[torch.Tensor, str], staleness: int | None) -> None:
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        names = [f"AsyncOptimizer.{named.get(p, f'param.{i}')}" for i, p in enumerate(params)]
        with torch.no_grad():
            bases = [p.detach().to("cpu", copy=True).reshape(-1).contiguous() for p in params]
        ids = declarations.declare_group(list(zip(names, bases)))
        self._sf_slots = [
            _Slot(param=p, tid=tid, base=base, delta=torch.empty_like(base))
            for p, tid, base in zip(params, ids, bases)
        ]
        self._sf_staleness = staleness
        self._sf_steps = 0

    def step(self, closure: Any = None) -> Any:
        """Updates the parameters locally (the wrapped optimizer's step), then pushes each
        parameter's delta and continues from the servers' latest parameters."""
        loss = super(self.__class__, self).step(closure)
        self._sf_exchange()
        return loss

    def synchronize(self) -> None:
        """Nothing to wait for: ``step()`` returns with the latest parameters. (Here for
        scripts written for ``DistributedOptimizer``.)"""

    def _sf_exchange(self) -> None:
        rt = _runtime.current()
        service = rt.service
        handles: list[tuple[_Slot, int]] = []
        with torch.no_grad():
            for priority, slot in enumerate(self._sf_slots):
                local = slot.param.detach().reshape(-1)
                torch.sub(local.to("cpu"), slot.base, out=slot.delta)
                nbytes = slot.delta.numel() * slot.delta.element_size()
                # The initial value (read by the first push only) is the value this
                # worker started from: the servers start from the first to arrive.
                handle = service.push_delta(
                    slot.tid,
                    slot.delta,
                    slot.delta.data_ptr(),
                    nbytes,
                    slot.base,
                    slot.base.data_ptr(),
                    self._sf_staleness,
                    priority,
                )
                handles.append((slot, handle))
            failure: BaseException | None = None
            for _, handle in handles:
                try:
                    service.wait(handle, rt.timeout)
                except BaseException as e:  # every handle is waited for, the first error raised
                    failure = failure or e
            if failure is not None:
                raise failure
            for slot, _ in handles:
                slot.base.copy_(slot.delta)
                slot.param.copy_(slot.delta.view_as(slot.param))
        self._sf_steps += 1


def AsyncOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    staleness: int | None = None,
) -> torch.optim.Optimizer:
    """Wraps `optimizer` for asynchronous training (BytePS §4.3): ``step()`` updates the
    parameters locally, pushes each one's delta to the summation servers, which add it to
    the parameters they keep, and continues from their latest parameters (see the module
    docs).

    The result is an instance of a subclass of the optimizer's class sharing its state,
    as with ``DistributedOptimizer``. ``named_parameters`` (``model.named_parameters()``)
    names the tensors; every worker must wrap the same parameters. The servers start from
    the parameters of the first worker whose first step reaches them: broadcast the
    parameters from one worker first (``broadcast_parameters``) for a deterministic
    start. ``staleness``: at most this many steps ahead of the slowest worker (``None``:
    unbounded; 0: the synchronous schedule).
    """
    if staleness is not None and (
        isinstance(staleness, bool)
        or not isinstance(staleness, int)
        or not 0 <= staleness <= MAX_STALENESS
    ):
        raise ValueError(
            f"staleness must be None (unbounded) or a whole number of steps from 0 to "
            f"{MAX_STALENESS}, not {staleness!r}"
        )
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.dtype not in declarations.DTYPES:
                raise TypeError(
                    f"AsyncOptimizer: a parameter holds {p.dtype}; deltas are summed in "
                    f"{', '.join(str(d) for d in declarations.DTYPES)}"
                )
    named = {p: n for n, p in named_parameters} if named_parameters is not None else {}
    wrapped = cast("_AsyncOptimizer", wrapping(optimizer, _AsyncOptimizer))
    wrapped._sf_setup(named, staleness)
    return wrapped
