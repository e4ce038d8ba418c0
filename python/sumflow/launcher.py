"""``sumflow-run``: start a whole sumflow job with one command.

On one machine (the default) it starts, over loopback only, a coordinator, one colocated
summation server per emulated worker machine, optional CPU-only summation servers, and the
N worker processes running the user's command::

    sumflow-run -np 4 python train.py --epochs 3
    sumflow-run -np 4 --local-size 2 --servers 1 -- python train.py

With ``-H host1:slots,host2:slots`` or ``--hostfile FILE`` it runs the workers and servers
on those hosts over ssh and the coordinator on this machine (see ``docs/launcher.md``).

What it guarantees:

- The configuration is checked before anything starts; a bad one is reported as
  ``sumflow-run: error: <reason>`` with exit status 2.
- A fresh job token is generated per job and handed to local processes through a private
  file (``SUMFLOW_JOB_TOKEN_FILE``), never on a command line.
- Every output line of every process is printed whole, prefixed with its origin
  (``[worker 0] ``, ``[server 1] ``, ``[cpu-server 0] ``, ``[coordinator] ``).
- When every worker has exited 0, the coordinator and servers get a grace period to stop
  by themselves and the launcher exits 0. When any process fails first, the launcher names
  it, stops every other process (SIGTERM to its process group, then SIGKILL) and exits with
  the failed process's status (128 + signal number for a signal death). SIGINT, SIGTERM
  and SIGHUP to the launcher stop the job the same way (exit 130, 143, 129).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

PROG = "sumflow-run"

#: Shortest job token the core accepts, in bytes.
MIN_TOKEN_BYTES = 16

#: Signals that stop the whole job when the launcher receives them.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: Run on the remote side of every ssh command. Arguments: the directory to work in, then
#: the command. It reads one line from stdin first: the job token, or an empty line when
#: the job uses a token file. The command then runs with stdin from /dev/null while the
#: shell keeps reading the rest of stdin; when that reaches end of file (the launcher
#: stopped the job, died, or its ssh connection dropped) it sends SIGTERM to the command,
#: so no process outlives its job on a remote host. The exit status is the command's.
REMOTE_WRAPPER = (
    'cd "$1" 2>/dev/null; shift; '
    "IFS= read -r t || exit 255; "
    'if [ -n "$t" ]; then SUMFLOW_JOB_TOKEN=$t; export SUMFLOW_JOB_TOKEN; fi; t=; '
    "exec 3<&0; "
    '"$@" </dev/null 3<&- & c=$!; '
    '{ while read -r _; do :; done <&3; kill -TERM "$c" 2>/dev/null; } & w=$!; '
    "exec 3<&-; "
    'wait "$c"; s=$?; kill "$w" 2>/dev/null; exit "$s"'
)

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

DESCRIPTION = """\
Start a sumflow job: a coordinator, summation servers and N worker processes running
COMMAND, every output line prefixed by the process it came from. Without -H/--hostfile
everything runs on this machine over loopback.

Exit status: 0 when every worker exited 0; otherwise the job is stopped and the status is
that of the first process that failed (128+N for signal N); 2 for a bad configuration;
130/143/129 when stopped by SIGINT/SIGTERM/SIGHUP.
"""

EXAMPLES = """\
examples:
  # 4 workers on this machine, one colocated summation server each
  sumflow-run -np 4 python train.py --epochs 3

  # 4 workers as 2 emulated machines of 2 workers, plus 1 CPU-only server
  sumflow-run -np 4 --local-size 2 --servers 1 -- python train.py

  # CPU-only servers, no colocated ones
  sumflow-run -np 2 --no-colocated --servers 2 python train.py

  # cluster: 2 GPU machines of 8 workers, 2 CPU machines running servers, over ssh
  sumflow-run -H gpu1:8,gpu2:8 --server-hosts cpu1,cpu2 \\
      --coordinator-bind 10.0.0.1:29400 --ssh 'ssh -o BatchMode=yes' python train.py

every worker gets SUMFLOW_COORDINATOR, SUMFLOW_JOB_TOKEN_FILE (SUMFLOW_JOB_TOKEN over ssh),
SUMFLOW_RANK, SUMFLOW_NUM_WORKERS, SUMFLOW_HOST_ID, SUMFLOW_WORKER_NAME and torchrun's
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Children do not
inherit SUMFLOW_* variables from this environment; forward one with -x NAME. See
docs/launcher.md.
"""


class ConfigError(Exception):
    """A bad configuration, found before anything starts. The message is the reason."""


@dataclass(frozen=True)
class Host:
    """A cluster machine: the name ssh reaches it by, and how many workers it runs."""

    name: str
    slots: int

    @property
    def address(self) -> str:
        """The host without any ``user@``: its identity and the address servers advertise."""
        return self.name.rsplit("@", 1)[-1]


@dataclass
class Plan:
    """A checked configuration: everything needed to start the job."""

    command: list[str]
    num_workers: int
    #: Worker ranks grouped per machine, in rank order: (host id, ssh host or None, size).
    machines: list[tuple[str, str | None, int]]
    colocated: bool
    cpu_servers: int
    #: Where each CPU server runs over ssh (cluster form), one entry per server.
    cpu_server_hosts: list[str] | None
    engine_threads: int | None
    coordinator_bind: str
    #: The address workers and servers dial, when it is not the one the coordinator reports.
    coordinator_addr: str | None
    ssh: list[str]
    server_program: list[str] | None
    server_port: int
    token_file: Path | None
    #: Variables every worker gets besides its identity (timeouts, partition size, -x).
    worker_env: dict[str, str]
    #: Variables every server and the coordinator get (timeouts, -x).
    service_env: dict[str, str]
    coordinator_args: list[str]
    rust_log: str
    start_timeout: float
    shutdown_grace: float
    kill_timeout: float
    verbose: bool

    @property
    def cluster(self) -> bool:
        """Whether workers run on other hosts over ssh."""
        return any(ssh_host is not None for _, ssh_host, _ in self.machines)

    @property
    def num_servers(self) -> int:
        """Every summation server of the job: colocated ones and CPU-only ones."""
        return (len(self.machines) if self.colocated else 0) + self.cpu_servers


@dataclass
class ProcSpec:
    """One process of the job, before it starts."""

    #: Names the process in prefixes and messages: "worker 0", "server 1", "coordinator".
    name: str
    #: "worker", "server" or "coordinator".
    kind: str
    argv: list[str]
    #: The variables the launcher sets for it (on top of the inherited environment when
    #: local; the whole remote ``env`` when over ssh).
    env: dict[str, str] = field(default_factory=dict)
    #: The ssh host it runs on, or None for this machine.
    host: str | None = None


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``sumflow-run`` argument parser."""
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=(
            "%(prog)s -np N [--servers K] [--colocated | --no-colocated] [--local-size G] "
            "[options] [--] command [args...]"
        ),
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    job = p.add_argument_group("job")
    job.add_argument(
        "-np",
        "-n",
        dest="np",
        type=int,
        metavar="N",
        help="number of worker processes (required on one machine; in the cluster form it "
        "defaults to the sum of the hosts' slots and must equal it if given)",
    )
    job.add_argument(
        "--servers",
        type=int,
        metavar="K",
        help="CPU-only summation servers (host ids cpu-0 ... cpu-K-1) [default: 0 on one "
        "machine, one per --server-hosts entry in the cluster form]",
    )
    job.add_argument(
        "--colocated",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run one summation server on each worker machine, sharing its host id "
        "[default: on]; --no-colocated needs --servers K >= 1",
    )
    job.add_argument(
        "--local-size",
        type=int,
        metavar="G",
        help="one machine only: workers per emulated machine; ranks are grouped G per "
        "machine, machine m has host id local-m and (with --colocated) its own server; N "
        "must be divisible by G [default: 1]",
    )
    job.add_argument(
        "--engine-threads",
        type=int,
        metavar="E",
        help="engine threads per summation server [default: 1 on one machine, the "
        "server's own default (half the cores) in the cluster form]",
    )
    job.add_argument(
        "--partition-bytes",
        type=int,
        metavar="BYTES",
        help="largest partition a tensor is cut into (SUMFLOW_PARTITION_BYTES for workers; "
        "the fifo scheduler sends whole tensors)",
    )
    job.add_argument(
        "--scheduler",
        choices=("fifo", "p3", "bytescheduler", "prophet"),
        help="when partitions enter the network (SUMFLOW_SCHEDULER for workers; "
        "docs/scheduling.md) [default: bytescheduler]",
    )
    job.add_argument(
        "--credit-bytes",
        type=int,
        metavar="BYTES",
        help="unacknowledged bytes per server for bytescheduler and prophet, 0 for no limit "
        "(SUMFLOW_CREDIT_BYTES for workers) [default: 2 partitions]",
    )
    job.add_argument(
        "--timeout",
        type=float,
        metavar="SECS",
        help="how long a worker waits for one operation (SUMFLOW_TIMEOUT for workers)",
    )
    job.add_argument(
        "--heartbeat-timeout",
        type=float,
        metavar="SECS",
        help="seconds of silence after which a node is declared failed (passed to the "
        "coordinator and as SUMFLOW_HEARTBEAT_TIMEOUT to every process)",
    )
    job.add_argument(
        "--join-timeout",
        type=float,
        metavar="SECS",
        help="seconds every node has to join the job (passed to the coordinator and as "
        "SUMFLOW_JOIN_TIMEOUT to every process)",
    )
    job.add_argument(
        "--wire-stats",
        metavar="DIR",
        help="each summation server writes the bytes it exchanged with the workers, per key, "
        "to DIR/server-RANK.json when it stops (SUMFLOW_WIRE_STATS_DIR for servers; read them "
        "with sumflow.torch.server_wire_bytes); over ssh, on each server's host",
    )
    job.add_argument(
        "--trace",
        metavar="DIR",
        help="record a Chrome trace of every worker into DIR (SUMFLOW_TRACE_DIR for workers; "
        "see docs/tracing.md); over ssh each host writes its workers' traces there",
    )
    job.add_argument(
        "--trace-start-step",
        type=int,
        metavar="N",
        help="first traced step, counting from 0 (SUMFLOW_TRACE_START_STEP) [default: 10]",
    )
    job.add_argument(
        "--trace-steps",
        type=int,
        metavar="N",
        help="how many steps are traced (SUMFLOW_TRACE_STEPS) [default: 5]",
    )
    job.add_argument(
        "-x",
        "--env",
        dest="env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="set NAME for every process, to VALUE or to its value here (repeatable); the "
        "way to forward variables to ssh hosts, and SUMFLOW_* ones at all",
    )
    job.add_argument(
        "--token-file",
        metavar="PATH",
        help="use this job token file (at least 16 bytes) instead of a fresh token; in the "
        "cluster form it must exist at the same path on every host, and the token is then "
        "never sent over ssh",
    )
    job.add_argument(
        "--server-program",
        metavar="CMD",
        help="command that runs a summation server (shell words) [default: this "
        "environment's sumflow-server locally, sumflow-server from the PATH over ssh]",
    )

    life = p.add_argument_group("supervision")
    life.add_argument(
        "--start-timeout",
        type=float,
        default=30.0,
        metavar="SECS",
        help="how long to wait for the coordinator to listen [default: 30]",
    )
    life.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        metavar="SECS",
        help="after every worker exited 0, how long the coordinator and servers get to stop "
        "by themselves before they are terminated (SIGTERM, which they also handle "
        "gracefully) [default: 5]",
    )
    life.add_argument(
        "--kill-timeout",
        type=float,
        default=5.0,
        metavar="SECS",
        help="how long a process gets after SIGTERM before SIGKILL [default: 5]",
    )
    life.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print each process's command and pid as it starts, and run the programs with "
        "RUST_LOG=info (unless RUST_LOG is set; the default is warn)",
    )

    cl = p.add_argument_group("cluster form (workers and servers on other hosts over ssh)")
    hosts = cl.add_mutually_exclusive_group()
    hosts.add_argument(
        "-H",
        "--hosts",
        metavar="HOST:SLOTS,...",
        help="worker hosts and how many workers each runs (HOST alone means 1 slot); ranks "
        "are assigned host by host in this order",
    )
    hosts.add_argument(
        "--hostfile",
        metavar="FILE",
        help="worker hosts, one a line: 'host slots=N' or 'host:N' ('#' starts a comment)",
    )
    cl.add_argument(
        "--server-hosts",
        metavar="HOST,...",
        help="hosts that run the CPU-only servers, assigned round-robin",
    )
    cl.add_argument(
        "--coordinator-bind",
        metavar="HOST:PORT",
        help="address the coordinator (on this machine) listens on; required in the cluster "
        "form, e.g. 10.0.0.1:29400 (port 0 picks a free port)",
    )
    cl.add_argument(
        "--coordinator-addr",
        metavar="HOST[:PORT]",
        help="address the other hosts dial to reach the coordinator [default: the bind "
        "address; the port defaults to the bound one]",
    )
    cl.add_argument(
        "--server-port",
        type=int,
        default=0,
        metavar="PORT",
        help="port the summation servers on ssh hosts listen on (all interfaces) "
        "[default: 0, any free port]",
    )
    p.add_argument(
        "--master-port",
        type=int,
        metavar="PORT",
        help="MASTER_PORT given to every worker, for torch.distributed's env:// rendezvous "
        "alongside MASTER_ADDR (the first worker machine) [default: a free port on this "
        "machine; 29500 in the cluster form]",
    )
    cl.add_argument(
        "--ssh",
        default="ssh",
        metavar="CMD",
        help="ssh command (shell words), e.g. 'ssh -o BatchMode=yes' [default: ssh]",
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the worker program and its arguments (after '--' if it could be mistaken "
        "for an option of sumflow-run)",
    )
    return p


def parse_host_entry(item: str, where: str) -> tuple[Host, bool]:
    """``host``, ``host:slots`` or ``[v6addr]:slots`` (``where`` names the source); also
    says whether the slots were given."""
    item = item.strip()
    slots_text: str | None = None
    if item.startswith("["):
        end = item.find("]")
        if end < 0:
            raise ConfigError(f"{where}: missing ']' in {item!r}")
        name, rest = item[1:end], item[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ConfigError(f"{where}: expected ':SLOTS' after ']' in {item!r}")
            slots_text = rest[1:]
    elif item.count(":") == 1:
        name, slots_text = item.split(":")
    else:
        name = item
    if not name:
        raise ConfigError(f"{where}: empty host name in {item!r}")
    slots = 1 if slots_text is None else _slots(slots_text, name, where)
    return Host(name, slots), slots_text is not None


def _slots(text: str, name: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise ConfigError(f"{where}: slots of {name} must be a number, got {text!r}") from None
    if slots < 1:
        raise ConfigError(f"{where}: {name} needs at least 1 slot, got {slots}")
    return slots


def parse_hosts(text: str) -> list[Host]:
    """The value of ``-H``: ``host1:slots,host2:slots``."""
    hosts = []
    for item in text.split(","):
        if not item.strip():
            raise ConfigError(f"-H {text!r}: empty host entry")
        hosts.append(parse_host_entry(item, f"-H {text!r}")[0])
    return _no_duplicates(hosts, "-H")


def parse_hostfile(text: str, path: str) -> list[Host]:
    """A host file: lines ``host slots=N`` or ``host:N`` or ``host``; ``#`` comments."""
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{lineno}"
        first, *fields = line.split()
        host, explicit = parse_host_entry(first, where)
        for f in fields:
            key, eq, value = f.partition("=")
            if key != "slots" or not eq:
                raise ConfigError(f"{where}: unknown field {f!r} (expected slots=N)")
            if explicit:
                raise ConfigError(f"{where}: slots given twice for {host.name}")
            host, explicit = Host(host.name, _slots(value, host.name, where)), True
        hosts.append(host)
    if not hosts:
        raise ConfigError(f"--hostfile {path}: no hosts in it")
    return _no_duplicates(hosts, f"--hostfile {path}")


def _no_duplicates(hosts: list[Host], where: str) -> list[Host]:
    seen: set[str] = set()
    for h in hosts:
        if h.address in seen:
            raise ConfigError(f"{where}: host {h.address} is listed twice")
        seen.add(h.address)
    return hosts


def split_host_port(text: str, what: str, port_required: bool = True) -> tuple[str, int | None]:
    """``host:port`` or ``[v6]:port`` (port optional unless ``port_required``)."""
    if text.startswith("["):
        end = text.find("]")
        rest = text[end + 1 :]
        if end < 0 or (rest and not rest.startswith(":")):
            raise ConfigError(f"{what} {text!r}: expected HOST:PORT")
        host, port_text = text[1:end], (rest[1:] if rest else None)
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" not in text:
        host, port_text = text, None
    else:
        raise ConfigError(f"{what} {text!r}: write IPv6 addresses as [ADDR]:PORT")
    if not host:
        raise ConfigError(f"{what} {text!r}: no host")
    if port_text is None:
        if port_required:
            raise ConfigError(f"{what} {text!r}: expected HOST:PORT")
        return host, None
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{what} {text!r}: the port must be a number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{what} {text!r}: the port must be 0 to 65535")
    return host, port


def join_host_port(host: str, port: int) -> str:
    """``host:port``, bracketing IPv6 addresses."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _seconds(value: float | None, flag: str, allow_zero: bool = False) -> None:
    if value is None:
        return
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        kind = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{flag} must be {kind} number of seconds, got {value}")


def _check_program(program: str) -> None:
    """Fails unless ``program`` can be executed here, as the OS would find it."""
    if "/" in program:
        path = Path(program)
        if not path.exists():
            raise ConfigError(f"cannot run {program!r}: no such file")
        if path.is_dir() or not os.access(path, os.X_OK):
            raise ConfigError(f"cannot run {program!r}: not an executable file")
    elif shutil.which(program) is None:
        hint = ""
        if Path(program).is_file():
            hint = f" (to run the file in this directory, write ./{program})"
        raise ConfigError(f"cannot run {program!r}: no such program on PATH{hint}")


def _free_port() -> int:
    """A TCP port free on loopback now (another program may take it before the job does,
    as with any such choice; --master-port fixes it instead)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _forwarded_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not _ENV_NAME.match(name):
            raise ConfigError(f"-x {item!r}: {name!r} is not a variable name")
        if not eq:
            if name not in os.environ:
                raise ConfigError(f"-x {name}: {name} is not set here; write -x {name}=VALUE")
            value = os.environ[name]
        env[name] = value
    return env


def make_plan(args: argparse.Namespace) -> Plan:
    """Checks the parsed arguments and resolves them into a plan; raises ConfigError."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command given: write the worker program after the options")
    if args.servers is not None and args.servers < 0:
        raise ConfigError(f"--servers must be at least 0, got {args.servers}")
    if args.engine_threads is not None and args.engine_threads < 1:
        raise ConfigError(f"--engine-threads must be at least 1, got {args.engine_threads}")
    if args.partition_bytes is not None and args.partition_bytes < 1:
        raise ConfigError(f"--partition-bytes must be at least 1, got {args.partition_bytes}")
    if args.credit_bytes is not None and args.credit_bytes < 0:
        raise ConfigError(f"--credit-bytes must be at least 0, got {args.credit_bytes}")
    for value, flag in (
        (args.timeout, "--timeout"),
        (args.heartbeat_timeout, "--heartbeat-timeout"),
        (args.join_timeout, "--join-timeout"),
        (args.start_timeout, "--start-timeout"),
        (args.kill_timeout, "--kill-timeout"),
    ):
        _seconds(value, flag)
    _seconds(args.shutdown_grace, "--shutdown-grace", allow_zero=True)
    if not 0 <= args.server_port <= 65535:
        raise ConfigError(f"--server-port must be 0 to 65535, got {args.server_port}")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise ConfigError(f"--master-port must be 1 to 65535, got {args.master_port}")

    forwarded = _forwarded_env(args.env)
    ssh = shlex.split(args.ssh) if args.ssh else []
    server_program = shlex.split(args.server_program) if args.server_program else None
    if args.server_program is not None and not server_program:
        raise ConfigError("--server-program is empty")

    token_file = None
    if args.token_file is not None:
        token_file = Path(args.token_file).absolute()
        try:
            token = token_file.read_bytes().rstrip()
        except OSError as e:
            raise ConfigError(f"--token-file {args.token_file}: {e.strerror}") from None
        if len(token) < MIN_TOKEN_BYTES:
            raise ConfigError(
                f"--token-file {args.token_file}: the token must be at least "
                f"{MIN_TOKEN_BYTES} bytes, it has {len(token)}"
            )

    hosts: list[Host] | None = None
    if args.hosts is not None:
        hosts = parse_hosts(args.hosts)
    elif args.hostfile is not None:
        try:
            text = Path(args.hostfile).read_text()
        except OSError as e:
            raise ConfigError(f"--hostfile {args.hostfile}: {e.strerror}") from None
        hosts = parse_hostfile(text, args.hostfile)

    machines: list[tuple[str, str | None, int]]
    cpu_server_hosts: list[str] | None = None
    if hosts is None:
        for flag, value in (
            ("--server-hosts", args.server_hosts),
            ("--coordinator-bind", args.coordinator_bind),
            ("--coordinator-addr", args.coordinator_addr),
        ):
            if value is not None:
                raise ConfigError(f"{flag} needs the cluster form (-H or --hostfile)")
        if args.np is None:
            raise ConfigError("-np N is required (the number of worker processes)")
        n = args.np
        if n < 1:
            raise ConfigError(f"-np must be at least 1, got {n}")
        g = 1 if args.local_size is None else args.local_size
        if g < 1:
            raise ConfigError(f"--local-size must be at least 1, got {g}")
        if n % g:
            raise ConfigError(
                f"-np {n} is not divisible by --local-size {g}: every emulated machine "
                f"runs exactly {g} workers"
            )
        machines = [(f"local-{m}", None, g) for m in range(n // g)]
        cpu_servers = args.servers or 0
        engine_threads = 1 if args.engine_threads is None else args.engine_threads
        coordinator_bind = "127.0.0.1:0"
        coordinator_addr = None
        _check_program(command[0])
    else:
        if args.local_size is not None:
            raise ConfigError(
                "--local-size is for one machine; in the cluster form each host's slots are "
                "its local size"
            )
        n = sum(h.slots for h in hosts)
        if args.np is not None and args.np != n:
            raise ConfigError(f"-np {args.np} does not match the hosts' {n} slots in all")
        machines = [(h.address, h.name, h.slots) for h in hosts]
        server_hosts = []
        if args.server_hosts is not None:
            server_hosts = [s.strip() for s in args.server_hosts.split(",")]
            if not all(server_hosts):
                raise ConfigError(f"--server-hosts {args.server_hosts!r}: empty host entry")
        cpu_servers = len(server_hosts) if args.servers is None else args.servers
        if cpu_servers and not server_hosts:
            raise ConfigError(
                f"--servers {cpu_servers} in the cluster form needs --server-hosts to say "
                "where they run"
            )
        if server_hosts and not cpu_servers:
            raise ConfigError("--server-hosts given with --servers 0")
        cpu_server_hosts = [server_hosts[k % len(server_hosts)] for k in range(cpu_servers)]
        engine_threads = args.engine_threads
        if args.coordinator_bind is None:
            raise ConfigError(
                "the cluster form needs --coordinator-bind HOST:PORT, an address of this "
                "machine the other hosts can reach (e.g. 10.0.0.1:29400)"
            )
        bind_host, _ = split_host_port(args.coordinator_bind, "--coordinator-bind")
        coordinator_bind = args.coordinator_bind
        coordinator_addr = args.coordinator_addr
        if coordinator_addr is not None:
            split_host_port(coordinator_addr, "--coordinator-addr", port_required=False)
        elif bind_host in ("0.0.0.0", "::"):
            raise ConfigError(
                f"--coordinator-bind {args.coordinator_bind} listens on every interface; "
                "give --coordinator-addr, the address the other hosts dial"
            )
        if not ssh:
            raise ConfigError("--ssh is empty")
        _check_program(ssh[0])

    if not args.colocated and cpu_servers < 1:
        raise ConfigError(
            "--no-colocated needs --servers K with K >= 1: the job needs at least one "
            "summation server"
        )

    common: dict[str, str] = {}
    coordinator_args = []
    if args.heartbeat_timeout is not None:
        common["SUMFLOW_HEARTBEAT_TIMEOUT"] = repr(float(args.heartbeat_timeout))
        coordinator_args += ["--heartbeat-timeout", common["SUMFLOW_HEARTBEAT_TIMEOUT"]]
    if args.join_timeout is not None:
        common["SUMFLOW_JOIN_TIMEOUT"] = repr(float(args.join_timeout))
        coordinator_args += ["--join-timeout", common["SUMFLOW_JOIN_TIMEOUT"]]
    worker_env = dict(common)
    # torch.distributed's env:// rendezvous, so a worker can open gloo/nccl groups next to
    # sumflow (rank 0 of the first machine hosts the store, as under torchrun).
    worker_env["MASTER_ADDR"] = "127.0.0.1" if hosts is None else machines[0][0]
    if args.master_port is not None:
        worker_env["MASTER_PORT"] = str(args.master_port)
    else:
        worker_env["MASTER_PORT"] = str(_free_port() if hosts is None else 29500)
    if args.partition_bytes is not None:
        worker_env["SUMFLOW_PARTITION_BYTES"] = str(args.partition_bytes)
    if args.scheduler is not None:
        worker_env["SUMFLOW_SCHEDULER"] = args.scheduler
    if args.credit_bytes is not None:
        worker_env["SUMFLOW_CREDIT_BYTES"] = str(args.credit_bytes)
    if args.timeout is not None:
        worker_env["SUMFLOW_TIMEOUT"] = repr(float(args.timeout))
    worker_env.update(_trace_env(args))
    # Local emulated machines all share this one.
    per_host = n if hosts is None else max(size for _, _, size in machines)
    if per_host > 1 and "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: several workers on a machine would each start an OpenMP pool
        # as large as the machine, and threads spinning between parallel regions starve
        # the others (-x OMP_NUM_THREADS=N or the launcher's environment overrides it).
        worker_env["OMP_NUM_THREADS"] = "1"
    worker_env.update(forwarded)
    service_env = {**common, **forwarded}
    if args.wire_stats is not None:
        if not args.wire_stats:
            raise ConfigError("--wire-stats needs a directory")
        service_env["SUMFLOW_WIRE_STATS_DIR"] = str(Path(args.wire_stats).absolute())

    if "RUST_LOG" in os.environ:
        rust_log = os.environ["RUST_LOG"]
    else:
        rust_log = "info" if args.verbose else "warn"

    return Plan(
        command=command,
        num_workers=n,
        machines=machines,
        colocated=args.colocated,
        cpu_servers=cpu_servers,
        cpu_server_hosts=cpu_server_hosts,
        engine_threads=engine_threads,
        coordinator_bind=coordinator_bind,
        coordinator_addr=coordinator_addr,
        ssh=ssh,
        server_program=server_program,
        server_port=args.server_port,
        token_file=token_file,
        worker_env=worker_env,
        service_env=service_env,
        coordinator_args=coordinator_args,
        rust_log=rust_log,
        start_timeout=args.start_timeout,
        shutdown_grace=args.shutdown_grace,
        kill_timeout=args.kill_timeout,
        verbose=args.verbose,
    )


# --------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------


def _trace_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' ``SUMFLOW_TRACE_*`` variables from ``--trace`` and its window."""
    if args.trace is None:
        for flag, value in (
            ("--trace-start-step", args.trace_start_step),
            ("--trace-steps", args.trace_steps),
        ):
            if value is not None:
                raise ConfigError(f"{flag} needs --trace DIR, the directory traces go to")
        return {}
    if not args.trace:
        raise ConfigError("--trace needs a directory")
    env = {"SUMFLOW_TRACE_DIR": str(Path(args.trace).absolute())}
    if args.trace_start_step is not None:
        if args.trace_start_step < 0:
            raise ConfigError(f"--trace-start-step must be at least 0, got {args.trace_start_step}")
        env["SUMFLOW_TRACE_START_STEP"] = str(args.trace_start_step)
    if args.trace_steps is not None:
        if args.trace_steps < 1:
            raise ConfigError(f"--trace-steps must be at least 1, got {args.trace_steps}")
        env["SUMFLOW_TRACE_STEPS"] = str(args.trace_steps)
    return env


def program(name: str) -> list[str]:
    """How to run the console script ``name`` ("sumflow-server" or "sumflow-coordinator"):
    this environment's script, else one on PATH, else this interpreter running the same
    entry point (``sumflow._cli``)."""
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return [str(candidate)]
    found = shutil.which(name)
    if found:
        return [found]
    entry = {"sumflow-server": "server", "sumflow-coordinator": "coordinator"}[name]
    return [sys.executable, "-c", f"from sumflow._cli import {entry}; {entry}()"]


def build_processes(plan: Plan, coordinator: str) -> list[ProcSpec]:
    """The servers, then the workers, of ``plan`` once the coordinator listens at
    ``coordinator`` (the address they dial). The token is not in these environments."""
    specs = []
    local_server = plan.server_program or program("sumflow-server")
    remote_server = plan.server_program or ["sumflow-server"]

    def server(name: str, host_id: str, ssh_host: str | None) -> ProcSpec:
        argv = [*(remote_server if ssh_host else local_server), "--coordinator", coordinator]
        if ssh_host is not None:
            advertise = Host(ssh_host, 1).address
            argv += ["--bind", join_host_port("0.0.0.0", plan.server_port)]
            argv += ["--advertise", advertise]
        argv += ["--host-id", host_id]
        if plan.engine_threads is not None:
            argv += ["--engine-threads", str(plan.engine_threads)]
        return ProcSpec(name, "server", argv, dict(plan.service_env), ssh_host)

    if plan.colocated:
        for m, (host_id, ssh_host, _) in enumerate(plan.machines):
            specs.append(server(f"server {m}", host_id, ssh_host))
    for k in range(plan.cpu_servers):
        ssh_host = plan.cpu_server_hosts[k] if plan.cpu_server_hosts else None
        specs.append(server(f"cpu-server {k}", f"cpu-{k}", ssh_host))

    rank = 0
    for host_id, ssh_host, size in plan.machines:
        for local_rank in range(size):
            env = {
                "SUMFLOW_COORDINATOR": coordinator,
                "SUMFLOW_RANK": str(rank),
                "SUMFLOW_NUM_WORKERS": str(plan.num_workers),
                "SUMFLOW_HOST_ID": host_id,
                "SUMFLOW_WORKER_NAME": f"worker {rank}",
                "RANK": str(rank),
                "WORLD_SIZE": str(plan.num_workers),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(size),
                **plan.worker_env,
            }
            specs.append(ProcSpec(f"worker {rank}", "worker", list(plan.command), env, ssh_host))
            rank += 1
    return specs


def remote_command(spec: ProcSpec, cwd: str) -> str:
    """The command line ssh runs on ``spec.host``: REMOTE_WRAPPER around
    ``env VAR=VALUE ... argv``, quoted for a POSIX shell."""
    assignments = [f"{k}={v}" for k, v in spec.env.items()]
    return shlex.join(["sh", "-c", REMOTE_WRAPPER, PROG, cwd, "env", *assignments, *spec.argv])


def describe_exit(code: int) -> str:
    """``exited with code C`` or ``was killed by SIGNAME`` for a Popen return code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def exit_status(code: int) -> int:
    """The launcher's exit status for a child's Popen return code (128+N for signal N)."""
    return 128 - code if code < 0 else code


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Output:
    """Writes whole lines to this process's stdout and stderr, one writer at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def write(self, to_stderr: bool, data: bytes) -> None:
        """Writes ``data`` (whole lines) and flushes; output errors are ignored."""
        stream = sys.stderr if to_stderr else sys.stdout
        with self._lock:
            try:
                buffer = getattr(stream, "buffer", None)
                stream.flush()
                if buffer is not None:
                    buffer.write(data)
                    buffer.flush()
                else:
                    stream.write(data.decode(errors="replace"))
                    stream.flush()
            except (OSError, ValueError):
                pass

    def message(self, text: str) -> None:
        """A message of the launcher itself, on stderr."""
        self.write(True, f"{PROG}: {text}\n".encode())

    def pump(self, source: IO[bytes], to_stderr: bool, prefix: bytes) -> None:
        """Copies ``source`` line by line, each prefixed, until end of file."""
        with source:
            while True:
                try:
                    line = source.readline(1 << 16)
                except (OSError, ValueError):
                    return
                if not line:
                    return
                if not line.endswith(b"\n"):
                    line += b"\n"
                self.write(to_stderr, prefix + line)


class Child:
    """A started process: its output is pumped, and its exit is reported on ``events``."""

    def __init__(
        self,
        spec: ProcSpec,
        proc: subprocess.Popen[bytes],
        output: Output,
        events: queue.Queue[Child],
    ) -> None:
        self.spec = spec
        self.proc = proc
        self.returncode: int | None = None
        self.done = threading.Event()
        self._events = events
        prefix = f"[{spec.name}] ".encode()
        self._threads = [
            threading.Thread(target=output.pump, args=(proc.stdout, False, prefix), daemon=True),
            threading.Thread(target=output.pump, args=(proc.stderr, True, prefix), daemon=True),
        ]
        waiter = threading.Thread(target=self._wait, daemon=True)
        for t in self._threads:
            t.start()
        waiter.start()

    @property
    def pid(self) -> int:
        """The process id (also its process group id)."""
        return self.proc.pid

    def describe(self) -> str:
        """Names the process for messages: ``worker 1 on node2 (pid 4242)``."""
        where = f" on {self.spec.host}" if self.spec.host else ""
        return f"{self.spec.name}{where} (pid {self.pid})"

    def _wait(self) -> None:
        code = self.proc.wait()
        self.returncode = code
        self.done.set()
        self._events.put(self)

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to the process's group, unless it has exited."""
        if self.done.is_set():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def close_stdin(self) -> None:
        """Closes its stdin (for ssh children: the remote side stops the command)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def join_output(self, deadline: float) -> None:
        """Waits, until ``deadline`` at most, for its output to be copied out."""
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


class Launcher:
    """Runs one job to its end: starts every process, supervises, tears down."""

    def __init__(self, plan: Plan, output: Output | None = None) -> None:
        self.plan = plan
        self.out = output or Output()
        self.children: list[Child] = []
        self._events: queue.Queue[Child] = queue.Queue()
        self._signals: list[int] = []
        self._tmp: Path | None = None
        self._token = ""
        self._base_env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
        self._base_env["RUST_LOG"] = plan.rust_log
        # The programs colour their logs even into pipes; not when this output is no
        # terminal either (a log file, CI), unless asked to.
        self._service_env: dict[str, str] = {}
        if "NO_COLOR" not in os.environ and not _isatty(sys.stderr):
            self._service_env["NO_COLOR"] = "1"

    # -- entry -------------------------------------------------------------------------

    def run(self) -> int:
        """Runs the job; returns the launcher's exit status."""
        previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}
        try:
            for sig in STOP_SIGNALS:
                previous[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread: no signal handling
            pass
        try:
            return self._run()
        finally:
            self._teardown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)

    def _run(self) -> int:
        plan = self.plan
        self._tmp = Path(tempfile.mkdtemp(prefix="sumflow-run-"))  # mode 0700
        if plan.token_file is not None:
            token_file = plan.token_file
        else:
            self._token = secrets.token_hex(32)
            token_file = self._tmp / "token"
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self._token + "\n")
        self._base_env["SUMFLOW_JOB_TOKEN_FILE"] = str(token_file)

        addr_file = self._tmp / "coordinator"
        argv = [
            *program("sumflow-coordinator"),
            "--bind",
            plan.coordinator_bind,
            "--workers",
            str(plan.num_workers),
            "--servers",
            str(plan.num_servers),
            "--addr-file",
            str(addr_file),
            *plan.coordinator_args,
        ]
        spec = ProcSpec("coordinator", "coordinator", argv, dict(plan.service_env))
        coordinator, code = self._start(spec)
        if coordinator is None:
            return code
        bound, code = self._await_address(coordinator, addr_file)
        if bound is None:
            return code
        address = self._dial_address(bound)
        for spec in build_processes(plan, address):
            _, code = self._start(spec)
            if code:
                return code
        return self._supervise()

    # -- starting ----------------------------------------------------------------------

    def _start(self, spec: ProcSpec) -> tuple[Child | None, int]:
        """Starts ``spec``; on failure prints why and returns (None, exit status)."""
        if spec.host is None:
            argv = spec.argv
            env = {**self._base_env, **spec.env}
            if spec.kind != "worker":
                env = {**self._service_env, **env}
            stdin: int = subprocess.DEVNULL
        else:
            remote_env = {"RUST_LOG": self.plan.rust_log, **spec.env}
            if self.plan.token_file is not None:
                remote_env["SUMFLOW_JOB_TOKEN_FILE"] = str(self.plan.token_file)
            remote = ProcSpec(spec.name, spec.kind, spec.argv, remote_env, spec.host)
            argv = [*self.plan.ssh, spec.host, remote_command(remote, os.getcwd())]
            env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
            stdin = subprocess.PIPE
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            self.out.message(f"cannot start {spec.name} ({shlex.join(argv[:1])}): {e}")
            if isinstance(e, FileNotFoundError):
                return None, 127
            return None, 126 if isinstance(e, PermissionError) else 1
        child = Child(spec, proc, self.out, self._events)
        self.children.append(child)
        if proc.stdin is not None:
            # The remote wrapper's first line: the token, or nothing with a token file.
            line = "" if self.plan.token_file is not None else self._token
            try:
                proc.stdin.write(line.encode() + b"\n")
                proc.stdin.flush()
            except OSError:
                pass  # it already exited; its exit is reported as any other
        if self.plan.verbose:
            shown = spec.argv if spec.host is None else [*self.plan.ssh, spec.host, *spec.argv]
            self.out.message(f"started {child.describe()}: {shlex.join(shown)}")
        return child, 0

    def _await_address(self, coordinator: Child, addr_file: Path) -> tuple[str | None, int]:
        """Waits for the coordinator's address file; (address, 0) or (None, exit status)."""
        deadline = time.monotonic() + self.plan.start_timeout
        while True:
            if self._signals:
                return None, self._stop_for_signal()
            try:
                text = addr_file.read_text().strip()
            except FileNotFoundError:
                text = ""
            if text:
                return text, 0
            if coordinator.done.is_set():
                code = coordinator.returncode or 0
                self.out.message(
                    f"{coordinator.describe()} {describe_exit(code)} before it listened"
                )
                return None, exit_status(code) or 1
            if time.monotonic() > deadline:
                self.out.message(
                    f"error: the coordinator did not write its address to {addr_file} "
                    f"within {self.plan.start_timeout:g} s (--start-timeout); stopping"
                )
                return None, 1
            time.sleep(0.02)

    def _dial_address(self, bound: str) -> str:
        """The coordinator address the other processes dial."""
        given = self.plan.coordinator_addr
        if given is None:
            return bound
        host, port = split_host_port(given, "--coordinator-addr", port_required=False)
        if not port:
            _, port = split_host_port(bound, "coordinator address")
        return join_host_port(host, port or 0)

    # -- supervising -------------------------------------------------------------------

    def _supervise(self) -> int:
        workers = [c for c in self.children if c.spec.kind == "worker"]
        workers_left = len(workers)
        grace_deadline: float | None = None
        while True:
            if self._signals:
                return self._stop_for_signal()
            try:
                child: Child | None = self._events.get(timeout=0.1)
            except queue.Empty:
                child = None
            if child is not None:
                code = child.returncode or 0
                if code != 0 and workers_left:
                    others = sum(1 for c in self.children if not c.done.is_set())
                    hint = ""
                    if child.spec.host is not None and code == 255:
                        hint = " (ssh's status when it cannot connect)"
                    self.out.message(
                        f"{child.describe()} {describe_exit(code)}{hint}; stopping the "
                        f"other {others} process{'es' if others != 1 else ''}"
                    )
                    return exit_status(code)
                if code != 0:
                    self.out.message(
                        f"warning: {child.describe()} {describe_exit(code)} after every "
                        "worker had finished"
                    )
                if child.spec.kind == "worker":
                    workers_left -= 1
                    if not workers_left:
                        grace_deadline = time.monotonic() + self.plan.shutdown_grace
                        if self.plan.verbose:
                            self.out.message("every worker exited 0")
            if grace_deadline is not None:
                left = [c for c in self.children if not c.done.is_set()]
                if not left:
                    return 0
                if time.monotonic() >= grace_deadline:
                    names = ", ".join(c.spec.name for c in left)
                    self.out.message(
                        f"every worker exited 0; stopping {names}, still running "
                        f"{self.plan.shutdown_grace:g} s later (--shutdown-grace)"
                    )
                    return 0

    def _stop_for_signal(self) -> int:
        sig = self._signals[0]
        name = signal.Signals(sig).name
        self.out.message(f"received {name}; stopping every process")
        return 128 + sig

    def _teardown(self) -> None:
        """Stops every process still running: SIGTERM to its group, SIGKILL after
        --kill-timeout (at once on a second signal), and waits for their output."""
        alive = [c for c in self.children if not c.done.is_set()]
        signals_seen = len(self._signals)
        for c in alive:
            c.close_stdin()
            c.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.plan.kill_timeout
        while alive and time.monotonic() < deadline and len(self._signals) <= signals_seen:
            alive[0].done.wait(0.05)
            alive = [c for c in alive if not c.done.is_set()]
        if alive:
            self.out.message(
                "sending SIGKILL to "
                + ", ".join(c.describe() for c in alive)
                + f": still running {self.plan.kill_timeout:g} s after SIGTERM"
            )
            for c in alive:
                c.signal(signal.SIGKILL)
            deadline = time.monotonic() + 10
            for c in alive:
                if not c.done.wait(max(0.0, deadline - time.monotonic())):
                    self.out.message(f"{c.describe()} did not exit after SIGKILL")
        # Kill anything left in the groups of processes that exited (their children).
        for c in self.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.pid, signal.SIGKILL)
        deadline = time.monotonic() + 2
        for c in self.children:
            c.join_output(deadline)
            c.close_stdin()


def main(argv: Sequence[str] | None = None) -> int:
    """The ``sumflow-run`` console script: returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = make_plan(args)
    except ConfigError as e:
        parser.error(str(e))
    return Launcher(plan).run()


if __name__ == "__main__":
    sys.exit(main())
