"""Wire accounting: the bytes this worker exchanged with the summation servers, counted
at its sockets (frames whole: headers, acknowledgements and sums), so that benchmarks
report what crossed the network rather than what tensor sizes suggest."""

from __future__ import annotations

from dataclasses import dataclass

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


def total_wire_bytes() -> WireBytes:
    """Every byte exchanged with the summation servers since this worker joined."""
    return sum(wire_bytes().values(), WireBytes())
