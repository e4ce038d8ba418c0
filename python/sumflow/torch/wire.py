"""Wire accounting: the bytes this worker exchanged with the summation servers, counted
at its sockets (frames whole: headers, acknowledgements and sums), so that benchmarks
report what crossed the network rather than what tensor sizes suggest; and the servers'
own counts, which they write when they stop."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from sumflow.torch import _runtime


@dataclass(frozen=True)
class WireBytes:
    """Bytes written to the servers (``sent``) and read from them (``received``)."""

    sent: int = 0
    received: int = 0

    def __add__(self, other: WireBytes) -> WireBytes:
        return WireBytes(self.sent + other.sent, self.received + other.received)

    def __sub__(self, other: WireBytes) -> WireBytes:
        return WireBytes(self.sent - other.sent, self.received - other.received)


def wire_bytes() -> dict[str, WireBytes]:
    """Bytes exchanged with the summation servers since this worker joined, per tensor
    name (summed over its partitions' keys). Frames that name no tensor (leaving the job)
    count under ``""``. Take differences between two calls for a step's traffic."""
    keys, (other_sent, other_received) = _runtime.current().service.wire_bytes()
    out: dict[str, WireBytes] = {}
    for tensor, _key, sent, received in keys:
        out[tensor] = out.get(tensor, WireBytes()) + WireBytes(sent, received)
    if other_sent or other_received:
        out[""] = out.get("", WireBytes()) + WireBytes(other_sent, other_received)
    return out


@dataclass(frozen=True)
class ServerTraffic:
    """What one summation server exchanged with the workers, from its side: ``sent`` to
    the workers (acknowledgements and sums), ``received`` from them (pushes, pulls)."""

    #: Per key (a partition of a tensor; a worker's ``wire_bytes`` names the tensors).
    keys: dict[int, WireBytes]
    #: Frames that name no key: heartbeats, leaving the job.
    other: WireBytes

    @property
    def total(self) -> WireBytes:
        return sum(self.keys.values(), self.other)


def server_wire_bytes(directory: str | os.PathLike[str]) -> dict[str, ServerTraffic]:
    """The bytes each summation server exchanged with the workers, per key, as the servers
    wrote them to `directory` when they stopped (``sumflow-run --wire-stats DIR``, or
    ``SUMFLOW_WIRE_STATS_DIR`` / ``sumflow-server --wire-stats-dir``), by file name
    (``server-RANK``). Read them after the job: a server writes its file as it stops."""
    out: dict[str, ServerTraffic] = {}
    for path in sorted(Path(directory).glob("server-*.json")):
        try:
            data = json.loads(path.read_text())
            out[path.stem] = ServerTraffic(
                keys={
                    int(k["key"]): WireBytes(int(k["sent"]), int(k["received"]))
                    for k in data["keys"]
                },
                other=WireBytes(int(data["other"]["sent"]), int(data["other"]["received"])),
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a summation server's wire statistics ({e})") from e
    return out


def total_wire_bytes() -> WireBytes:
    """Every byte exchanged with the summation servers since this worker joined."""
    return sum(wire_bytes().values(), WireBytes())
