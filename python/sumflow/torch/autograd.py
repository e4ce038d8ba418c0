"""The collectives as differentiable functions, with Horovod's gradients:

- allreduce: the gradient reduced with the same op and scaling;
- allgather: the gradient averaged over workers, then this worker's rows;
- broadcast: the gradient summed over workers, on the root (zeros elsewhere);
- alltoall: the gradient sent back the way the rows came;
- reducescatter: the gradients gathered (times the number of workers for a sum).

The backward pass runs the same collectives, so every worker must run it, as in Horovod.
"""

from __future__ import annotations

from typing import Any

import torch

from sumflow.torch import _runtime, collectives, ops
from sumflow.torch.compression import Compression, Compressor
from sumflow.torch.ops import Average, ReduceOp, Sum


def _grad_name(name: str | None) -> str | None:
    return None if name is None else f"{name}.grad"


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: ReduceOp,
        compression: Any,
        prescale: float,
        postscale: float,
    ) -> torch.Tensor:
        ctx.args = (name, op, prescale, postscale)
        handle = ops.allreduce_async(
            tensor, None, name, op, prescale, postscale, compression=compression
        )
        return collectives.synchronize_tensor(handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        name, op, prescale, postscale = ctx.args
        out = ops.allreduce_async(
            grad.contiguous(), None, _grad_name(name), op, prescale, postscale
        )
        return collectives.synchronize_tensor(out), None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] | Compressor = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """The reduction (default: average) of `tensor` over all workers, as a new tensor.
    Differentiable: the gradient is reduced the same way."""
    ops._no_process_sets(process_set)
    result: torch.Tensor = _Allreduce.apply(
        tensor, name, ops._op_of(average, op), compression, prescale_factor, postscale_factor
    )
    return result


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None) -> torch.Tensor:  # type: ignore[override]
        ctx.name, ctx.rows = name, tensor.shape[0] if tensor.dim() else 0
        return collectives.synchronize_tensor(collectives.allgather_async(tensor, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return _own_rows(grad, ctx.rows, ctx.name), None


def _own_rows(grad: torch.Tensor, rows: int, name: str | None) -> torch.Tensor:
    """This worker's rows of the average of `grad` over workers."""
    averaged = collectives.synchronize_tensor(
        ops.allreduce_async(grad.contiguous(), None, _grad_name(name), Average)
    )
    counts = collectives.synchronize_tensor(
        collectives.allgather_async(
            torch.tensor([rows], dtype=torch.int64),
            None if name is None else f"{name}.grad.rows",
        )
    ).tolist()
    rank = _runtime.current().service.rank
    return averaged.narrow(0, sum(counts[:rank]), rows)


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = None
) -> torch.Tensor:
    ops._no_process_sets(process_set)
    result: torch.Tensor = _Allgather.apply(tensor, name)
    return result


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.name, ctx.rows = name, [t.shape[0] if t.dim() else 0 for t in tensors]
        result = ops.synchronize(collectives.grouped_allgather_async(list(tensors), name))
        return tuple(result)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        base = ctx.name
        return (
            None,
            *(
                _own_rows(g, rows, None if base is None else f"{base}.{i}")
                for i, (g, rows) in enumerate(zip(grads, ctx.rows))
            ),
        )


def grouped_allgather(
    tensors: list[torch.Tensor], name: str | None = None, process_set: Any = None
) -> list[torch.Tensor]:
    ops._no_process_sets(process_set)
    return list(_GroupedAllgather.apply(name, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, name: str | None) -> torch.Tensor:  # type: ignore[override]
        ctx.root, ctx.name = root, name
        out = ops.synchronize(ops.broadcast_async(tensor, root, name))
        assert isinstance(out, torch.Tensor)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        summed = collectives.synchronize_tensor(
            ops.allreduce_async(grad.contiguous(), None, _grad_name(ctx.name), Sum)
        )
        if _runtime.current().service.rank != ctx.root:
            summed = torch.zeros_like(summed)
        return summed, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> torch.Tensor:
    """root_rank's `tensor`, as a new tensor on every worker. Differentiable: the root's
    gradient is the sum of every worker's."""
    ops._no_process_sets(process_set)
    result: torch.Tensor = _Broadcast.apply(tensor, root_rank, name)
    return result


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None) -> Any:  # type: ignore[override]
        ctx.name = name
        out, received = ops.synchronize(collectives.alltoall_async(tensor, splits, name))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> Any:  # type: ignore[override]
        back, _sent = ops.synchronize(
            collectives.alltoall_async(grad.contiguous(), ctx.received, _grad_name(ctx.name))
        )
        return back, None, None


def alltoall(
    tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    ops._no_process_sets(process_set)
    out, received = _Alltoall.apply(tensor, splits, name)
    return out, received


def _scatter_grad_factor(op: ReduceOp, prescale: float, postscale: float) -> float:
    size = _runtime.current().service.size
    return (size if op is Sum else 1) * prescale * postscale


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        name: str | None,
        op: ReduceOp,
        prescale: float,
        postscale: float,
        *tensors: torch.Tensor,
    ) -> Any:
        ctx.name, ctx.factor = name, _scatter_grad_factor(op, prescale, postscale)
        result = ops.synchronize(
            collectives.grouped_reducescatter_async(
                list(tensors), name, op, None, prescale, postscale
            )
        )
        return tuple(result)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        gathered = ops.synchronize(
            collectives.grouped_allgather_async(
                [g.contiguous() for g in grads], _grad_name(ctx.name)
            )
        )
        return (None, None, None, None, *(g * ctx.factor for g in gathered))


def reducescatter(
    tensor: torch.Tensor,
    name: str | None,
    compression: Any,
    op: ReduceOp,
    process_set: Any,
    prescale: float,
    postscale: float,
) -> torch.Tensor:
    out = grouped_reducescatter([tensor], name, compression, op, process_set, prescale, postscale)
    return out[0]


def grouped_reducescatter(
    tensors: list[torch.Tensor],
    name: str | None,
    compression: Any,
    op: ReduceOp,
    process_set: Any,
    prescale: float,
    postscale: float,
) -> list[torch.Tensor]:
    ops._no_process_sets(process_set)
    if compression is not Compression.none:
        raise NotImplementedError("reducescatter sends tensors uncompressed")
    if op not in (Sum, Average):
        raise NotImplementedError(f"reducescatter: op={op!r}; use Sum or Average")
    return list(_Reducescatter.apply(name, op, prescale, postscale, *tensors))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        name: str | None,
        op: ReduceOp,
        prescale: float,
        postscale: float,
        *tensors: torch.Tensor,
    ) -> Any:
        ctx.args = (name, op, prescale, postscale)
        result = ops.synchronize(
            collectives.grouped_allreduce_async(list(tensors), None, name, op, prescale, postscale)
        )
        return tuple(result)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        name, op, prescale, postscale = ctx.args
        reduced = ops.synchronize(
            collectives.grouped_allreduce_async(
                [g.contiguous() for g in grads], None, _grad_name(name), op, prescale, postscale
            )
        )
        return (None, None, None, None, *reduced)


def grouped_allreduce(
    tensors: list[torch.Tensor],
    average: bool | None,
    name: str | None,
    op: ReduceOp | None,
    prescale: float,
    postscale: float,
    process_set: Any,
) -> list[torch.Tensor]:
    ops._no_process_sets(process_set)
    reduce_op = ops._op_of(average, op)
    return list(_GroupedAllreduce.apply(name, reduce_op, prescale, postscale, *tensors))
