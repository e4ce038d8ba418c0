"""Collective operations on torch tensors: push_pull (allreduce), broadcast, barrier.

Every operation is asynchronous underneath: ``*_async`` returns a handle at once and
``synchronize(handle)`` waits (with the GIL released) and returns the result. Tensors are
identified by name across workers; unnamed calls get ``<op>.noname.<n>``, which matches
across workers as long as they make the same calls in the same order, as in Horovod.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sumflow.torch import (
    _runtime,
    _staging,
    _work,
    adasum,
    declarations,
    negotiate,
    process_sets,
    relay,
    timeline,
)
from sumflow.torch.compression import Compression, Compressor, bind, core_spec
from sumflow.torch.declarations import DTYPES as DTYPES
from sumflow.torch.declarations import check_dtype, declare
from sumflow.torch.declarations import declare_group as declare_group
from sumflow.torch.process_sets import Group


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

#: Unnamed calls made so far, per kind and process set: the next call's number.
_unnamed: dict[str, int] = {}
#: Names given to unnamed calls and not yet issued: their tensors are retired once the
#: operation is synchronized, since the names never recur.
_unnamed_fresh: set[str] = set()
_unnamed_lock = threading.Lock()


def _reset() -> None:
    """Forgets declarations and handles (at shutdown: a new job starts afresh)."""
    declarations.reset()
    with _unnamed_lock:
        _unnamed.clear()
        _unnamed_fresh.clear()
    _work.reset()


def _auto_name(kind: str, name: str | None, group: Group | None = None) -> str:
    """The tensor name of an operation: its kind, its process set's tag, and the user's
    name or, for unnamed calls, a counter per kind and set (the same on every member as
    long as they make the same calls in the same order)."""
    prefix = f"{kind}.{group.tag if group is not None else ''}"
    if name is not None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tensor name must be a non-empty string, not {name!r}")
        return f"{prefix}{name}"
    with _unnamed_lock:
        n = _unnamed.get(prefix, 0)
        _unnamed[prefix] = n + 1
        full = f"{prefix}noname.{n}"
        _unnamed_fresh.add(full)
        return full


def _take_unnamed(name: str) -> bool:
    """Whether `name` was given to an unnamed call (once: the operation is issued now)."""
    with _unnamed_lock:
        if name in _unnamed_fresh:
            _unnamed_fresh.discard(name)
            return True
        return False


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


#: Integer dtypes the core does not sum, carried as int32 (exact: their sums fit).
_INT_CARRIERS = {torch.uint8: torch.int32, torch.int8: torch.int32, torch.int16: torch.int32}


def sum_work(
    name: str,
    output: torch.Tensor,
    op: ReduceOp,
    priority: int,
    compression: type[Compressor] | Compressor,
    prescale_factor: float,
    postscale_factor: float,
    group: Group,
    takes: bool = True,
    home: int | None = None,
    *,
    replace: bool = False,
) -> _work.CoreWork:
    """Reduces `output` across the group's workers in place, after compression: Sum or
    Average, or Min, Max or Product by the servers' kernels (uncompressed only); the
    work's result is `output`. Integers are averaged as Horovod does: the sum is divided
    and truncated toward zero. ``takes`` False: this worker only contributes, and
    `output` is left as it was (a reduce-scatter's rows of another worker); ``home``: the
    worker that takes it, on whose machine its keys are then kept. ``replace``: declared
    as an agreed operation's data, a new layout retiring the name's previous one
    (``declarations``); otherwise pinned (the declared fast path)."""
    check_dtype(output, name)
    if output.requires_grad and output.is_leaf:
        raise ValueError(f"tensor '{name}' is a leaf that requires grad; pass tensor.data")
    on_servers = _SERVER_OPS.get(op)
    if on_servers is not None and compression is not Compression.none:
        raise ValueError(f"'{name}': {op!r} reduces uncompressed tensors only")
    rt = _runtime.current()
    compressor = bind(compression, name)
    if prescale_factor != 1.0:
        prescale_factor = applied_factor(prescale_factor, output.dtype, output.is_cuda)
    if postscale_factor != 1.0:
        postscale_factor = applied_factor(postscale_factor, output.dtype, output.is_cuda)
    wire, ctx = compressor.compress(output)
    if prescale_factor != 1.0:
        _scale(wire, prescale_factor)
    host, source = _staging.to_host(name, wire)
    tid = declare(
        name,
        host,
        core_spec(compressor, wire),
        group.members,
        home,
        replace=replace,
        shape=wire.shape,
    )
    #: Whether the core divides the sum (floats); integers are divided here, truncated.
    float_average = op is Average and wire.is_floating_point()
    job = _staging.Sum(tid, host, priority, float_average, on_servers, None if takes else [])
    if source is None:
        cores, copies = job.issue(rt.service), []
    else:
        # The sum is issued once the copy to host memory is complete: backward goes on.
        cores, copies = [], [_staging.after_copy(name, source, job)]

    def finish() -> torch.Tensor:
        if host is not wire:
            _staging.copy_back(host, wire)
        result = compressor.decompress(wire, ctx)
        if result is not output:
            output.copy_(result)
        post = (
            postscale_factor / group.size
            if op is Average and not float_average
            else postscale_factor
        )
        if post != 1.0:
            _scale(output, post)
        return output

    return _work.CoreWork(name, cores, finish, [tid], copies)


#: Reductions other than sums, done by the servers' kernels.
_SERVER_OPS = {Min: "min", Max: "max", Product: "product"}


def applied_factor(factor: float, dtype: torch.dtype, on_gpu: bool) -> float:
    """A scaling factor as Horovod applies it, so that results match to the bit: a GPU
    scales a 16-bit float tensor by the factor rounded to that type; the CPU (and every
    other dtype) by the factor in at least float32 precision."""
    if on_gpu and dtype in (torch.float16, torch.bfloat16) and factor != 1.0:
        return float(torch.tensor(factor, dtype=dtype))
    return factor


def _scale(tensor: torch.Tensor, factor: float) -> None:
    """Multiplies in place; integers as Horovod scales them (in float64, truncated)."""
    with torch.no_grad():
        if tensor.is_floating_point():
            tensor.mul_(factor)
        else:
            tensor.copy_(tensor.double().mul_(factor).trunc_())


def issue_declared(
    name: str,
    output: torch.Tensor,
    op: ReduceOp,
    priority: int,
    compression: type[Compressor] | Compressor,
    prescale_factor: float,
    postscale_factor: float,
    group: Group | None = None,
) -> int:
    """A sum of a tensor whose layout every worker (of `group`) already agrees on (a
    declared model's gradients): no negotiation, the fast path. Returns a handle."""
    if op not in (Average, Sum):
        raise NotImplementedError(f"op={op!r}: gradients are summed or averaged")
    return _register_declared(
        name,
        lambda: sum_work(
            name,
            output,
            op,
            priority,
            compression,
            prescale_factor,
            postscale_factor,
            group if group is not None else process_sets.group_of(None, name),
        ),
    )


def _register_declared(name: str, make: Callable[[], _work.CoreWork]) -> int:
    """A handle for the work `make` issues, a declared sum, whose one timeline phase is
    its data stage (agreed in advance, it has no negotiation)."""
    traced = timeline.running()
    if traced:
        timeline.phase(name, "ALLREDUCE")
    try:
        work = make()
    except BaseException:
        if traced:
            timeline.phase(name, None)
        raise
    if traced:
        _ends_phase(name, work)
    return _work.register(work)


class PreparedSum:
    """A declared sum of the same memory every step (a span of DistributedOptimizer's
    gradient pool), sent uncompressed and unscaled: what ``issue_declared`` works out on
    every call (checks, host buffer, declaration, the staging's arguments) worked out
    once, so that a gradient hook that sends makes one call into the core and registers
    the work (``issue``). Valid in the runtime generation it was prepared in."""

    __slots__ = ("_copy", "_job", "_service", "host", "name", "output", "post", "tensor_id")

    def __init__(
        self,
        name: str,
        output: torch.Tensor,
        op: ReduceOp,
        priority: int,
        postscale_factor: float,
        group: Group,
    ) -> None:
        check_dtype(output, name)
        if output.requires_grad and output.is_leaf:
            raise ValueError(f"tensor '{name}' is a leaf that requires grad; pass tensor.data")
        self.name = name
        self.output = output
        host, source = _staging.to_host(name, output)
        self.host = host
        self.tensor_id = declare(name, host, None, group.members, shape=output.shape)
        float_average = op is Average and output.is_floating_point()
        post = applied_factor(postscale_factor, output.dtype, output.is_cuda)
        #: What the result is scaled by once summed (integers are averaged here).
        self.post = post / group.size if op is Average and not float_average else post
        self._job = _staging.Sum(self.tensor_id, host, priority, float_average, None, None)
        self._copy = None if source is None else _staging.CopyThenSum(name, source, self._job)
        self._service = _runtime.current().service

    def issue(self) -> int:
        """Starts this step's sum of the tensor's current values; returns its handle."""
        if timeline.running():
            return _register_declared(self.name, self._start)
        return _work.register(self._start())

    def _start(self) -> _work.CoreWork:
        if self._copy is None:
            cores, copies = self._job.issue(self._service), []
        else:
            cores, copies = [], [self._copy.start()]
        return _work.CoreWork(self.name, cores, self._finish, [self.tensor_id], copies)

    def _finish(self) -> torch.Tensor:
        output = self.output
        if self.host is not output:
            _staging.copy_back(self.host, output)
        if self.post != 1.0:
            _scale(output, self.post)
        return output


def prepare_declared(
    name: str,
    output: torch.Tensor,
    op: ReduceOp,
    priority: int,
    compression: type[Compressor] | Compressor,
    prescale_factor: float,
    postscale_factor: float,
    group: Group,
) -> PreparedSum | None:
    """``issue_declared``'s sum of `output` prepared for every step (``PreparedSum``);
    None where it cannot be: compressed or scaled before it is sent (the wire tensor is
    new every step), or not contiguous (summed through a copy made every step)."""
    if op not in (Average, Sum):
        raise NotImplementedError(f"op={op!r}: gradients are summed or averaged")
    if compression is not Compression.none or prescale_factor != 1.0:
        return None
    if not output.is_contiguous():
        return None
    return PreparedSum(name, output, op, priority, postscale_factor, group)


def _ends_phase(name: str, work: _work.Work) -> None:
    """Makes taking `work`'s result (or its failure) end the timeline phase of `name`."""
    if isinstance(work, _work.CoreWork):
        inner = work.finish

        def finish() -> Any:
            try:
                return inner()
            finally:
                timeline.phase(name, None)

        work.finish = finish


def negotiated(
    request: negotiate.Request,
    group: Group,
    start: Callable[[list[negotiate.Row]], _work.Work],
) -> int:
    """Issues an operation that starts with an agreement (``negotiate.py``) among the
    group's workers: returns its handle at once; ``start`` gets every member's row, in
    member order, and issues the data stage."""
    _work.check_not_in_flight(request.name)
    transient = _take_unnamed(request.name)
    rt = _runtime.current()
    width = negotiate.WIDTH + len(request.extra)
    table = negotiate.encode(request, group.rank, group.size, width)
    # The phase begins before the agreement's push, so that it holds every event it causes.
    timeline.phase(request.name, f"NEGOTIATE_{request.kind.upper()}")
    try:
        tid = declare(f"agree.{request.name}", table, None, group.members, replace=True)
        core = rt.service.push_pull(tid, table, table.data_ptr(), table.numel() * 8, 0, False)
    except BaseException:
        timeline.phase(request.name, None)
        raise

    def begin() -> _work.Work:
        try:
            rows = negotiate.check(request, negotiate.decode(table, group.ranks), group.ranks)
        except BaseException:
            timeline.phase(request.name, None)
            raise
        timeline.phase(request.name, request.kind.upper())
        try:
            work = start(rows)
        except BaseException:
            timeline.phase(request.name, None)
            raise
        _ends_phase(request.name, work)
        return work

    return _work.register(_work.NegotiatedWork(request.name, core, begin, tid, transient))


def _op_code(op: ReduceOp) -> int:
    return (Average, Sum, Adasum, Min, Max, Product).index(op)


def poll(handle: int) -> bool:
    """True once the operation behind `handle` has finished (then ``synchronize`` returns
    at once); raises the operation's error if it failed."""
    return _work.poll(handle)


def synchronize(handle: int) -> Any:
    """Waits for the operation behind `handle` and returns its result (a tensor; for
    ``alltoall`` the tensor and the received splits; for grouped operations a list).

    Raises ``SumflowTimeoutError`` after the job's timeout (``SUMFLOW_TIMEOUT``, default
    300 s), ``NodeFailedError`` naming a failed peer, ``HorovodInternalError`` when the
    workers disagreed on the operation (the job goes on).
    """
    return _work.wait(handle)


def _op_of(average: bool | None, op: ReduceOp | None) -> ReduceOp:
    if average is not None and op is not None:
        raise ValueError("give either average= (deprecated) or op=, not both")
    if op is not None:
        if not isinstance(op, ReduceOp):
            raise TypeError(
                f"op must be sumflow.torch.Sum, Average, Min, Max or Product, not {op!r}"
            )
        return op
    if average is not None:
        return Average if average else Sum
    return Average


def _facts(tensor: torch.Tensor, *values: float, extra: str = "") -> str:
    return f"{tensor.device.type}|{negotiate.pack_floats(*values)}|{extra}"


def allreduce_work(
    name: str,
    output: torch.Tensor,
    op: ReduceOp,
    compression: type[Compressor] | Compressor,
    prescale_factor: float,
    postscale_factor: float,
    group: Group,
    priority: int = 0,
    takes: bool = True,
    home: int | None = None,
) -> _work.CoreWork:
    """The data stage of an agreed allreduce of `output` over the group, in place."""
    carrier = _INT_CARRIERS.get(output.dtype)
    scales = (prescale_factor, postscale_factor)
    if carrier is None:
        return sum_work(
            name, output, op, priority, compression, *scales, group, takes, home, replace=True
        )

    def narrow(wide_result: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            output.copy_(wide_result)
        return output

    wide = output.to(carrier)
    work = sum_work(
        name, wide, op, priority, compression, *scales, group, takes, home, replace=True
    )
    return work.then(narrow)


def _check_reduce_op(name: str, tensor: torch.Tensor, op: ReduceOp) -> None:
    """Refuses a tensor the servers cannot reduce (Adasum is checked by ``adasum``)."""
    if tensor.dtype not in DTYPES and tensor.dtype not in _INT_CARRIERS:
        raise TypeError(
            f"'{name}': sumflow reduces float16, bfloat16, float32, float64, uint8, int8, "
            f"int16, int32 and int64 tensors, not {tensor.dtype}"
        )


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
    """Starts averaging (or summing, or Min/Max/Product) `tensor` across workers in place;
    returns a handle for ``poll`` / ``synchronize``. Lower ``priority`` is sent first.
    Workers that disagree on the operation (shape, dtype, op, scaling) all get a
    ``HorovodInternalError`` for it, and the job goes on."""
    group = process_sets.group_of(process_set, "allreduce")
    full = _auto_name("allreduce", name, group)
    reduce_op = _op_of(average, op)
    if reduce_op is Adasum:
        adasum.check(full, tensor, group.size, compression)
    else:
        _check_reduce_op(full, tensor, reduce_op)
    if tensor.requires_grad and tensor.is_leaf:
        raise ValueError(f"tensor '{full}' is a leaf that requires grad; pass tensor.data")
    comp_name = getattr(compression, "__name__", type(compression).__name__)
    request = negotiate.Request(
        kind="allreduce",
        name=full,
        dtype=tensor.dtype,
        shape=tuple(tensor.shape),
        op=_op_code(reduce_op),
        facts=_facts(tensor, prescale_factor, postscale_factor, extra=comp_name),
    )
    if reduce_op is Adasum:
        return adasum.allreduce_async_(
            tensor, full, group, prescale_factor, postscale_factor, request
        )
    # The data stage starts on the negotiation thread, after the work queued so far on
    # this thread's stream (which produces `tensor`).
    stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None
    return negotiated(
        request,
        group,
        lambda rows: _staging.on_stream(
            stream,
            lambda: allreduce_work(
                full,
                tensor,
                reduce_op,
                compression,
                prescale_factor,
                postscale_factor,
                group,
                priority,
            ),
        ),
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
    return synchronize(  # type: ignore[no-any-return]
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
    across workers; returns a handle. Lower ``priority`` is sent first. Like BytePS, no
    agreement step: every worker must push the same name with the same shape and dtype
    (the declaration is checked, a mismatch is ``DeclarationMismatchError``)."""
    del version  # BytePS's argument; sumflow counts rounds itself.
    full = _auto_name("push_pull", name)
    # The declared fast path: its tensors are pinned, named or not.
    _take_unnamed(full)
    _work.check_not_in_flight(full)
    return issue_declared(
        full, tensor, Average if average else Sum, priority, Compression.none, 1.0, 1.0
    )


def push_pull(
    tensor: torch.Tensor,
    average: bool = True,
    name: str | None = None,
    version: int = 0,
    priority: int = 0,
) -> torch.Tensor:
    """BytePS's name: sums or averages `tensor` in place across workers and returns it."""
    return synchronize(push_pull_async(tensor, average, name, version, priority))  # type: ignore[no-any-return]


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> int:
    """Starts overwriting `tensor` with root_rank's on every worker; returns a handle.
    Every dtype is carried bit for bit: the root pushes its bytes once, the others take
    them (``relay.py``)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"broadcast needs a torch.Tensor, not {type(tensor).__name__}")
    group = process_sets.group_of(process_set, "broadcast")
    rank = _runtime.current().service.rank
    full = _auto_name("broadcast", name, group)
    if not isinstance(root_rank, int) or root_rank not in group.ranks:
        if group.members is not None:
            raise ValueError(
                f"broadcast '{full}': root_rank {root_rank} is not a member of the process "
                f"set {group.ranks}"
            )
        size = len(group.ranks)
        raise ValueError(
            f"broadcast '{full}': root_rank {root_rank} is not a worker rank (0 to {size - 1})"
        )
    request = negotiate.Request(
        kind="broadcast",
        name=full,
        dtype=tensor.dtype if tensor.dtype in negotiate.DTYPE_CODES else torch.uint8,
        shape=tuple(tensor.shape),
        root=root_rank,
        facts=_facts(tensor, extra=str(tensor.dtype)),
    )

    def start(rows: list[negotiate.Row]) -> _work.Work:
        landing = relay.host_bytes(tensor)
        region = relay.Region(full, landing, rank == root_rank, group.members)

        def finish() -> torch.Tensor:
            if rank != root_rank and landing.data_ptr() != tensor.data_ptr():
                with torch.no_grad():
                    tensor.copy_(landing.view(tensor.dtype).reshape(tensor.shape))
            return tensor

        return relay.relay_work(full, [region], finish)

    return negotiated(request, group, start)


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> int:
    """Starts broadcasting root_rank's `tensor` into a new tensor (``synchronize``
    returns it); `tensor` itself is left as it is."""
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> torch.Tensor:
    """Overwrites `tensor` with root_rank's on every worker, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None
) -> Any:
    """root_rank's `obj` on every worker (pickled with torch.save, so tensors inside
    arrive on the devices they were saved from)."""
    rt = _runtime.current()
    base = name or type(obj).__name__
    if rt.service.rank == root_rank:
        buf = io.BytesIO()
        torch.save(obj, buf)
        payload = buf.getvalue()
    else:
        payload = b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    broadcast_(length, root_rank, name=f"object.{base}.length", process_set=process_set)
    data = torch.zeros(int(length.item()), dtype=torch.uint8)
    if payload:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    broadcast_(data, root_rank, name=f"object.{base}.data", process_set=process_set)
    if rt.service.rank == root_rank:
        return obj
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)


def join(device: int = -1) -> int:
    """Horovod's ``join()``: this worker has finished its data. Until every worker has
    joined, the others' allreduces go on with this worker counting as zeros (Average still
    divides by the number of workers), and their gathering operations (allgather,
    broadcast, alltoall, reducescatter) raise ``HorovodInternalError``. Blocks until every
    worker has joined and returns the rank of the worker that joined last, the same on
    every worker; then every operation works as before. Operations of this worker still in
    flight are waited for first. ``device`` plays no part (tensors meet in host memory)."""
    del device
    rt = _runtime.current()
    _work.quiesce(rt.timeout)
    last = int(rt.service.join(rt.timeout))
    _agree_unnamed()
    return last


def _agree_unnamed() -> None:
    """Sets every unnamed-call counter to the highest any worker has reached. A worker
    that joined made none of the calls the others made meanwhile (their gathers failed,
    their sums went on without it), so its counters lag and its next unnamed call would
    not meet theirs; ``join()`` is the one point every worker passes, so they agree
    there."""
    from sumflow.torch import collectives

    with _unnamed_lock:
        mine = dict(_unnamed)
    for theirs in collectives.allgather_object(mine, name="join.unnamed"):
        with _unnamed_lock:
            for prefix, n in theirs.items():
                _unnamed[prefix] = max(_unnamed.get(prefix, 0), n)


def barrier(process_set: Any = None) -> None:
    """Waits until every worker (or every member of `process_set`) reaches the barrier,
    at most the job's timeout. A set's barrier is an agreed sum among its members."""
    group = process_sets.group_of(process_set, "barrier")
    if group.members is None:
        rt = _runtime.current()
        rt.service.barrier(rt.timeout)
        return
    synchronize(allreduce_async_(torch.zeros(1), name="barrier", op=Sum, process_set=process_set))
