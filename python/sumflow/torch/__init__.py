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

# First: a torch release the plugin cannot run on is refused here, naming what it lacks.
from sumflow.torch import _requires as _requires
from sumflow.torch import _runtime, _staging, elastic, ops, process_sets
from sumflow.torch.asynchronous import AsyncOptimizer
from sumflow.torch.autograd import allreduce, broadcast
from sumflow.torch.collectives import (
    allgather,
    allgather_async,
    allgather_object,
    alltoall,
    alltoall_async,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from sumflow.torch.compression import Compression, Compressor, ErrorFeedback
from sumflow.torch.csc import CoarseSparseSGD
from sumflow.torch.ddp import DDPHookState, ddp_hook
from sumflow.torch.negotiate import HorovodInternalError
from sumflow.torch.ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    declare_tensors,
    join,
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
from sumflow.torch.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from sumflow.torch.sparse import sparse_allreduce_async
from sumflow.torch.sync_batch_norm import SyncBatchNorm
from sumflow.torch.timeline import start_timeline, stop_timeline
from sumflow.torch.timeline import stop_quietly as timeline_stop_quietly
from sumflow.torch.wire import (
    ServerTraffic,
    WireBytes,
    server_wire_bytes,
    total_wire_bytes,
    wire_bytes,
)


def init(comm: object = None, process_sets: object = None) -> None:
    """Joins the job this process belongs to (see the module docs); blocks until every
    worker and server has joined. Horovod's ``comm`` (an MPI communicator) is not
    supported: the job comes from the environment. ``process_sets`` may list sets to
    register (see ``add_process_set``)."""
    if comm is not None:
        raise NotImplementedError(
            "sumflow.torch.init(comm=...): sumflow uses no MPI communicator; the job comes "
            "from the environment (sumflow-run, torchrun, mpirun, srun, or a job of one)"
        )
    _runtime.init()
    if process_sets == "dynamic":
        return
    for ps in process_sets or ():  # type: ignore[attr-defined]
        add_process_set(ps)


def shutdown() -> None:
    """Leaves the job. Called at exit if not before."""
    try:
        # A running timeline is written first, while the service still records.
        timeline_stop_quietly()
        _runtime.shutdown()
    finally:
        ops._reset()
        process_sets.reset()
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


def is_homogeneous() -> bool:
    """Whether every worker machine runs the same number of workers."""
    return _runtime.current().service.is_homogeneous


def mpi_threads_supported() -> bool:
    """sumflow uses no MPI."""
    return False


def mpi_built() -> bool:
    """sumflow uses no MPI: False."""
    return False


def mpi_enabled() -> bool:
    """sumflow uses no MPI: False."""
    return False


def gloo_built() -> bool:
    """sumflow does not use Gloo: its summation servers carry every collective. False."""
    return False


def gloo_enabled() -> bool:
    """False: see ``gloo_built``."""
    return False


def nccl_built() -> int:
    """0: sumflow is not built against NCCL (CUDA tensors are staged through host memory)."""
    return 0


def ddl_built() -> bool:
    """False: sumflow has no IBM DDL support."""
    return False


def ccl_built() -> bool:
    """False: sumflow has no oneCCL support."""
    return False


def cuda_built() -> bool:
    """True: CUDA tensors are accepted (staged through pinned host memory). sumflow's wheel
    is not built against CUDA, so this holds for every torch build."""
    return True


def rocm_built() -> bool:
    """False: ROCm tensors are not supported."""
    return False


__all__ = [
    "Adasum",
    "AsyncOptimizer",
    "Average",
    "CoarseSparseSGD",
    "Compression",
    "Compressor",
    "DDPHookState",
    "DeclarationMismatchError",
    "DistributedOptimizer",
    "ErrorFeedback",
    "HorovodInternalError",
    "Max",
    "Min",
    "NodeFailedError",
    "ProcessSet",
    "Product",
    "ProtocolError",
    "ReduceOp",
    "ServerTraffic",
    "Sum",
    "SumflowError",
    "SumflowTimeoutError",
    "SyncBatchNorm",
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
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "ddp_hook",
    "declare_tensors",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "push_pull",
    "push_pull_async",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "server_wire_bytes",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
    "total_wire_bytes",
    "wire_bytes",
]
