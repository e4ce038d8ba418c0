"""Worker traces into one file: ``python -m sumflow.trace merge DIR [-o OUT]``.

Each worker of a traced job writes ``sumflow-trace-rank{r}.json`` (see
``docs/tracing.md``). Merged, every worker is one process of the trace (process id rank
+ 1, named "worker r"), on the common wall clock, so Perfetto shows the workers one above
the other and a slow worker's pushes can be compared with the others' at a glance.
Files are read one at a time and events are written as they are read.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The files workers write.
PATTERN = re.compile(r"sumflow-trace-rank(\d+)\.json\Z")
#: The merged file's name when ``-o`` is not given.
MERGED_NAME = "sumflow-trace-merged.json"


@dataclass(frozen=True)
class Merged:
    """What a merge wrote."""

    output: Path
    workers: list[int]
    events: int


def trace_files(inputs: Sequence[Path]) -> list[Path]:
    """The worker traces named by ``inputs`` (files, or directories holding
    ``sumflow-trace-rank*.json``), ordered by rank within each directory."""
    files: list[Path] = []
    for p in inputs:
        if p.is_dir():
            found = [(int(m[1]), f) for f in p.iterdir() if (m := PATTERN.match(f.name))]
            if not found:
                raise ValueError(f"{p}: no sumflow-trace-rank*.json files in this directory")
            files += [f for _, f in sorted(found)]
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"{p}: no such file or directory")
    return files


def _load(path: Path) -> dict[str, Any]:
    try:
        with path.open() as f:
            trace = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a trace: {e}") from None
    if not (
        isinstance(trace, dict)
        and isinstance(trace.get("traceEvents"), list)
        and "sumflow_trace" in trace.get("otherData", {})
    ):
        raise ValueError(f"{path}: not a sumflow worker trace (no otherData.sumflow_trace)")
    return trace


def merge(inputs: Sequence[Path], output: Path) -> Merged:
    """Merges the worker traces named by ``inputs`` into ``output``. Two files of the same
    worker rank (traces of different jobs, or a file given twice) are refused."""
    files = trace_files(inputs)
    owner: dict[int, Path] = {}
    workers: list[dict[str, Any]] = []
    events = 0
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    try:
        with partial.open("w") as out:
            out.write('{"traceEvents":[')
            first = True
            for path in files:
                trace = _load(path)
                meta = trace["otherData"]
                rank = int(meta["rank"])
                if rank in owner:
                    raise ValueError(
                        f"{owner[rank]} and {path} both hold worker {rank}: traces of "
                        "different jobs cannot be merged"
                    )
                owner[rank] = path
                workers.append(meta)
                for event in trace["traceEvents"]:
                    out.write("\n" if first else ",\n")
                    first = False
                    out.write(json.dumps(event, ensure_ascii=False, separators=(",", ":")))
                    events += event.get("ph") != "M"
            out.write('\n],\n"displayTimeUnit":"ms",\n"otherData":')
            json.dump({"sumflow_trace_merged": workers}, out, ensure_ascii=False)
            out.write("}\n")
        os.replace(partial, output)
    finally:
        partial.unlink(missing_ok=True)
    return Merged(output, sorted(owner), events)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sumflow.trace``; returns the exit status (2 for bad input)."""
    p = argparse.ArgumentParser(
        prog="python -m sumflow.trace",
        description="Tools for sumflow's per-worker Chrome traces (docs/tracing.md).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser(
        "merge",
        help="merge the workers' traces into one file for Perfetto",
        description="Merge sumflow-trace-rank*.json files into one Chrome trace, one "
        "process per worker, for ui.perfetto.dev or chrome://tracing.",
    )
    m.add_argument(
        "inputs",
        nargs="+",
        type=Path,
        metavar="DIR|FILE",
        help="a trace directory (every sumflow-trace-rank*.json in it) or a worker's file",
    )
    m.add_argument(
        "-o",
        "--output",
        type=Path,
        help=f"the merged file [default: {MERGED_NAME} in the first input's directory]",
    )
    args = p.parse_args(argv)
    output = args.output
    if output is None:
        first = args.inputs[0]
        output = (first if first.is_dir() else first.parent) / MERGED_NAME
    try:
        merged = merge(args.inputs, output)
    except ValueError as e:
        print(f"python -m sumflow.trace: error: {e}", file=sys.stderr)
        return 2
    print(
        f"merged the traces of workers {', '.join(map(str, merged.workers))} "
        f"({merged.events} events) into {merged.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
