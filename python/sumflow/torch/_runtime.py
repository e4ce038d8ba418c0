"""The process's one communication service: how it is found, started and stopped.

A worker learns its job from the environment (``sumflow.settings``, docs/settings.md).
``sumflow-run`` sets ``SUMFLOW_*`` variables, ``SUMFLOW_COORDINATOR`` first. Under another
launcher (torchrun, horovodrun, Open MPI's mpirun, MPICH's mpiexec, Slurm's srun; read by
``sumflow.jobenv``) the process that ``sumflow.jobenv.coordinator`` names starts the
coordinator and each machine's local rank 0 its colocated summation server. A process
started alone is a job of one, with its own coordinator and server.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from sumflow import _core, settings
from sumflow._programs import program
from sumflow.jobenv import elastic, rendezvous
from sumflow.jobenv.coordinator import Coordinator, derived_token, locate
from sumflow.jobenv.environment import LaunchEnvironment
from sumflow.jobenv.launchers import detect

#: How long a coordinator this process starts has to listen.
_START_TIMEOUT = 60.0


class _Options(TypedDict, total=False):
    """The service's keywords that come from the environment. Those of the trace window are
    there only when their variable is set, so that the core's own defaults hold otherwise."""

    name: str
    partition_bytes: int | None
    link_gbits: float | None
    scheduler: str
    credit_bytes: int | None
    push_window_bytes: int | None
    connections_per_cpu_server: int | None
    shared_memory: bool
    hierarchical: bool
    local_sockets: bool
    server_shared_memory: bool
    join_timeout: float
    heartbeat_timeout: float
    stall_warning: float
    prophet_stage_factor: float
    trace_dir: str
    trace_start_step: int
    trace_steps: int
    trace_max_events: int


def _service_options() -> _Options:
    """Every keyword of the service the environment sets, read (and so checked) before
    any coordinator or server is started for the job."""
    options: _Options = {
        "name": settings.WORKER_NAME.read() or f"worker pid {os.getpid()}",
        "partition_bytes": settings.PARTITION_BYTES.read(),
        "link_gbits": settings.LINK_GBITS.read(),
        "scheduler": settings.SCHEDULER.read(),
        "credit_bytes": settings.CREDIT_BYTES.read(),
        "push_window_bytes": settings.PUSH_WINDOW_BYTES.read(),
        "connections_per_cpu_server": settings.CPU_SERVER_CONNECTIONS.read(),
        "shared_memory": settings.SHARED_MEMORY.read() == "on",
        "hierarchical": settings.HIERARCHICAL.read() == "on",
        "local_sockets": settings.LOCAL_SOCKETS.read() == "on",
        "server_shared_memory": settings.SERVER_SHARED_MEMORY.read() == "on",
        "join_timeout": settings.JOIN_TIMEOUT.read(),
        "heartbeat_timeout": settings.HEARTBEAT_TIMEOUT.read(),
        "stall_warning": settings.STALL_WARNING.read(),
        "prophet_stage_factor": settings.PROPHET_STAGE_FACTOR.read(),
    }
    options.update(_trace_settings())
    return options


def _trace_settings() -> _Options:
    """The service's trace keywords from ``SUMFLOW_TRACE_*`` (docs/tracing.md): tracing is
    on when ``SUMFLOW_TRACE_DIR`` is set; the window's defaults are the core's."""
    window = (settings.TRACE_START_STEP, settings.TRACE_STEPS, settings.TRACE_MAX_EVENTS)
    start_step, steps, max_events = (s.get() for s in window)
    directory = settings.TRACE_DIR.read()
    if not directory:
        given = [
            s.name
            for s, value in zip(window, (start_step, steps, max_events), strict=True)
            if value is not None
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)} set without {settings.TRACE_DIR.name}, the directory the "
                "trace is written to: set it too to record a trace"
            )
        return {}
    options: _Options = {"trace_dir": directory}
    if start_step is not None:
        options["trace_start_step"] = start_step
    if steps is not None:
        options["trace_steps"] = steps
    if max_events is not None:
        options["trace_max_events"] = max_events
    return options


def report_trace(written: tuple[str, str] | None) -> None:
    """Says on stderr where a trace was written and which steps it holds."""
    if written is not None:
        path, recorded = written
        print(f"sumflow: trace {path}: {recorded} (open it in ui.perfetto.dev)", file=sys.stderr)


@dataclass
class Runtime:
    """The started service and what was started alongside it."""

    service: _core.CommunicationService
    timeout: float
    #: Coordinator and servers this process started (jobs of other launchers, and jobs of
    #: one).
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    tmpdir: tempfile.TemporaryDirectory[str] | None = None
    #: The rendezvous file this process published (rank 0 of a one-machine job).
    published: Path | None = None
    #: The membership epoch this service belongs to, in an elastic job.
    epoch: int | None = None
    #: Whether CUDA tensors are staged by the core through the CUDA driver (``_staging``);
    #: None until the first one.
    driver_staging: bool | None = None


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()
#: An elastic job's rendezvous client, and the last epoch this process took part in.
_elastic: elastic.Client | None = None
_last_epoch = -1
#: Counts the services started in this process: state kept across ``shutdown()`` and
#: ``init()`` (an elastic job's epochs) sees that it must be set up again.
generation = 0


def current() -> Runtime:
    """The running service; a clear error when ``init()`` was not called."""
    rt = _runtime
    if rt is None:
        raise ValueError(
            "sumflow is not initialised: call sumflow.torch.init() first (inside a job "
            "started by sumflow-run, torchrun, mpirun, horovodrun or srun, or alone for a "
            "job of one)"
        )
    return rt


def is_initialized() -> bool:
    return _runtime is not None


def running() -> Runtime | None:
    """The running service, or None before ``init()`` and after ``shutdown()``."""
    return _runtime


def _die_with_parent() -> None:
    """Run in a child before exec: it gets SIGTERM when this process dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _start(name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Starts ``sumflow-server`` or ``sumflow-coordinator``; it dies with this process."""
    return subprocess.Popen(
        [*program(name), *args],
        env=env,
        stdin=subprocess.DEVNULL,
        # Started before the service's threads exist, so preexec_fn is safe here.
        preexec_fn=_die_with_parent,
    )


def _wait_for_file(path: Path, what: str, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        if path.exists():
            text = path.read_text().strip()
            if text:
                return text
        if proc.poll() is not None:
            raise RuntimeError(f"the {what} exited with code {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {what} did not report its address within {timeout:.0f} s")
        time.sleep(0.01)


def _given_token() -> str | None:
    """The job token the environment gives: ``SUMFLOW_JOB_TOKEN_FILE``'s content, else
    ``SUMFLOW_JOB_TOKEN``; None when neither is set."""
    path = settings.JOB_TOKEN_FILE.read()
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as e:
            raise ValueError(
                f"{settings.JOB_TOKEN_FILE.name}={path}: cannot read the job token: {e}"
            ) from None
    return settings.JOB_TOKEN.read()


def _job_token() -> str:
    token = _given_token()
    if token:
        return token
    raise ValueError(
        f"no job token: set {settings.JOB_TOKEN_FILE.name} or {settings.JOB_TOKEN.name} "
        "(sumflow-run sets one)"
    )


def _joined_job(coordinator: str) -> tuple[str, str, str, int | None]:
    """Coordinator address, token, machine id and rank (None: the coordinator assigns one)
    of a worker joining a running coordinator (``SUMFLOW_COORDINATOR``, as sumflow-run
    sets it). Without ``SUMFLOW_RANK`` it asks for the rank its launcher gave it, if any."""
    rank = settings.RANK.read()
    launch = detect(os.environ) if rank is None else None
    if launch is not None:
        rank = launch.rank
    host_id = settings.HOST_ID.read() or (launch and launch.host_id) or socket.gethostname()
    return coordinator, _job_token(), host_id, rank


def elastic_client() -> elastic.Client | None:
    """The rendezvous of the elastic job this process belongs to, if it is one."""
    return _elastic


def _elastic_job(options: _Options) -> tuple[str, str, str, int, int]:
    """Coordinator address, token, machine id, rank and epoch of a worker of an elastic
    ``sumflow-run`` job: its place in the first epoch after the last it took part in.
    Removed when the launcher says it is not part of the job any more."""
    global _elastic, _last_epoch
    if _elastic is None:
        address = settings.ELASTIC_ADDR.read()
        name = settings.ELASTIC_WORKER.read()
        if not address or not name:
            raise ValueError(
                f"{settings.ELASTIC_ADDR.name} is set without {settings.ELASTIC_WORKER.name}: "
                "an elastic job's workers are started by sumflow-run, which sets both"
            )
        _elastic = elastic.Client(address, _job_token(), name)
    place = _elastic.assignment(_last_epoch, settings.JOIN_TIMEOUT.read())
    _last_epoch = place.epoch
    # torchrun's variables, for scripts that read them, follow the membership.
    os.environ.update(
        RANK=str(place.rank),
        WORLD_SIZE=str(place.size),
        LOCAL_RANK=str(place.local_rank),
        LOCAL_WORLD_SIZE=str(place.local_size),
    )
    options["name"] = _elastic.worker
    return place.coordinator, _job_token(), place.host_id, place.rank, place.epoch


def _program_env(token: str) -> dict[str, str]:
    """The environment of a coordinator or server this process starts for its job."""
    env = {**os.environ, settings.JOB_TOKEN.name: token}
    env.pop(settings.JOB_TOKEN_FILE.name, None)
    env.setdefault("RUST_LOG", "warn")
    return env


def _start_coordinator(
    children: list[subprocess.Popen[bytes]],
    launch: LaunchEnvironment,
    where: Coordinator,
    token: str,
    tmp: str,
) -> str:
    """Starts the job's coordinator at ``where.bind`` and waits until it listens; the
    address it reports."""
    addr_file = Path(tmp) / "coordinator"
    args = [
        f"--bind={where.bind}",
        f"--workers={launch.size}",
        f"--servers={launch.machines}",
        f"--addr-file={addr_file}",
    ]
    children.append(_start("sumflow-coordinator", args, _program_env(token)))
    what = f"coordinator on {where.bind} ({where.how})"
    return _wait_for_file(addr_file, what, children[-1], _START_TIMEOUT)


def _launched_job(
    launch: LaunchEnvironment, children: list[subprocess.Popen[bytes]], tmp: str
) -> tuple[str, str, str, int, Path | None]:
    """Coordinator address, token, machine id and rank of a process another launcher
    started, and the rendezvous file it published, if any. The process
    ``sumflow.jobenv.coordinator.locate`` names starts the coordinator; each machine's local
    rank 0 starts the machine's colocated server."""
    where = locate(
        launch,
        os.environ,
        temp_dir=Path(tempfile.gettempdir()),
        uid=os.getuid(),
        parent_pid=os.getppid(),
    )
    host_id = settings.HOST_ID.read() or launch.host_id or socket.gethostname()
    token = _given_token()
    published = None
    if where.rendezvous_file is None:
        assert where.address is not None, "an address unless a rendezvous file carries it"
        address = where.address
        if not token:
            token = derived_token(launch, address)
            if where.starts_it:
                warnings.warn(
                    f"sumflow under {launch.launcher} without {settings.JOB_TOKEN.name}: the "
                    "job token is derived from the launcher's job id and the coordinator's "
                    "address, so anyone who knows them can join; set "
                    f"{settings.JOB_TOKEN.name} to the same secret on every process",
                    stacklevel=4,
                )
        if where.starts_it:
            _start_coordinator(children, launch, where, token, tmp)
    elif where.starts_it:
        # Only this machine's processes can read the file, so a fresh secret can travel
        # in it; no one needs to derive the token.
        token = token or secrets.token_hex(32)
        address = _start_coordinator(children, launch, where, token, tmp)
        published = where.rendezvous_file
    else:
        hint = (
            f"rank 0 of this {launch.launcher} job publishes it once its coordinator listens, "
            "if it runs on this machine with the same job id; otherwise set MASTER_ADDR and "
            "MASTER_PORT (rank 0 starts the coordinator on MASTER_PORT + 1) or "
            "SUMFLOW_COORDINATOR on every process"
        )
        address, token = rendezvous.await_published(
            where.rendezvous_file, settings.JOIN_TIMEOUT.read(), hint
        )
    if launch.local_rank == 0:
        if where.loopback:
            bind, advertise = "127.0.0.1", "127.0.0.1"
        else:
            bind, advertise = "0.0.0.0", socket.getfqdn()
        children.append(
            _start(
                "sumflow-server",
                [
                    f"--coordinator={address}",
                    f"--host-id={host_id}",
                    f"--bind={bind}:0",
                    f"--advertise={advertise}",
                ],
                _program_env(token),
            )
        )
    if published is not None:
        # Last: a start that failed before leaves no file behind.
        rendezvous.publish(published, address, token)
    return address, token, host_id, launch.rank, published


def _single_process_job(
    children: list[subprocess.Popen[bytes]], tmp: str
) -> tuple[str, str, str, int]:
    """A job of one: its own coordinator and colocated server on loopback."""
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith(settings.PREFIX)}
    env[settings.JOB_TOKEN.name] = token
    env.setdefault("RUST_LOG", "warn")
    addr_file = Path(tmp) / "coordinator"
    children.append(
        _start(
            "sumflow-coordinator",
            ["--bind=127.0.0.1:0", "--workers=1", "--servers=1", f"--addr-file={addr_file}"],
            env,
        )
    )
    coordinator = _wait_for_file(addr_file, "coordinator", children[-1], _START_TIMEOUT)
    children.append(
        _start(
            "sumflow-server",
            [f"--coordinator={coordinator}", "--host-id=local-0", "--engine-threads=1"],
            env,
        )
    )
    return coordinator, token, "local-0", 0


def init() -> Runtime:
    """Starts this process's communication service (once; later calls return it)."""
    global _runtime, generation
    with _runtime_lock:
        if _runtime is not None:
            return _runtime
        children: list[subprocess.Popen[bytes]] = []
        tmpdir = tempfile.TemporaryDirectory(prefix="sumflow-")
        published: Path | None = None
        epoch = None
        try:
            timeout = settings.TIMEOUT.read()
            options = _service_options()
            rank: int | None
            given = settings.COORDINATOR.read()
            if settings.ELASTIC_ADDR.read():
                try:
                    coordinator, token, host_id, rank, epoch = _elastic_job(options)
                except elastic.Removed as e:
                    print(f"sumflow: leaving the elastic job: {e}", file=sys.stderr, flush=True)
                    raise SystemExit(0) from None
            elif given:
                coordinator, token, host_id, rank = _joined_job(given)
            else:
                launch = detect(os.environ)
                if launch is not None and launch.size > 1:
                    coordinator, token, host_id, rank, published = _launched_job(
                        launch, children, tmpdir.name
                    )
                else:
                    coordinator, token, host_id, rank = _single_process_job(children, tmpdir.name)
            service = _core.CommunicationService(
                coordinator, token, host_id=host_id, rank=rank, **options
            )
        except BaseException:
            _stop_children(children)
            if published is not None:
                rendezvous.withdraw(published)
            tmpdir.cleanup()
            raise
        _runtime = Runtime(service, timeout, children, tmpdir, published, epoch)
        generation += 1
        atexit.unregister(_shutdown_at_exit)  # once, however many epochs
        atexit.register(_shutdown_at_exit)
        return _runtime


def _shutdown_at_exit() -> None:
    """`shutdown` as the interpreter exits: a job that broke (a lost coordinator, a failed
    peer) has already raised its error where it happened, so leaving it says so in one
    line instead of a second traceback."""
    try:
        shutdown()
    except _core.SumflowError as e:
        print(f"sumflow: leaving the job: {e}", file=sys.stderr, flush=True)


def _stop_children(children: list[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    deadline = time.monotonic() + grace
    for p in children:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in children:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def shutdown() -> None:
    """Leaves the job; waits for any coordinator or server this process started."""
    global _runtime
    with _runtime_lock:
        rt, _runtime = _runtime, None
    if rt is None:
        return
    try:
        try:
            report_trace(rt.service.trace_flush())
        except OSError as e:
            # A trace that cannot be written must not keep the worker from leaving.
            warnings.warn(f"sumflow: {e}", stacklevel=2)
        rt.service.shutdown("worker finished")
    finally:
        if rt.published is not None:
            rendezvous.withdraw(rt.published)
        _stop_children(rt.children)
        if rt.tmpdir is not None:
            rt.tmpdir.cleanup()
