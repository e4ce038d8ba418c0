"""The tuner's account of itself: a line a person reads for each event, on rank 0's
stderr, and the same as a JSON line in a file for tools.

Events, in order (docs/autotune.md shows a whole log):

- ``start``: the key, the search space, the budget, the configuration the job started with;
- ``reuse``: a stored configuration was applied instead of tuning (then nothing else);
- ``propose``: the configuration the next trial measures, and why it was chosen;
- ``trial``: a finished trial: configuration, every measured step time, the score, the
  best so far;
- ``finish``: why tuning stopped, the configuration applied from then on, where it is
  stored, and what tuning cost.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sumflow.tune.space import Configuration

PREFIX = "sumflow autotune: "


def say_on_stderr(line: str) -> None:
    """Writes `line` to stderr at once (worker output is often piped, hence buffered)."""
    print(PREFIX + line, file=sys.stderr, flush=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


class TrialLog:
    """Human lines through `say`; JSON lines appended to `path` (None: no file)."""

    def __init__(self, path: Path | None, say: Callable[[str], None] = say_on_stderr) -> None:
        self.path = path
        self.say = say
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, event: str, line: str, **fields: Any) -> None:
        """Says `line` and appends ``{"event": event, "time": ..., **fields}``."""
        self.say(line)
        if self.path is None:
            return
        entry = {"event": event, "time": round(time.time(), 3), **fields}
        with self.path.open("a") as f:
            f.write(json.dumps(entry, default=_jsonable) + "\n")


def _jsonable(value: object) -> object:
    if isinstance(value, Configuration):
        return value.to_json()
    raise TypeError(f"cannot write {type(value).__name__} to the trial log")


def faster_than(score: float, reference: float | None) -> str:
    """``', 12.0% faster than at the start'`` (or slower); nothing without a reference,
    or for the start itself."""
    if reference is None or reference <= 0 or score == reference:
        return ""
    change = 1 - score / reference
    word = "faster" if change >= 0 else "slower"
    return f", {abs(change):.1%} {word} than at the start"
