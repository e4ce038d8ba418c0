"""Slurm's compressed lists: host lists (``node[01-03,07],gpu5``) and tasks per node
(``2(x3),1``), as in ``SLURM_JOB_NODELIST`` and ``SLURM_TASKS_PER_NODE``. Pure functions;
errors name the variable the text came from."""

from __future__ import annotations

import itertools
import re

_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?\Z")


def _split_top_level(text: str, variable: str) -> list[str]:
    """``text`` cut at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"{variable}={text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{variable}={text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"{variable}={text!r}: missing ']'")
    items.append(text[start:])
    return items


def _range_values(spec: str, text: str, variable: str) -> list[str]:
    """``01-03,07`` -> ``01 02 03 07``, keeping the low bound's zero padding."""
    values = []
    for part in spec.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{variable}={text!r}: {part!r} is not N or N-M")
        if not dash:
            values.append(low)
            continue
        first, last = int(low), int(high)
        if last < first:
            raise ValueError(f"{variable}={text!r}: range {part!r} runs backwards")
        values += [str(n).zfill(len(low)) for n in range(first, last + 1)]
    return values


def expand_hostlist(text: str, variable: str) -> list[str]:
    """The host names of a Slurm host list, in order: ``node[01-03,07],gpu5`` is
    ``node01 node02 node03 node07 gpu5``; every bracket of a name is expanded."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip(), variable):
        if not item:
            raise ValueError(f"{variable}={text!r}: empty host entry")
        # Alternating literal text and bracket contents: "a", "1-2", "b", "3-4", "".
        pieces = re.split(r"\[([^\]]*)\]", item)
        choices = [
            [piece] if i % 2 == 0 else _range_values(piece, text, variable)
            for i, piece in enumerate(pieces)
        ]
        hosts += ["".join(parts) for parts in itertools.product(*choices)]
    return hosts


def expand_tasks_per_node(text: str, variable: str) -> list[int]:
    """Tasks on each node, in node order: ``2(x3),1`` is ``2 2 2 1``."""
    counts: list[int] = []
    for item in text.strip().split(","):
        match = _TASKS.match(item.strip())
        if not match:
            raise ValueError(f"{variable}={text!r}: {item!r} is not N or N(xM)")
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        counts += [count] * repeat
    return counts
