"""Sparse allreduce, as Horovod does it: every worker's indices and values are gathered
(two allgathers, agreed and carried like any other) and the sparse tensors added up
locally, so only the non-zero rows travel."""

from __future__ import annotations

from typing import Any

import torch

from sumflow.torch import _runtime, _work, collectives
from sumflow.torch.ops import Average, ReduceOp, Sum


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: ReduceOp = Average, process_set: Any = None
) -> int:
    """Starts summing (or averaging) a sparse COO tensor across workers; ``synchronize``
    gives the coalesced sparse result."""
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
    size = _runtime.current().service.size

    def finish(results: list[torch.Tensor]) -> torch.Tensor:
        all_indices, all_values = results
        if op is Average:
            all_values = all_values / size
        out = torch.sparse_coo_tensor(all_indices.t(), all_values, tensor.shape)
        return out.coalesce()

    return _work.register(_work.Chain(base, handles, finish))
