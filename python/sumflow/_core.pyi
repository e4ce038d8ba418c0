"""Typed stub of ``sumflow._core``, the Rust extension module (crates/binding)."""

from collections.abc import Callable, Sequence
from os import PathLike
from typing import Any, final

from typing_extensions import Self

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_CREDIT_PARTITIONS",
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "DEFAULT_JOIN_TIMEOUT_S",
    "DEFAULT_OPERATION_TIMEOUT_S",
    "DEFAULT_PARTITION_BYTES",
    "DEFAULT_PROPHET_STAGE_FACTOR",
    "DEFAULT_SCHEDULER",
    "DEFAULT_STALL_WARNING_S",
    "DEFAULT_TRACE_MAX_EVENTS",
    "DEFAULT_TRACE_START_STEP",
    "DEFAULT_TRACE_STEPS",
    "DEFAULT_WINDOW_PARTITIONS",
    "DEFAULT_WINDOW_PARTITIONS_SEVERAL_WORKERS",
    "MAX_CPU_SERVER_CONNECTIONS",
    "SCHEDULERS",
    "CommunicationService",
    "DeclarationMismatchError",
    "NodeFailedError",
    "ProtocolError",
    "StagedSum",
    "SumflowError",
    "SumflowTimeoutError",
    "__version__",
    "run_coordinator",
    "run_server",
    "simd_level",
    "simulate",
]

__version__: str
"""The version of the core: the Cargo workspace's."""

# The core's defaults (crates/binding/src/defaults.rs): sumflow.settings reads them from here.
#: Partition size in bytes (BytePS §6.1's 4 MB).
DEFAULT_PARTITION_BYTES: int
#: The scheduler a job runs unless it asks for another.
DEFAULT_SCHEDULER: str
#: Every scheduler's name, as the communication service and the simulator accept it.
SCHEDULERS: tuple[str, ...]
#: Prophet's stage factor: 0, every gap between gradients ends a stage.
DEFAULT_PROPHET_STAGE_FACTOR: float
#: The credit per server, in partitions, when none is given.
DEFAULT_CREDIT_PARTITIONS: int
#: The push window per server a job starts with, in partitions of its starting size.
DEFAULT_WINDOW_PARTITIONS: int
DEFAULT_WINDOW_PARTITIONS_SEVERAL_WORKERS: int
#: The most connections a worker may open to one CPU summation server.
MAX_CPU_SERVER_CONNECTIONS: int
#: Longest wait for one collective operation, in seconds.
DEFAULT_OPERATION_TIMEOUT_S: float
#: Time every expected node has to join the job, in seconds.
DEFAULT_JOIN_TIMEOUT_S: float
#: How long a node retries connecting to a peer that may still be starting, in seconds.
DEFAULT_CONNECT_TIMEOUT_S: float
#: How often a node heartbeats to the coordinator, in seconds.
DEFAULT_HEARTBEAT_INTERVAL_S: float
#: Silence after which a node is declared failed, in seconds.
DEFAULT_HEARTBEAT_TIMEOUT_S: float
DEFAULT_STALL_WARNING_S: float
#: The first step a trace records.
DEFAULT_TRACE_START_STEP: int
#: How many steps a trace records.
DEFAULT_TRACE_STEPS: int
#: The most events a trace holds.
DEFAULT_TRACE_MAX_EVENTS: int

def simd_level() -> str:
    """The SIMD kernels the summation service would use on this CPU: "avx512",
    "avx2+f16c" or "portable"."""

def run_server(argv: Sequence[str]) -> int:
    """Runs the ``sumflow-server`` program in this process and returns its exit status.

    ``argv`` is the argument list without the program name, as in ``sys.argv[1:]``.
    Returns 0 after a clean stop (and for --help), 1 when the server failed, 2 for bad
    arguments. Blocks until the server stops, with the GIL released. While it runs, SIGTERM
    and SIGINT stop it gracefully; afterwards they no longer have their default effect.
    """

def run_coordinator(argv: Sequence[str]) -> int:
    """Runs the ``sumflow-coordinator`` program in this process and returns its exit status.

    ``argv`` is the argument list without the program name, as in ``sys.argv[1:]``.
    Returns 0 when the job ended cleanly (and for --help), 1 when a node failed or not every
    node joined, 2 for bad arguments. Blocks until the job ends, with the GIL released.
    While it runs, SIGTERM and SIGINT tell every node to shut down; afterwards they no
    longer have their default effect.
    """

def simulate(
    config: str,
    progress: Callable[[int, int, float, int, float], None] | None = None,
) -> str:
    """Runs a simulation described by ``config`` (JSON, as ``sumflow.sim.Config.to_json``
    writes it) and returns its report as JSON, with the GIL released. ``progress`` is called
    about once a second of a long run with ``(iteration, iterations, simulated_s, events,
    wall_s)``; an exception it raises stops the run and is raised here. Raises ValueError
    for a configuration that cannot be simulated, ``SumflowError`` if the simulation stalls.
    """

class SumflowError(RuntimeError):
    """Base class of every error sumflow raises. The message names what failed."""

class SumflowTimeoutError(SumflowError, TimeoutError):
    """A wait ran past its timeout; the message names what was awaited and the timeout.
    Also a builtin TimeoutError."""

class NodeFailedError(SumflowError):
    """A worker, summation server or the coordinator failed or left; the message names it
    and says why."""

class DeclarationMismatchError(SumflowError):
    """Workers declared the same tensor with different shapes, dtypes or names; the message
    names the tensor and both declarations."""

class ProtocolError(SumflowError):
    """A peer sent a message it must not send (a bug or a version mismatch); the message
    names the peer."""

# PyO3 classes: not subclassable; StagedSum is made by push_pull_after_copy only.
@final
class StagedSum:
    """A CUDA tensor's sum, issued once its copy to host memory is complete
    (``CommunicationService.push_pull_after_copy``)."""

    def ready(self) -> bool:
        """Whether its sum was issued (or failed to be)."""
    def cores(self, timeout: float) -> list[int]:
        """The handle of its sum, in a list, once issued: waits at most ``timeout`` seconds
        for the copy (0: only looks). Raises what the copy or the issue raised, every time
        it is asked."""

@final
class CommunicationService:
    """The communication service of one worker: joins the job through its coordinator,
    connects to every summation server, and sums tensors across workers.

    Low level: ``sumflow.torch`` drives it for PyTorch users. Buffers are passed as raw
    host addresses together with the object that owns the memory; the service keeps a
    reference to that owner until the operation has been waited for.
    """

    def __new__(
        cls,
        coordinator: str,
        token: str,
        *,
        host_id: str,
        rank: int | None = None,
        name: str | None = None,
        partition_bytes: int | None = None,
        link_gbits: float | None = None,
        scheduler: str | None = None,
        credit_bytes: int | None = None,
        push_window_bytes: int | None = None,
        prophet_stage_factor: float = ...,
        connections_per_cpu_server: int | None = None,
        shared_memory: bool = True,
        local_sockets: bool = True,
        server_shared_memory: bool = True,
        hierarchical: bool = True,
        join_timeout: float = ...,
        declare_timeout: float = ...,
        connect_timeout: float = ...,
        heartbeat_interval: float = ...,
        heartbeat_timeout: float = ...,
        trace_dir: str | PathLike[str] | None = None,
        trace_start_step: int | None = None,
        trace_steps: int | None = None,
        trace_max_events: int | None = None,
        stall_warning: float = ...,
    ) -> Self:
        """Joins the job at ``coordinator`` (host:port) with the job ``token`` and blocks
        (GIL released) until every node has joined, at most ``join_timeout`` seconds.
        Every default is the core's, a ``DEFAULT_*`` constant of this module (the
        timeouts, in seconds, the ``DEFAULT_*_S`` ones; ``declare_timeout`` the join's).

        ``host_id`` names this worker's machine: workers with the same one share its
        colocated summation server. ``rank`` asks for a worker rank; ``name`` appears in
        other nodes' error messages. Tensors are cut into partitions of at most
        ``partition_bytes`` (None: a size derived from each declaration, the largest
        power of two giving every server 32 partitions from each of a machine's workers,
        within floors set by the CPU cost of a message and the link rate, and at most
        ``DEFAULT_PARTITION_BYTES``; the reason is in ``schedule()``). ``link_gbits`` is
        this worker's link rate (None: the speed the kernel reports for the interface
        that reaches the coordinator, if any); the slowest rate any worker registered
        sets the derived size's link floor, the time a partition spends on the link.
        ``scheduler`` decides when partitions go out: ``"fifo"``,
        ``"p3"``, ``"bytescheduler"`` or ``"prophet"`` (docs/scheduling.md);
        ``credit_bytes`` (default: 2 partitions; 0: unbounded) is the credit of
        ByteScheduler and Prophet, the bytes pushed to one server that it has not
        acknowledged yet. ``prophet_stage_factor``: a gap between gradients longer than
        this times the mean gap ends one of Prophet's stages (0: every gap does). At most
        ``push_window_bytes`` (default: 4 partitions; 0:
        unbounded) may be pushed to one server before their sums come back, which keeps
        the workers' pushes to a server in step so its sums stream back while pushes go
        out. ``connections_per_cpu_server`` (1 to 16; default: round(c/g) of BytePS's
        Eq. 1 and 2, at most 4) connections go to each CPU-only server, each partition
        for it cut into one piece per connection (every worker must use the same value),
        so that TCP's per-connection fairness gives it its share of
        every link; colocated servers get one. With ``shared_memory`` (every worker must
        agree), a tensor whose workers all share this machine is summed in the machine's
        shared memory (``/dev/shm``) instead of through a summation server. With
        ``local_sockets``, a summation server on this machine is reached through its Unix
        socket rather than TCP (the same frames, for less CPU per byte); with
        ``server_shared_memory`` too, the payloads of those sockets pass through memory
        shared with that server, which sums a push where the worker put it. With
        ``hierarchical`` (and ``shared_memory``), a tensor whose workers span machines is
        aggregated inside each machine first, so a machine sends each byte once.

        With ``trace_dir`` the worker records a Chrome trace of steps ``trace_start_step``
        (default 10) to ``trace_start_step + trace_steps - 1`` (default 5 steps), at most
        ``trace_max_events`` events (default 500000), into
        ``trace_dir/sumflow-trace-rank{rank}.json`` (see ``docs/tracing.md``); the
        directory is created now, and ``OSError`` (never ``ValueError``) is raised if it
        cannot be. A ``wait`` that has waited ``stall_warning`` seconds (0: never) logs a
        warning naming the tensor and what it still waits for (the servers, or this
        machine's workers that have not pushed), and again after each further such
        stretch. Bad arguments raise ``ValueError``.
        """

    def reconfigure(
        self, partition_bytes: int | None = None, credit_bytes: int | None = None
    ) -> None:
        """Changes the partition size and/or the credit per server. Every worker must
        make the same call between the same two steps, with no operation in flight
        (raises ``ValueError`` otherwise). A new partition size re-cuts every declared
        tensor under keys of its own; a size used before gets its old keys back."""
    def wire_bytes(self) -> tuple[list[tuple[str, int, int, int]], tuple[int, int]]:
        """The bytes written to and read from the summation servers so far, counted at
        the sockets: ``([(tensor, key, sent, received), ...], (sent, received))``, the
        second for frames naming no key (leaving)."""
    def schedule(self) -> dict[str, Any]:
        """The schedule in use: ``scheduler`` (name), ``partition_bytes``, ``derived``
        (whether the partition size is derived from each declaration; ``partition_bytes``
        is then the last group's), ``credit_bytes``, and ``bandwidth`` (bytes/s at which
        partitions complete) once measured."""
    @property
    def rank(self) -> int:
        """This worker's rank, 0 to size - 1."""
    @property
    def size(self) -> int:
        """The number of workers."""
    @property
    def local_rank(self) -> int:
        """This worker's rank among the workers of its machine."""
    @property
    def local_size(self) -> int:
        """The number of workers on this machine."""
    @property
    def is_homogeneous(self) -> bool:
        """Whether every worker machine runs the same number of workers."""
    @property
    def num_servers(self) -> int:
        """The number of summation servers."""
    def declare(
        self,
        name: str,
        dtype_name: str,
        elements: int,
        compression: tuple[str, float, bool] | None = None,
        members: Sequence[int] | None = None,
        home: int | None = None,
        shape: Sequence[int] | None = None,
    ) -> int:
        """Declares a tensor by name and returns its id. Every worker must declare it with
        the same dtype ("f32", "f16", "bf16", "f64", "i32" or "i64"), number of elements,
        shape (``None``: a flat buffer; ``ValueError`` if its product is not
        ``elements``), compression and members, or every worker gets
        ``DeclarationMismatchError`` naming it, the declarations and the workers.
        ``compression`` is ``(compressor, parameter, error_feedback)``: ``("topk",
        ratio, ...)``, ``("randomk", ratio, ...)``, ``("sign", 0, ...)`` or
        ``("dithering", levels, ...)``, for f32 tensors; each partition is compressed on
        the way out and its sum decoded in place.

        ``members`` (a Horovod process set) are the ranks, in any order, of the workers
        whose tensors are summed; ``None``: every worker. Only members may push the tensor
        (``push_pull`` refuses the others with ``ValueError``), and every member must push
        it each time. Members are for uncompressed tensors; ``ValueError`` names the
        tensor for an empty list, a rank listed twice, or a rank that is not below
        ``size``.

        ``home``: the worker that takes the tensor's bytes (a relay region, a
        reduce-scatter's share); its partitions are then kept by the summation server on
        that worker's machine, so the bytes cross one link, not two (placed from their keys
        where that machine has no server)."""
    def declare_group(
        self,
        tensors: Sequence[
            tuple[str, str, int, tuple[str, float, bool] | None]
            | tuple[str, str, int, tuple[str, float, bool] | None, Sequence[int] | None]
        ],
        shapes: Sequence[Sequence[int] | None] | None = None,
    ) -> list[int]:
        """Declares tensors ``(name, dtype, elements, compression)`` or ``(name, dtype,
        elements, compression, members)`` (see ``declare``) together and places their
        partitions by BytePS's Eq. 1 and 2; returns their ids in order. ``shapes``: each
        tensor's, as ``declare`` takes it. Every worker must declare the same group."""
    def push_pull(
        self,
        tensor_id: int,
        owner: object,
        ptr: int,
        nbytes: int,
        priority: int = 0,
        average: bool = False,
        *,
        op: str | None = None,
        pushes: list[tuple[int, int]] | None = None,
        pulls: list[tuple[int, int]] | None = None,
    ) -> int:
        """Starts summing tensor ``tensor_id`` across workers, in place in the ``nbytes``
        bytes at host address ``ptr``, which ``owner`` must own. Returns a handle at once.
        Lower ``priority`` is sent first; ``average`` divides the sum by the number of
        workers summed: the tensor's members, or the size; ``op`` ``"min"``, ``"max"`` or
        ``"product"`` reduces by that instead (on the servers). The memory must not be
        read or written until ``wait`` has returned.

        ``pushes`` and ``pulls``: the ``(start, end)`` byte ranges this worker contributes
        and takes back (None: all of it). The servers work by partition: a partition that
        meets no pushed range is skipped (an empty push: no bytes cross the wire), one that
        meets no pulled range is left as it is (only its completion is awaited). Bytes of
        a pushed partition outside this worker's ranges must hold the op's identity."""
    def push_pull_after_copy(
        self,
        name: str,
        source: object,
        source_ptr: int,
        device: int,
        stream: int,
        tensor_id: int,
        owner: object,
        ptr: int,
        nbytes: int,
        priority: int = 0,
        average: bool = False,
        *,
        op: str | None = None,
        pushes: list[tuple[int, int]] | None = None,
        pulls: list[tuple[int, int]] | None = None,
    ) -> StagedSum:
        """``push_pull`` of a CUDA tensor through its pinned host buffer: marks the point
        of the caller's CUDA stream ``stream`` (a ``cudaStream_t``, 0: the legacy default
        stream) of device ``device`` where the tensor at device address ``source_ptr``
        (owned by ``source``) is complete, and returns at once. A staging thread copies the
        tensor into the ``nbytes`` bytes at host address ``ptr`` (pinned memory owned by
        ``owner``) on a side stream once the GPU reaches that point, then issues the sum,
        all without the GIL. ``name`` names the tensor in errors. Raises where the CUDA
        driver cannot be used (``cuda_staging_unavailable`` says why beforehand)."""
    def cuda_staging_unavailable(self) -> str | None:
        """None where CUDA tensors can be staged through the CUDA driver
        (``push_pull_after_copy``); else why not (no driver, no GPU). The first call loads
        the driver and starts the staging thread."""
    def push_delta(
        self,
        tensor_id: int,
        owner: object,
        ptr: int,
        nbytes: int,
        initial_owner: object,
        initial: int,
        staleness: int | None = None,
        priority: int = 0,
    ) -> int:
        """Asynchronous training (BytePS §4.3): adds the ``nbytes`` bytes at ``ptr`` (owned
        by ``owner``), this worker's delta of tensor ``tensor_id``, to the servers' stored
        value and overwrites them with the stored value once the delta is in. ``initial``
        (an address of as many bytes, owned by ``initial_owner``) is the value the servers
        start from, read by the tensor's first push only. With ``staleness`` s, the
        worker's round r returns once every worker has pushed round r - s. Returns a
        handle at once; neither buffer may be touched until ``wait`` has returned."""
    def retire(self, tensor_id: int) -> None:
        """Retires tensor ``tensor_id``: this worker will never push it again. Raises
        ``ValueError`` while an operation on it is in flight. Servers free its keys, and
        the coordinator its name, once every worker of it has retired it; declaring the
        name again makes a new tensor with a new id (ids are never reused)."""
    def live_tensors(self) -> int:
        """Tensors declared by this worker and not retired."""
    def poll(self, handle: int) -> bool:
        """True once the operation has finished; raises its error if it failed."""
    def wait(self, handle: int, timeout: float) -> None:
        """Waits (GIL released) at most ``timeout`` seconds for an operation and releases
        it; raises its error if it failed, ``SumflowTimeoutError`` naming the tensor and
        the servers still owing partitions if it did not finish in time."""
    def barrier(self, timeout: float) -> None:
        """Waits (GIL released) until every worker reaches this barrier."""
    def join(self, timeout: float) -> int:
        """Horovod's join(): waits (GIL released) until every worker has joined, the
        others' sums meanwhile counting this worker as zeros; returns the rank of the
        worker that joined last, the same on every worker."""
    def placement_report(self) -> list[str]:
        """One line per summation server: the bytes of declared tensors it sums."""
    def mark_step(self) -> tuple[str, str] | None:
        """Ends the current training step (the end of its backward pass): Prophet profiles
        iterations by it, and the trace window counts it. Returns (path, which steps
        it holds) when this step closed the window and the trace was written; raises
        ``OSError`` if it could not be."""
    def trace_flush(self) -> tuple[str, str] | None:
        """Writes the trace now unless it was written already or tracing is off: what the
        window holds so far, or a file saying why it holds nothing. Returns (path, which
        steps it holds or why none). ``shutdown`` does this too, without returning it."""
    def trace_interval_start(
        self, path: str | PathLike[str], max_events: int | None = None
    ) -> None:
        """Starts recording a trace of an interval on demand, whatever the trace window does:
        the same events as the window (partitions, servers, scheduler, Python spans), at
        most ``max_events`` of them (default ``DEFAULT_TRACE_MAX_EVENTS``), written to
        ``path`` by ``trace_interval_stop``. Raises ``ValueError`` while an interval is
        being recorded already and ``OSError`` when ``path``'s directory does not exist."""
    def trace_interval_stop(self) -> tuple[str, str] | None:
        """Stops recording the interval and writes its file: returns (path, what it holds),
        or None when none was being recorded; raises ``OSError`` if it could not be
        written. ``shutdown`` writes an interval still being recorded."""
    @property
    def tracing(self) -> bool:
        """Whether trace events are being recorded now."""
    def trace_now(self) -> int:
        """The trace clock: nanoseconds since this worker's start, for ``trace_span``."""
    def trace_span(
        self,
        track: str,
        name: str,
        start: int,
        end: int,
        args: dict[str, Any] | None = None,
    ) -> None:
        """Records the slice ``name`` from ``start`` to ``end`` (``trace_now()`` readings)
        on the Python track ``track``, with ``args`` (ints, floats and strings; anything
        else as its ``str()``) shown when it is selected. Nothing unless recording."""
    def trace_instant(
        self,
        track: str,
        name: str,
        at: int | None = None,
        args: dict[str, Any] | None = None,
    ) -> None:
        """Records the moment ``name`` at ``at`` (a ``trace_now()`` reading; now if None)
        on the Python track ``track``. Nothing unless recording."""
    def shutdown(self, reason: str = "shutdown") -> None:
        """Leaves the job gracefully, writing a trace window cut short and an interval
        still being recorded first. Operations in flight fail, and so does any later
        call."""
