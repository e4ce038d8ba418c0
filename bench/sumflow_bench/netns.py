"""An emulated cluster on one Linux machine: hosts as network namespaces behind a switch.

Each host is a network namespace with one interface, ``eth0``, an address in a private
subnet, loopback up and no default route. The switch is a Linux bridge inside a namespace
of its own; each host's veth pair ends there. Every link is shaped with tc's HTB to the
same rate B in both directions (the host's egress on ``eth0``, its ingress on the switch
port's egress), optionally with a delay (netem), so each host behaves like a machine with
a full-duplex NIC of B on a non-blocking switch: the assumptions of BytePS §4.1.

Safety: the root namespace gets no interface and no address in the emulated subnet (it is
refused if one is already there), hosts cannot reach anything outside the subnet, and every
process of a run is started inside a host namespace (:meth:`EmulatedCluster.command`, and
the ssh stand-in :meth:`EmulatedCluster.ssh_command` for ``sumflow-run``'s cluster form).
Namespaces carry one prefix; a lock file keeps two runs apart, and leftovers of a crashed
run with the prefix are removed before a new one starts. :class:`EmulatedCluster` is a
context manager that tears everything down on exit, on an exception and on SIGTERM/SIGHUP
(turned into ``SystemExit``) or SIGINT.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO

#: Prefix of every namespace the harness creates; leftovers with it are removed at start.
PREFIX = "sfbench"
#: Keeps two runs on one machine from tearing down each other's namespaces.
LOCK_PATH = Path("/run/lock/sumflow-bench.lock")
DEFAULT_SUBNET = "10.211.0.0/24"
#: Seconds any single ip/tc command may take before the run is declared broken.
COMMAND_TIMEOUT = 30.0


class ClusterUnavailable(RuntimeError):
    """This machine cannot host an emulated cluster; the message says why and what to do."""


class ClusterError(RuntimeError):
    """Building or using the emulated cluster failed; the message names the step."""


@dataclass(frozen=True)
class LinkShape:
    """Every host's link: ``rate_mbit`` Mbit/s in each direction, plus an optional
    one-way ``delay_ms`` added on each host's egress and on the switch port's egress."""

    rate_mbit: float
    delay_ms: float = 0.0
    mtu: int = 1500
    #: Packets the shaper may queue per direction (a shallow switch buffer).
    queue_packets: int = 256

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be positive, got {self.rate_mbit}")
        if not self.delay_ms >= 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be 576 to 65535, got {self.mtu}")
        if self.queue_packets < 1:
            raise ValueError(f"queue_packets must be at least 1, got {self.queue_packets}")

    @property
    def rate_bytes(self) -> float:
        """The rate in bytes per second."""
        return self.rate_mbit * 1e6 / 8

    def burst_bytes(self) -> int:
        """HTB's burst: 2 ms at the rate, at least one 64 KiB GSO segment and a jumbo
        frame, so the shaper holds its rate with the kernel's timer granularity."""
        return int(max(self.rate_bytes * 0.002, 65536 + self.mtu))


@dataclass(frozen=True)
class EmulatedHost:
    """One emulated machine."""

    index: int
    namespace: str
    address: str


def unavailable_reason() -> str | None:
    """Why this machine cannot run an emulated cluster, or None when it can: checks root,
    iproute2 and tc, and that a network namespace can really be created."""
    if os.geteuid() != 0:
        return (
            "the emulated cluster needs root (network namespaces and tc); run it as root, "
            "e.g. with sudo"
        )
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs {tool!r}: install {package} (apt install {package})"
    failed = _probe_qdisc(["htb"])
    if failed is not None:
        step, err = failed
        return f"cannot {step} here: {err}"
    return None


def netem_available() -> bool:
    """Whether tc's netem (needed for a link delay) works on this kernel."""
    return _probe_qdisc(["netem", "delay", "1ms"]) is None


def _probe_qdisc(qdisc: Sequence[str]) -> tuple[str, str] | None:
    """Tries, in a throwaway namespace, what the cluster needs: the namespace, a veth pair
    and the root qdisc `qdisc` on it. None when all worked, else the failed step and why."""
    probe = f"{PREFIX}-probe-{os.getpid()}"
    steps = [
        ("create a network namespace", ["ip", "netns", "add", probe]),
        (
            "create a veth pair",
            ["ip", "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0"],
        ),
        (
            f"attach a {qdisc[0]} qdisc with tc",
            ["tc", "-n", probe, "qdisc", "add", "dev", "a0", "root", *qdisc],
        ),
    ]
    try:
        for step, argv in steps:
            err = _run_quiet(argv)
            if err:
                return step, err
        return None
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)


def _run_quiet(argv: Sequence[str]) -> str:
    """Runs argv; returns its error text, or "" when it succeeded."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    return "" if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


def _sh(argv: Sequence[str], what: str) -> None:
    try:
        err = _run_quiet(argv)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{what}: {shlex.join(argv)} took over {COMMAND_TIMEOUT:g} s") from None
    if err:
        raise ClusterError(f"{what}: {shlex.join(argv)} failed: {err}")


def namespaces_with_prefix() -> list[str]:
    """Names of this harness's namespaces that exist now (ours or a crashed run's)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX + "-")]


def remove_namespace(name: str) -> None:
    """Kills every process in namespace ``name``, then deletes it (and its interfaces)."""
    for _ in range(50):
        pids = subprocess.run(
            ["ip", "netns", "pids", name], capture_output=True, text=True, check=False
        ).stdout.split()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.1)
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def _root_addresses() -> list[ipaddress.IPv4Interface]:
    out = subprocess.run(
        ["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=False
    )
    found = []
    for line in out.stdout.splitlines():
        words = line.split()
        if "inet" in words:
            found.append(ipaddress.IPv4Interface(words[words.index("inet") + 1]))
    return found


class EmulatedCluster:
    """``hosts`` emulated machines joined by a switch, every link shaped to ``shape``.

    Use as a context manager; :attr:`hosts` lists the machines in order (addresses .1,
    .2, ... of ``subnet``).
    """

    def __init__(
        self, hosts: int, shape: LinkShape, subnet: str = DEFAULT_SUBNET, log: IO[str] | None = None
    ) -> None:
        net = ipaddress.IPv4Network(subnet)
        if hosts < 2:
            raise ValueError(f"an emulated cluster needs at least 2 hosts, got {hosts}")
        if hosts > min(net.num_addresses - 2, 250):
            raise ValueError(f"{hosts} hosts do not fit in {subnet} (at most 250)")
        self.shape = shape
        self.subnet = net
        self.hosts = [
            EmulatedHost(i, f"{PREFIX}-h{i + 1}", str(net.network_address + i + 1))
            for i in range(hosts)
        ]
        self.switch = f"{PREFIX}-switch"
        self._log = log
        self._lock: IO[str] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._old_handlers: dict[int, object] = {}

    # -- lifetime -------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        if self.shape.delay_ms and not netem_available():
            raise ClusterUnavailable(
                "a link delay needs tc's netem, which this kernel lacks (sch_netem); run "
                "without a delay"
            )
        self._take_lock()
        self._install_signal_handlers()
        try:
            self._remove_leftovers()
            for addr in _root_addresses():
                if addr.ip in self.subnet or self.subnet.overlaps(addr.network):
                    raise ClusterError(
                        f"the root namespace already has {addr} in the emulated subnet "
                        f"{self.subnet}; choose another subnet"
                    )
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._message("tearing down the emulated cluster")
        for name in [self.switch, *(h.namespace for h in self.hosts)]:
            remove_namespace(name)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        self._restore_signal_handlers()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _take_lock(self) -> None:
        LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
        lock = LOCK_PATH.open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise ClusterUnavailable(
                f"another emulated-cluster run holds {LOCK_PATH} ({holder}); wait for it"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}\n")
        lock.flush()
        self._lock = lock

    def _install_signal_handlers(self) -> None:
        def stop(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError):  # not the main thread: leave them be
                self._old_handlers[sig] = signal.signal(sig, stop)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._old_handlers.clear()

    def _remove_leftovers(self) -> None:
        leftovers = namespaces_with_prefix()
        if leftovers:
            self._message(f"removing leftovers of an earlier run: {', '.join(leftovers)}")
        for name in leftovers:
            remove_namespace(name)

    def _message(self, text: str) -> None:
        if self._log is not None:
            print(f"[cluster] {text}", file=self._log, flush=True)

    # -- building -------------------------------------------------------------------------

    def _build(self) -> None:
        shape = self.shape
        self._message(
            f"{len(self.hosts)} hosts at {shape.rate_mbit:g} Mbit/s per direction"
            + (f", {shape.delay_ms:g} ms delay" if shape.delay_ms else "")
            + f", MTU {shape.mtu}, subnet {self.subnet}"
        )
        sw = self.switch
        _sh(["ip", "netns", "add", sw], "creating the switch namespace")
        _sh(
            ["ip", "-n", sw, "link", "add", "br0", "type", "bridge", "stp_state", "0"],
            "creating the bridge",
        )
        _sh(["ip", "-n", sw, "link", "set", "br0", "mtu", str(shape.mtu), "up"], "bridge up")
        # Bridged frames need not pass the switch namespace's (empty) iptables.
        subprocess.run(
            self.command_in(sw, ["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0"]),
            capture_output=True,
            check=False,
        )
        for host in self.hosts:
            ns, port = host.namespace, f"port{host.index + 1}"
            what = f"building host {host.address}"
            _sh(["ip", "netns", "add", ns], what)
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"], what)
            _sh(
                [
                    *("ip", "link", "add", "eth0", "netns", ns, "type", "veth"),
                    *("peer", "name", port, "netns", sw),
                ],
                what,
            )
            _sh(["ip", "-n", ns, "link", "set", "eth0", "mtu", str(shape.mtu)], what)
            _sh(["ip", "-n", sw, "link", "set", port, "mtu", str(shape.mtu)], what)
            _sh(["ip", "-n", sw, "link", "set", port, "master", "br0"], what)
            _sh(["ip", "-n", sw, "link", "set", port, "up"], what)
            prefix = self.subnet.prefixlen
            _sh(["ip", "-n", ns, "addr", "add", f"{host.address}/{prefix}", "dev", "eth0"], what)
            _sh(["ip", "-n", ns, "link", "set", "eth0", "up"], what)
            self._shape(ns, "eth0", f"shaping {host.address}'s egress")
            self._shape(sw, port, f"shaping {host.address}'s ingress")
        self._wait_reachable()

    def _shape(self, ns: str, dev: str, what: str) -> None:
        shape = self.shape
        rate = f"{shape.rate_mbit * 1000:.0f}kbit"
        burst = str(shape.burst_bytes())
        _sh(
            [
                *("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:"),
                *("htb", "default", "1", "r2q", "100000"),
            ],
            what,
        )
        _sh(
            [
                *("tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1"),
                *("htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst),
            ],
            what,
        )
        leaf = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:"]
        if shape.delay_ms:
            leaf += ["netem", "delay", f"{shape.delay_ms}ms", "limit", str(shape.queue_packets)]
        else:
            leaf += ["pfifo", "limit", str(shape.queue_packets)]
        _sh(leaf, what)

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """Waits until host 1 reaches every other host: a TCP connection to a closed
        port that is refused proves the path (no ping needed on the machine)."""
        probe = (
            "import socket, sys, time\n"
            "for addr in sys.argv[2:]:\n"
            "    deadline = time.monotonic() + float(sys.argv[1])\n"
            "    while True:\n"
            "        try:\n"
            "            socket.create_connection((addr, 9), timeout=1).close()\n"
            "            break\n"
            "        except ConnectionRefusedError:\n"
            "            break\n"
            "        except OSError as e:\n"
            "            if time.monotonic() > deadline:\n"
            "                sys.exit(f'{addr}: {e}')\n"
            "            time.sleep(0.1)\n"
        )
        others = [h.address for h in self.hosts[1:]]
        argv = [sys.executable, "-c", probe, str(timeout), *others]
        done = subprocess.run(
            self.command(self.hosts[0], argv), capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise ClusterError(
                f"host {self.hosts[0].address} cannot reach every other host within "
                f"{timeout:g} s: {done.stderr.strip()}"
            )

    # -- using ----------------------------------------------------------------------------

    def port_bytes(self) -> dict[str, tuple[int, int]]:
        """What each host's switch port has carried so far, by host address: the bytes of
        the frames from the host and of those to it (whole Ethernet frames: every header
        and every TCP acknowledgement counted, as a switch counts them)."""
        argv = ["ip", "-n", self.switch, "-s", "-j", "link", "show"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
        if done.returncode != 0:
            raise ClusterError(f"reading the switch's port counters: {done.stderr.strip()}")
        ports = {link["ifname"]: link["stats64"] for link in json.loads(done.stdout)}
        counts = {}
        for host in self.hosts:
            stats = ports.get(f"port{host.index + 1}")
            if stats is None:
                raise ClusterError(f"the switch has no port for host {host.address}")
            # The port receives what the host sends, and transmits what it receives.
            counts[host.address] = (int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"]))
        return counts

    def command(self, host: EmulatedHost, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return self.command_in(host.namespace, argv)

    @staticmethod
    def command_in(namespace: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace named ``namespace``."""
        return ["ip", "netns", "exec", namespace, *argv]

    def ssh_command(self) -> str:
        """A stand-in for ssh for ``sumflow-run --ssh``: ``CMD HOST COMMAND`` runs
        COMMAND with ``sh -c`` inside the namespace of the host whose address is HOST,
        and refuses any other host (status 255, as ssh does)."""
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="sumflow-bench-")
        path = Path(self._tmp.name) / "netns-ssh"
        cases = "\n".join(f"  {h.address}) ns={h.namespace} ;;" for h in self.hosts)
        path.write_text(
            "#!/bin/sh\n"
            "# ssh stand-in: runs a command inside an emulated host's network namespace.\n"
            'host=$1; shift\ncase "$host" in\n'
            f"{cases}\n"
            '  *) echo "netns-ssh: $host is not an emulated host" >&2; exit 255 ;;\n'
            "esac\n"
            'exec ip netns exec "$ns" sh -c "$*"\n'
        )
        path.chmod(0o755)
        return str(path)


@contextlib.contextmanager
def started(
    cluster: EmulatedCluster, host: EmulatedHost, argv: Sequence[str], **popen: object
) -> Iterator[subprocess.Popen[bytes]]:
    """Starts ``argv`` in ``host``'s namespace; kills it (SIGTERM, then SIGKILL after 5 s)
    when the block exits, whatever happens."""
    proc: subprocess.Popen[bytes] = subprocess.Popen(cluster.command(host, argv), **popen)  # type: ignore[call-overload]
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
