"""Collective operations on torch tensors: push_pull (allreduce), broadcast, barrier.

Every operation is asynchronous underneath: ``*_async`` returns a handle at once and
``synchronize(handle)`` waits (with the GIL released) and returns the result. Tensors are
identified by name across workers; unnamed calls get ``<op>.noname.<n>``, which matches
across workers as long as they make the same calls in the same order, as in Horovod.
"""

from __future__ import annotations

import io
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sumflow.torch import _runtime, _staging
from sumflow.torch.compression import Compression, Compressor, CoreSpec, bind, core_spec


class ReduceOp:
    """A reduction; compare with ``Average``, ``Sum`` and the others by identity."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"sumflow.torch.{self.name}"


Average = ReduceOp("Average")
Sum = ReduceOp("Sum")
Adasum = ReduceOp("Adasum")
Min = ReduceOp("Min")
Max = ReduceOp("Max")
Product = ReduceOp("Product")

#: torch dtype -> the core's dtype name.
DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int32: "i32",
    torch.int64: "i64",
}


@dataclass
class _Pending:
    core: int
    output: torch.Tensor
    finish: Callable[[], None]


_pending: dict[int, _Pending] = {}
_pending_lock = threading.Lock()
_next_handle = itertools.count(1)
_declared: dict[str, tuple[int, torch.dtype, int, CoreSpec | None]] = {}
_declared_lock = threading.Lock()
_unnamed: dict[str, itertools.count[int]] = {}


def _reset() -> None:
    """Forgets declarations and handles (at shutdown: a new job starts afresh)."""
    with _declared_lock:
        _declared.clear()
        _unnamed.clear()
    with _pending_lock:
        _pending.clear()


def _auto_name(kind: str, name: str | None) -> str:
    if name is not None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tensor name must be a non-empty string, not {name!r}")
        return f"{kind}.{name}"
    with _declared_lock:
        counter = _unnamed.setdefault(kind, itertools.count())
        return f"{kind}.noname.{next(counter)}"


def check_dtype(tensor: torch.Tensor, what: str) -> str:
    """The core dtype name of `tensor`, or a TypeError saying what to do instead."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor, not {type(tensor).__name__}")
    try:
        return DTYPES[tensor.dtype]
    except KeyError:
        raise TypeError(
            f"{what}: sumflow sums float32, float16, bfloat16, float64, int32 and int64 "
            f"tensors, not {tensor.dtype}; convert it first (e.g. .to(torch.int32))"
        ) from None


def declare(name: str, tensor: torch.Tensor, compression: CoreSpec | None = None) -> int:
    """The id of tensor `name`, declaring it on first use, with how the core compresses it
    (``None``: not at all). Reusing a name for a tensor of another dtype, size or
    compression is an error, on this worker as across workers."""
    dtype = check_dtype(tensor, name)
    numel = tensor.numel()
    with _declared_lock:
        known = _declared.get(name)
    if known is not None:
        tid, kdtype, knumel, kcompression = known
        if (kdtype, knumel, kcompression) != (tensor.dtype, numel, compression):
            raise ValueError(
                f"tensor '{name}' was first used as {knumel} x {kdtype} (compression "
                f"{kcompression}) and now as {numel} x {tensor.dtype} (compression "
                f"{compression}); give tensors of different shapes different names"
            )
        return tid
    tid = _runtime.current().service.declare(name, dtype, numel, compression)
    with _declared_lock:
        _declared[name] = (tid, tensor.dtype, numel, compression)
    return tid


def declare_group(
    named: list[tuple[str, torch.Tensor]],
    compression: type[Compressor] | Compressor = Compression.none,
) -> list[int]:
    """Declares tensors together, so their partitions are placed as one group (BytePS
    Eq. 1 and 2 over the whole set), as `compression` will send them; names already
    declared keep their placement."""
    wires = [(n, w, core_spec(compression, w)) for n, w in _wires(compression, named)]
    with _declared_lock:
        fresh = [(n, w, c) for n, w, c in wires if n not in _declared]
    if fresh:
        specs = [(n, check_dtype(w, n), w.numel(), c) for n, w, c in fresh]
        ids = _runtime.current().service.declare_group(specs)
        with _declared_lock:
            for (n, w, c), tid in zip(fresh, ids):
                _declared[n] = (tid, w.dtype, w.numel(), c)
    return [declare(n, w, c) for n, w, c in wires]


def _wires(
    compression: type[Compressor] | Compressor, named: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """What `compression` sends for each tensor (their data never matters: they may be on
    the meta device). The compressor unbound, so no per-tensor state moves; a tensor it
    cannot compress off its data is left out, to be declared when first sent."""
    out = []
    for name, tensor in named:
        try:
            wire, _ = compression.compress(tensor)
        except (RuntimeError, NotImplementedError):
            continue
        out.append((name, wire))
    return out


def declare_tensors(named: Sequence[tuple[str, torch.Tensor]], *, api: str = "allreduce") -> None:
    """Declares tensors you will sum under these names with ``allreduce*`` (``api=
    "allreduce"``) or ``push_pull*`` (``api="push_pull"``), all at once, so their
    partitions are placed over the summation servers together by BytePS's Eq. 1 and 2, as
    ``DistributedOptimizer`` does for a model. Tensors first seen by a sum one at a time
    are placed one at a time, which balances the servers less well. Every worker must
    declare the same tensors; names already declared keep their placement."""
    if api not in ("allreduce", "push_pull"):
        raise ValueError(f"api must be 'allreduce' or 'push_pull', not {api!r}")
    declare_group([(_auto_name(api, name), tensor) for name, tensor in named])


def _issue(
    name: str,
    output: torch.Tensor,
    op: ReduceOp,
    priority: int,
    compression: type[Compressor] | Compressor,
    prescale_factor: float,
    postscale_factor: float,
    deliver_to: torch.Tensor | None = None,
) -> int:
    """Sums `output` across workers in place (after compression); returns a handle.
    With `deliver_to`, the result is also copied there and that is what ``synchronize``
    returns."""
    if op not in (Average, Sum):
        raise NotImplementedError(
            f"op={op!r} is not supported by sumflow; use sumflow.torch.Average or Sum "
            "(Adasum, Min, Max and Product need an all-to-all exchange sumflow does not do)"
        )
    check_dtype(output, name)
    if op is Average and not output.is_floating_point():
        raise ValueError(
            f"tensor '{name}' holds {output.dtype}: averaging integers would truncate; "
            "use op=sumflow.torch.Sum"
        )
    if output.requires_grad and output.is_leaf:
        raise ValueError(f"tensor '{name}' is a leaf that requires grad; pass tensor.data")
    rt = _runtime.current()
    compressor = bind(compression, name)
    wire, ctx = compressor.compress(output)
    if prescale_factor != 1.0:
        wire.mul_(prescale_factor)
    host = _staging.to_host(name, wire)
    tid = declare(name, host, core_spec(compressor, wire))
    core = rt.service.push_pull(
        tid,
        host,
        host.data_ptr(),
        host.numel() * host.element_size(),
        priority,
        op is Average,
    )

    def finish() -> None:
        if host is not wire:
            _staging.copy_back(host, wire)
        result = compressor.decompress(wire, ctx)
        if result is not output:
            output.copy_(result)
        if postscale_factor != 1.0:
            output.mul_(postscale_factor)
        if deliver_to is not None:
            with torch.no_grad():
                deliver_to.copy_(output)

    handle = next(_next_handle)
    with _pending_lock:
        _pending[handle] = _Pending(core, output if deliver_to is None else deliver_to, finish)
    return handle


def _take(handle: int) -> _Pending:
    with _pending_lock:
        pending = _pending.pop(handle, None)
    if pending is None:
        raise ValueError(f"unknown handle {handle}: never issued, or already synchronized")
    return pending


def poll(handle: int) -> bool:
    """True once the operation behind `handle` has finished (then ``synchronize`` returns
    at once); raises the operation's error if it failed."""
    with _pending_lock:
        pending = _pending.get(handle)
    if pending is None:
        raise ValueError(f"unknown handle {handle}: never issued, or already synchronized")
    return _runtime.current().service.poll(pending.core)


def synchronize(handle: int) -> torch.Tensor:
    """Waits for the operation behind `handle` and returns its result tensor.

    Raises ``SumflowTimeoutError`` after the job's timeout (``SUMFLOW_TIMEOUT``, default
    300 s), ``NodeFailedError`` naming a failed peer, ``DeclarationMismatchError`` naming a
    tensor that workers declared differently.
    """
    pending = _take(handle)
    rt = _runtime.current()
    rt.service.wait(pending.core, rt.timeout)
    pending.finish()
    return pending.output


def _op_of(average: bool | None, op: ReduceOp | None) -> ReduceOp:
    if average is not None and op is not None:
        raise ValueError("give either average= (deprecated) or op=, not both")
    if op is not None:
        return op
    if average is not None:
        return Average if average else Sum
    return Average


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
    *,
    compression: type[Compressor] | Compressor = Compression.none,
    priority: int = 0,
) -> int:
    """Starts averaging (or summing) `tensor` across workers in place; returns a handle
    for ``poll`` / ``synchronize``. Lower ``priority`` is sent first."""
    _no_process_sets(process_set)
    return _issue(
        _auto_name("allreduce", name),
        tensor,
        _op_of(average, op),
        priority,
        compression,
        prescale_factor,
        postscale_factor,
    )


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
    *,
    compression: type[Compressor] | Compressor = Compression.none,
    priority: int = 0,
) -> int:
    """Like ``allreduce_async_``, into a new tensor (``synchronize`` returns it)."""
    output = tensor.detach().clone(memory_format=torch.contiguous_format)
    return allreduce_async_(
        output,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        compression=compression,
        priority=priority,
    )


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
    """The average (or sum, ``op=Sum``) of `tensor` over all workers, as a new tensor.

    Unlike Horovod's, it does not propagate gradients through the reduction.
    """
    handle = allreduce_async(
        tensor,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        compression=compression,
    )
    return synchronize(handle)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """Averages (or sums) `tensor` over all workers in place and returns it."""
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def push_pull_async(
    tensor: torch.Tensor,
    average: bool = True,
    name: str | None = None,
    version: int = 0,
    priority: int = 0,
) -> int:
    """BytePS's name: starts summing (``average=False``) or averaging `tensor` in place
    across workers; returns a handle. Lower ``priority`` is sent first."""
    del version  # BytePS's argument; sumflow counts rounds itself.
    return _issue(
        _auto_name("push_pull", name),
        tensor,
        Average if average else Sum,
        priority,
        Compression.none,
        1.0,
        1.0,
    )


def push_pull(
    tensor: torch.Tensor,
    average: bool = True,
    name: str | None = None,
    version: int = 0,
    priority: int = 0,
) -> torch.Tensor:
    """BytePS's name: sums or averages `tensor` in place across workers and returns it."""
    return synchronize(push_pull_async(tensor, average, name, version, priority))


_BROADCAST_CARRIER = {
    torch.bool: torch.int32,
    torch.uint8: torch.int32,
    torch.int8: torch.int32,
    torch.int16: torch.int32,
}


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """Starts overwriting `tensor` with root_rank's on every worker; returns a handle.

    Implemented as a sum in which every worker but the root contributes zeros, exact in
    every dtype.
    """
    rt = _runtime.current()
    size = rt.service.size
    if not 0 <= root_rank < size:
        raise ValueError(f"root_rank {root_rank} is not a worker rank (0 to {size - 1})")
    full_name = _auto_name("broadcast", name)
    carrier_dtype = _BROADCAST_CARRIER.get(tensor.dtype)
    if carrier_dtype is None and tensor.dtype not in DTYPES:
        raise TypeError(f"broadcast of '{full_name}': unsupported dtype {tensor.dtype}")
    carrier = tensor.detach().to(
        carrier_dtype or tensor.dtype, memory_format=torch.contiguous_format
    )
    if carrier is tensor or carrier.data_ptr() == tensor.data_ptr():
        carrier = carrier.clone()
    if rt.service.rank != root_rank:
        carrier.zero_()
    return _issue(full_name, carrier, Sum, 0, Compression.none, 1.0, 1.0, deliver_to=tensor)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Overwrites `tensor` with root_rank's on every worker, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """root_rank's `tensor`, as a new tensor on every worker."""
    out = tensor.detach().clone()
    return broadcast_(out, root_rank, name)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """root_rank's `obj` on every worker (pickled with torch.save, so tensors inside
    arrive on the devices they were saved from)."""
    rt = _runtime.current()
    base = name or "object"
    if rt.service.rank == root_rank:
        buf = io.BytesIO()
        torch.save(obj, buf)
        payload = buf.getvalue()
    else:
        payload = b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    broadcast_(length, root_rank, name=f"{base}.length")
    n = int(length.item())
    padded = (n + 3) // 4 * 4
    data = torch.zeros(padded, dtype=torch.uint8)
    if payload:
        data[:n] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    words = data.view(torch.int32)
    broadcast_(words, root_rank, name=f"{base}.data.{padded}")
    if rt.service.rank == root_rank:
        return obj
    return torch.load(io.BytesIO(words.view(torch.uint8)[:n].numpy().tobytes()), weights_only=False)


def barrier() -> None:
    """Waits until every worker reaches the barrier (at most the job's timeout)."""
    rt = _runtime.current()
    rt.service.barrier(rt.timeout)


def _no_process_sets(process_set: Any) -> None:
    if process_set is not None:
        raise NotImplementedError(
            "process sets are not supported by sumflow: every operation spans all workers; "
            "start a separate job for a subset of workers"
        )
