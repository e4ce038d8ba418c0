"""DistributedOptimizer: averages gradients across workers as backward produces them.

Each parameter's gradient is pushed the moment autograd has accumulated it (a
post-accumulate-grad hook), with the parameter's position in the model as its priority:
the layers nearest the input, whose gradients come last in backward but are needed first
in the next forward, go first (ByteScheduler's order). ``step()`` waits for the sums and
then runs the wrapped optimizer, so the optimizer stays on the worker, as in BytePS.

With ``cross_barrier=True`` ``step()`` does not wait: each parameter is updated as soon
as its own sum arrives, and the next forward waits per module (``overlap.py``, ByteScheduler
§3.4), using the wrapped optimizer's own update one parameter at a time
(``per_parameter.py``).

With Horovod's ``num_groups`` or ``groups``, the gradients of a group are held until the
last of them is ready and then sent back to back: the same sums, issued later.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from sumflow import settings
from sumflow.torch import (
    _runtime,
    _work,
    adasum,
    fusion,
    ops,
    per_parameter,
    process_sets,
    trace,
)
from sumflow.torch.compression import Compression, Compressor
from sumflow.torch.fusion import GradientPool, Span
from sumflow.torch.overlap import CrossBarrier, Update, once, zero_grad_of
from sumflow.torch.sparse import sparse_allreduce_handle
from sumflow.tune import plugin as autotune


@dataclass(eq=False)
class Bundle:
    """One of Horovod's explicit groups (``groups=``/``num_groups=``): gradients sent only
    once every one of them is ready. Named so to tell it from the process set's ``Group``
    and torch's ``param_groups``."""

    params: list[torch.Tensor]


class _DistributedOptimizer(torch.optim.Optimizer):
    # Set by DistributedOptimizer() on the dynamic subclass's instance.
    _sf_names: dict[torch.Tensor, str]
    #: The parameters' own names (``_sf_names`` are their gradients' tensor names).
    _sf_param_names: dict[torch.Tensor, str]
    _sf_priority: dict[torch.Tensor, int]
    #: The push_pull handle of each parameter's gradient this step (shared by a span's).
    #: This and the per-step maps below are keyed by ``id(param)`` (the optimizer holds
    #: its parameters): a tensor's ``__hash__`` is a Python call, and the gradient hook
    #: looks parameters up about ten times, during backward.
    _sf_handles: dict[int, int]
    #: Backward passes seen this step per parameter, counted with backward_passes_per_step
    #: > 1 only.
    _sf_passes: dict[int, int]
    #: With fusion: the gradient pool. With groups: each grouped parameter's bundle.
    _sf_pool: GradientPool | None
    _sf_bundle_of: dict[torch.Tensor, Bundle]
    #: Each unsent span's or bundle's parameters whose gradient is ready this step.
    _sf_ready: dict[Span | Bundle, set[int]]
    #: Each span's sum, prepared at its first send (False: it cannot be, as compressed).
    _sf_prepared: dict[Span, ops.PreparedSum | Literal[False]]
    _sf_backward_passes: int
    _sf_compression: type[Compressor] | Compressor
    _sf_op: ops.ReduceOp
    _sf_predivide: float
    _parameter_names: dict[torch.Tensor, str]
    _sf_sparse_as_dense: bool
    #: The workers gradients are averaged over (a process set, or every worker); None on a
    #: worker outside the optimizer's process set, which sends nothing.
    _sf_group: process_sets.Group | None
    _sf_process_set: Any
    _sf_synchronized: bool
    _sf_skip: bool
    _sf_hooks: list[Any]
    #: The wrapped optimizer's class, whose step updates parameters.
    _sf_base: type[torch.optim.Optimizer]
    #: Set with cross_barrier=True.
    _sf_overlap: CrossBarrier | None
    _sf_steps: int

    def _sf_setup(
        self,
        base: type[torch.optim.Optimizer],
        named_parameters: list[tuple[str, torch.Tensor]],
        compression: type[Compressor] | Compressor,
        backward_passes_per_step: int,
        op: ops.ReduceOp,
        gradient_predivide_factor: float,
        model: torch.nn.Module | None,
        fusion_threshold: int,
        sparse_as_dense: bool,
        group: process_sets.Group | None,
        process_set: Any,
        bundles: list[Bundle],
    ) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        names, order = parameter_names(params, named_parameters)
        if backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be >= 1, not {backward_passes_per_step}"
            )
        if op not in (ops.Average, ops.Sum):
            raise NotImplementedError(f"op={op!r}: DistributedOptimizer supports Average and Sum")
        if gradient_predivide_factor != 1.0 and op is not ops.Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        self._sf_param_names = {p: names[p] for p in params}
        # Horovod's name for the same map, which scripts and Horovod's tests read.
        self._parameter_names = self._sf_param_names
        self._sf_group = group
        self._sf_process_set = process_set
        prefix = f"DistributedOptimizer.{group.tag if group is not None else ''}grad"
        self._sf_names = {p: f"{prefix}.{names[p]}" for p in params}
        # The first parameter in model order belongs to the layer nearest the input.
        self._sf_priority = {p: i for i, p in enumerate(order)}
        self._sf_handles = {}
        self._sf_passes = {}
        self._sf_backward_passes = backward_passes_per_step
        self._sf_compression = compression
        self._sf_op = op
        self._sf_predivide = gradient_predivide_factor
        self._sf_sparse_as_dense = sparse_as_dense
        self._sf_synchronized = False
        self._sf_skip = False
        self._sf_base = base
        self._sf_steps = 0
        self._sf_generation = _runtime.generation
        trainable = [p for p in order if p.requires_grad]
        self._sf_overlap = None
        if model is not None:
            per_parameter.check_separable(self)
            self._sf_overlap = CrossBarrier(
                model,
                {p: names[p] for p in trainable},
                lambda: _runtime.current().timeout,
            )
        self._sf_pool = None
        self._sf_ready = {}
        self._sf_prepared = {}
        self._sf_bundle_of = {p: b for b in bundles for p in b.params}
        if fusion_threshold > 0:
            # Backward produces the last layers' gradients first.
            self._sf_pool = GradientPool(
                trainable[::-1],
                self._sf_param_names,
                self._sf_priority,
                fusion_threshold,
                prefix,
            )
        if group is None:
            self._sf_hooks = []
            return
        self._sf_declare()
        self._sf_hooks = [
            p.register_post_accumulate_grad_hook(self._sf_grad_ready) for p in trainable
        ]

    def _sf_renew(self) -> None:
        """Follows the job into a new service (an elastic job's next membership, after
        ``shutdown()`` and ``init()``): what was in flight in the old one is gone, the
        number of workers may differ, and the new one must be told the tensors."""
        if self._sf_overlap is not None:
            raise NotImplementedError(
                "DistributedOptimizer(cross_barrier=True) cannot follow an elastic job into "
                "its next membership yet: updates of the old one may still be in flight; "
                "use cross_barrier=False in an elastic job (docs/elastic.md)"
            )
        self._sf_generation = _runtime.generation
        self._sf_handles = {}
        self._sf_passes = {}
        self._sf_ready = {}
        self._sf_prepared = {}
        self._sf_synchronized = False
        if self._sf_group is not None:
            self._sf_group = process_sets.group_of(self._sf_process_set, "DistributedOptimizer")
            self._sf_declare()

    def _sf_current(self) -> None:
        if self._sf_generation != _runtime.generation:
            self._sf_renew()

    def _sf_declare(self) -> None:
        # Declared together so placement balances the whole model over the servers.
        ops.declare_group(
            [
                (name, torch.empty(shape, dtype=dt, device="meta"))
                for name, dt, shape in self._sf_sent()
            ],
            self._sf_compression,
            None if self._sf_group is None else self._sf_group.members,
        )

    def _sf_sent(self, by_gradient: bool = False) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, wire dtype, shape) of every tensor a step sends, in priority order:
        one per gradient (its parameter's shape, which every worker must declare alike),
        or one per span with fusion (flat; unless `by_gradient`: what a tuned
        configuration is keyed by, whatever the spans). The wire dtype is what compression
        sends."""

        def wire_dtype(dtype: torch.dtype) -> torch.dtype:
            return self._sf_compression.compress(torch.empty(0, dtype=dtype))[0].dtype

        if self._sf_pool is not None and not by_gradient:
            spans = sorted(self._sf_pool.spans, key=lambda s: s.priority)
            return [(s.name, wire_dtype(s.flat.dtype), tuple(s.flat.shape)) for s in spans]
        return [
            (self._sf_names[p], wire_dtype(p.dtype), tuple(p.shape)) for p in self._sf_trainable()
        ]

    def _sf_set_fusion(self, threshold: int) -> None:
        """Sends spans of at least `threshold` bytes from the next step on (the
        auto-tuner's knob); every worker calls it at the same step boundary, with nothing
        in flight."""
        if self._sf_pool is None:
            raise RuntimeError("this DistributedOptimizer does not fuse (fusion_threshold=0)")
        if self._sf_handles or self._sf_ready:
            raise RuntimeError("the fusion threshold can only change between steps")
        self._sf_pool.replan(fusion.check_threshold(threshold))
        self._sf_prepared = {}
        self._sf_declare()

    def _sf_grad_ready(self, p: torch.Tensor) -> None:
        # Backward's thread runs this once per gradient, and on a GPU machine every
        # microsecond of it lengthens backward: attribute reads and calls are kept few.
        if self._sf_generation != _runtime.generation:
            self._sf_renew()
        key = id(p)
        sent = key in self._sf_handles
        pool = self._sf_pool
        if pool is not None and not sent and p.grad is not pool.view_of[key]:
            pool.adopt(p)
        if self._sf_backward_passes > 1:
            passes = self._sf_passes.get(key, 0) + 1
            self._sf_passes[key] = passes
            if passes < self._sf_backward_passes:
                return
        # What p is sent with, if anything: its span (fusion) or its bundle (groups).
        batch: Span | Bundle | None = (
            pool.span_of[key] if pool is not None else self._sf_bundle_of.get(p)
        )
        if sent:
            self._sf_computed_again(p)
        if batch is None:
            self._sf_push(p)
            return
        readies = self._sf_ready
        ready = readies.get(batch)
        if ready is None:
            ready = readies[batch] = {key}
        elif key in ready:
            self._sf_computed_again(p)
        else:
            ready.add(key)
        if len(ready) < len(batch.params):
            return
        if isinstance(batch, Span):
            # Every gradient of the span arrived through this hook, which adopted it.
            self._sf_push_span(batch, adopted=True)
            return
        # Each gradient under its own name, as without groups: the same sums and
        # placement, and per-parameter handles for cross_barrier's updates.
        del self._sf_ready[batch]
        for q in batch.params:
            self._sf_push(q)

    def _sf_computed_again(self, p: torch.Tensor) -> None:
        raise RuntimeError(
            f"the gradient of {self._sf_names[p]} was computed again before step() or "
            "synchronize() used the previous one; with gradient accumulation pass "
            "backward_passes_per_step to DistributedOptimizer"
        )

    def _sf_push(self, p: torch.Tensor) -> None:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            self._sf_handles[id(p)] = self._sf_issue_sparse(p)
            return
        self._sf_handles[id(p)] = self._sf_issue(self._sf_names[p], p.grad, self._sf_priority[p])

    def _sf_issue_sparse(self, p: torch.Tensor) -> int:
        """A sparse gradient (e.g. of ``nn.Embedding(sparse=True)``): gathered as indices
        and values (Horovod's sparse allreduce), or, with ``sparse_as_dense``, summed as
        a dense tensor; either way it stays sparse for the optimizer."""
        assert p.grad is not None
        name = self._sf_names[p]
        if self._sf_sparse_as_dense:
            dense = p.grad.to_dense()
            handle = self._sf_issue(name, dense, self._sf_priority[p])
            then = [handle]
        else:
            op = ops.Sum if self._sf_op is ops.Sum else ops.Average
            then = [sparse_allreduce_handle(p.grad, name, op, self._sf_process_set)]

        def replace(results: list[torch.Tensor]) -> None:
            p.grad = results[0].to_sparse() if self._sf_sparse_as_dense else results[0]

        return _work.register(_work.Chain(f"{name}.sparse", then, replace))

    def _sf_push_span(self, span: Span, adopted: bool = False) -> None:
        """Sends a span of the pool; gradients it has not seen this step (parameters
        unused in the forward) go as they are, zeros if they have none. ``adopted``:
        every gradient of it is in its place in the pool already."""
        assert self._sf_pool is not None
        if not adopted:
            for q in span.params:
                self._sf_pool.adopt(q)
        self._sf_ready.pop(span, None)
        prepared = self._sf_prepared.get(span)
        if prepared is None and self._sf_group is not None:
            op, prescale, postscale = self._sf_scaling()
            # False: not preparable (compressed or scaled before sending), not tried again.
            prepared = self._sf_prepared[span] = (
                ops.prepare_declared(
                    span.name,
                    span.flat,
                    op,
                    span.priority,
                    self._sf_compression,
                    prescale,
                    postscale,
                    self._sf_group,
                )
                or False
            )
        if prepared:
            handle = prepared.issue()
        else:
            handle = self._sf_issue(span.name, span.flat, span.priority)
        self._sf_handles.update(dict.fromkeys(span.keys, handle))

    def _sf_issue(self, name: str, grad: torch.Tensor, priority: int) -> int:
        op, prescale, postscale = self._sf_scaling()
        return ops.issue_declared(
            name, grad, op, priority, self._sf_compression, prescale, postscale, self._sf_group
        )

    def _sf_scaling(self) -> tuple[ops.ReduceOp, float, float]:
        """The reduction and the factors a gradient is scaled by before and after it."""
        if self._sf_predivide == 1.0:
            return self._sf_op, 1.0, 1.0
        assert self._sf_group is not None, "a worker outside the set sends nothing"
        size = self._sf_group.size
        return ops.Sum, 1.0 / self._sf_predivide, self._sf_predivide / size

    def synchronize(self) -> None:
        """Waits until every gradient has been averaged across workers. Parameters whose
        gradient did not arrive this step (unused in the forward) are sent now, as zeros if
        they have none, so every worker takes part in every sum.

        With ``cross_barrier``, it first waits until every update of the steps before is
        done (call it before evaluating outside the model's forward, reading or saving the
        parameters, or ending the script), then synchronizes gradients only if a backward
        pass has produced some since the last step (for clipping: see ``step()``)."""
        self._sf_current()
        if self._sf_overlap is not None:
            self._sf_overlap.wait_all("optimizer.synchronize()")
            # No gradient sent, waiting for its span or bundle, or counted since the step.
            if not (self._sf_handles or self._sf_ready or self._sf_passes):
                return
        self._sf_push_missing()
        handles, self._sf_handles = self._sf_handles, {}
        errors = []
        with trace.span("waits", "optimizer.synchronize()"):
            # A span's parameters share one handle.
            for h in dict.fromkeys(handles.values()):
                try:
                    ops.synchronize(h)
                except Exception as e:
                    errors.append(e)
        self._sf_passes.clear()
        self._sf_synchronized = True
        if errors:
            raise errors[0]

    def _sf_push_missing(self) -> None:
        """Sends, as zeros if they have none, the gradients that did not arrive this step
        (parameters unused in the forward), so every worker takes part in every sum."""
        if self._sf_group is None:
            return
        if self._sf_pool is not None:
            for span in self._sf_pool.spans:
                if id(span.params[0]) not in self._sf_handles:
                    self._sf_push_span(span)
            return
        for p in self._sf_trainable():
            if id(p) not in self._sf_handles:
                self._sf_push(p)
        # Bundles that were still waiting have just been sent, with the rest.
        self._sf_ready.clear()

    def _sf_sent_as(self, p: torch.Tensor) -> str:
        """The name of the tensor `p`'s gradient is sent in."""
        if self._sf_pool is not None:
            return self._sf_pool.span_of[id(p)].name
        return self._sf_names[p]

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
        """Synchronizes gradients (unless inside ``skip_synchronize()``) and steps.

        With ``cross_barrier`` it returns at once (and returns None); the update thread
        updates each parameter when its sum arrives. After ``synchronize()`` (e.g. to clip
        gradients) or inside ``skip_synchronize()`` it steps synchronously instead, as
        without ``cross_barrier``. A ``closure`` is refused: it would need every parameter
        updated at once."""
        self._sf_current()
        if self._sf_overlap is not None:
            self._sf_overlap.raise_failure()
            if closure is not None:
                raise ValueError(
                    "step(closure) with cross_barrier: the closure re-evaluates the model, "
                    "which needs every parameter updated first; use DistributedOptimizer "
                    "without cross_barrier"
                )
            if not (self._sf_skip or self._sf_synchronized):
                self._sf_step_across_barrier()
                autotune.after_step(self)
                return None
            self._sf_overlap.wait_all("optimizer.step()")
        if not (self._sf_skip or self._sf_synchronized):
            self._sf_push_missing()
        if self._sf_synchronized and not self._sf_skip:
            warnings.warn(
                "optimizer.step() called without optimizer.skip_synchronize() context after "
                "optimizer.synchronize(): the gradients are not sent twice, but wrap the "
                "step in `with optimizer.skip_synchronize():` to say so",
                stacklevel=2,
            )
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

    def _sf_step_across_barrier(self) -> None:
        overlap = self._sf_overlap
        assert overlap is not None
        # The forward waited for every parameter it read, so what may still be pending are
        # the updates of parameters that got no gradient: they still read the gradient
        # that is about to be sent again.
        overlap.wait_all("optimizer.step()")
        self._sf_push_missing()
        trace.mark_step()
        handles, self._sf_handles = self._sf_handles, {}
        self._sf_passes.clear()
        self._sf_steps += 1
        # The parameters of a span share a handle, waited for once.
        waits = {h: once(functools.partial(ops.synchronize, h)) for h in set(handles.values())}
        updates = []
        for group in self.param_groups:
            # The hyper-parameters in effect now: an LR scheduler may change them before
            # the sums arrive.
            hyper = per_parameter.hyperparameters(group)
            for index, p in enumerate(group["params"]):
                handle = handles.get(id(p))
                if handle is None:
                    continue
                updates.append(
                    Update(
                        param=p,
                        handle=handle,
                        wait=waits[handle],
                        tensor=self._sf_sent_as(p),
                        step=self._sf_steps,
                        apply=functools.partial(
                            per_parameter.step_one,
                            self._sf_base,
                            self.__dict__,
                            p,
                            hyper,
                            index,
                            self._sf_param_names[p],
                        ),
                        stream=torch.cuda.current_stream(p.device) if p.is_cuda else None,
                    )
                )
        # The order the push queues send them, so sums are awaited as they arrive.
        updates.sort(key=lambda u: self._sf_priority[u.param])
        overlap.submit(updates)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients; refuses while a push_pull still writes into them. With
        fusion, gradients in the pool are zeroed in place (``.grad`` stays a view of the
        pool, even with ``set_to_none``). With ``cross_barrier``, a parameter whose update
        is still pending has its gradient cleared right after the update."""
        if self._sf_handles:
            raise RuntimeError(
                "zero_grad() while gradients are being averaged: call step() or synchronize() first"
            )
        if self._sf_overlap is not None:
            pending = self._sf_overlap.defer_zero_grad(set_to_none)
            if pending:
                for group in self.param_groups:
                    for p in group["params"]:
                        if p not in pending:
                            zero_grad_of(p, set_to_none)
                return
        if self._sf_pool is not None:
            # The pool's gradients are zeroed in place, never set to None: they are
            # sent (as zeros if need be) every step anyway, and autograd then adds into
            # the pool instead of allocating gradients that would be copied into it.
            self._sf_pool.zero()
            for group in self.param_groups:
                for p in group["params"]:
                    if id(p) not in self._sf_pool.span_of:
                        zero_grad_of(p, set_to_none)
            return
        super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state; with ``cross_barrier``, once every pending
        update is done."""
        if self._sf_overlap is not None:
            self._sf_overlap.wait_all("optimizer.state_dict()")
        return super(self.__class__, self).state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the wrapped optimizer's state; with ``cross_barrier``, once every pending
        update is done."""
        if self._sf_overlap is not None:
            self._sf_overlap.wait_all("optimizer.load_state_dict()")
        super(self.__class__, self).load_state_dict(state_dict)


def parameter_names(
    params: list[torch.Tensor], named_parameters: list[tuple[str, torch.Tensor]]
) -> tuple[dict[torch.Tensor, str], list[torch.Tensor]]:
    """Each of the optimizer's `params` by its name in `named_parameters` (by position
    without them), and the parameters in model order; refuses names missing or repeated."""
    if not named_parameters:
        return {p: f"param.{i}" for i, p in enumerate(params)}, params
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
    return names, [p for _, p in named_parameters if p in set(params)]


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] | Compressor | None = None,
    backward_passes_per_step: int = 1,
    op: ops.ReduceOp = ops.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    *,
    cross_barrier: bool = False,
    model: torch.nn.Module | None = None,
    fusion_threshold: int | None = None,
) -> torch.optim.Optimizer:
    """Wraps `optimizer` so that gradients are averaged across workers before each step.

    The result is an instance of a subclass of the optimizer's class sharing its state,
    so schedulers and checkpoints treat it as the original. Every worker must build it
    with the same parameters (names, shapes, dtypes): a difference raises
    ``DeclarationMismatchError`` naming the tensor on every worker.

    ``named_parameters``: ``model.named_parameters()``, for readable tensor names and the
    model order that sets priorities; without it parameters are named by position.
    ``compression`` (default ``SUMFLOW_COMPRESSION``, else none): how gradients travel,
    e.g. ``Compression.fp16`` or ``Compression.topk(0.01)``; see docs/compression.md.
    ``backward_passes_per_step``: backward passes accumulated locally per step.
    ``gradient_predivide_factor``: divide gradients by this before summing and by
    size / factor after (Horovod's semantics).

    ``groups`` (Horovod's explicit groups): a list of lists of parameters, each list sent
    only once every gradient in it is ready (parameters in no list are sent alone, as
    usual); or a number N, which cuts the parameters, in the optimizer's order, into N
    consecutive groups of nearly equal count (``num_groups=N``, Horovod's older spelling,
    is the same; pass one of the two). A group's gradients are then sent back to back,
    each under its own name, so the sums are exactly those without groups. Parameters
    that require no gradient are left out of groups (they are never sent). Groups and
    fusion both decide what is sent together, so an explicit ``fusion_threshold`` > 0
    with groups is refused, and ``SUMFLOW_FUSION_THRESHOLD`` is ignored (with a
    warning). ``cross_barrier`` works with groups: each parameter is still updated when
    its own sum arrives.

    ``fusion_threshold`` (bytes; default ``SUMFLOW_FUSION_THRESHOLD``, else 4 MiB for an
    optimizer with CUDA parameters and 0 = off for one of CPU parameters only):
    GradientFlow's lazy allreduce. The gradients live in one pool in the order backward
    produces them (each ``param.grad`` a view of it), and consecutive gradients are sent
    together, straight from the pool, once they hold at least this many bytes; the
    averages land in place. Sums of many small gradients then cost one message instead
    of one each. Tensor names become the spans' (``DistributedOptimizer.grad[<first>..
    <last>]``). See docs/compression.md.

    ``cross_barrier=True`` (ByteScheduler's crossing of the global barrier, §3.4):
    ``step()`` returns at once, each parameter is updated by a background thread as soon
    as its gradient's average arrives, and the forward of each module of ``model`` first
    waits for the update of that module's own parameters. It needs ``model``: the module
    whose forward uses every parameter the optimizer updates. The wrapped optimizer's own
    step runs for one parameter at a time, so it must be per-parameter separable (every
    ``torch.optim`` optimizer but LBFGS). Call ``synchronize()`` before using the
    parameters outside the model's forward; ``state_dict()`` and ``model.state_dict()``
    wait by themselves. See docs/overlap.md.
    """
    if cross_barrier and model is None:
        raise ValueError(
            "cross_barrier=True needs model=: the module whose forward uses the parameters, "
            "so its forward can wait for their updates"
        )
    if model is not None:
        if not cross_barrier:
            raise ValueError("model= is only used with cross_barrier=True")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if op is ops.Adasum:
        return _adasum_optimizer(
            optimizer,
            named_parameters,
            compression,
            backward_passes_per_step,
            gradient_predivide_factor,
            num_groups,
            groups,
            sparse_as_dense,
            process_set,
            cross_barrier,
            fusion_threshold,
        )
    # A worker outside the optimizer's process set steps on its own gradients, as in
    # Horovod: nothing is sent for it.
    outside = isinstance(process_set, process_sets.ProcessSet) and not process_set.included()
    named = list(named_parameters) if named_parameters is not None else []
    params = [p for g in optimizer.param_groups for p in g["params"]]
    # The names errors use: named_parameters' where given, else the optimizer's positions.
    names = {p: f"param.{i}" for i, p in enumerate(params)} | {p: n for n, p in named}
    bundles = [Bundle(ps) for ps in plan_groups(num_groups, groups, params, names)]
    chosen = (
        settings.FUSION_THRESHOLD.read()
        if fusion_threshold is None
        else fusion.check_threshold(fusion_threshold)
    )
    threshold = fusion.default_threshold(optimizer) if chosen is None else chosen
    if threshold > 0 and isinstance(optimizer, torch.optim.SparseAdam):
        # The pool is dense; SparseAdam refuses dense gradients.
        if fusion_threshold is not None:
            raise ValueError(
                f"fusion_threshold={fusion_threshold} with SparseAdam: fusion sums gradients "
                "dense, and SparseAdam needs them sparse (pass fusion_threshold=0)"
            )
        warnings.warn(
            f"{settings.FUSION_THRESHOLD.name}={threshold} is ignored for SparseAdam, which "
            "needs its gradients sparse (fusion sums them dense)",
            stacklevel=2,
        )
        threshold = 0
    if bundles and threshold > 0:
        # Fusion's spans are cut from the pool by size and would cut across the groups.
        if chosen is None:
            threshold = 0
        elif fusion_threshold is not None:
            raise ValueError(
                f"fusion_threshold={fusion_threshold} with groups: both decide which gradients "
                "are sent together; pass one of them (fusion_threshold=0 with groups)"
            )
        else:
            warnings.warn(
                f"{settings.FUSION_THRESHOLD.name}={threshold} is ignored by a "
                "DistributedOptimizer with groups: its groups decide which gradients are "
                "sent together",
                stacklevel=2,
            )
            threshold = 0
    group = None if outside else process_sets.group_of(process_set, "DistributedOptimizer")
    wrapped = cast("_DistributedOptimizer", wrapping(optimizer, _DistributedOptimizer))
    wrapped._sf_setup(
        optimizer.__class__,
        named,
        Compression.from_env() if compression is None else compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        model,
        threshold,
        sparse_as_dense,
        group,
        process_set,
        bundles,
    )
    return wrapped


def _adasum_optimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
    compression: type[Compressor] | Compressor | None,
    backward_passes_per_step: int,
    gradient_predivide_factor: float,
    num_groups: int,
    groups: Any,
    sparse_as_dense: bool,
    process_set: Any,
    cross_barrier: bool,
    fusion_threshold: int | None,
) -> torch.optim.Optimizer:
    """``DistributedOptimizer(op=Adasum)``, refusing what only the averaging optimizer does."""
    refused = [
        what
        for what, given in (
            ("cross_barrier=True", cross_barrier),
            ("groups", bool(groups) or bool(num_groups)),
            ("fusion_threshold > 0", bool(fusion_threshold)),
            ("gradient_predivide_factor", gradient_predivide_factor != 1.0),
            ("sparse_as_dense", sparse_as_dense),
        )
        if given
    ]
    if refused:
        raise ValueError(
            f"DistributedOptimizer(op=Adasum) combines each parameter's update on its own: "
            f"it does not take {', '.join(refused)}"
        )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names, _ = parameter_names(params, list(named_parameters or []))
    chosen = Compression.from_env() if compression is None else compression
    local = adasum.check_optimizer(optimizer, chosen, backward_passes_per_step, process_set)
    wrapped = cast("adasum.AdasumOptimizer", wrapping(optimizer, adasum.AdasumOptimizer))
    wrapped._sf_adasum_setup(
        optimizer.__class__, names, backward_passes_per_step, process_set, local
    )
    return wrapped


def plan_groups(
    num_groups: Any, groups: Any, params: list[torch.Tensor], names: dict[torch.Tensor, str]
) -> list[list[torch.Tensor]]:
    """The parameters of each of Horovod's explicit groups, from ``DistributedOptimizer``'s
    `num_groups` and `groups`; `params` are the optimizer's parameters in its order, and
    `names` name them in errors. [] for no groups. Only parameters that require a
    gradient are grouped: the others are never sent."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(
            f"num_groups must be a whole number >= 0 (0 = no groups), not {num_groups!r}"
        )
    if groups is None:
        groups = num_groups
    elif num_groups:
        # Horovod silently prefers groups; two answers to one question are more likely a
        # mistake.
        raise ValueError(
            f"num_groups={num_groups} and groups=... both given: pass one of them "
            "(groups=N is num_groups=N)"
        )
    trainable = [p for p in params if p.requires_grad]
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 0:
            raise ValueError(f"groups must be a number of groups >= 0 (0 = none), not {groups}")
        if groups == 0:
            return []
        # N consecutive runs, the first len % N of them one longer (Horovod's split).
        count, longer = divmod(len(trainable), groups)
        cuts, start = [], 0
        for i in range(groups):
            stop = start + count + (i < longer)
            cuts.append(trainable[start:stop])
            start = stop
        return [c for c in cuts if c]
    if not isinstance(groups, (list, tuple)):
        raise ValueError(
            "groups must be a number of groups or a list of lists of parameters, "
            f"not a {type(groups).__name__}"
        )
    known = set(params)
    first_in: dict[torch.Tensor, int] = {}
    planned: list[list[torch.Tensor]] = []
    for i, members in enumerate(groups):
        if isinstance(members, torch.Tensor) or not isinstance(members, Iterable):
            raise ValueError(
                f"groups[{i}] is a {type(members).__name__}, not a list of parameters: "
                "groups is a list of lists, e.g. [[p1, p2], [p3]]"
            )
        listed = list(members)
        for p in listed:
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"groups[{i}] holds a {type(p).__name__}, not a parameter")
            if p not in known:
                raise ValueError(
                    f"groups[{i}] holds a tensor of shape {tuple(p.shape)} that the optimizer "
                    "does not update: groups name the wrapped optimizer's parameters"
                )
            if p in first_in:
                raise ValueError(
                    f"parameter {names[p]} is in groups[{first_in[p]}] and groups[{i}]: "
                    "a parameter belongs to one group at most"
                )
            first_in[p] = i
        planned.append([p for p in listed if p.requires_grad])
    return [g for g in planned if g]


def wrapping(optimizer: torch.optim.Optimizer, methods: type) -> torch.optim.Optimizer:
    """`optimizer` as an instance of a subclass of its own class with the methods of
    `methods` added, sharing its state: isinstance checks, schedulers, checkpoints and the
    class's own step keep working."""
    cls = cast(
        "type[torch.optim.Optimizer]",
        type(
            optimizer.__class__.__name__,
            (optimizer.__class__,),
            {k: v for k, v in methods.__dict__.items() if k not in ("__dict__", "__weakref__")},
        ),
    )
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__
    _route_patched_step(wrapped)
    return wrapped


def _route_patched_step(wrapped: torch.optim.Optimizer) -> None:
    """Makes ``wrapped.step`` this class's even when ``step`` was replaced on the instance.

    An LR scheduler created before wrapping replaces ``optimizer.step`` on the instance
    (to track that it was called), and the wrapper shares the instance's attributes: that
    bound method of the original class would then shadow ours, and step() would update
    the parameters without averaging any gradient. The replacement is swapped for one
    that runs our step, keeping torch's marks that the scheduler looks for.
    """
    patched = wrapped.__dict__.get("step")
    if patched is None:
        return
    ours = type(wrapped).step
    tracked = getattr(patched, "_wrapped_by_lr_sched", False)

    @functools.wraps(ours)
    def step(*args: Any, **kwargs: Any) -> Any:
        if tracked:
            # What torch's own patch records: the scheduler warns without it.
            wrapped.__dict__["_opt_called"] = True
        return ours(wrapped, *args, **kwargs)

    if tracked:
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    wrapped.__dict__["step"] = step


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


def _zero_missing_grads(optimizer: torch.optim.Optimizer) -> None:
    """As Horovod does before broadcasting the state of an optimizer that has not stepped:
    every parameter that requires a gradient and has none gets a zero one (Horovod's
    scripts read them afterwards). No step is taken, so no state is made up: a state
    empty on every worker is already the same on every worker."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Makes every worker's optimizer state (hyper-parameters and per-parameter buffers
    such as momentum) root_rank's."""
    if not optimizer.state_dict()["state"]:
        _zero_missing_grads(optimizer)
    state = ops.broadcast_object(optimizer.state_dict(), root_rank, name="optimizer_state")
    if _runtime.current().service.rank != root_rank:
        optimizer.load_state_dict(state)
