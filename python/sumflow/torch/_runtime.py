"""The process's one communication service: how it is found, started and stopped.

A worker learns its job from the environment (``sumflow.settings``, docs/settings.md).
``sumflow-run`` sets ``SUMFLOW_*`` variables; under ``torchrun`` (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) rank 0 starts the
coordinator and each machine's local rank 0 its colocated summation server; a process
started alone is a job of one, with its own coordinator and server.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
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


class _Options(TypedDict, total=False):
    """The service's keywords that come from the environment. Those of the trace window are
    there only when their variable is set, so that the core's own defaults hold otherwise."""

    name: str
    partition_bytes: int
    scheduler: str
    credit_bytes: int | None
    push_window_bytes: int | None
    connections_per_cpu_server: int | None
    join_timeout: float
    heartbeat_timeout: float
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
        "scheduler": settings.SCHEDULER.read(),
        "credit_bytes": settings.CREDIT_BYTES.read(),
        "push_window_bytes": settings.PUSH_WINDOW_BYTES.read(),
        "connections_per_cpu_server": settings.CPU_SERVER_CONNECTIONS.read(),
        "join_timeout": settings.JOIN_TIMEOUT.read(),
        "heartbeat_timeout": settings.HEARTBEAT_TIMEOUT.read(),
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
            s.name for s, value in zip(window, (start_step, steps, max_events)) if value is not None
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


def _torchrun_int(name: str) -> int | None:
    """One of torchrun's integer variables (``RANK``, ``WORLD_SIZE``...), None when unset."""
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


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
    #: Coordinator and servers this process started (torchrun and single-process jobs).
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    tmpdir: tempfile.TemporaryDirectory[str] | None = None


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def current() -> Runtime:
    """The running service; a clear error when ``init()`` was not called."""
    rt = _runtime
    if rt is None:
        raise ValueError(
            "sumflow is not initialised: call sumflow.torch.init() first (inside a job "
            "started by sumflow-run or torchrun, or alone for a job of one)"
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


def _job_token() -> str:
    path = settings.JOB_TOKEN_FILE.read()
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as e:
            raise ValueError(
                f"{settings.JOB_TOKEN_FILE.name}={path}: cannot read the job token: {e}"
            ) from None
    token = settings.JOB_TOKEN.read()
    if token:
        return token
    raise ValueError(
        f"no job token: set {settings.JOB_TOKEN_FILE.name} or {settings.JOB_TOKEN.name} "
        "(sumflow-run sets one)"
    )


def _torchrun_job(children: list[subprocess.Popen[bytes]]) -> tuple[str, str, str, int]:
    """Coordinator address, token, machine id and rank for a torchrun worker, starting the
    coordinator (rank 0) and this machine's colocated server (local rank 0)."""
    rank = _torchrun_int("RANK") or 0
    world = _torchrun_int("WORLD_SIZE") or 1
    local_rank = _torchrun_int("LOCAL_RANK") or 0
    local_world = _torchrun_int("LOCAL_WORLD_SIZE") or world
    if world % local_world:
        raise ValueError(
            f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}: sumflow "
            "under torchrun needs the same number of workers on every machine"
        )
    master = os.environ["MASTER_ADDR"]
    port = (_torchrun_int("MASTER_PORT") or 29500) + 1
    coordinator = f"{master}:{port}"
    token = settings.JOB_TOKEN.read()
    if not token:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        token = hashlib.sha256(f"sumflow:{run_id}:{coordinator}:{world}".encode()).hexdigest()
        if rank == 0:
            warnings.warn(
                f"sumflow under torchrun without {settings.JOB_TOKEN.name}: the job token is "
                "derived from the rendezvous settings, so anyone who knows them can join; set "
                f"{settings.JOB_TOKEN.name} to the same secret on every machine",
                stacklevel=3,
            )
    host_id = settings.HOST_ID.read() or socket.gethostname()
    env = {**os.environ, settings.JOB_TOKEN.name: token}
    env.pop(settings.JOB_TOKEN_FILE.name, None)
    env.setdefault("RUST_LOG", "warn")
    machines = world // local_world
    if rank == 0:
        bind = "0.0.0.0" if master not in ("127.0.0.1", "localhost") else "127.0.0.1"
        children.append(
            _start(
                "sumflow-coordinator",
                [f"--bind={bind}:{port}", f"--workers={world}", f"--servers={machines}"],
                env,
            )
        )
    if local_rank == 0:
        advertise = "127.0.0.1" if master in ("127.0.0.1", "localhost") else socket.getfqdn()
        children.append(
            _start(
                "sumflow-server",
                [
                    f"--coordinator={coordinator}",
                    f"--host-id={host_id}",
                    f"--bind={'127.0.0.1' if advertise == '127.0.0.1' else '0.0.0.0'}:0",
                    f"--advertise={advertise}",
                ],
                env,
            )
        )
    return coordinator, token, host_id, rank


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
    coordinator = _wait_for_file(addr_file, "coordinator", children[-1], 60.0)
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
    global _runtime
    with _runtime_lock:
        if _runtime is not None:
            return _runtime
        children: list[subprocess.Popen[bytes]] = []
        tmpdir = tempfile.TemporaryDirectory(prefix="sumflow-")
        try:
            timeout = settings.TIMEOUT.read()
            options = _service_options()
            given_coordinator = settings.COORDINATOR.read()
            if given_coordinator:
                coordinator = given_coordinator
                token = _job_token()
                host_id = settings.HOST_ID.read() or socket.gethostname()
                rank = settings.RANK.read()
            elif os.environ.get("MASTER_ADDR") and os.environ.get("WORLD_SIZE"):
                coordinator, token, host_id, rank = _torchrun_job(children)
            else:
                coordinator, token, host_id, rank = _single_process_job(children, tmpdir.name)
            service = _core.CommunicationService(
                coordinator, token, host_id=host_id, rank=rank, **options
            )
        except BaseException:
            _stop_children(children)
            tmpdir.cleanup()
            raise
        _runtime = Runtime(service, timeout, children, tmpdir)
        atexit.register(shutdown)
        return _runtime


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
        _stop_children(rt.children)
        if rt.tmpdir is not None:
            rt.tmpdir.cleanup()
