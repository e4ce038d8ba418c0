"""DistributedOptimizer: averages gradients across workers as backward produces them.

Each parameter's gradient is pushed the moment autograd has accumulated it (a
post-accumulate-grad hook), with the parameter's position in the model as its priority:
the layers nearest the input, whose gradients come last in backward but are needed first
in the next forward, go first (ByteScheduler's order). ``step()`` waits for the sums and
then runs the wrapped optimizer, so the optimizer stays on the worker, as in BytePS.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from sumflow.torch import ops, trace
from sumflow.torch.compression import Compression, Compressor
from sumflow.tune import plugin as autotune


class _DistributedOptimizer(torch.optim.Optimizer):
    # Set by DistributedOptimizer() on the dynamic subclass's instance.
    _sf_names: dict[torch.Tensor, str]
    _sf_priority: dict[torch.Tensor, int]
    _sf_handles: dict[torch.Tensor, int]
    _sf_passes: dict[torch.Tensor, int]
    _sf_backward_passes: int
    _sf_compression: type[Compressor] | Compressor
    _sf_op: ops.ReduceOp
    _sf_predivide: float
    _sf_synchronized: bool
    _sf_skip: bool
    _sf_hooks: list[Any]

    def _sf_setup(
        self,
        named_parameters: list[tuple[str, torch.Tensor]],
        compression: type[Compressor] | Compressor,
        backward_passes_per_step: int,
        op: ops.ReduceOp,
        gradient_predivide_factor: float,
    ) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters:
            names = {p: n for n, p in named_parameters}
            missing = [i for i, p in enumerate(params) if p not in names]
            if missing:
                raise ValueError(
                    f"named_parameters does not name {len(missing)} of the optimizer's "
                    f"parameters (first: index {missing[0]}); pass model.named_parameters() "
                    "of the model whose parameters the optimizer updates"
                )
            dupes = {n for n, count in Counter(n for n, _ in named_parameters).items() if count > 1}
            if dupes:
                raise ValueError(f"named_parameters repeats names: {sorted(dupes)}")
            order = [p for _, p in named_parameters if p in set(params)]
        else:
            names = {p: f"param.{i}" for i, p in enumerate(params)}
            order = params
        if backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be >= 1, not {backward_passes_per_step}"
            )
        if op not in (ops.Average, ops.Sum):
            raise NotImplementedError(f"op={op!r}: DistributedOptimizer supports Average and Sum")
        if gradient_predivide_factor != 1.0 and op is not ops.Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        self._sf_names = {p: f"DistributedOptimizer.grad.{names[p]}" for p in params}
        # The first parameter in model order belongs to the layer nearest the input.
        self._sf_priority = {p: i for i, p in enumerate(order)}
        self._sf_handles = {}
        self._sf_passes = {}
        self._sf_backward_passes = backward_passes_per_step
        self._sf_compression = compression
        self._sf_op = op
        self._sf_predivide = gradient_predivide_factor
        self._sf_synchronized = False
        self._sf_skip = False
        trainable = [p for p in order if p.requires_grad]
        # Declared together so placement balances the whole model over the servers; the
        # wire dtype is what compression sends.
        ops.declare_group([(self._sf_names[p], self._sf_wire_like(p)) for p in trainable])
        self._sf_hooks = [
            p.register_post_accumulate_grad_hook(self._sf_grad_ready) for p in trainable
        ]

    def _sf_wire_like(self, p: torch.Tensor) -> torch.Tensor:
        wire, _ = self._sf_compression.compress(torch.empty(0, dtype=p.dtype))
        return torch.empty(p.numel(), dtype=wire.dtype, device="meta")

    def _sf_grad_ready(self, p: torch.Tensor) -> None:
        passes = self._sf_passes.get(p, 0) + 1
        self._sf_passes[p] = passes
        if passes < self._sf_backward_passes:
            return
        if p in self._sf_handles:
            raise RuntimeError(
                f"the gradient of {self._sf_names[p]} was computed again before step() or "
                "synchronize() used the previous one; with gradient accumulation pass "
                "backward_passes_per_step to DistributedOptimizer"
            )
        self._sf_push(p)

    def _sf_push(self, p: torch.Tensor) -> None:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        prescale, postscale = 1.0, 1.0
        op = self._sf_op
        if self._sf_predivide != 1.0:
            size = ops._runtime.current().service.size
            prescale, postscale, op = 1.0 / self._sf_predivide, self._sf_predivide / size, ops.Sum
        self._sf_handles[p] = ops._issue(
            self._sf_names[p],
            p.grad,
            op,
            self._sf_priority[p],
            self._sf_compression,
            prescale,
            postscale,
        )

    def synchronize(self) -> None:
        """Waits until every gradient has been averaged across workers. Parameters whose
        gradient did not arrive this step (unused in the forward) are sent now, as zeros if
        they have none, so every worker takes part in every sum."""
        for p in self._sf_trainable():
            if p not in self._sf_handles:
                self._sf_push(p)
        handles, self._sf_handles = self._sf_handles, {}
        errors = []
        for h in handles.values():
            try:
                ops.synchronize(h)
            except Exception as e:
                errors.append(e)
        self._sf_passes.clear()
        self._sf_synchronized = True
        if errors:
            raise errors[0]

    def _sf_trainable(self) -> Iterator[torch.Tensor]:
        return (p for p in self._sf_priority if p.requires_grad)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not synchronize: for code that called
        ``synchronize()`` itself, e.g. to clip or unscale gradients first."""
        self._sf_skip = True
        try:
            yield
        finally:
            self._sf_skip = False

    def step(self, closure: Any = None) -> Any:
        """Synchronizes gradients (unless inside ``skip_synchronize()``) and steps."""
        # The backward pass is over: the scheduler closes its view of the iteration, and
        # the trace window counts the step.
        trace.mark_step()
        if self._sf_skip:
            if not self._sf_synchronized and self._sf_handles:
                raise RuntimeError(
                    "step() inside skip_synchronize() but gradients are still in flight: "
                    "call optimizer.synchronize() first"
                )
        else:
            self.synchronize()
        self._sf_synchronized = False
        loss = super(self.__class__, self).step(closure)
        autotune.after_step(self)  # SUMFLOW_AUTOTUNE: docs/autotune.md
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients; refuses while a push_pull still writes into them."""
        if self._sf_handles:
            raise RuntimeError(
                "zero_grad() while gradients are being averaged: call step() or synchronize() first"
            )
        super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] | Compressor = Compression.none,
    backward_passes_per_step: int = 1,
    op: ops.ReduceOp = ops.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
) -> torch.optim.Optimizer:
    """Wraps `optimizer` so that gradients are averaged across workers before each step.

    The result is an instance of a subclass of the optimizer's class sharing its state,
    so schedulers and checkpoints treat it as the original. Every worker must build it
    with the same parameters (names, shapes, dtypes): a difference raises
    ``DeclarationMismatchError`` naming the tensor on every worker.

    ``named_parameters``: ``model.named_parameters()``, for readable tensor names and the
    model order that sets priorities; without it parameters are named by position.
    ``backward_passes_per_step``: backward passes accumulated locally per step.
    ``gradient_predivide_factor``: divide gradients by this before summing and by
    size / factor after (Horovod's semantics). ``num_groups`` and ``groups`` (Horovod's
    fusion groups) are accepted and ignored: sumflow schedules tensors individually.
    """
    if sparse_as_dense:
        raise NotImplementedError("sparse gradients are not supported; sumflow sends dense tensors")
    ops._no_process_sets(process_set)
    del num_groups, groups
    cls = type(
        optimizer.__class__.__name__,
        (optimizer.__class__,),
        {
            k: v
            for k, v in _DistributedOptimizer.__dict__.items()
            if k not in ("__dict__", "__weakref__")
        },
    )
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__
    wrapped._sf_setup(
        list(named_parameters) if named_parameters is not None else [],
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
    )
    return wrapped


def broadcast_parameters(
    params: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root_rank: int
) -> None:
    """Overwrites every tensor in `params` (``model.state_dict()`` or
    ``model.named_parameters()``) with root_rank's, in place."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    handles = []
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"broadcast_parameters: '{name}' is a {type(t).__name__}, not a tensor")
        handles.append(ops.broadcast_async_(t.data, root_rank, name=f"parameter.{name}"))
    for h in handles:
        ops.synchronize(h)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Makes every worker's optimizer state (hyper-parameters and per-parameter buffers
    such as momentum) root_rank's."""
    state = ops.broadcast_object(optimizer.state_dict(), root_rank, name="optimizer_state")
    if ops._runtime.current().service.rank != root_rank:
        optimizer.load_state_dict(state)
