"""sumflow for PyTorch, Horovod-compatible: ``import sumflow.torch as hvd``.

A Horovod training script runs after changing only its import line. Gradients go to
sumflow's summation service (BytePS's architecture) instead of an all-reduce ring; the
optimizer stays on the workers.

    import sumflow.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Start workers with ``sumflow-run -np 4 python train.py`` or with torchrun; a process
started alone is a job of one. DDP users keep DDP and register ``ddp_hook`` instead.
"""

from __future__ import annotations

from sumflow import (
    DeclarationMismatchError,
    NodeFailedError,
    ProtocolError,
    SumflowError,
    SumflowTimeoutError,
)
from sumflow.torch import _runtime, _staging, ops
from sumflow.torch.compression import Compression, Compressor, ErrorFeedback
from sumflow.torch.csc import CoarseSparseSGD
from sumflow.torch.ddp import DDPHookState, ddp_hook
from sumflow.torch.ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async_,
    broadcast_object,
    declare_tensors,
    poll,
    push_pull,
    push_pull_async,
    synchronize,
)
from sumflow.torch.optimizer import (
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from sumflow.torch.wire import (
    ServerTraffic,
    WireBytes,
    server_wire_bytes,
    total_wire_bytes,
    wire_bytes,
)


def init(*args: object, **kwargs: object) -> None:
    """Joins the job this process belongs to (see the module docs); blocks until every
    worker and server has joined. Horovod's arguments (``comm``, ``process_sets``) are not
    supported: every sumflow job spans all its workers."""
    if args or kwargs:
        raise NotImplementedError(
            "sumflow.torch.init() takes no arguments: the job comes from the environment "
            "(sumflow-run, torchrun, or a job of one)"
        )
    _runtime.init()


def shutdown() -> None:
    """Leaves the job. Called at exit if not before."""
    try:
        _runtime.shutdown()
    finally:
        ops._reset()
        _staging.clear()


def is_initialized() -> bool:
    """Whether ``init()`` has been called (and not ``shutdown()``)."""
    return _runtime.is_initialized()


def rank() -> int:
    """This worker's rank, 0 to ``size() - 1``."""
    return _runtime.current().service.rank


def size() -> int:
    """The number of workers."""
    return _runtime.current().service.size


def local_rank() -> int:
    """This worker's rank among the workers of its machine."""
    return _runtime.current().service.local_rank


def local_size() -> int:
    """The number of workers on this machine."""
    return _runtime.current().service.local_size


def cross_rank() -> int:
    """This machine's index among the machines (workers are grouped by machine)."""
    return rank() // local_size()


def cross_size() -> int:
    """The number of worker machines."""
    return size() // local_size()


def mpi_threads_supported() -> bool:
    """sumflow uses no MPI."""
    return False


def _unsupported(name: str, alternative: str) -> object:
    def fail(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"sumflow.torch.{name} is not supported: {alternative}")

    fail.__name__ = name
    fail.__doc__ = f"Not supported by sumflow: {alternative}"
    return fail


allgather = _unsupported("allgather", "use broadcast_object or allreduce of a zero-padded tensor")
allgather_async = _unsupported("allgather_async", "use broadcast_object")
allgather_object = _unsupported("allgather_object", "broadcast_object from each rank in turn")
alltoall = _unsupported("alltoall", "sumflow implements sum and broadcast only")
reducescatter = _unsupported("reducescatter", "use allreduce and slice")
grouped_allreduce = _unsupported("grouped_allreduce", "issue allreduce_async_ per tensor")
join = _unsupported("join", "give every worker the same number of steps")
add_process_set = _unsupported("add_process_set", "start a separate job per subset")

__all__ = [
    "Adasum",
    "Average",
    "CoarseSparseSGD",
    "Compression",
    "Compressor",
    "DDPHookState",
    "DeclarationMismatchError",
    "DistributedOptimizer",
    "ErrorFeedback",
    "Max",
    "Min",
    "NodeFailedError",
    "Product",
    "ProtocolError",
    "ReduceOp",
    "ServerTraffic",
    "Sum",
    "SumflowError",
    "SumflowTimeoutError",
    "WireBytes",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "ddp_hook",
    "declare_tensors",
    "grouped_allreduce",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_threads_supported",
    "poll",
    "push_pull",
    "push_pull_async",
    "rank",
    "reducescatter",
    "server_wire_bytes",
    "shutdown",
    "size",
    "synchronize",
    "total_wire_bytes",
    "wire_bytes",
]
