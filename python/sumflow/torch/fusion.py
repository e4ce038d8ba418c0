"""Tensor fusion without copies: GradientFlow's lazy allreduce (§3.1).

Models such as ResNet-50 produce a hundred or more small gradients (batch-norm vectors of
a few KB) per iteration, and each sent alone costs a key, a round trip and its frames. Here
the gradients of ``DistributedOptimizer`` live in one contiguous *pool* per dtype and
device, laid out in the order backward produces them (the reverse of the model's
parameter order), and every ``param.grad`` is a view of its place in the pool, as with
DDP's ``gradient_as_bucket_view``. The pool is cut into *spans*: consecutive gradients
join a span until it holds at least the threshold theta. A span is summed as one
push_pull, straight from the pool, once the last of its gradients is ready, and the
average lands in place, in the gradients' own memory.

So nothing is copied into a fusion buffer or back out of one (Horovod's fusion copies
both ways). The optimizer's ``zero_grad`` zeros the pool in place, even with
``set_to_none=True``, so autograd adds each new gradient into its view; a gradient put
elsewhere (by ``p.grad = None`` or by hand) is moved into its view once.

Where the optimizer has CUDA parameters, fusion is on by default (4 MiB): every tensor
sent from a GPU costs backward's thread a copy to host memory and a hook's Python work. On
an H200 machine with a slow host CPU, ResNet-50's 161 gradients sent one by one made
backward 1.8-1.9x slower at 64 images, 1.29x in 4 MiB spans (BENCHMARKS.md, CUDA). On
the CPU a gradient costs no copy, and fusion stays off unless asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: The fusion threshold of an optimizer with CUDA parameters when none is given.
CUDA_DEFAULT_THRESHOLD = 4 << 20


def default_threshold(optimizer: torch.optim.Optimizer) -> int:
    """The threshold for `optimizer` when neither the caller nor SUMFLOW_FUSION_THRESHOLD
    gives one: `CUDA_DEFAULT_THRESHOLD` if any of its parameters is on a GPU, else 0. A
    sparse optimizer (``SparseAdam``) needs its gradients sparse, which the pool is not."""
    if isinstance(optimizer, torch.optim.SparseAdam):
        return 0
    on_gpu = any(p.is_cuda for g in optimizer.param_groups for p in g["params"])
    return CUDA_DEFAULT_THRESHOLD if on_gpu else 0


def check_threshold(value: int, what: str = "fusion_threshold") -> int:
    """`value` if it is a valid theta (a whole number of bytes, >= 0)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{what} must be a whole number of bytes >= 0 (0 = no fusion), not {value!r}"
        )
    return value


def plan_spans(sizes: Sequence[int], threshold: int) -> list[range]:
    """Cuts tensors of `sizes` bytes, in the order they become ready, into spans of
    consecutive tensors: a span closes as soon as it holds at least `threshold` bytes
    (lazy allreduce waits until the waited tensors reach theta); the last span holds what
    is left. With ``threshold`` 0 every tensor is its own span."""
    check_threshold(threshold, "threshold")
    spans: list[range] = []
    start, held = 0, 0
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"tensor {i} has a negative size ({size} B)")
        held += size
        if held >= threshold:
            spans.append(range(start, i + 1))
            start, held = i + 1, 0
    if start < len(sizes):
        spans.append(range(start, len(sizes)))
    return spans


@dataclass(eq=False)
class Span:
    """Gradients sent together as one push_pull."""

    #: The tensor name it is sent under, the same on every worker.
    name: str
    #: Its parameters, in the pool's order.
    params: list[torch.Tensor]
    #: The pool's elements of those gradients.
    flat: torch.Tensor
    #: The most urgent of its parameters' priorities.
    priority: int
    #: ``id()`` of each of its parameters, the optimizer's keys.
    keys: tuple[int, ...]


class GradientPool:
    """The gradient memory of a set of parameters, and its spans."""

    def __init__(
        self,
        backward_order: list[torch.Tensor],
        names: dict[torch.Tensor, str],
        priority: dict[torch.Tensor, int],
        threshold: int,
        prefix: str,
    ) -> None:
        """Lays out the gradients of `backward_order` (the parameters in the order their
        gradients are expected) and makes each parameter's ``.grad`` a view of it, keeping
        any gradient it already has. `names` are the parameters' names; a span of one
        parameter is sent as ``prefix.<name>``, a longer one as
        ``prefix[<first>..<last>]``."""
        self._names = names
        self._priority = priority
        self._prefix = prefix
        #: By ``id(param)`` (a tensor's ``__hash__`` is a Python call, and backward's
        #: hooks look parameters up): each parameter's view of the pool, and the
        #: parameters.
        self.view_of: dict[int, torch.Tensor] = {}
        self._params: list[torch.Tensor] = []
        #: Per dtype and device: its parameters, their offsets, and their pool.
        self._pools: list[tuple[list[torch.Tensor], list[int], torch.Tensor]] = []
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in backward_order:
            groups.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, device), params in groups.items():
            pool = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
            offsets = [0]
            for p in params:
                offsets.append(offsets[-1] + p.numel())
            for p, start in zip(params, offsets[:-1], strict=True):
                self.view_of[id(p)] = pool[start : start + p.numel()].view(p.shape)
                self._params.append(p)
            self._pools.append((params, offsets, pool))
        self.replan(threshold)
        for p in backward_order:
            if p.grad is not None:
                self.adopt(p)

    def replan(self, threshold: int) -> None:
        """Cuts the pool into spans of at least `threshold` bytes. The layout, and so
        every gradient, stays where it is; only what is sent together changes (call it
        with no span in flight)."""
        self.threshold = threshold
        self.spans: list[Span] = []
        #: By ``id(param)``.
        self.span_of: dict[int, Span] = {}
        for params, offsets, pool in self._pools:
            item = pool.element_size()
            for cut in plan_spans([p.numel() * item for p in params], threshold):
                members = [params[i] for i in cut]
                first, last = self._names[members[0]], self._names[members[-1]]
                span = Span(
                    name=(
                        f"{self._prefix}.{first}"
                        if len(members) == 1
                        else f"{self._prefix}[{first}..{last}]"
                    ),
                    params=members,
                    flat=pool[offsets[cut.start] : offsets[cut.stop]],
                    priority=min(self._priority[p] for p in members),
                    keys=tuple(id(p) for p in members),
                )
                self.spans.append(span)
                self.span_of.update((id(p), span) for p in members)

    def adopt(self, p: torch.Tensor) -> None:
        """Makes ``p.grad`` its view of the pool: zeros if it has no gradient, its
        gradient's values (moved in once) if autograd or the user put another tensor
        there."""
        view = self.view_of[id(p)]
        grad = p.grad
        if grad is view:  # after `zero`: autograd added into the pool
            return
        if grad is None:
            view.zero_()
        elif grad.is_sparse:
            # An embedding's sparse gradient is summed as dense: the pool is dense.
            view.copy_(grad.detach().to_dense())
        elif _is_view(grad, view):
            return
        else:
            view.copy_(grad.detach())
        p.grad = view

    def zero(self) -> None:
        """Zeros every gradient in place, each ``.grad`` staying its view of the pool:
        autograd then adds the next gradients into the pool, where setting them to None
        would have it allocate new ones that `adopt` copies in (a kernel launch and
        a copy per gradient during backward)."""
        for _, _, pool in self._pools:
            pool.zero_()
        for p in self._params:
            view = self.view_of[id(p)]
            if p.grad is not view:
                p.grad = view


def _is_view(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape and grad.is_contiguous()
