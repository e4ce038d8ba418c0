"""A simulation's timeline as a Chrome trace, in the format of the runtime's traces
(``docs/tracing.md``): Perfetto and ``chrome://tracing`` open both.

Every simulated machine is a process (pid = machine + 1), named as the report names it;
its tracks are those of a worker's runtime trace (``steps``, ``compute``, ``scheduler``,
``push → server s lane l``, ``receive ← server s lane l``) plus the simulator's own
(``intra-machine``, ``all-reduce``, ``rounds of server s`` on the servers' machines, and a
``link utilisation`` counter per iteration). Times are simulated microseconds since the
simulation began.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sumflow.sim.result import Result

_FIRST = ("steps", "compute", "scheduler", "intra-machine", "all-reduce")


def _track_key(track: str) -> tuple[int, int, int, str]:
    """Fixed tracks first, then per server: its rounds, then each lane's push and receive."""
    if track in _FIRST:
        return (0, _FIRST.index(track), 0, "")
    m = re.search(r"server (\d+)(?: lane (\d+))?", track)
    if m:
        return (1, int(m[1]), int(m[2] or -1), track)
    return (2, 0, 0, track)


def chrome_trace(result: Result) -> dict[str, Any]:
    """The trace as a JSON-ready dict."""
    events: list[dict[str, Any]] = []
    tracks: dict[tuple[int, str], int] = {}
    used = sorted(
        {(e["machine"], e["track"]) for e in result.trace_events if e["ph"] != "C"},
        key=lambda mt: (mt[0], _track_key(mt[1])),
    )
    for machine, track in used:
        tid = sum(1 for m, _ in tracks if m == machine) + 1
        tracks[(machine, track)] = tid
    for machine in sorted({e["machine"] for e in result.trace_events}):
        pid = machine + 1
        events.append(
            {
                "ph": "M",
                "pid": pid,
                "name": "process_name",
                "args": {"name": result.machines[machine]},
            }
        )
        events.append(
            {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}}
        )
    for (machine, track), tid in tracks.items():
        pid = machine + 1
        events.append(
            {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": track}}
        )
        events.append(
            {
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "name": "thread_sort_index",
                "args": {"sort_index": tid},
            }
        )
    for e in sorted(result.trace_events, key=lambda e: e["ts"]):
        pid = e["machine"] + 1
        out: dict[str, Any] = {
            "ph": e["ph"],
            "pid": pid,
            "name": e["name"],
            "ts": e["ts"] * 1e6,
            "args": e["args"],
        }
        if e["ph"] == "X":
            out["dur"] = e["dur"] * 1e6
        if e["ph"] != "C":
            out["tid"] = tracks[(e["machine"], e["track"])]
        if e["ph"] == "i":
            out["s"] = "t"
        events.append(out)
    cfg = result.config
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "sumflow_trace": 1,
            "simulated": True,
            "configuration": cfg.describe(),
            "recorded": (
                f"measured iterations {cfg.warmup_iterations} to "
                f"{cfg.warmup_iterations + cfg.iterations - 1}"
            ),
            "reduction": result.reduction,
            "events": len(result.trace_events),
            "max_events": cfg.trace_max_events,
            "truncated": result.trace_truncated,
            "clock": "simulated time since the simulation began, microseconds",
        },
    }


def write_trace(result: Result, path: Path) -> Path:
    """Writes :func:`chrome_trace` to `path` (its directory is created)."""
    if not result.config.trace:
        raise ValueError(
            "this simulation recorded no timeline: run it with Config(trace=True) "
            "(sumflow sim --trace PATH)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(result)) + "\n")
    return path
