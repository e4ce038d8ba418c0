"""Tensor declarations as this worker knows them: which (name, layout) has which id in the
core. A layout is (dtype, element count, compression); a name used with another layout is
declared again under a name of its own (``_core_name``), so each call stands alone as in
Horovod, and every worker running the same program computes the same names.

Declarations come in two kinds. Pinned ones (the declared fast path: ``DistributedOptimizer``,
the DDP hook, ``declare_tensors``, ``push_pull``) live as long as the job. Replacing ones
(what an agreed operation declares: its agreement table, its data, its relay regions) hold
one layout per name at a time: a name used with a new layout retires the previous one (its
keys on the servers, its name at the coordinator) and declares the new one under the name's
next generation, ``<name>~<g>``, so that the new tensor never shares a name with one a
slower worker may still be using. A named tensor reused in the same layout costs nothing:
no retirement, no message. ``release`` retires the tensors of an operation that cannot
recur (an unnamed one) once it is synchronized.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Sequence

import torch

from sumflow.torch import _runtime
from sumflow.torch.compression import Compression, Compressor, CoreSpec, core_spec

#: torch dtype -> the core's dtype name.
DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int32: "i32",
    torch.int64: "i64",
}


#: (dtype, elements, compression): what a tensor's keys hold.
Layout = tuple[torch.dtype, int, CoreSpec | None]

_declared: dict[str, dict[Layout, int]] = {}
_first_layout: dict[str, Layout] = {}
#: The layout of each name declared by the replacing kind (at most one per name).
_replaceable: dict[str, Layout] = {}
#: How many times each name's replaceable layout was replaced: its generation.
_generation: dict[str, int] = {}
#: Every declared id's (name, layout).
_owner: dict[int, tuple[str, Layout]] = {}
_declared_lock = threading.Lock()


def reset() -> None:
    """Forgets every declaration (a new job starts afresh)."""
    with _declared_lock:
        _declared.clear()
        _first_layout.clear()
        _replaceable.clear()
        _generation.clear()
        _owner.clear()
        _told.clear()


def live() -> int:
    """Tensors this worker has declared and not retired."""
    with _declared_lock:
        return len(_owner)


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


def _core_name(name: str, layout: Layout) -> str:
    """The name the core knows a layout of `name` by: the name itself for the first layout
    it was used with, the name and the layout after that, either followed by ``~<g>`` from
    the name's first replacement on. Every worker running the same program computes the
    same one, so a name may change shape, dtype or compression."""
    with _declared_lock:
        first = _first_layout.setdefault(name, layout)
        generation = _generation.get(name, 0)
    suffix = f"~{generation}" if generation else ""
    if first == layout:
        return f"{name}{suffix}"
    dtype, numel, compression = layout
    spec = "" if compression is None else f":{compression[0]}:{compression[1]}:{compression[2]}"
    return f"{name}@{DTYPES[dtype]}x{numel}{spec}{suffix}"


def declare(
    name: str,
    tensor: torch.Tensor,
    compression: CoreSpec | None = None,
    members: list[int] | None = None,
    home: int | None = None,
    *,
    replace: bool = False,
    shape: Sequence[int] | None = None,
) -> int:
    """The id of tensor `name` in this layout (dtype, size, compression), declaring it on
    first use. A name used with another layout gets keys of its own for it: each call
    stands alone, as in Horovod. ``members``: the process set's workers, whose rounds
    alone its keys count (None: every worker); ``home``: the worker that takes its bytes,
    whose machine then keeps its keys. ``replace``: a new layout retires the name's
    previous replaceable one (see the module's doc). ``shape`` (default: the tensor's):
    what the first declaration of the layout tells the coordinator, which refuses workers
    that declare one size in different shapes."""
    check_dtype(tensor, name)
    layout = (tensor.dtype, tensor.numel(), compression)
    if not replace:
        # The common case, a gradient hook's every step: a pinned layout already known.
        # Reading without the lock is safe: a dict read is atomic, and a pinned layout's
        # id never changes.
        tid = _declared.get(name, {}).get(layout)
        if tid is not None and _replaceable.get(name) != layout:
            return tid
    return declare_layouts(
        [(name, layout, members)],
        together=False,
        homes=[home],
        replace=replace,
        shapes=[tuple(tensor.shape) if shape is None else tuple(shape)],
    )[0]


def declare_layouts(
    specs: list[tuple[str, Layout, list[int] | None]],
    *,
    together: bool = True,
    homes: Sequence[int | None] | None = None,
    replace: bool = False,
    shapes: Sequence[tuple[int, ...] | None] | None = None,
) -> list[int]:
    """The ids of tensors (name, layout, members), declaring those not yet known.
    ``together``: placed over the servers as one group (BytePS Eq. 1 and 2), which every
    worker must declare alike; otherwise each is placed alone: on the machine of its
    worker in ``homes`` (the worker that takes its bytes), or from its keys, so workers
    may each declare only the tensors they use. ``replace``: each name holds one
    replaceable layout at a time, a new one retiring the previous (whose operation, under
    Horovod's one-operation-per-name rule, has been synchronized); without it the
    declarations are pinned, never retired."""
    if together and homes is not None:
        raise ValueError("tensors placed together have no home of their own")
    with _declared_lock:
        known = [_declared.get(name, {}).get(layout) for name, layout, _ in specs]
        if not replace:
            # A layout pinned now is never retired, whichever kind declared it first.
            for name, layout, _ in specs:
                if _replaceable.get(name) == layout:
                    del _replaceable[name]
    fresh = [i for i, tid in enumerate(known) if tid is None]
    if fresh:
        service = _runtime.current().service
        if replace:
            _retire_replaced([specs[i][0] for i in fresh])
        wanted = []
        for i in fresh:
            name, layout, members = specs[i]
            dtype, numel, compression = layout
            wanted.append((_core_name(name, layout), DTYPES[dtype], numel, compression, members))
        dims = [None if shapes is None else _dims(shapes[i]) for i in fresh]
        if together:
            ids = service.declare_group(wanted, shapes=dims)
        else:
            places = [None] * len(specs) if homes is None else list(homes)
            ids = [
                service.declare(n, d, e, c, members=m, home=places[i], shape=dims[j])
                for j, (i, (n, d, e, c, m)) in enumerate(zip(fresh, wanted, strict=True))
            ]
        with _declared_lock:
            for i, tid in zip(fresh, ids, strict=True):
                name, layout, _ = specs[i]
                _declared.setdefault(name, {})[layout] = tid
                _owner[tid] = (name, layout)
                if replace:
                    _replaceable[name] = layout
                known[i] = tid
    return [tid for tid in known if tid is not None]


def _dims(shape: tuple[int, ...] | None) -> list[int] | None:
    """A shape as the core takes it: None for a flat (one-dimensional) tensor, whose shape
    says nothing its size does not."""
    return None if shape is None or len(shape) == 1 else list(shape)


def _retire_replaced(names: list[str]) -> None:
    """Retires the replaceable layout of each of `names` that has one, and moves the name
    to its next generation, under which its new layout is declared. Every worker running
    the same program replaces a name's layouts in the same order, so all compute the same
    generations."""
    retiring = []
    with _declared_lock:
        for name in dict.fromkeys(names):
            old = _replaceable.pop(name, None)
            if old is None:
                continue
            _generation[name] = _generation.get(name, 0) + 1
            tid = _declared[name].pop(old)
            del _owner[tid]
            retiring.append((name, tid))
    _retire(retiring)


def release(tids: list[int]) -> None:
    """Retires the tensors `tids` of an operation that cannot recur (an unnamed one), once
    it is synchronized, and forgets their names here. Pinned tensors are left alone."""
    retiring = []
    with _declared_lock:
        for tid in tids:
            owner = _owner.get(tid)
            if owner is None or _replaceable.get(owner[0]) != owner[1]:
                continue
            name, layout = owner
            del _owner[tid]
            del _replaceable[name]
            layouts = _declared[name]
            del layouts[layout]
            if not layouts:
                del _declared[name]
                _first_layout.pop(name, None)
                _generation.pop(name, None)
            retiring.append((name, tid))
    _retire(retiring)


def _retire(retiring: list[tuple[str, int]]) -> None:
    rt = _runtime.running()
    if rt is None:
        return
    for name, tid in retiring:
        try:
            rt.service.retire(tid)
        except ValueError as e:
            # Still in flight (an operation whose wait timed out): its keys stay, and its
            # name at the coordinator; the job goes on with them.
            warnings.warn(f"tensor '{name}' could not be retired: {e}", stacklevel=3)


def declare_group(
    named: list[tuple[str, torch.Tensor]],
    compression: type[Compressor] | Compressor = Compression.none,
    members: list[int] | None = None,
) -> list[int]:
    """Declares tensors together, so their partitions are placed as one group (BytePS
    Eq. 1 and 2 over the whole set), as `compression` will send them; names already
    declared in that layout keep their placement."""
    wires = [(n, w, core_spec(compression, w)) for n, w in _wires(compression, named)]
    for n, w, _ in wires:
        check_dtype(w, n)
    ids = declare_layouts(
        [(n, (w.dtype, w.numel(), c), members) for n, w, c in wires],
        shapes=[tuple(w.shape) for _, w, _ in wires],
    )
    _tell_partition_size(len(wires))
    return ids


#: The derived partition sizes already told (once each per job).
_told: set[str] = set()


def _tell_partition_size(tensors: int) -> None:
    """Says on worker 0, once per choice, which partition size the core derived for a
    group it was not given one for, and why: the one line a user needs to see it."""
    service = _runtime.current().service
    reason = service.schedule().get("partition_reason")
    if reason is None or service.rank != 0 or reason in _told:
        return
    _told.add(reason)
    print(
        f"sumflow: {tensors} tensors declared together, {reason} "
        "(SUMFLOW_PARTITION_BYTES sets a size)",
        file=sys.stderr,
        flush=True,
    )


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
