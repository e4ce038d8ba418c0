"""Horovod's collectives beyond allreduce and broadcast: allgather, alltoall,
reducescatter, and the grouped forms, each agreed first (``negotiate.py``) and then carried
by the summation servers.

Gathering operations (allgather, alltoall) move each worker's rows as regions of bytes
that one worker pushes and others take (``relay.py``): bit for bit for every dtype, and
each byte crosses the wire only to the servers and to the workers that take it.
Reductions (reducescatter, grouped allreduce) are sums of the tensors themselves, fused
into one buffer per dtype for a group; a reducescatter takes back only its own rows.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Sequence
from typing import Any

import torch

from sumflow.torch import _staging, _work, adasum, negotiate, ops, process_sets, relay
from sumflow.torch.compression import Compression, Compressor
from sumflow.torch.ops import Adasum, Average, ReduceOp, Sum


def _first_dim(tensor: torch.Tensor, what: str) -> int:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor, not {type(tensor).__name__}")
    if tensor.dim() == 0:
        raise ValueError(f"{what}: a scalar has no first dimension to gather or split along")
    return int(tensor.shape[0])


def _request_dtype(tensor: torch.Tensor) -> torch.dtype:
    return tensor.dtype if tensor.dtype in negotiate.DTYPE_CODES else torch.uint8


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> int:
    """Starts gathering every worker's `tensor` along the first dimension (which may
    differ between workers, even be 0); the others must agree. Returns a handle;
    ``synchronize`` gives the gathered tensor, on `tensor`'s device."""
    return grouped_allgather_async([tensor], name, process_set, _single=True)


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = None
) -> torch.Tensor:
    """Every worker's `tensor`, concatenated along the first dimension in rank order.
    Differentiable: the gradient of a worker's input is its rows of the averaged gradient."""
    from sumflow.torch import autograd

    return autograd.allgather(tensor, name, process_set)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: Any = None,
    *,
    _single: bool = False,
) -> int:
    """Starts an allgather of each tensor of `tensors`, agreed once and carried in one
    buffer; ``synchronize`` gives the list of gathered tensors."""
    kind = "allgather" if _single else "grouped_allgather"
    group = process_sets.group_of(process_set, kind)
    full = ops._auto_name(kind, name, group)
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{kind} '{full}': no tensors given")
    firsts = [_first_dim(t, f"{kind} '{full}'") for t in tensors]
    request = negotiate.Request(
        kind=kind,
        name=full,
        dtype=_request_dtype(tensors[0]),
        shape=tuple(tensors[0].shape) if _single else (len(tensors),),
        facts="|".join(f"{t.dtype}{list(t.shape[1:])}{t.device.type}" for t in tensors),
        extra=tuple(firsts),
        any_first_dim=_single,
    )

    def start(rows: list[negotiate.Row]) -> _work.Work:
        counts = [row.extra for row in rows]  # counts[r][i]: rows of tensor i from member r
        outs, regions = relay.gathered(full, tensors, counts, group, _single)

        def finish() -> Any:
            moved = [out.to(t.device) for out, t in zip(outs, tensors, strict=True)]
            return moved[0] if _single else moved

        return relay.relay_work(full, regions, finish)

    return ops.negotiated(request, group, start)


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: Any = None
) -> list[torch.Tensor]:
    """``allgather`` of each tensor, as one operation. Differentiable."""
    from sumflow.torch import autograd

    return autograd.grouped_allgather(list(tensors), name, process_set)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Every worker's picklable `obj`, as a list in rank order."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    base = name or type(obj).__name__
    gathered = synchronize_tensor(
        allgather_async(payload, name=f"object.{base}", process_set=process_set)
    )
    sizes = synchronize_tensor(
        allgather_async(
            torch.tensor([payload.numel()], dtype=torch.int64),
            name=f"object.{base}.sizes",
            process_set=process_set,
        )
    ).tolist()
    out, offset = [], 0
    for n in sizes:
        out.append(pickle.loads(gathered[offset : offset + n].numpy().tobytes()))
        offset += n
    return out


def synchronize_tensor(handle: int) -> torch.Tensor:
    result = ops.synchronize(handle)
    assert isinstance(result, torch.Tensor)
    return result


def _splits_list(tensor: torch.Tensor, splits: Any, size: int, what: str) -> list[int]:
    first = _first_dim(tensor, what)
    if splits is None:
        if first % size:
            raise ValueError(
                f"{what}: the first dimension ({first}) is not divisible by the number of "
                f"workers ({size}); pass splits="
            )
        return [first // size] * size
    if isinstance(splits, torch.Tensor):
        if splits.dtype not in (torch.int32, torch.int64):
            # Horovod raises ValueError here, and scripts catch it as such.
            raise ValueError(f"{what}: splits must hold int32 or int64, not {splits.dtype}")
        values = [int(v) for v in splits.reshape(-1).tolist()]
    else:
        values = [int(v) for v in splits]
    if len(values) != size:
        raise ValueError(f"{what}: {len(values)} splits for {size} workers")
    if any(v < 0 for v in values):
        raise ValueError(f"{what}: splits must not be negative, got {values}")
    if sum(values) != first:
        raise ValueError(
            f"{what}: the splits {values} add up to {sum(values)}, not to the first "
            f"dimension {first}"
        )
    return values


def alltoall_async(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None
) -> int:
    """Starts sending ``splits[j]`` rows of `tensor` (in order) to worker j, and receiving
    every worker's rows for this one; ``synchronize`` gives ``(received, received_splits)``.
    Without splits, the first dimension is divided equally."""
    group = process_sets.group_of(process_set, "alltoall")
    size, rank = group.size, group.rank
    full = ops._auto_name("alltoall", name, group)
    values = _splits_list(tensor, splits, size, f"alltoall '{full}'")
    request = negotiate.Request(
        kind="alltoall",
        name=full,
        dtype=_request_dtype(tensor),
        shape=tuple(tensor.shape),
        facts=f"{tensor.dtype}|{tensor.device.type}",
        extra=tuple(values),
        any_first_dim=True,
    )
    per_row = relay.row_bytes(tensor)

    def start(rows: list[negotiate.Row]) -> _work.Work:
        matrix = [row.extra for row in rows]  # matrix[i][j]: rows from i to j
        received = [matrix[i][rank] for i in range(size)]
        out = torch.empty((sum(received), *tensor.shape[1:]), dtype=tensor.dtype)
        sending, landing = relay.host_bytes(tensor), relay.host_bytes(out)
        sent_at = [sum(matrix[rank][:j]) * per_row for j in range(size)]
        received_at = [sum(received[:i]) * per_row for i in range(size)]
        regions = []
        # Block i -> j is a key of its two workers alone, kept on j's machine: nobody else
        # takes part in it, and its bytes cross the sender's link and no other.
        me = group.ranks[rank]
        for j in range(size):
            block = sending[sent_at[j] : sent_at[j] + matrix[rank][j] * per_row]
            if j == rank:
                landing[received_at[j] : received_at[j] + block.numel()].copy_(block)
            else:
                to = group.ranks[j]
                pair = sorted((me, to))
                regions.append(relay.Region(f"{full}#{rank}>{j}", block, True, pair, to))
        for i in range(size):
            if i != rank:
                block = landing[received_at[i] : received_at[i] + received[i] * per_row]
                pair = sorted((group.ranks[i], me))
                regions.append(relay.Region(f"{full}#{i}>{rank}", block, False, pair, me))

        def finish() -> Any:
            # Horovod gives the received splits on the device of the splits given.
            where = splits.device if isinstance(splits, torch.Tensor) else "cpu"
            return out.to(tensor.device), torch.tensor(received, dtype=torch.int32, device=where)

        return relay.relay_work(full, regions, finish)

    return ops.negotiated(request, group, start)


def alltoall(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None
) -> Any:
    """Scatters `tensor`'s rows to the workers by `splits` and gathers theirs; returns
    the received tensor, and with `splits` given also the received splits. Differentiable."""
    from sumflow.torch import autograd

    out, received = autograd.alltoall(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


def reducescatter_rows(first: int, size: int) -> list[int]:
    """How many rows of the first dimension each worker receives: as even as can be,
    the lower ranks taking one more."""
    base, extra = divmod(first, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: ReduceOp = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    *,
    _single: bool = False,
) -> int:
    """Starts reducing each tensor over the workers and giving each worker its rows of the
    result (``reducescatter_rows``); ``synchronize`` gives the list of slices."""
    kind = "reducescatter" if _single else "grouped_reducescatter"
    group = process_sets.group_of(process_set, kind)
    full = ops._auto_name(kind, name, group)
    tensors = list(tensors)
    if op not in (Sum, Average):
        raise NotImplementedError(f"{kind} '{full}': op={op!r}; reducescatter sums or averages")
    _one_device(f"{kind} '{full}'", tensors)
    for t in tensors:
        _first_dim(t, f"{kind} '{full}'")
    request = negotiate.Request(
        kind=kind,
        name=full,
        dtype=_request_dtype(tensors[0]),
        shape=tuple(tensors[0].shape) if _single else (len(tensors),),
        op=ops._op_code(op),
        facts=ops._facts(tensors[0], prescale_factor, postscale_factor)
        + "|".join(f"{t.dtype}{list(t.shape)}" for t in tensors),
    )

    def start(rows: list[negotiate.Row]) -> _work.Work:
        work = _scattered_sum(full, tensors, op, prescale_factor, postscale_factor, group)
        return work.then(lambda slices: slices[0] if _single else slices)

    return ops.negotiated(request, group, start)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts reducing `tensor` over the workers; ``synchronize`` gives this worker's rows
    of the result (``reducescatter_rows``)."""
    return grouped_reducescatter_async(
        [tensor], name, op, process_set, prescale_factor, postscale_factor, _single=True
    )


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] | Compressor = Compression.none,
    op: ReduceOp = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This worker's rows of `tensor` reduced over the workers. Differentiable."""
    from sumflow.torch import autograd

    return autograd.reducescatter(
        tensor, name, compression, op, process_set, prescale_factor, postscale_factor
    )


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] | Compressor = Compression.none,
    op: ReduceOp = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """``reducescatter`` of each tensor, as one operation. Differentiable."""
    from sumflow.torch import autograd

    return autograd.grouped_reducescatter(
        list(tensors), name, compression, op, process_set, prescale_factor, postscale_factor
    )


def _by_dtype(name: str, tensors: list[torch.Tensor]) -> list[tuple[str, list[int]]]:
    """The indices of `tensors` of each dtype, with the name their sum goes by: `name`
    itself when they share one dtype, else `name.<dtype>`."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    if len(by_dtype) == 1:
        return [(name, next(iter(by_dtype.values())))]
    return [(f"{name}.{d}".replace("torch.", ""), ix) for d, ix in by_dtype.items()]


def _applied(like: torch.Tensor, prescale: float, postscale: float) -> tuple[float, float]:
    """The scaling factors of tensors like `like`, summed through a host copy, as Horovod
    applies them where the tensors live (``ops.applied_factor``)."""
    return (
        ops.applied_factor(prescale, like.dtype, like.is_cuda),
        ops.applied_factor(postscale, like.dtype, like.is_cuda),
    )


def _one_device(what: str, tensors: list[torch.Tensor]) -> None:
    """A grouped operation's tensors share one device, as in Horovod."""
    devices = {str(t.device) for t in tensors}
    if len(devices) > 1:
        raise RuntimeError(
            f"{what}: the tensors of a group must share one device, not {sorted(devices)}"
        )


def _fused_sum(
    name: str,
    tensors: list[torch.Tensor],
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    group: process_sets.Group,
) -> _work.CoreWork:
    """One sum per dtype over copies of `tensors` laid end to end; the work's result is
    the list of reduced tensors, shaped as given."""
    works: list[tuple[list[int], torch.Tensor, _work.CoreWork]] = []
    for label, members in _by_dtype(name, tensors):
        flat = torch.cat([tensors[i].detach().reshape(-1).cpu() for i in members])
        scales = _applied(tensors[members[0]], prescale_factor, postscale_factor)
        work = ops.allreduce_work(label, flat, op, Compression.none, *scales, group)
        works.append((members, flat, work))

    def finish() -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for members, flat, work in works:
            work.finish()
            offset = 0
            for i in members:
                t = tensors[i]
                out[i] = flat.narrow(0, offset, t.numel()).view(t.shape).to(t.device)
                offset += t.numel()
        return [t for t in out if t is not None]

    return _work.CoreWork(
        name,
        [c for _, _, w in works for c in w.cores],
        finish,
        [t for _, _, w in works for t in w.tensors],
        [c for _, _, w in works for c in w.copies],
    )


def _scattered_sum(
    name: str,
    tensors: list[torch.Tensor],
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    group: process_sets.Group,
) -> _work.CoreWork:
    """A reduce-scatter: each tensor reduced over the group, this worker taking back only
    its rows (``reducescatter_rows``). Per dtype, the rows are laid out by the worker that
    takes them, and each worker's share is a sum of its own, kept on that worker's machine:
    every worker pushes every share, and only the share's taker pulls it, from its own
    machine. The work's result is the list of this worker's slices."""
    size, rank = group.size, group.rank
    cores: list[int] = []
    copies: list[_staging.Staged] = []
    declared: list[int] = []
    finishes = []
    for label, members in _by_dtype(name, tensors):
        shares: list[list[torch.Tensor]] = [[] for _ in range(size)]
        for i in members:
            t = tensors[i].detach()
            counts = reducescatter_rows(t.shape[0], size)
            for w, rows in zip(range(size), t.split(counts), strict=True):
                shares[w].append(rows.reshape(-1).cpu())
        scales = _applied(tensors[members[0]], prescale_factor, postscale_factor)
        for w in range(size):
            flat = torch.cat(shares[w])
            if not flat.numel():
                continue
            work = ops.allreduce_work(
                f"{label}#{w}",
                flat,
                op,
                Compression.none,
                *scales,
                group,
                takes=w == rank,
                home=group.ranks[w],
            )
            cores += work.cores
            copies += work.copies
            declared += work.tensors
            if w == rank:
                finishes.append((members, work))

    def finish() -> list[torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        for members, work in finishes:
            flat = work.finish()
            offset = 0
            for i in members:
                t = tensors[i]
                rows = reducescatter_rows(t.shape[0], size)[rank]
                n = rows * math.prod(t.shape[1:])
                out[i] = flat.narrow(0, offset, n).view(rows, *t.shape[1:]).to(t.device)
                offset += n
        return [out.get(i, t.new_empty((0, *t.shape[1:]))) for i, t in enumerate(tensors)]

    return _work.CoreWork(name, cores, finish, declared, copies)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> int:
    """Starts reducing every tensor of `tensors` as one operation, fused into one buffer
    per dtype; ``synchronize`` gives the list of results (new tensors)."""
    return _grouped_allreduce(
        list(tensors), average, name, op, prescale_factor, postscale_factor, process_set, False
    )


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> int:
    """Like ``grouped_allreduce_async``, writing each result into its tensor."""
    return _grouped_allreduce(
        list(tensors), average, name, op, prescale_factor, postscale_factor, process_set, True
    )


def _grouped_allreduce(
    tensors: list[torch.Tensor],
    average: bool | None,
    name: str | None,
    op: ReduceOp | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: Any,
    in_place: bool,
) -> int:
    group = process_sets.group_of(process_set, "grouped_allreduce")
    full = ops._auto_name("grouped_allreduce", name, group)
    reduce_op = ops._op_of(average, op)
    if not tensors:
        raise ValueError(f"grouped_allreduce '{full}': no tensors given")
    _one_device(f"grouped_allreduce '{full}'", tensors)
    for t in tensors:
        if reduce_op is Adasum:
            adasum.check(full, t, group.size, Compression.none)
        else:
            ops._check_reduce_op(full, t, reduce_op)
    request = negotiate.Request(
        kind="grouped_allreduce",
        name=full,
        dtype=_request_dtype(tensors[0]),
        shape=(len(tensors),),
        op=ops._op_code(reduce_op),
        facts=ops._facts(tensors[0], prescale_factor, postscale_factor)
        + "|".join(f"{t.dtype}{list(t.shape)}" for t in tensors),
    )

    def start(rows: list[negotiate.Row]) -> _work.Work:
        scales = (prescale_factor, postscale_factor)
        work = (
            adasum.combined_work(full, tensors, *scales, group, False)
            if reduce_op is Adasum
            else _fused_sum(full, tensors, reduce_op, *scales, group)
        )
        if not in_place:
            return work

        def write_back(reduced: list[torch.Tensor]) -> list[torch.Tensor]:
            with torch.no_grad():
                for t, r in zip(tensors, reduced, strict=True):
                    t.copy_(r)
            return tensors

        return work.then(write_back)

    return ops.negotiated(request, group, start)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] | Compressor = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list[torch.Tensor]:
    """Each tensor reduced over the workers, as one fused operation. Differentiable."""
    from sumflow.torch import autograd

    return autograd.grouped_allreduce(
        list(tensors), average, name, op, prescale_factor, postscale_factor, process_set
    )


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list[torch.Tensor]:
    """Reduces each tensor over the workers in place, as one fused operation."""
    result = ops.synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )
    return list(result)
