"""Sparse allreduce, as Horovod does it: every worker's indices and values are gathered
(two allgathers, agreed and carried like any other) and the sparse tensors added up
locally, so only the non-zero rows travel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sumflow.torch import _work, collectives, ops, process_sets
from sumflow.torch.ops import Average, ReduceOp, Sum


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: ReduceOp = Average, process_set: Any = None
) -> Callable[[], torch.Tensor]:
    """Starts summing (or averaging) a sparse COO tensor across workers; returns, as
    Horovod does, a function that waits and gives the coalesced sparse result."""
    handle = sparse_allreduce_handle(tensor, name, op, process_set)

    def wait() -> torch.Tensor:
        result = ops.synchronize(handle)
        assert isinstance(result, torch.Tensor)
        return result

    return wait


def sparse_allreduce_handle(tensor: torch.Tensor, name: str, op: ReduceOp, process_set: Any) -> int:
    """``sparse_allreduce_async`` as a handle for ``synchronize``."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError("sparse_allreduce_async needs a sparse COO torch.Tensor")
    if op not in (Sum, Average):
        raise NotImplementedError(f"sparse allreduce: op={op!r}; use Sum or Average")
    coalesced = tensor.coalesce()
    indices = coalesced.indices().t().contiguous()
    values = coalesced.values().contiguous()
    base = f"sparse.{name}"
    handles = [
        collectives.allgather_async(indices, f"{base}.indices", process_set),
        collectives.allgather_async(values, f"{base}.values", process_set),
    ]
    size = process_sets.group_of(process_set, "sparse_allreduce").size

    def finish(results: list[torch.Tensor]) -> torch.Tensor:
        all_indices, all_values = results
        if op is Average:
            all_values = all_values / size
        out = torch.sparse_coo_tensor(all_indices.t(), all_values, tensor.shape)
        return out.coalesce()

    return _work.register(_work.Chain(base, handles, finish))
