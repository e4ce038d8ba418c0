"""The elastic rendezvous: how a worker of an elastic job (``sumflow-run --min-np N``)
learns, at every change of membership, its rank and the coordinator to join.

Each membership *epoch* is a job of its own, with a fresh coordinator and fresh summation
servers, so no round can mix the gradients of two memberships; the worker processes live
on from one epoch to the next (docs/elastic.md). The launcher serves this rendezvous on
TCP. A worker asks one question per connection, one JSON line each way, each naming the
worker (``SUMFLOW_ELASTIC_WORKER``) and signed with the job token (see :func:`sign`; the
token itself never crosses the network, as with the coordinator's handshake):

``{"op": "assignment", "after": E}``
    Its place in the first epoch after E: ``{"epoch", "coordinator", "rank", "size",
    "local_rank", "local_size", "host_id"}``; ``{"wait": true, "patience": S}`` while that
    epoch is not formed yet (the launcher may take up to S seconds from the first request),
    or ``{"leave": why}`` when the worker is not part of the job any more.
``{"op": "updates", "epoch": E}``
    ``{"pending": true}`` when the membership is about to change (workers wait to join,
    or some must leave): the next ``commit()`` interrupts training for it.

``{"op": "serve", "after": E}`` and ``{"op": "retire"}``
    From a summation server started by hand (``sumflow-server --elastic ADDR``): its place
    in the first epoch after E (``{"epoch", "coordinator", "host_id"}``, ``wait`` or
    ``leave`` as above), and its wish to leave at the next change (``{"ok": true}``).

A request that is malformed, too long, unsigned, signed with another token, too old or
seen before is answered with ``{"error": why}`` and the connection closed; it changes
nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

#: The longest line either side accepts, in bytes.
MAX_LINE = 1 << 16
#: How often a waiting worker asks again.
POLL_INTERVAL = 0.1
#: How long one request may take on the network before it is retried.
REQUEST_TIMEOUT = 10.0


class RendezvousError(RuntimeError):
    """The launcher's rendezvous refused a request, or could not be reached in time."""


@dataclass(frozen=True)
class Assignment:
    """A worker's place in one epoch."""

    epoch: int
    coordinator: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    host_id: str

    @classmethod
    def from_reply(cls, reply: dict[str, Any]) -> Assignment:
        """The assignment in a rendezvous reply; a RendezvousError naming what is wrong."""
        try:
            return cls(
                epoch=int(reply["epoch"]),
                coordinator=str(reply["coordinator"]),
                rank=int(reply["rank"]),
                size=int(reply["size"]),
                local_rank=int(reply["local_rank"]),
                local_size=int(reply["local_size"]),
                host_id=str(reply["host_id"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise RendezvousError(
                f"malformed assignment from the launcher: {reply!r} ({e})"
            ) from None


class Removed(Exception):
    """This worker is not part of the job's next epoch (its host was removed or
    blacklisted): it should leave, and its launcher expects it to."""


def encode(message: dict[str, Any]) -> bytes:
    """One line of the rendezvous."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """The message in one line; ValueError unless it is a JSON object within MAX_LINE."""
    if len(line) > MAX_LINE or not line.endswith(b"\n"):
        raise ValueError(f"a request is one line of at most {MAX_LINE} bytes")
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("a request is a JSON object")
    return message


#: How far a request's time may lie from the launcher's clock, in seconds.
MAX_CLOCK_SKEW = 300.0


def _signed_text(message: dict[str, Any]) -> bytes:
    """What a request's MAC covers: its fields in a fixed order, one per line (the Rust
    server, ``crates/summation/src/elastic.rs``, builds the same)."""
    fields = ("op", "worker", "after", "epoch", "nonce", "time")
    return "\n".join(str(message.get(f, "")) for f in fields).encode()


def sign(message: dict[str, Any], token: str) -> dict[str, Any]:
    """`message` with a fresh nonce, the time, and its HMAC-SHA256 under the job token."""
    full = {**message, "nonce": secrets.token_hex(16), "time": int(time.time())}
    full["mac"] = hmac.new(token.encode(), _signed_text(full), hashlib.sha256).hexdigest()
    return full


def verify(message: dict[str, Any], token: str, now: float | None = None) -> str | None:
    """Why `message` is not a genuine, fresh request of the job (None when it is): its MAC
    is compared in constant time, and its time must lie within MAX_CLOCK_SKEW of `now`.
    Replays within that window are the caller's to refuse, by nonce."""
    mac = message.get("mac")
    if not isinstance(mac, str) or not isinstance(message.get("nonce"), str):
        return "unsigned request"
    expected = hmac.new(token.encode(), _signed_text(message), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(mac.encode(), expected.encode()):
        return "wrong job token"
    sent = message.get("time")
    if not isinstance(sent, int) or isinstance(sent, bool):
        return "a request carries its time in whole seconds"
    now = time.time() if now is None else now
    if abs(now - sent) > MAX_CLOCK_SKEW:
        return f"the request's time is {now - sent:+.0f} s off this machine's clock"
    return None


def _read_line(sock: socket.socket) -> bytes:
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = sock.recv(MAX_LINE + 1 - len(data))
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_LINE:
            break
    return bytes(data)


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) as a socket address."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"the elastic rendezvous address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


class Client:
    """A worker's side of the rendezvous."""

    def __init__(self, address: str, token: str, worker: str) -> None:
        self.address = address
        self._where = split_address(address)
        self._token = token
        self.worker = worker

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Sends one request and returns the reply; OSError when the launcher cannot be
        reached, RendezvousError when it refuses."""
        full = sign({**message, "worker": self.worker}, self._token)
        with socket.create_connection(self._where, timeout=REQUEST_TIMEOUT) as sock:
            sock.sendall(encode(full))
            line = _read_line(sock)
        if not line:
            raise ConnectionError("the launcher closed the connection without answering")
        try:
            reply = decode(line)
        except ValueError as e:
            raise RendezvousError(f"malformed reply from the launcher: {e}") from None
        if "error" in reply:
            raise RendezvousError(f"the launcher refused {message.get('op')!r}: {reply['error']}")
        return reply

    def _retrying(self, message: dict[str, Any], deadline: float, what: str) -> dict[str, Any]:
        """`request`, retried until `deadline` while the launcher cannot be reached (it
        may be busy starting an epoch's processes)."""
        while True:
            try:
                return self.request(message)
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise RendezvousError(
                        f"cannot reach sumflow-run's elastic rendezvous at {self.address} "
                        f"while waiting for {what}: {e}"
                    ) from None
            time.sleep(POLL_INTERVAL)

    def assignment(self, after: int, timeout: float) -> Assignment:
        """This worker's place in the first epoch after `after`, waiting up to `timeout`
        seconds for the launcher to form it; Removed when the worker is to leave."""
        start = time.monotonic()
        deadline = start + timeout
        what = f"the job's membership after epoch {after}" if after >= 0 else "its first epoch"
        while True:
            reply = self._retrying({"op": "assignment", "after": after}, deadline, what)
            if "leave" in reply:
                raise Removed(str(reply["leave"]))
            if not reply.get("wait"):
                return Assignment.from_reply(reply)
            # The launcher may wait longer than `timeout` for workers (--elastic-timeout),
            # and says so; it stops the job itself when that runs out.
            patience = reply.get("patience")
            if isinstance(patience, (int, float)) and patience > 0:
                deadline = max(deadline, start + float(patience))
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"waited {time.monotonic() - start:.0f} s for {what} from sumflow-run at "
                    f"{self.address}; it has not formed one"
                )
            time.sleep(POLL_INTERVAL)

    def updates_pending(self, epoch: int) -> bool:
        """Whether the membership after `epoch` is about to change."""
        deadline = time.monotonic() + REQUEST_TIMEOUT
        reply = self._retrying({"op": "updates", "epoch": epoch}, deadline, "membership updates")
        return bool(reply.get("pending"))
