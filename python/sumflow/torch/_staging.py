"""Host staging: the core reads and writes host memory only.

CPU tensors that are contiguous are summed where they are; others through a contiguous
copy. A CUDA tensor goes through a pinned host buffer (cached by tensor name and device
and reused every step) in a pipeline that never makes the caller wait for the GPU
(BytePS §6.1: the copy between GPU and host memory is a stage of its own):

1. ``after_copy`` (in the caller: a gradient hook, during backward) marks the point of the
   caller's stream where the tensor is complete, and returns. That is all backward's
   thread does: on an H200 a gradient pass launches kernels about as fast as the GPU runs
   them, so every microsecond of Python in a hook lengthens backward.
2. A *staging* thread queues each copy into its pinned buffer on a side stream, behind
   that point, and an event after it (every copy waiting in line is queued before the
   thread waits for the first, so the copy engine runs them back to back); then it waits
   for those events in order (blocking-sync events: it sleeps, it does not spin) and
   issues each buffer's sum as soon as its copy is complete.
3. ``copy_back`` queues the copy of the result into the tensor on the side stream and
   makes the caller's stream wait for it on the GPU: nothing on the CPU waits.

Steps 1 and 2 run in the core by default (``sumflow_cuda``, through the CUDA driver):
the staging thread there never takes the GIL, which backward's thread needs for every
hook. Where the driver cannot be loaded, or with ``SUMFLOW_CUDA_STAGING=python``, a
Python thread does step 2 through torch (``Copy``): the same pipeline, but each of its
torch calls competes with the hooks for the GIL.

The caller keeps the rest (compression, scaling, declaring): handing that to another
thread was measured slower, since both then compete for the GIL during backward.

The tensor is copied after the caller returned, so it must stay alive and unwritten until
its copy completes: it does, since the caller's work holds it until its sum is finished
(Horovod's contract: a tensor in flight is not touched), and the work's finish comes only
after the copy; the staging thread holds a reference too, until the copy is done. A pinned
buffer is rewritten only by the next copy into it, which waits for the caller's stream,
which ``copy_back`` made wait for the copy out of it; and the core fills it only after
that copy's event: no buffer is overwritten while a copy still reads it, without any CPU
wait. Events are reused too: a name is never in flight twice, so the staging thread has
waited for an event's last recording before the next one.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import warnings
from collections.abc import Callable
from typing import NamedTuple, Protocol, TypeVar

import torch

from sumflow import SumflowTimeoutError, _core, settings
from sumflow.torch import _runtime

T = TypeVar("T")

#: By (tensor name, device index): the pinned buffer, the event after the tensor's
#: producer, and the event after its last copy in.
_pinned: dict[tuple[str, int], tuple[torch.Tensor, torch.cuda.Event, torch.cuda.Event]] = {}
_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()
#: The trace track of the copies to host memory.
TRACK = "cuda staging"


class ToHost:
    """A CUDA tensor's copy into its pinned buffer, ordered after the caller's work that
    produces it (``produced``, recorded by ``after_copy``); ``start`` queues it."""

    def __init__(
        self,
        tensor: torch.Tensor,
        host: torch.Tensor,
        produced: torch.cuda.Event,
        copied: torch.cuda.Event,
    ) -> None:
        self.tensor = tensor
        self.host = host
        self.produced = produced
        #: Recorded on the side stream after the copy.
        self.copied = copied

    def start(self) -> None:
        """Queues the copy (on the issuer thread, whose current stream on the tensor's
        device stays sumflow's side stream: no stream switch per copy)."""
        global _issuer_stream
        stream = _side_stream(self.tensor.device)
        stream.wait_event(self.produced)
        if _issuer_stream is not stream:
            torch.cuda.set_stream(stream)
            _issuer_stream = stream
        self.host.copy_(self.tensor.reshape(-1), non_blocking=True)
        self.copied.record(stream)
        # Should the tensor be freed early after all, its memory waits for the copy.
        self.tensor.record_stream(stream)


class Copy:
    """A CUDA tensor's copy to host memory, and the core sums to issue once it is
    complete (``issue`` returns their handles)."""

    def __init__(
        self,
        name: str,
        device: torch.device,
        transfer: ToHost,
        issue: Callable[[], list[int]],
    ) -> None:
        self.name = name
        self.device = device
        self.transfer = transfer
        self.issue = issue
        self._started = False
        service = _runtime.current().service
        self.queued_at = service.trace_now() if service.tracing else 0
        self._done = threading.Event()
        self._cores: list[int] = []
        self._error: BaseException | None = None

    def ready(self) -> bool:
        """Whether its sums were issued (or failed to be)."""
        return self._done.is_set()

    def cores(self, timeout: float) -> list[int]:
        """The handles of its sums, once issued; raises what issuing raised."""
        if not self._done.wait(timeout):
            raise SumflowTimeoutError(
                f"tensor '{self.name}': its copy from {self.device} to host memory did not "
                f"complete within {timeout:g} s (SUMFLOW_TIMEOUT): the GPU is still busy "
                "with the work queued before it, or hung"
            )
        if self._error is not None:
            raise self._error
        return self._cores

    def start(self) -> None:
        """Queues the copy on the GPU (on the issuer thread; once)."""
        if self._started:
            return
        self._started = True
        try:
            self.transfer.start()
        except BaseException as e:  # handed to the waiter by run()
            self._error = e

    def run(self) -> None:
        self.start()
        try:
            if self._error is not None:
                raise self._error
            self.transfer.copied.synchronize()
            service = _runtime.current().service
            if service.tracing and self.queued_at:
                service.trace_span(
                    TRACK, f"to host {self.name}", self.queued_at, service.trace_now(), None
                )
            self._cores = self.issue()
        except BaseException as e:  # handed to the waiter
            self._error = e
        finally:
            self._done.set()


_copies: queue.SimpleQueue[Copy] = queue.SimpleQueue()
_issuer: threading.Thread | None = None
#: The stream the issuer thread last made current (its copies' side stream).
_issuer_stream: torch.cuda.Stream | None = None


def _issue_forever() -> None:
    waiting: collections.deque[Copy] = collections.deque()
    while True:
        if not waiting:
            waiting.append(_copies.get())
        # Every copy in line is on the GPU before the issuer waits for the first.
        with contextlib.suppress(queue.Empty):
            while True:
                waiting.append(_copies.get_nowait())
        for copy in waiting:
            copy.start()
        waiting.popleft().run()


class Staged(Protocol):
    """A CUDA tensor's sum, issued once its copy to host memory is complete: ``Copy``
    (the Python staging thread) or ``_core.StagedSum`` (the core's)."""

    def ready(self) -> bool:
        """Whether its sum was issued (or failed to be)."""
        ...

    def cores(self, timeout: float) -> list[int]:
        """The handles of its sums, once issued; raises what issuing raised."""
        ...


class Sum(NamedTuple):
    """A push_pull of a host buffer, to issue once the buffer holds its tensor (a tuple:
    made in every gradient hook that sends, where a frozen dataclass costs microseconds)."""

    tensor_id: int
    host: torch.Tensor
    priority: int
    average: bool
    #: The servers' reduction other than a sum ("min", "max", "product"), if any.
    op: str | None
    #: The byte ranges this worker takes back (None: all).
    pulls: list[tuple[int, int]] | None

    def issue(self, service: _core.CommunicationService) -> list[int]:
        """Issues it now; returns its handle, in a list."""
        host = self.host
        nbytes = host.numel() * host.element_size()
        args = (self.tensor_id, host, host.data_ptr(), nbytes, self.priority, self.average)
        return [service.push_pull(*args, op=self.op, pulls=self.pulls)]


def after_copy(name: str, tensor: torch.Tensor, job: Sum) -> Staged:
    """Issues `job` once `tensor` (CUDA, produced by the work queued so far on the
    caller's stream) is copied into ``job.host``; returns at once."""
    return CopyThenSum(name, tensor, job).start()


#: push_pull_after_copy's arguments before the caller's stream, and after it.
_DriverArgs = tuple[
    tuple[str, torch.Tensor, int, int], tuple[int, torch.Tensor, int, int, int, bool]
]


class CopyThenSum:
    """A CUDA tensor's copy into its host buffer, then `job`, with the arguments worked out
    once: a tensor staged every step from the same memory (a span of the gradient pool,
    contiguous) is started each step by one call, ``start``, the one call of a gradient
    hook's send that has to run on backward's thread."""

    __slots__ = ("_args", "_device", "_job", "_name", "_service", "_tensor")

    def __init__(self, name: str, tensor: torch.Tensor, job: Sum) -> None:
        rt = _runtime.current()
        if rt.driver_staging is None:
            rt.driver_staging = _driver_staging(rt.service)
        self._service = rt.service
        self._name = name
        self._job = job
        self._device = tensor.get_device()
        self._tensor = tensor
        #: push_pull_after_copy's arguments before and after the caller's stream (None:
        #: staged by the Python thread).
        self._args: _DriverArgs | None = None
        if rt.driver_staging:
            host = job.host
            # The driver copies bytes as they lie: a strided tensor is packed first, on the
            # caller's stream (torch's own copy does that inside the Python thread's).
            source = tensor if tensor.is_contiguous() else tensor.contiguous()
            nbytes = host.numel() * host.element_size()
            self._args = (
                (name, source, source.data_ptr(), self._device),
                (job.tensor_id, host, host.data_ptr(), nbytes, job.priority, job.average),
            )

    def start(self) -> Staged:
        """Marks the point of the caller's current stream where the tensor is complete
        (it must be complete there, and unwritten until the sum is finished), and returns:
        the copy and the sum follow on a staging thread."""
        job = self._job
        if self._args is not None:
            (name, source, source_ptr, device), (tid, host, ptr, nbytes, priority, average) = (
                self._args
            )
            stream = _raw_stream(device)
            return self._service.push_pull_after_copy(
                name, source, source_ptr, device, stream, tid, host, ptr, nbytes, priority,
                average, op=job.op, pulls=job.pulls,
            )  # fmt: skip
        tensor = self._tensor
        _, produced, copied = _pinned_for(self._name, tensor)
        # The tensor is produced on the caller's stream: copied once that work is done.
        produced.record(torch.cuda.current_stream(tensor.device))
        transfer = ToHost(tensor, job.host, produced, copied)
        service = self._service
        return _python_after_copy(self._name, tensor.device, transfer, lambda: job.issue(service))


#: torch's call for the current ``cudaStream_t`` of a device, where it has one.
_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _raw_stream(device: int) -> int:
    """The caller's current stream on `device`, as a ``cudaStream_t``: one call into
    torch where it has one (``torch.cuda.current_stream`` makes a Stream object)."""
    if _CURRENT_RAW_STREAM is not None:
        return int(_CURRENT_RAW_STREAM(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


def _driver_staging(service: _core.CommunicationService) -> bool:
    """Whether this service stages CUDA tensors in the core (SUMFLOW_CUDA_STAGING)."""
    if settings.CUDA_STAGING.read() == "python":
        return False
    why = service.cuda_staging_unavailable()
    if why is None:
        return True
    warnings.warn(
        f"sumflow: CUDA tensors are staged to host memory by a Python thread, since the "
        f"core cannot use the CUDA driver: {why}",
        stacklevel=3,
    )
    return False


def _python_after_copy(
    name: str, device: torch.device, transfer: ToHost, issue: Callable[[], list[int]]
) -> Copy:
    """Has the Python staging thread queue `transfer` and call `issue` once it has
    completed."""
    global _issuer
    copy = Copy(name, device, transfer, issue)
    if _issuer is None:
        with _lock:
            if _issuer is None:
                # Daemon: a script that ends with copies in flight must not hang on them.
                _issuer = threading.Thread(
                    target=_issue_forever, name="sumflow-staging", daemon=True
                )
                _issuer.start()
    _copies.put(copy)
    return copy


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream of `device` that sumflow's copies run on."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        with _lock:
            stream = _streams.setdefault(index, torch.cuda.Stream(device=index))
    return stream


def _pinned_for(
    name: str, tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.cuda.Event, torch.cuda.Event]:
    """The pinned buffer of `name` on `tensor`'s device, and its two events: after the
    tensor's producer, and after the copy."""
    key = (name, tensor.device.index or 0)
    found = _pinned.get(key)
    if found is not None and found[0].dtype == tensor.dtype and found[0].numel() == tensor.numel():
        return found
    made = (
        torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=True),
        torch.cuda.Event(),
        torch.cuda.Event(blocking=True),
    )
    with _lock:
        _pinned[key] = made
    return made


def to_host(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The host buffer the core sums for `tensor`, and the CUDA tensor to copy into it
    first with ``after_copy`` (None: it holds the values now; `tensor` itself when the
    core can use it)."""
    if tensor.device.type == "cpu":
        return (tensor if tensor.is_contiguous() else tensor.contiguous()), None
    if tensor.device.type != "cuda":
        raise TypeError(
            f"tensor '{name}' is on {tensor.device}: sumflow handles CPU and CUDA tensors"
        )
    return _pinned_for(name, tensor)[0], tensor


def on_stream(stream: torch.cuda.Stream | None, run: Callable[[], T]) -> T:
    """`run()` with `stream` current (None, on the CPU: as it is)."""
    if stream is None:
        return run()
    with torch.cuda.stream(stream):
        return run()


def copy_back(host: torch.Tensor, tensor: torch.Tensor) -> None:
    """Writes the summed `host` buffer into `tensor`, ordered before any later work on the
    caller's stream and after any earlier one."""
    if tensor.device.type == "cpu":
        tensor.copy_(host.view_as(tensor))
        return
    stream = _side_stream(tensor.device)
    caller = torch.cuda.current_stream(tensor.device)
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        tensor.copy_(host.view(tensor.shape), non_blocking=True)
    tensor.record_stream(stream)
    caller.wait_stream(stream)


def clear() -> None:
    """Frees the cached pinned buffers."""
    with _lock:
        _pinned.clear()
