"""A DDP communication hook: keep DistributedDataParallel, exchange gradients via sumflow.

    model = DistributedDataParallel(model)
    model.register_comm_hook(sumflow.torch.DDPHookState(model), sumflow.torch.ddp_hook)

DDP still needs its process group (gloo or nccl) for its start-up broadcast; the hook only
replaces the gradient all-reduce. Each bucket is summed as one tensor, in place in DDP's
bucket buffer, named after the parameters it holds (``ddp.grad[<first>..<last>]x<count>``,
or ``ddp.grad.<parameter>`` for a bucket of one), never after its index: DDP rebuilds its
buckets after the first iteration, the same way on every worker, and an index would then
name other parameters. Its priority is its most urgent parameter's model position. A
bucket's buffer is the same memory step after step, so its sum is prepared at its first
step (``ops.PreparedSum``) and a later step's hook makes one call into the core.
"""

import queue
import threading

import torch
import torch.distributed as dist

from sumflow.torch import _runtime, ops, process_sets
from sumflow.torch.compression import AnyCompressor, Compression


class DDPHookState:
    """What ``ddp_hook`` needs: parameter names (``state=None`` names them by first
    appearance, which is the same on every worker but less readable in error messages),
    the ``compression`` of the gradients (default ``SUMFLOW_COMPRESSION``, else none), and
    a ``name`` prefixing the declared tensors (``ddp.grad[<first>..<last>]x<count>``), so
    two hooked models of one job keep apart."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        compression: AnyCompressor | None = None,
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

        #: By bucket index: what its sum was prepared for (the runtime's generation, the
        #: buffer's address, size and dtype, its parameters' run) and the sum, or where it
        #: cannot be prepared (compressed) its name and priority for ``issue_declared``.
        #: One per index, so a rebuilt bucket's replaces it and frees the old buffer.
        self._prepared: dict[int, tuple[tuple[object, ...], ops.PreparedSum | tuple[str, int]]] = {}

    def _parameter(self, p: torch.Tensor) -> tuple[str, int]:
        """`p`'s name and model position (by first appearance if the model gave none)."""
        key = id(p)
        if key not in self._names:
            n = len(self._names)
            self._names[key] = f"param.{n}"
            self._priority[key] = n
        return self._names[key], self._priority[key]

    def bucket_of(self, params: list[torch.Tensor]) -> tuple[str, int]:
        """The tensor name and priority of a bucket of `params`, in the bucket's order."""
        named = [self._parameter(p) for p in params]
        priority = min(position for _, position in named)
        if len(named) == 1:
            return f"{self.prefix}.grad.{named[0][0]}", priority
        first, last = named[0][0], named[-1][0]
        return f"{self.prefix}.grad[{first}..{last}]x{len(named)}", priority

    def issue(
        self, bucket: dist.GradBucket, buffer: torch.Tensor, params: list[torch.Tensor]
    ) -> int:
        """Starts averaging `bucket`'s `buffer` (its `params`' gradients back to back) in
        place; returns the handle."""
        # A bucket is the same while its buffer and its parameters' run are.
        key = (
            _runtime.generation,
            buffer.data_ptr(),
            buffer.numel(),
            buffer.dtype,
            id(params[0]),
            id(params[-1]),
            len(params),
        )
        index = bucket.index()
        found = self._prepared.get(index)
        if found is None or found[0] != key:
            name, priority = self.bucket_of(params)
            group = process_sets.group_of(None, name)
            made = ops.prepare_declared(
                name, buffer, ops.Average, priority, self.compression, 1.0, 1.0, group
            )
            found = self._prepared[index] = (key, made or (name, priority))
        if bucket.is_last():
            # Indices past the last bucket belong to buckets DDP has rebuilt away.
            for stale in [i for i in self._prepared if i > index]:
                del self._prepared[stale]
        sent = found[1]
        if isinstance(sent, ops.PreparedSum):
            return sent.issue()
        name, priority = sent
        return ops.issue_declared(name, buffer, ops.Average, priority, self.compression, 1.0, 1.0)


_default_state = DDPHookState()
_completions: queue.Queue[tuple[list[int], torch.futures.Future[torch.Tensor], torch.Tensor]] = (
    queue.Queue()
)
_completer: threading.Thread | None = None
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
    state: DDPHookState | None, bucket: dist.GradBucket
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
    handles = [state.issue(bucket, buffer, params)]
    # A CUDA-aware future: set_result records the completer's stream (which waits for the
    # copies of the sums back to the GPU), and DDP's wait makes its own stream wait for it.
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buffer.device] if buffer.is_cuda else None
    )
    _start_completer()
    _completions.put((handles, fut, buffer))
    return fut
