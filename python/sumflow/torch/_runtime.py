"""The process's one communication service: how it is found, started and stopped.

A worker learns its job from the environment. ``sumflow-run`` sets ``SUMFLOW_*`` variables;
under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) rank 0 starts the coordinator and each machine's local rank 0 its
colocated summation server; a process started alone is a job of one, with its own
coordinator and server.
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

from sumflow import _core
from sumflow._programs import program

#: Default wait for one operation, in seconds (``SUMFLOW_TIMEOUT``). Dead peers are found
#: by heartbeats much sooner; this bounds every other way an operation can stall.
DEFAULT_TIMEOUT = 300.0


def _env_factor(name: str) -> float:
    """A factor >= 0 from the environment; 0 when unset."""
    raw = os.environ.get(name) or "0"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name}={raw!r} must be a finite number >= 0")
    return value


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _env_count(name: str, least: int) -> int | None:
    value = _env_int(name)
    if value is not None and value < least:
        raise ValueError(f"{name}={value} must be at least {least}")
    return value


class _TraceSettings(TypedDict, total=False):
    trace_dir: str
    trace_start_step: int
    trace_steps: int
    trace_max_events: int


def _trace_settings() -> _TraceSettings:
    """The service's trace keywords from ``SUMFLOW_TRACE_*`` (docs/tracing.md): tracing is
    on when ``SUMFLOW_TRACE_DIR`` is set; the window's defaults are the core's."""
    start_step = _env_count("SUMFLOW_TRACE_START_STEP", 0)
    steps = _env_count("SUMFLOW_TRACE_STEPS", 1)
    max_events = _env_count("SUMFLOW_TRACE_MAX_EVENTS", 1)
    directory = os.environ.get("SUMFLOW_TRACE_DIR")
    if not directory:
        given = [
            name
            for name, value in (
                ("SUMFLOW_TRACE_START_STEP", start_step),
                ("SUMFLOW_TRACE_STEPS", steps),
                ("SUMFLOW_TRACE_MAX_EVENTS", max_events),
            )
            if value is not None
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)} set without SUMFLOW_TRACE_DIR, the directory the trace "
                "is written to: set it too to record a trace"
            )
        return {}
    settings: _TraceSettings = {"trace_dir": directory}
    if start_step is not None:
        settings["trace_start_step"] = start_step
    if steps is not None:
        settings["trace_steps"] = steps
    if max_events is not None:
        settings["trace_max_events"] = max_events
    return settings


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
    path = os.environ.get("SUMFLOW_JOB_TOKEN_FILE")
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as e:
            raise ValueError(
                f"SUMFLOW_JOB_TOKEN_FILE={path}: cannot read the job token: {e}"
            ) from None
    token = os.environ.get("SUMFLOW_JOB_TOKEN")
    if token:
        return token
    raise ValueError(
        "no job token: set SUMFLOW_JOB_TOKEN_FILE or SUMFLOW_JOB_TOKEN (sumflow-run sets one)"
    )


def _torchrun_job(children: list[subprocess.Popen[bytes]]) -> tuple[str, str, str, int]:
    """Coordinator address, token, machine id and rank for a torchrun worker, starting the
    coordinator (rank 0) and this machine's colocated server (local rank 0)."""
    rank = _env_int("RANK") or 0
    world = _env_int("WORLD_SIZE") or 1
    local_rank = _env_int("LOCAL_RANK") or 0
    local_world = _env_int("LOCAL_WORLD_SIZE") or world
    if world % local_world:
        raise ValueError(
            f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}: sumflow "
            "under torchrun needs the same number of workers on every machine"
        )
    master = os.environ["MASTER_ADDR"]
    port = (_env_int("MASTER_PORT") or 29500) + 1
    coordinator = f"{master}:{port}"
    token = os.environ.get("SUMFLOW_JOB_TOKEN")
    if not token:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        token = hashlib.sha256(f"sumflow:{run_id}:{coordinator}:{world}".encode()).hexdigest()
        if rank == 0:
            warnings.warn(
                "sumflow under torchrun without SUMFLOW_JOB_TOKEN: the job token is derived "
                "from the rendezvous settings, so anyone who knows them can join; set "
                "SUMFLOW_JOB_TOKEN to the same secret on every machine",
                stacklevel=3,
            )
    host_id = os.environ.get("SUMFLOW_HOST_ID") or socket.gethostname()
    env = dict(os.environ, SUMFLOW_JOB_TOKEN=token)
    env.pop("SUMFLOW_JOB_TOKEN_FILE", None)
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
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
    env["SUMFLOW_JOB_TOKEN"] = token
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
            timeout = _env_float("SUMFLOW_TIMEOUT", DEFAULT_TIMEOUT)
            if os.environ.get("SUMFLOW_COORDINATOR"):
                coordinator = os.environ["SUMFLOW_COORDINATOR"]
                token = _job_token()
                host_id = os.environ.get("SUMFLOW_HOST_ID") or socket.gethostname()
                rank = _env_int("SUMFLOW_RANK")
            elif os.environ.get("MASTER_ADDR") and os.environ.get("WORLD_SIZE"):
                coordinator, token, host_id, rank = _torchrun_job(children)
            else:
                coordinator, token, host_id, rank = _single_process_job(children, tmpdir.name)
            service = _core.CommunicationService(
                coordinator,
                token,
                host_id=host_id,
                rank=rank,
                name=os.environ.get("SUMFLOW_WORKER_NAME") or f"worker pid {os.getpid()}",
                partition_bytes=_env_int("SUMFLOW_PARTITION_BYTES") or 4 << 20,
                scheduler=os.environ.get("SUMFLOW_SCHEDULER") or "bytescheduler",
                credit_bytes=_env_int("SUMFLOW_CREDIT_BYTES"),
                push_window_bytes=_env_int("SUMFLOW_PUSH_WINDOW_BYTES"),
                prophet_stage_factor=_env_factor("SUMFLOW_PROPHET_STAGE_FACTOR"),
                connections_per_cpu_server=_env_int("SUMFLOW_CPU_SERVER_CONNECTIONS"),
                join_timeout=_env_float("SUMFLOW_JOIN_TIMEOUT", 300.0),
                heartbeat_timeout=_env_float("SUMFLOW_HEARTBEAT_TIMEOUT", 10.0),
                **_trace_settings(),
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
