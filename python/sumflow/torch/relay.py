"""Bytes that one worker holds and others take: the data stage of allgather, alltoall and
broadcast.

Each region of bytes is a tensor of its own in the core. The worker holding the region
pushes it; the workers taking it pull it; every other worker of the region's key takes
part in its rounds with an empty push, and the holder asks only for the notice that the
round is complete (docs/protocol.md: ``Skip`` pushes, ``wants_sum``). So each byte crosses
the wire once to a server and once to each worker that takes it, and no zeros travel.
A round of one push is that push, bit for bit, so regions travel as int32 words whatever
their dtype.

Buffers are views of the caller's tensors where they can be (a contiguous host tensor):
the holder pushes straight from its input, the takers receive straight into the output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sumflow.torch import _runtime, _work, declarations
from sumflow.torch.process_sets import Group


@dataclass(frozen=True)
class Region:
    """A span of bytes under one name: pushed by this worker (``pushes``) or taken by it."""

    name: str
    #: Flat host bytes: what this worker pushes, or where the region lands.
    data: torch.Tensor
    pushes: bool
    #: Global ranks whose rounds the region's keys count, ascending (None: every worker).
    members: list[int] | None = None
    #: The worker (global rank) whose machine keeps the region's keys: one that takes it
    #: (its bytes then cross one link, not two), or None to place them from their keys.
    home: int | None = None


def host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bytes as a flat host uint8 tensor: a view of a contiguous host tensor
    (writing it writes the tensor), else a copy."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu" or not flat.is_contiguous():
        flat = flat.cpu().contiguous()
    return flat.view(torch.uint8)


def row_bytes(tensor: torch.Tensor) -> int:
    """The bytes of one row (first-dimension slice) of `tensor`."""
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def gathered(
    name: str,
    tensors: Sequence[torch.Tensor],
    counts: Sequence[Sequence[int]],
    group: Group,
    single: bool,
) -> tuple[list[torch.Tensor], list[Region]]:
    """The landing tensors of an allgather of `tensors` over the group's members, each
    member `r` contributing ``counts[r][i]`` rows of tensor `i`, and the regions that fill
    them: this worker's rows pushed from its own tensor, every other member's taken, each
    kept on its holder's machine (it pushes locally, the others pull once)."""
    outs, regions = [], []
    for i, t in enumerate(tensors):
        per_row = row_bytes(t)
        out = torch.empty((sum(c[i] for c in counts), *t.shape[1:]), dtype=t.dtype)
        landing = host_bytes(out)
        offset = 0
        for r, c in enumerate(counts):
            span = landing[offset : offset + c[i] * per_row]
            offset += span.numel()
            label = f"{name}#{r}" if single else f"{name}#{i}.{r}"
            home = group.ranks[r]
            if r == group.rank:
                mine = host_bytes(t)
                span.copy_(mine)
                regions.append(Region(label, mine, True, group.members, home))
            else:
                regions.append(Region(label, span, False, group.members, home))
        outs.append(out)
    return outs, regions


def relay_work(name: str, regions: Sequence[Region], finish: Callable[[], Any]) -> _work.CoreWork:
    """Issues every non-empty region of `regions`; once each has been pushed or received,
    the work's result is ``finish()``."""
    live = [r for r in regions if r.data.numel()]
    # The core counts int32 words: a region of another length travels in a padded copy.
    buffers = [r.data if r.data.numel() % 4 == 0 else _padded(r) for r in live]
    # Placed one by one: each worker declares only the regions it pushes or takes. A
    # region whose size changed since its name's last operation retires its old layout.
    ids = declarations.declare_layouts(
        [
            (r.name, (torch.int32, b.numel() // 4, None), r.members)
            for r, b in zip(live, buffers, strict=True)
        ],
        together=False,
        homes=[r.home for r in live],
        replace=True,
    )
    service = _runtime.current().service
    cores = [
        service.push_pull(
            tid,
            buf,
            buf.data_ptr(),
            buf.numel(),
            pushes=None if r.pushes else [],
            pulls=[] if r.pushes else None,
        )
        for r, buf, tid in zip(live, buffers, ids, strict=True)
    ]

    def done() -> Any:
        for r, buf in zip(live, buffers, strict=True):
            if buf is not r.data and not r.pushes:
                r.data.copy_(buf[: r.data.numel()])
        return finish()

    return _work.CoreWork(name, cores, done, ids)


def _padded(region: Region) -> torch.Tensor:
    n = region.data.numel()
    buf = torch.zeros(-(-n // 4) * 4, dtype=torch.uint8)
    if region.pushes:
        buf[:n].copy_(region.data)
    return buf
