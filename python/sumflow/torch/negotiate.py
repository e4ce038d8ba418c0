"""Agreeing on one operation before any of its data moves (Horovod's negotiation).

Every worker of an operation writes one row of a small int64 table, what it asks for
(kind, dtype, shape, reduction, root, and per-worker facts such as its allgather rows or
alltoall splits), into its own row of an otherwise zero table, and the table is summed
over the summation servers: each worker then holds every row, exactly. The rows are
compared on every worker alike, so either every worker goes on with the same agreed
operation, or every worker raises the same ``HorovodInternalError`` naming the tensor and
the disagreeing workers, and the job goes on; nothing of the operation's data was sent.

The table of a name always has the same layout (``WIDTH + extra`` words per worker), so
it is declared once and reused by every later operation of that name.

A worker that has called ``join()`` pushes nothing: the servers complete its rounds
without it, so its row reads all zeros. A valid row never does (its first word is 1, and
its kind and dtype codes start at 1), so a zero row means that member has joined. Sums
(allreduce, grouped allreduce, a process set's barrier) go on without it, the joined
worker counting as zeros, as in Horovod; gathering and scattering operations need every
worker's data and fail on every worker that has not joined.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sumflow import SumflowError

#: Words of a row before the operation's extra words.
WIDTH = 16
#: Dimensions a row spells out (a tensor of more is compared by its hash).
SHOWN_DIMS = 8

_KINDS = (
    "allreduce",
    "allgather",
    "broadcast",
    "alltoall",
    "reducescatter",
    "grouped_allreduce",
    "grouped_allgather",
    "grouped_reducescatter",
)
#: Every dtype an operation can carry, by code (0 is "no row").
DTYPE_CODES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.bool,
)


class HorovodInternalError(SumflowError):
    """An operation failed on every worker taking part, for a reason that leaves the job
    able to go on (workers disagreed on it); the message names the tensor and the
    workers. A ``RuntimeError``, as Horovod's is."""


@dataclass(frozen=True)
class Request:
    """What one worker asks of an operation. ``op`` and ``root`` are -1 where the kind
    has none; ``facts`` are compared as a whole (``detail`` says what they mean), and
    ``extra`` are per-worker numbers the operation needs from every worker (allgather's
    rows, alltoall's splits) and that may differ between workers."""

    kind: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    op: int = -1
    root: int = -1
    facts: str = ""
    extra: tuple[int, ...] = ()
    #: Whether workers may differ in the first dimension (allgather, alltoall).
    any_first_dim: bool = False


@dataclass(frozen=True)
class Row:
    """One worker's request as the table shows it to every worker."""

    rank: int
    kind: str
    dtype: torch.dtype
    op: int
    root: int
    shape: tuple[int, ...] | None  # None: more than SHOWN_DIMS dimensions
    digest: int
    extra: tuple[int, ...]


def _digest(request: Request) -> int:
    """A 62-bit hash of what must agree and the row does not spell out: the settings, and
    the shape where it has more dimensions than a row shows."""
    shape = request.shape[1:] if request.any_first_dim else request.shape
    text = f"{request.facts}|{list(shape) if len(request.shape) > SHOWN_DIMS else ''}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def encode(request: Request, rank: int, size: int, width: int) -> torch.Tensor:
    """The table this worker pushes: its row filled, every other row zero."""
    if len(request.extra) > width - WIDTH:
        raise ValueError(f"{request.name}: {len(request.extra)} extra words, room for {width}")
    table = torch.zeros(size, width, dtype=torch.int64)
    shape = request.shape if len(request.shape) <= SHOWN_DIMS else ()
    words = [
        1,
        _KINDS.index(request.kind) + 1,
        DTYPE_CODES.index(request.dtype) + 1,
        request.op,
        request.root,
        len(request.shape) if len(request.shape) <= SHOWN_DIMS else -1,
        *shape,
    ]
    words += [0] * (SHOWN_DIMS + 6 - len(words))
    words += [_digest(request), len(request.extra), *request.extra]
    table[rank, : len(words)] = torch.tensor(words, dtype=torch.int64)
    return table


def decode(table: torch.Tensor, ranks: Sequence[int]) -> list[Row | None]:
    """Every member's row, in member order (None where a member wrote none); ``ranks``
    are the members' worker ranks, by which rows are named."""
    rows: list[Row | None] = []
    for rank, words in zip(ranks, table.tolist(), strict=True):
        if words[0] != 1:
            rows.append(None)
            continue
        ndim = words[5]
        n_extra = words[15]
        rows.append(
            Row(
                rank=rank,
                kind=_KINDS[words[1] - 1] if 0 < words[1] <= len(_KINDS) else "?",
                dtype=DTYPE_CODES[words[2] - 1],
                op=words[3],
                root=words[4],
                shape=tuple(words[6 : 6 + ndim]) if ndim >= 0 else None,
                digest=words[14],
                extra=tuple(words[WIDTH : WIDTH + n_extra]),
            )
        )
    return rows


def _groups(rows: Sequence[Row], key: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for row in rows:
        out.setdefault(key_of(row, key), []).append(row.rank)
    return out


def key_of(row: Row, key: str) -> str:
    """How a row reads in a message, for one of the compared fields."""
    if key == "shape":
        return "?" if row.shape is None else str(list(row.shape))
    if key == "shape after the first dimension":
        return "?" if row.shape is None else str(list(row.shape[1:]))
    if key == "rank (number of dimensions)":
        return "?" if row.shape is None else str(len(row.shape))
    return str(getattr(row, key))


def _spell(groups: dict[str, list[int]]) -> str:
    return "; ".join(
        f"{value} on worker{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        for value, ranks in groups.items()
    )


#: Kinds that go on while some workers have joined, the joined ones counting as zeros.
SUMS = frozenset({"allreduce", "grouped_allreduce"})


def check(
    request: Request, rows: Sequence[Row | None], ranks: Sequence[int] | None = None
) -> list[Row]:
    """The rows of the members that asked, once they all agree with each other; otherwise
    a ``HorovodInternalError`` naming the operation, what differs, and on which workers.

    A member without a row has joined (``join()``): a sum goes on without it (its rows
    are left out of the result), any other kind raises naming the joined workers by
    their ``ranks`` (the members' worker ranks; positions if not given)."""
    present = list(rows)
    missing = [i for i, row in enumerate(present) if row is None]
    if missing and (request.kind not in SUMS or len(missing) == len(present)):
        joined = [ranks[i] for i in missing] if ranks is not None else missing
        who = "worker" + ("s " if len(joined) > 1 else " ") + ", ".join(map(str, joined))
        raise HorovodInternalError(
            f"{request.kind} '{request.name}': {who} {'have' if len(joined) > 1 else 'has'} "
            f"joined (hvd.join()) and sent no request for it: {request.kind} needs every "
            "worker's data, so it cannot run while a worker has joined; only allreduce goes "
            "on, the joined workers counting as zeros"
        )
    got = [row for row in present if row is not None]
    compared = ["kind", "dtype", "op", "root"]
    if request.any_first_dim:
        compared += ["rank (number of dimensions)", "shape after the first dimension"]
    else:
        compared += ["shape"]
    compared += ["digest"]
    for key in compared:
        groups = _groups(got, key)
        if len(groups) > 1:
            what = "settings (scaling, compression or device)" if key == "digest" else key
            raise HorovodInternalError(
                f"{request.kind} '{request.name}': the workers disagree on the {what}: "
                f"{_spell(groups) if key != 'digest' else _spell_ranks(groups)}"
            )
    return got


def _spell_ranks(groups: dict[str, list[int]]) -> str:
    return " vs ".join(f"workers {ranks}" for ranks in groups.values())


def pack_floats(*values: float) -> str:
    """Float settings as exact text for ``Request.facts``."""
    return ",".join(struct.pack("<d", v).hex() for v in values)
