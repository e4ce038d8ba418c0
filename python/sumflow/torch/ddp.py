"""A DDP communication hook: keep DistributedDataParallel, exchange gradients via sumflow.

    model = DistributedDataParallel(model)
    model.register_comm_hook(sumflow.torch.DDPHookState(model), sumflow.torch.ddp_hook)

DDP still needs its process group (gloo or nccl) for its start-up broadcast; the hook only
replaces the gradient all-reduce. Gradients are pushed per parameter, named after the
parameter, not per bucket: DDP rebuilds its buckets after the first iteration, and bucket
indices would then name different tensors. Each parameter keeps its own declaration and
its model position as priority however the buckets are cut.
"""

import queue
import threading
from typing import Optional

import torch
import torch.distributed as dist

from sumflow.torch import ops
from sumflow.torch.compression import AnyCompressor, Compression


class DDPHookState:
    """What ``ddp_hook`` needs: parameter names (``state=None`` names them by first
    appearance, which is the same on every worker but less readable in error messages),
    the ``compression`` of the gradients (default ``SUMFLOW_COMPRESSION``, else none), and
    a ``name`` prefixing the declared tensors (``ddp.grad.<parameter>``), so two hooked
    models of one job keep apart."""

    def __init__(
        self,
        model: Optional[torch.nn.Module] = None,
        compression: Optional[AnyCompressor] = None,
        name: str = "ddp",
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, not {name!r}")
        self.compression = Compression.from_env() if compression is None else compression
        self.prefix = name
        self._names: dict[int, str] = {}
        self._priority: dict[int, int] = {}
        if model is not None:
            module = getattr(model, "module", model)
            for i, (name, p) in enumerate(module.named_parameters()):
                self._names[id(p)] = name
                self._priority[id(p)] = i

    def name_of(self, p: torch.Tensor) -> tuple[str, int]:
        key = id(p)
        if key not in self._names:
            n = len(self._names)
            self._names[key] = f"param.{n}"
            self._priority[key] = n
        return f"{self.prefix}.grad.{self._names[key]}", self._priority[key]


_default_state = DDPHookState()
_completions: queue.Queue[tuple[list[int], torch.futures.Future[torch.Tensor], torch.Tensor]] = (
    queue.Queue()
)
_completer: Optional[threading.Thread] = None
_completer_lock = threading.Lock()


def _complete_forever() -> None:
    while True:
        handles, fut, buffer = _completions.get()
        try:
            for h in handles:
                ops.synchronize(h)
        except Exception as e:
            # torch annotates the exception as the future's result type; it takes any.
            fut.set_exception(e)  # type: ignore[arg-type]
        else:
            fut.set_result(buffer)


def _start_completer() -> None:
    global _completer
    with _completer_lock:
        if _completer is None or not _completer.is_alive():
            _completer = threading.Thread(target=_complete_forever, name="sumflow-ddp", daemon=True)
            _completer.start()


# Evaluated annotations (no `from __future__ import annotations`): DDP inspects them.
def ddp_hook(
    state: Optional[DDPHookState], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Averages a DDP gradient bucket across sumflow workers; register with
    ``model.register_comm_hook(state, ddp_hook)``."""
    state = state if state is not None else _default_state
    buffer = bucket.buffer()
    params = bucket.parameters()
    total = sum(p.numel() for p in params)
    if total != buffer.numel():
        raise RuntimeError(
            f"DDP bucket {bucket.index()} holds {buffer.numel()} elements but its parameters "
            f"{total}: this DDP lays out buckets in a way ddp_hook does not know"
        )
    handles = []
    offset = 0
    for p in params:
        name, priority = state.name_of(p)
        # The bucket buffer is the parameters' gradients back to back: each is summed in
        # place in its own span.
        span = buffer.narrow(0, offset, p.numel())
        offset += p.numel()
        handles.append(
            ops.issue_declared(name, span, ops.Average, priority, state.compression, 1.0, 1.0)
        )
    # A CUDA-aware future: set_result records the completer's stream (which waits for the
    # copies of the sums back to the GPU), and DDP's wait makes its own stream wait for it.
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buffer.device] if buffer.is_cuda else None
    )
    _start_completer()
    _completions.put((handles, fut, buffer))
    return fut
