"""The collectives as differentiable functions, with Horovod's gradients:

- allreduce: the gradient reduced with the same op and scaling;
- allgather: the gradient averaged over the members, then this worker's rows;
- broadcast: the gradient averaged over the members, on the root (zeros elsewhere);
- alltoall: the gradient sent back the way the rows came;
- reducescatter: the gradients gathered (times the number of members for a sum).

The backward pass runs the same collectives, over the same process set, so every member
must run it, as in Horovod.
"""

from __future__ import annotations

from typing import Any

import torch

from sumflow.torch import _runtime, collectives, ops, process_sets
from sumflow.torch.compression import Compression, Compressor
from sumflow.torch.ops import Average, ReduceOp, Sum


def _grad_name(name: str | None) -> str | None:
    return None if name is None else f"{name}.grad"


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: ReduceOp,
        compression: Any,
        scales: tuple[float, float],
        process_set: Any,
    ) -> torch.Tensor:
        ctx.args = (name, op, scales, process_set)
        return collectives.synchronize_tensor(
            ops.allreduce_async(
                tensor, None, name, op, scales[0], scales[1], process_set, compression=compression
            )
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        name, op, scales, process_set = ctx.args
        out = ops.allreduce_async(
            grad.contiguous(), None, _grad_name(name), op, scales[0], scales[1], process_set
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
    """The reduction (default: average) of `tensor` over the workers (or the members of
    `process_set`), as a new tensor. Differentiable: the gradient is reduced the same way."""
    result: torch.Tensor = _Allreduce.apply(
        tensor,
        name,
        ops._op_of(average, op),
        compression,
        (prescale_factor, postscale_factor),
        process_set,
    )
    return result


def _own_rows(grad: torch.Tensor, rows: int, name: str | None, process_set: Any) -> torch.Tensor:
    """This worker's rows of the average of `grad` over the members."""
    averaged = collectives.synchronize_tensor(
        ops.allreduce_async(
            grad.contiguous(), None, _grad_name(name), Average, process_set=process_set
        )
    )
    counts = collectives.synchronize_tensor(
        collectives.allgather_async(
            torch.tensor([rows], dtype=torch.int64),
            None if name is None else f"{name}.grad.rows",
            process_set,
        )
    ).tolist()
    rank = process_sets.group_of(process_set, "allgather").rank
    return averaged.narrow(0, sum(counts[:rank]), rows)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, name: str | None, single: bool, process_set: Any, *tensors: torch.Tensor
    ) -> Any:
        ctx.name, ctx.process_set = name, process_set
        ctx.rows = [t.shape[0] if t.dim() else 0 for t in tensors]
        if single:
            return collectives.synchronize_tensor(
                collectives.allgather_async(tensors[0], name, process_set)
            )
        result = ops.synchronize(
            collectives.grouped_allgather_async(list(tensors), name, process_set)
        )
        return tuple(result)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        base = ctx.name
        if len(grads) == 1:
            names = [base]
        else:
            names = [None if base is None else f"{base}.{i}" for i in range(len(grads))]
        own = (
            _own_rows(g, rows, n, ctx.process_set)
            for g, rows, n in zip(grads, ctx.rows, names, strict=True)
        )
        return (None, None, None, *own)


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = None
) -> torch.Tensor:
    result: torch.Tensor = _GroupedAllgather.apply(name, True, process_set, tensor)
    return result


def grouped_allgather(
    tensors: list[torch.Tensor], name: str | None = None, process_set: Any = None
) -> list[torch.Tensor]:
    return list(_GroupedAllgather.apply(name, False, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root: int, name: str | None, process_set: Any
    ) -> torch.Tensor:
        ctx.root, ctx.name, ctx.process_set = root, name, process_set
        return collectives.synchronize_tensor(ops.broadcast_async(tensor, root, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        averaged = collectives.synchronize_tensor(
            ops.allreduce_async(
                grad.contiguous(),
                None,
                _grad_name(ctx.name),
                Average,
                process_set=ctx.process_set,
            )
        )
        if _runtime.current().service.rank != ctx.root:
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> torch.Tensor:
    """root_rank's `tensor`, as a new tensor on every worker (or member). Differentiable:
    the root's gradient is the average of every member's, the others' zero."""
    result: torch.Tensor = _Broadcast.apply(tensor, root_rank, name, process_set)
    return result


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any
    ) -> Any:
        ctx.name, ctx.process_set = name, process_set
        out, received = ops.synchronize(
            collectives.alltoall_async(tensor, splits, name, process_set)
        )
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> Any:
        back, _sent = ops.synchronize(
            collectives.alltoall_async(
                grad.contiguous(), ctx.received, _grad_name(ctx.name), ctx.process_set
            )
        )
        return back, None, None, None


def alltoall(
    tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    out, received = _Alltoall.apply(tensor, splits, name, process_set)
    return out, received


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        name: str | None,
        op: ReduceOp,
        scales: tuple[float, float],
        process_set: Any,
        *tensors: torch.Tensor,
    ) -> Any:
        members = process_sets.group_of(process_set, "reducescatter").size
        ctx.name, ctx.process_set = name, process_set
        ctx.factor = (members if op is Sum else 1) * scales[0] * scales[1]
        result = ops.synchronize(
            collectives.grouped_reducescatter_async(
                list(tensors), name, op, process_set, scales[0], scales[1]
            )
        )
        return tuple(result)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        gathered = ops.synchronize(
            collectives.grouped_allgather_async(
                [g.contiguous() for g in grads], _grad_name(ctx.name), ctx.process_set
            )
        )
        return (None, None, None, None, *(g * ctx.factor for g in gathered))


def grouped_reducescatter(
    tensors: list[torch.Tensor],
    name: str | None,
    compression: Any,
    op: ReduceOp,
    process_set: Any,
    prescale: float,
    postscale: float,
) -> list[torch.Tensor]:
    if compression is not Compression.none:
        raise NotImplementedError("reducescatter sends tensors uncompressed")
    if op not in (Sum, Average):
        raise NotImplementedError(f"reducescatter: op={op!r}; use Sum or Average")
    return list(_Reducescatter.apply(name, op, (prescale, postscale), process_set, *tensors))


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


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        name: str | None,
        op: ReduceOp,
        scales: tuple[float, float],
        process_set: Any,
        *tensors: torch.Tensor,
    ) -> Any:
        ctx.args = (name, op, scales, process_set)
        result = ops.synchronize(
            collectives.grouped_allreduce_async(
                list(tensors), None, name, op, scales[0], scales[1], process_set
            )
        )
        return tuple(result)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        name, op, scales, process_set = ctx.args
        reduced = ops.synchronize(
            collectives.grouped_allreduce_async(
                [g.contiguous() for g in grads],
                None,
                _grad_name(name),
                op,
                scales[0],
                scales[1],
                process_set,
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
    reduce_op = ops._op_of(average, op)
    return list(
        _GroupedAllreduce.apply(name, reduce_op, (prescale, postscale), process_set, *tensors)
    )
