"""Tensor declarations as this worker knows them: which (name, layout) has which id in the
core. A layout is (dtype, element count, compression); a name used with another layout is
declared again under a name of its own (``_core_name``), so each call stands alone as in
Horovod, and every worker running the same program computes the same names.
"""

from __future__ import annotations

import threading
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
_declared_lock = threading.Lock()


def reset() -> None:
    """Forgets every declaration (a new job starts afresh)."""
    with _declared_lock:
        _declared.clear()
        _first_layout.clear()


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
    it was used with, the name and the layout after that. Every worker running the same
    program computes the same one, so a name may change shape, dtype or compression."""
    with _declared_lock:
        first = _first_layout.setdefault(name, layout)
    if first == layout:
        return name
    dtype, numel, compression = layout
    spec = "" if compression is None else f":{compression[0]}:{compression[1]}:{compression[2]}"
    return f"{name}@{DTYPES[dtype]}x{numel}{spec}"


def declare(
    name: str,
    tensor: torch.Tensor,
    compression: CoreSpec | None = None,
    members: list[int] | None = None,
    home: int | None = None,
) -> int:
    """The id of tensor `name` in this layout (dtype, size, compression), declaring it on
    first use. A name used with another layout gets keys of its own for it: each call
    stands alone, as in Horovod. ``members``: the process set's workers, whose rounds
    alone its keys count (None: every worker); ``home``: the worker that takes its bytes,
    whose machine then keeps its keys."""
    check_dtype(tensor, name)
    layout = (tensor.dtype, tensor.numel(), compression)
    return declare_layouts([(name, layout, members)], together=False, homes=[home])[0]


def declare_layouts(
    specs: list[tuple[str, Layout, list[int] | None]],
    *,
    together: bool = True,
    homes: Sequence[int | None] | None = None,
) -> list[int]:
    """The ids of tensors (name, layout, members), declaring those not yet known.
    ``together``: placed over the servers as one group (BytePS Eq. 1 and 2), which every
    worker must declare alike; otherwise each is placed alone: on the machine of its
    worker in ``homes`` (the worker that takes its bytes), or from its keys, so workers
    may each declare only the tensors they use."""
    if together and homes is not None:
        raise ValueError("tensors placed together have no home of their own")
    with _declared_lock:
        known = [_declared.get(name, {}).get(layout) for name, layout, _ in specs]
    fresh = [i for i, tid in enumerate(known) if tid is None]
    if fresh:
        service = _runtime.current().service
        wanted = []
        for i in fresh:
            name, layout, members = specs[i]
            dtype, numel, compression = layout
            wanted.append((_core_name(name, layout), DTYPES[dtype], numel, compression, members))
        if together:
            ids = service.declare_group(wanted)
        else:
            places = [None] * len(specs) if homes is None else list(homes)
            ids = [
                service.declare(n, d, e, c, members=m, home=places[i])
                for i, (n, d, e, c, m) in zip(fresh, wanted)
            ]
        with _declared_lock:
            for i, tid in zip(fresh, ids):
                name, layout, _ = specs[i]
                _declared.setdefault(name, {})[layout] = tid
                known[i] = tid
    return [tid for tid in known if tid is not None]


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
    return declare_layouts([(n, (w.dtype, w.numel(), c), members) for n, w, c in wires])


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
