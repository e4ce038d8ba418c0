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
both ways). What autograd does is unchanged: with ``zero_grad(set_to_none=False)`` it
adds each new gradient into its view in place; after ``set_to_none=True`` it hands over a
fresh tensor, which is moved into the view once (the move DDP's bucket views make too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
        self._views: dict[torch.Tensor, torch.Tensor] = {}
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
            for p, start in zip(params, offsets):
                self._views[p] = pool[start : start + p.numel()].view(p.shape)
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
        self.span_of: dict[torch.Tensor, Span] = {}
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
                )
                self.spans.append(span)
                self.span_of.update((p, span) for p in members)

    def adopt(self, p: torch.Tensor) -> None:
        """Makes ``p.grad`` its view of the pool: zeros if it has no gradient, its
        gradient's values (moved in once) if autograd or the user put another tensor
        there."""
        view = self._views[p]
        grad = p.grad
        if grad is None:
            view.zero_()
        elif _is_view(grad, view):
            return
        else:
            view.copy_(grad.detach())
        p.grad = view


def _is_view(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape and grad.is_contiguous()
