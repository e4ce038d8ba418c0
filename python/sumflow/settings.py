"""Every ``SUMFLOW_*`` environment variable the Python side reads, in one table.

Each setting is a typed constant of this module: its name, what text it accepts, its
default (the core's, from ``sumflow._core``, where the core has one), a one-line doc and
who reads it. Values are read from ``os.environ`` when asked for, never cached, and an
unset or empty variable means the default::

    from sumflow import settings

    settings.SCHEDULER.read()            # "bytescheduler" unless SUMFLOW_SCHEDULER says
    settings.PARTITION_BYTES.read()      # None unless set: a size derived per declaration
    settings.TRACE_STEPS.get()           # None unless set, whatever the default

A value that is not allowed raises :class:`SettingError`, which names the variable, its
value and what is allowed. The programs of the core (``sumflow-server``,
``sumflow-coordinator``) read variables of their own, listed in :data:`PROGRAM_VARIABLES`
(their defaults are in their ``--help``). ``python -m sumflow.settings --markdown`` writes
the table of both, ``docs/settings.md``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sumflow import _core

T = TypeVar("T")
U = TypeVar("U")

#: The prefix of every sumflow variable; the launcher hands none of this environment's to
#: its children unless asked to (``sumflow-run -x``).
PREFIX = "SUMFLOW_"

#: The scheduler names the communication service accepts (docs/scheduling.md), the core's.
#: The core refuses any other too, but only a check here can name the variable.
SCHEDULERS: tuple[str, ...] = _core.SCHEDULERS
#: The tuner's search drivers (``sumflow.tune.search``).
TUNE_METHODS = ("bo", "random", "grid")

#: Who reads a setting (the table's "read by" column).
WORKER = "workers"
TUNER = "rank 0's tuner"
SERVER_PROGRAM = "sumflow-server"
COORDINATOR_PROGRAM = "sumflow-coordinator"


class SettingError(ValueError):
    """A ``SUMFLOW_*`` variable holds a value that is not allowed; the message names the
    variable, its value and what is allowed."""


# --------------------------------------------------------------------------------------
# Kinds: what text a setting accepts, and the value it becomes
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind(Generic[T]):
    """How a setting's text becomes a value. ``convert`` raises ValueError for text that is
    not allowed; ``allowed`` says, in a phrase, what is."""

    allowed: str
    convert: Callable[[str], T]


def _bounds(least: float | None, most: float | None, *, above: bool = False) -> str:
    if least is not None and most is not None:
        return f" from {least:g} to {most:g}"
    if least is not None:
        return f" {'>' if above else '>='} {least:g}"
    return ""


def integer(least: int | None = None, most: int | None = None, unit: str = "") -> Kind[int]:
    """A whole number in [`least`, `most`] (either end open when None)."""
    allowed = f"an integer{_bounds(least, most)}{f' ({unit})' if unit else ''}"

    def convert(text: str) -> int:
        value = int(text)
        if (least is not None and value < least) or (most is not None and value > most):
            raise ValueError(allowed)
        return value

    return Kind(allowed, convert)


def number(least: float, *, above: bool = False, unit: str = "") -> Kind[float]:
    """A finite number >= `least` (> `least` with `above`)."""
    allowed = f"a number{_bounds(least, None, above=above)}{f' ({unit})' if unit else ''}"

    def convert(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < least or (above and value == least):
            raise ValueError(allowed)
        return value

    return Kind(allowed, convert)


def choice(
    values: Sequence[str],
    *,
    aliases: Mapping[str, str] | None = None,
    ignore_case: bool = False,
    allowed: str = "",
) -> Kind[str]:
    """One of `values`, or an alias of one; `allowed` words it when the list alone would
    not say enough."""
    fold: Callable[[str], str] = str.lower if ignore_case else str
    names = {fold(v): v for v in values}
    names.update({fold(k): v for k, v in (aliases or {}).items()})

    def convert(text: str) -> str:
        return names[fold(text.strip())]

    return Kind(allowed or f"one of {', '.join(values)}", convert)


def on_off() -> Kind[str]:
    """``on`` or ``off`` (also 1/0, true/false, yes/no, in any case)."""
    return choice(
        ("on", "off"),
        aliases={"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"},
        ignore_case=True,
    )


def text(what: str) -> Kind[str]:
    """Any text; `what` says what it is (a path, an address)."""
    return Kind(what, str)


def byte_range() -> Kind[tuple[int, int]]:
    """``MIN:MAX``, two whole numbers of bytes with 0 < MIN <= MAX."""
    allowed = "MIN:MAX in bytes with 0 < MIN <= MAX, e.g. 65536:33554432"

    def convert(text: str) -> tuple[int, int]:
        low, high = (int(part) for part in text.split(":"))
        if not 0 < low <= high:
            raise ValueError(allowed)
        return low, high

    return Kind(allowed, convert)


# --------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variable(ABC, Generic[T]):
    """A ``SUMFLOW_*`` variable the Python side reads: its name, kind, doc and readers."""

    name: str
    kind: Kind[T]
    #: One line: what it sets.
    doc: str
    #: Who reads it: WORKER or TUNER, then any of the core's programs that read it too.
    readers: tuple[str, ...]

    def raw(self) -> str | None:
        """The variable's text, or None when it is unset or empty."""
        value = os.environ.get(self.name)
        return value if value is not None and value.strip() else None

    def get(self) -> T | None:
        """The variable's value, or None when it is unset or empty."""
        raw = self.raw()
        if raw is None:
            return None
        try:
            return self.kind.convert(raw)
        except (ValueError, KeyError):
            raise self.invalid(raw) from None

    def read_or(self, fallback: U) -> T | U:
        """The variable's value, or `fallback` when it is unset or empty."""
        value = self.get()
        return fallback if value is None else value

    def invalid(self, raw: str, why: str = "") -> SettingError:
        """The error for the value `raw`: what is allowed, or `why` it was refused."""
        return SettingError(
            f"{self.name}={raw!r}: {why or 'expected ' + self.kind.allowed}; "
            f"unset it for {self.default_text()}"
        )

    @abstractmethod
    def read(self) -> T | None:
        """The variable's value, or what unset means (the default, or None)."""

    @abstractmethod
    def default_text(self) -> str:
        """What an unset variable means, in words."""


@dataclass(frozen=True)
class Setting(Variable[T]):
    """A variable with a default: unset or empty, :meth:`read` returns it."""

    default: T

    def read(self) -> T:
        """The variable's value, or the default when it is unset or empty."""
        return self.read_or(self.default)

    def default_text(self) -> str:
        return f"the default, {_format(self.default)}"


@dataclass(frozen=True)
class OptionalSetting(Variable[T]):
    """A variable whose absence means something no value says (no limit, no trace, the
    core decides): :meth:`read` returns None then, and `unset` says what it means."""

    unset: str

    def read(self) -> T | None:
        """The variable's value, or None when it is unset or empty."""
        return self.get()

    def default_text(self) -> str:
        return self.unset


def _format(value: object) -> str:
    if isinstance(value, tuple):
        return ":".join(str(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}"
    return str(value)


_TABLE: list[Variable[Any]] = []
V = TypeVar("V", bound="Variable[Any]")


def _add(variable: V) -> V:
    _TABLE.append(variable)
    return variable


# ---- the job: set by sumflow-run for every worker ---------------------------------------

COORDINATOR = _add(
    OptionalSetting(
        name="SUMFLOW_COORDINATOR",
        kind=text("HOST:PORT"),
        doc="the job's coordinator, which every node joins the job through",
        readers=(WORKER, SERVER_PROGRAM),
        unset="another launcher's job (torchrun, mpirun, horovodrun, srun; docs/launcher.md), "
        "or a job of one",
    )
)
JOB_TOKEN_FILE = _add(
    OptionalSetting(
        name="SUMFLOW_JOB_TOKEN_FILE",
        kind=text("a path"),
        doc="a file holding the job's secret token (read before SUMFLOW_JOB_TOKEN)",
        readers=(WORKER, SERVER_PROGRAM, COORDINATOR_PROGRAM),
        unset="SUMFLOW_JOB_TOKEN",
    )
)
JOB_TOKEN = _add(
    OptionalSetting(
        name="SUMFLOW_JOB_TOKEN",
        kind=text("the token"),
        doc="the job's secret token, the same on every node",
        readers=(WORKER, SERVER_PROGRAM, COORDINATOR_PROGRAM),
        unset="none (under another launcher: on one machine rank 0 makes one up, else it is "
        "derived from the launcher's job id, with a warning)",
    )
)
HOST_ID = _add(
    OptionalSetting(
        name="SUMFLOW_HOST_ID",
        kind=text("a name"),
        doc="the machine a worker runs on: workers with the same one share its colocated "
        "summation server",
        readers=(WORKER, SERVER_PROGRAM),
        unset="the launcher's name for the machine (HOROVOD_HOSTNAME, SLURMD_NODENAME), else "
        "this machine's host name",
    )
)
RANK = _add(
    OptionalSetting(
        name="SUMFLOW_RANK",
        kind=integer(least=0),
        doc="the worker rank to ask the coordinator for",
        readers=(WORKER,),
        unset="the rank another launcher gave (torchrun, mpirun, srun...), else the lowest "
        "free rank",
    )
)
WORKER_NAME = _add(
    OptionalSetting(
        name="SUMFLOW_WORKER_NAME",
        kind=text("a name"),
        doc="how other nodes' messages name this worker",
        readers=(WORKER,),
        unset="worker pid PID",
    )
)
ELASTIC_ADDR = _add(
    OptionalSetting(
        name="SUMFLOW_ELASTIC_ADDR",
        kind=text("HOST:PORT"),
        doc="the elastic launcher's rendezvous, which gives this worker its rank and "
        "coordinator at every change of membership (docs/elastic.md)",
        readers=(WORKER,),
        unset="a job whose membership is fixed",
    )
)
ELASTIC_WORKER = _add(
    OptionalSetting(
        name="SUMFLOW_ELASTIC_WORKER",
        kind=text("a name"),
        doc="this worker's name in an elastic job, the same across changes of membership",
        readers=(WORKER,),
        unset="not an elastic job",
    )
)

# ---- the communication service ----------------------------------------------------------

PARTITION_BYTES = _add(
    OptionalSetting(
        name="SUMFLOW_PARTITION_BYTES",
        kind=integer(least=2, unit="bytes"),
        doc="the largest partition a tensor is cut into (the fifo scheduler sends whole tensors)",
        readers=(WORKER,),
        unset="a size derived from each declaration: the largest power of two giving every server "
        "32 partitions from each worker of a machine, 256 KiB (over the workers per machine, and "
        "raised on links faster than 10 Gbit/s: SUMFLOW_LINK_GBITS) to 4 MiB (docs/scheduling.md)",
    )
)
LINK_GBITS = _add(
    OptionalSetting(
        name="SUMFLOW_LINK_GBITS",
        kind=number(0.001, unit="Gbit/s"),
        doc="this worker's link rate; the slowest any worker states or detects sets the derived "
        "partition size's floor: at least 0.34 ms on the link, as BytePS's 4 MiB at 100 Gbit/s",
        readers=(WORKER,),
        unset="the speed the kernel reports for the network interface that reaches the "
        "coordinator (/sys/class/net/IFACE/speed); none for loopback and for virtual NICs "
        "that report none",
    )
)
SCHEDULER = _add(
    Setting(
        name="SUMFLOW_SCHEDULER",
        kind=choice(SCHEDULERS),
        doc="when partitions enter the network (docs/scheduling.md)",
        readers=(WORKER,),
        default=_core.DEFAULT_SCHEDULER,
    )
)
CREDIT_BYTES = _add(
    OptionalSetting(
        name="SUMFLOW_CREDIT_BYTES",
        kind=integer(least=0, unit="bytes, 0: no limit"),
        doc="bytescheduler's and prophet's credit: bytes pushed to a server and not yet "
        "acknowledged",
        readers=(WORKER,),
        unset=f"{_core.DEFAULT_CREDIT_PARTITIONS} partitions",
    )
)
PUSH_WINDOW_BYTES = _add(
    OptionalSetting(
        name="SUMFLOW_PUSH_WINDOW_BYTES",
        kind=integer(least=0, unit="bytes, 0: no limit"),
        doc="bytes pushed to one server before their sums come back",
        readers=(WORKER,),
        unset=f"{_core.DEFAULT_WINDOW_PARTITIONS} partitions of the starting partition size "
        f"({_core.DEFAULT_WINDOW_PARTITIONS_SEVERAL_WORKERS} where a machine runs several "
        "workers)",
    )
)
PROPHET_STAGE_FACTOR = _add(
    Setting(
        name="SUMFLOW_PROPHET_STAGE_FACTOR",
        kind=number(0.0),
        doc="prophet: a gap between gradients longer than this times the mean gap ends a "
        "stage (0: every gap ends one)",
        readers=(WORKER,),
        default=_core.DEFAULT_PROPHET_STAGE_FACTOR,
    )
)
CPU_SERVER_CONNECTIONS = _add(
    OptionalSetting(
        name="SUMFLOW_CPU_SERVER_CONNECTIONS",
        kind=integer(least=1, most=_core.MAX_CPU_SERVER_CONNECTIONS),
        doc="connections from a worker to each CPU-only server (the same on every worker)",
        readers=(WORKER,),
        unset="BytePS's Eq. 1 and 2 share of the link: round(c/g), at most 4",
    )
)
SHARED_MEMORY = _add(
    Setting(
        name="SUMFLOW_SHARED_MEMORY",
        kind=on_off(),
        doc="sum the tensors whose workers all share a machine in its shared memory "
        "(/dev/shm), not through a summation server (the same on every worker)",
        readers=(WORKER,),
        default="on",
    )
)

HIERARCHICAL = _add(
    Setting(
        name="SUMFLOW_HIERARCHICAL",
        kind=on_off(),
        doc="with shared memory on, aggregate a tensor whose workers span machines inside "
        "each machine first (each machine sends each byte once, not once per worker)",
        readers=(WORKER,),
        default="on",
    )
)

LOCAL_SOCKETS = _add(
    Setting(
        name="SUMFLOW_LOCAL_SOCKETS",
        kind=on_off(),
        doc="reach a summation server on this worker's machine through its Unix socket "
        "rather than TCP (off: TCP to every server)",
        readers=(WORKER,),
        default="on",
    )
)

SERVER_SHARED_MEMORY = _add(
    Setting(
        name="SUMFLOW_SERVER_SHARED_MEMORY",
        kind=on_off(),
        doc="pass the payloads to and from a summation server on this worker's machine "
        "through memory shared with it (BytePS §6.2: the server sums a push where the "
        "worker put it); needs SUMFLOW_LOCAL_SOCKETS (off: through the Unix socket)",
        readers=(WORKER,),
        default="on",
    )
)

# ---- timeouts ---------------------------------------------------------------------------

TIMEOUT = _add(
    Setting(
        name="SUMFLOW_TIMEOUT",
        kind=number(0.0, above=True, unit="seconds"),
        doc="the longest wait for one operation; dead peers are found sooner, by heartbeats",
        readers=(WORKER,),
        default=_core.DEFAULT_OPERATION_TIMEOUT_S,
    )
)
STALL_WARNING = _add(
    Setting(
        name="SUMFLOW_STALL_WARNING",
        kind=number(0.0, unit="seconds, 0: never"),
        doc="how long a worker waits on one operation before it logs what it waits for "
        "(the tensor, the servers or the machine's workers that owe it), and a server's "
        "round keeps workers waiting before it tells them which workers have not pushed it; "
        "again after each further such stretch (Horovod's HOROVOD_STALL_CHECK_TIME_SECONDS)",
        readers=(WORKER, SERVER_PROGRAM),
        default=_core.DEFAULT_STALL_WARNING_S,
    )
)
JOIN_TIMEOUT = _add(
    Setting(
        name="SUMFLOW_JOIN_TIMEOUT",
        kind=number(0.0, above=True, unit="seconds"),
        doc="how long every node has to join the job",
        readers=(WORKER, SERVER_PROGRAM, COORDINATOR_PROGRAM),
        default=_core.DEFAULT_JOIN_TIMEOUT_S,
    )
)
HEARTBEAT_TIMEOUT = _add(
    Setting(
        name="SUMFLOW_HEARTBEAT_TIMEOUT",
        kind=number(0.0, above=True, unit="seconds"),
        doc="silence after which a node is declared failed",
        readers=(WORKER, SERVER_PROGRAM, COORDINATOR_PROGRAM),
        default=_core.DEFAULT_HEARTBEAT_TIMEOUT_S,
    )
)

# ---- tracing (docs/tracing.md) ----------------------------------------------------------

TRACE_DIR = _add(
    OptionalSetting(
        name="SUMFLOW_TRACE_DIR",
        kind=text("a directory"),
        doc="record a Chrome trace of each worker into this directory",
        readers=(WORKER,),
        unset="no trace",
    )
)
TRACE_START_STEP = _add(
    Setting(
        name="SUMFLOW_TRACE_START_STEP",
        kind=integer(least=0),
        doc="the first traced step, counting from 0",
        readers=(WORKER,),
        default=_core.DEFAULT_TRACE_START_STEP,
    )
)
TRACE_STEPS = _add(
    Setting(
        name="SUMFLOW_TRACE_STEPS",
        kind=integer(least=1),
        doc="how many steps are traced",
        readers=(WORKER,),
        default=_core.DEFAULT_TRACE_STEPS,
    )
)
TRACE_MAX_EVENTS = _add(
    Setting(
        name="SUMFLOW_TRACE_MAX_EVENTS",
        kind=integer(least=1),
        doc="the most events a trace holds",
        readers=(WORKER,),
        default=_core.DEFAULT_TRACE_MAX_EVENTS,
    )
)

# ---- gradients (docs/compression.md) ----------------------------------------------------

COMPRESSION = _add(
    OptionalSetting(
        name="SUMFLOW_COMPRESSION",
        kind=text("a compressor, NAME[:PARAM=VALUE,...], e.g. topk:ratio=0.01"),
        doc="how gradients travel when the optimizer or DDP hook is given no compression",
        readers=(WORKER,),
        unset="no compression",
    )
)
FUSION_THRESHOLD = _add(
    OptionalSetting(
        name="SUMFLOW_FUSION_THRESHOLD",
        kind=integer(least=0, unit="bytes, 0: no fusion"),
        doc="fuse gradients into spans of at least this many bytes, when the optimizer is "
        "given no threshold (and no groups)",
        readers=(WORKER,),
        unset="4 MiB where the optimizer has CUDA parameters (each span then costs one "
        "copy to host memory and one hook's work, not one per gradient), else no fusion",
    )
)

CUDA_STAGING = _add(
    Setting(
        name="SUMFLOW_CUDA_STAGING",
        kind=choice(("driver", "python")),
        doc="who queues and awaits a CUDA tensor's copy to host memory: sumflow's core "
        "through the CUDA driver, without Python (where the driver cannot be loaded: "
        "python, with a warning), or a Python thread through torch",
        readers=(WORKER,),
        default="driver",
    )
)

# ---- auto-tuning (docs/autotune.md): only rank 0 reads these, and tells the others --------

AUTOTUNE = _add(
    Setting(
        name="SUMFLOW_AUTOTUNE",
        kind=choice(
            ("off", "on", "retune"),
            aliases={"0": "off", "false": "off", "no": "off", "1": "on", "true": "on", "yes": "on"},
            ignore_case=True,
            allowed="1 (tune, or reuse a stored result), retune (tune even if a result is "
            "stored) or 0",
        ),
        doc="tune partition size and credit (and the fusion threshold) while training",
        readers=(TUNER,),
        default="off",
    )
)
AUTOTUNE_METHOD = _add(
    Setting(
        name="SUMFLOW_AUTOTUNE_METHOD",
        kind=choice(TUNE_METHODS),
        doc="how the next trial is chosen: Bayesian optimisation, random or grid search",
        readers=(TUNER,),
        default="bo",
    )
)
AUTOTUNE_TRIALS = _add(
    Setting(
        name="SUMFLOW_AUTOTUNE_TRIALS",
        kind=integer(least=1),
        doc="trials at most, the job's starting configuration included",
        readers=(TUNER,),
        default=10,
    )
)
AUTOTUNE_SECONDS = _add(
    OptionalSetting(
        name="SUMFLOW_AUTOTUNE_SECONDS",
        kind=number(0.0, above=True, unit="seconds"),
        doc="stop tuning after this long even with trials left",
        readers=(TUNER,),
        unset="no time limit",
    )
)
AUTOTUNE_WARMUP_STEPS = _add(
    Setting(
        name="SUMFLOW_AUTOTUNE_WARMUP_STEPS",
        kind=integer(least=0),
        doc="steps run after each switch before measuring",
        readers=(TUNER,),
        default=3,
    )
)
AUTOTUNE_MEASURE_STEPS = _add(
    Setting(
        name="SUMFLOW_AUTOTUNE_MEASURE_STEPS",
        kind=integer(least=1),
        doc="steps measured per trial; the score is their trimmed mean",
        readers=(TUNER,),
        default=10,
    )
)
AUTOTUNE_SEED = _add(
    Setting(
        name="SUMFLOW_AUTOTUNE_SEED",
        kind=integer(),
        doc="the seed of the search's random choices",
        readers=(TUNER,),
        default=0,
    )
)
AUTOTUNE_PARTITION_BYTES = _add(
    Setting(
        name="SUMFLOW_AUTOTUNE_PARTITION_BYTES",
        kind=byte_range(),
        doc="the partition sizes searched (whole pages)",
        readers=(TUNER,),
        default=(64 << 10, 32 << 20),
    )
)
AUTOTUNE_MAX_CREDIT_PARTITIONS = _add(
    Setting(
        name="SUMFLOW_AUTOTUNE_MAX_CREDIT_PARTITIONS",
        kind=number(1.0, unit="partitions"),
        doc="the largest credit searched, in partitions (the smallest is 1)",
        readers=(TUNER,),
        default=16.0,
    )
)
AUTOTUNE_FUSION_BYTES = _add(
    Setting(
        name="SUMFLOW_AUTOTUNE_FUSION_BYTES",
        kind=byte_range(),
        doc="the fusion thresholds searched when the optimizer fuses gradients (whole pages)",
        readers=(TUNER,),
        default=(16 << 10, 32 << 20),
    )
)
AUTOTUNE_FILE = _add(
    OptionalSetting(
        name="SUMFLOW_AUTOTUNE_FILE",
        kind=text("a path"),
        doc="the file of tuned configurations, reused by later runs of the same job",
        readers=(TUNER,),
        unset="$XDG_CACHE_HOME/sumflow/autotune.json (~/.cache without XDG_CACHE_HOME)",
    )
)
AUTOTUNE_LOG = _add(
    OptionalSetting(
        name="SUMFLOW_AUTOTUNE_LOG",
        kind=text("a path"),
        doc="the JSON-lines log of every trial",
        readers=(TUNER,),
        unset="a new file next to the tuned configurations, one per tuning run",
    )
)

#: Every variable the Python side reads, in the order of the docs.
TABLE: tuple[Variable[Any], ...] = tuple(_TABLE)


@dataclass(frozen=True)
class ProgramVariable:
    """A ``SUMFLOW_*`` variable only the core's programs read, as the default of one of
    their options: listed for the docs, its default is in the program's ``--help``."""

    name: str
    #: The option it stands for, in the programs that read it.
    option: str
    doc: str
    readers: tuple[str, ...]


_SERVER = (SERVER_PROGRAM,)
_COORDINATOR = (COORDINATOR_PROGRAM,)
_BOTH = (SERVER_PROGRAM, COORDINATOR_PROGRAM)

#: Set by ``sumflow-run`` for every process; read by the programs only.
NUM_WORKERS = ProgramVariable(
    "SUMFLOW_NUM_WORKERS",
    "--workers",
    "the workers the job waits for (a server without a coordinator serves that many)",
    _BOTH,
)
#: Set by ``sumflow-run --wire-stats`` for the servers.
WIRE_STATS_DIR = ProgramVariable(
    "SUMFLOW_WIRE_STATS_DIR",
    "--wire-stats-dir",
    "where a server writes the bytes it exchanged per key when it stops",
    _SERVER,
)

#: The variables only ``sumflow-server`` and ``sumflow-coordinator`` read (their clap
#: options' ``env``; python/tests/test_settings.py checks this list against the crates).
PROGRAM_VARIABLES = (
    ProgramVariable("SUMFLOW_SERVER_BIND", "--bind", "the address a server listens on", _SERVER),
    ProgramVariable(
        "SUMFLOW_COORDINATOR_BIND", "--bind", "the address the coordinator listens on", _COORDINATOR
    ),
    NUM_WORKERS,
    ProgramVariable(
        "SUMFLOW_NUM_SERVERS", "--servers", "the servers the job waits for", _COORDINATOR
    ),
    ProgramVariable(
        "SUMFLOW_ADVERTISE_HOST", "--advertise", "the host workers reach a server at", _SERVER
    ),
    ProgramVariable(
        "SUMFLOW_SERVER_RANK", "--rank", "the server rank to ask the coordinator for", _SERVER
    ),
    ProgramVariable(
        "SUMFLOW_ENGINE_THREADS",
        "--engine-threads",
        "engines a server splits its keys over: how many threads can sum at once",
        _SERVER,
    ),
    ProgramVariable(
        "SUMFLOW_PUSH_BUFFERS",
        "--push-buffers",
        "receive buffers per worker connection: pushes in flight before back-pressure",
        _SERVER,
    ),
    ProgramVariable(
        "SUMFLOW_MAX_KEY_MEMORY",
        "--max-key-memory",
        "a cap on the bytes a server holds for keys",
        _SERVER,
    ),
    ProgramVariable("SUMFLOW_SIMD", "--simd", "the SIMD kernels a server sums with", _SERVER),
    ProgramVariable(
        "SUMFLOW_HEARTBEAT_INTERVAL",
        "--heartbeat-interval",
        "seconds between a server's heartbeats to the coordinator",
        _SERVER,
    ),
    WIRE_STATS_DIR,
    ProgramVariable(
        "SUMFLOW_MAX_FRAME_BYTES", "--max-frame-bytes", "the largest frame body accepted", _BOTH
    ),
    ProgramVariable("SUMFLOW_JOB_ID", "--job-id", "the job's name in messages", _COORDINATOR),
    ProgramVariable(
        "SUMFLOW_METRICS_BIND",
        "--metrics-bind",
        "where a server or the coordinator serves Prometheus metrics (GET /metrics); "
        "unset: nowhere",
        _BOTH,
    ),
    ProgramVariable("SUMFLOW_LOG_FORMAT", "--log-format", "text or JSON log lines", _BOTH),
)


# --------------------------------------------------------------------------------------
# The docs' table
# --------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """docs/settings.md: every variable of :data:`TABLE` and :data:`PROGRAM_VARIABLES`."""
    lines = [
        "# Settings: the SUMFLOW_* environment variables",
        "",
        "<!-- Generated by `python -m sumflow.settings --markdown > docs/settings.md` from",
        "     python/sumflow/settings.py; python/tests/test_settings.py checks it is current. -->",
        "",
        "Every variable sumflow reads, who reads it and what it takes. Unset or empty means",
        "the default; a value that is not allowed stops the reader with an error that names",
        "the variable. `sumflow-run` sets the job's variables for every worker",
        "([launcher.md](launcher.md)) and hands its own environment's `SUMFLOW_*` variables",
        "to no process unless asked to (`-x NAME`). The defaults of the communication",
        "service, the timeouts and the trace window are the core's (`sumflow._core`).",
        "",
        "## Read by the Python package",
        "",
        "In Python, `sumflow.settings` has each as a typed constant, e.g.",
        "`settings.PARTITION_BYTES.read()`.",
        "",
        "| variable | takes | unset | read by | what it sets |",
        "|---|---|---|---|---|",
    ]
    for v in TABLE:
        unset = _format(v.default) if isinstance(v, Setting) else v.default_text()
        lines.append(
            f"| `{v.name}` | {_cell(v.kind.allowed)} | {_cell(unset)} | "
            f"{', '.join(v.readers)} | {_cell(v.doc)} |"
        )
    lines += [
        "",
        "## Read by sumflow-server and sumflow-coordinator only",
        "",
        "Each stands for an option of the programs; its default and what it takes are in",
        "`sumflow-server --help` and `sumflow-coordinator --help`.",
        "",
        "| variable | option | read by | what it sets |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| `{v.name}` | `{v.option}` | {', '.join(v.readers)} | {_cell(v.doc)} |"
        for v in PROGRAM_VARIABLES
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sumflow.settings --markdown``: prints docs/settings.md."""
    parser = argparse.ArgumentParser(
        prog="python -m sumflow.settings",
        description="sumflow's SUMFLOW_* environment variables, as the table of docs/settings.md.",
    )
    parser.add_argument("--markdown", action="store_true", required=True, help="print it")
    parser.parse_args(argv)
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
