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

The parameters of each dtype travel as one tensor, cut into partitions over the servers
(Eq. 1 and 2), uncompressed from host memory: CUDA parameters are copied to the host and
back each step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch

from sumflow.torch import _runtime, declarations
from sumflow.torch.optimizer import wrapping

#: The largest staleness bound the wire carries (its maximum means "none").
MAX_STALENESS = (1 << 32) - 2


@dataclass(eq=False)
class _Flat:
    """The parameters of one dtype, exchanged as one tensor: their offsets in it, the
    value last pulled (host memory), and the buffer the deltas go out in and the latest
    value comes back in."""

    params: list[torch.Tensor]
    offsets: list[int]
    tid: int
    base: torch.Tensor
    delta: torch.Tensor

    def spans(self) -> Iterator[tuple[torch.Tensor, slice]]:
        """Each parameter and its elements' place in the flat buffers."""
        for p, start in zip(self.params, self.offsets, strict=True):
            yield p, slice(start, start + p.numel())


class _AsyncOptimizer(torch.optim.Optimizer):
    """The methods ``AsyncOptimizer`` adds to the wrapped optimizer's class."""

    _sf_flats: list[_Flat]
    _sf_staleness: int | None

    def _sf_setup(self, named: dict[torch.Tensor, str], staleness: int | None) -> None:
        if _runtime.elastic_client() is not None:
            # Its parameters live on the servers, which each membership starts afresh.
            raise NotImplementedError(
                "AsyncOptimizer in an elastic job (sumflow-run --min-np ...) is not supported "
                "yet: use DistributedOptimizer there (docs/elastic.md)"
            )
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        names = {p: named.get(p, f"param.{i}") for i, p in enumerate(params)}
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        # One tensor per dtype, cut into partitions over the servers: one push per step
        # for the whole model rather than one per parameter.
        flats: list[tuple[str, list[torch.Tensor], list[int], torch.Tensor]] = []
        with torch.no_grad():
            for dtype, group in by_dtype.items():
                offsets = [0]
                for p in group[:-1]:
                    offsets.append(offsets[-1] + p.numel())
                base = torch.cat([p.detach().reshape(-1).to("cpu") for p in group])
                span = f"{names[group[0]]}..{names[group[-1]]}"
                flats.append((f"AsyncOptimizer[{span}].{dtype}", group, offsets, base))
        ids = (
            declarations.declare_group([(name, base) for name, _, _, base in flats])
            if flats
            else []
        )
        self._sf_flats = [
            _Flat(params=group, offsets=offsets, tid=tid, base=base, delta=torch.empty_like(base))
            for (_, group, offsets, base), tid in zip(flats, ids, strict=True)
        ]
        self._sf_staleness = staleness

    def step(self, closure: Any = None) -> Any:
        """Updates the parameters locally (the wrapped optimizer's step), then pushes their
        deltas and continues from the servers' latest parameters."""
        loss = super(self.__class__, self).step(closure)
        self._sf_exchange()
        return loss

    def synchronize(self) -> None:
        """Nothing to wait for: ``step()`` returns with the latest parameters. (Here for
        scripts written for ``DistributedOptimizer``.)"""

    def _sf_exchange(self) -> None:
        rt = _runtime.current()
        service = rt.service
        handles: list[int] = []
        with torch.no_grad():
            for flat in self._sf_flats:
                for p, where in flat.spans():
                    local = p.detach().reshape(-1).to("cpu")
                    torch.sub(local, flat.base[where], out=flat.delta[where])
                # The initial value (read by the first push only) is the value this
                # worker started from: the servers start from the first to arrive.
                handles.append(
                    service.push_delta(
                        flat.tid,
                        flat.delta,
                        flat.delta.data_ptr(),
                        flat.delta.numel() * flat.delta.element_size(),
                        flat.base,
                        flat.base.data_ptr(),
                        self._sf_staleness,
                    )
                )
            failure: BaseException | None = None
            for handle in handles:
                try:
                    service.wait(handle, rt.timeout)
                except BaseException as e:  # every handle is waited for, the first error raised
                    failure = failure or e
            if failure is not None:
                raise failure
            for flat in self._sf_flats:
                flat.base.copy_(flat.delta)
                for p, where in flat.spans():
                    p.copy_(flat.delta[where].view_as(p))


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
