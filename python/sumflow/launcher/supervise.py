"""Supervising a started job: its processes, their prefixed output, and the teardown
when the job ends, fails or is stopped by a signal."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, BinaryIO

from sumflow import settings
from sumflow._programs import program
from sumflow.launcher.errors import PROG
from sumflow.launcher.hosts import join_host_port, split_host_port
from sumflow.launcher.logs import open_logs
from sumflow.launcher.plan import Plan, ProcSpec, build_processes
from sumflow.launcher.ssh import first_line, ssh_argv

#: Signals that stop the whole job when the launcher receives them.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


#: Variables the launcher sets itself for every job: one in its own environment (from an
#: enclosing job, or a shell) is replaced, not lost.
_SET_BY_LAUNCHER = frozenset(
    v.name
    for v in (
        settings.COORDINATOR,
        settings.JOB_TOKEN_FILE,
        settings.JOB_TOKEN,
        settings.HOST_ID,
        settings.RANK,
        settings.WORKER_NAME,
        settings.ELASTIC_ADDR,
        settings.ELASTIC_WORKER,
    )
) | {settings.NUM_WORKERS.name}


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


@dataclass(frozen=True)
class Incident:
    """A line of the coordinator's incidents file: a node it declared failed or a worker
    a summation server saw stalled (``crates/coordinator/src/incidents.rs``)."""

    time: float
    kind: str
    role: str
    rank: int
    name: str
    host_id: str
    pid: int
    reason: str

    def describe(self) -> str:
        """``worker 1 'worker 1' (pid 4242 on node-b) stalled: has not pushed ...``."""
        return (
            f"{self.role} {self.rank} '{self.name}' (pid {self.pid} on {self.host_id}) "
            f"{self.kind}: {self.reason}"
        )


def read_incidents(path: Path) -> list[Incident]:
    """The incidents recorded so far, in order; lines that are not whole are skipped (the
    coordinator may be writing one)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        try:
            v = json.loads(line)
            found.append(
                Incident(
                    float(v["time"]),
                    str(v["kind"]),
                    str(v["role"]),
                    int(v["rank"]),
                    str(v["name"]),
                    str(v["host_id"]),
                    int(v["pid"]),
                    str(v["reason"]),
                )
            )
        except (ValueError, KeyError, TypeError):
            continue
    return found


#: Beyond the stall warning's period, how long the launcher may take to see the exit of a
#: worker that gave up waiting on a stalled one (its traceback, its leaving the job, a
#: busy machine): a stall reported this recently is still the cause.
_STALL_EXIT_GRACE = 30.0


def first_cause(incidents: list[Incident], at: float, stall_window: float) -> Incident | None:
    """What to blame for a job that failed at ``at`` (Unix time): the first node the
    coordinator declared failed; else a worker stalled within ``stall_window`` seconds
    before ``at`` (a stall that ended long before is no cause: the job went on)."""
    failed = [i for i in incidents if i.kind == "failed"]
    if failed:
        return failed[0]
    recent = [i for i in incidents if i.kind == "stalled" and at - i.time <= stall_window]
    return recent[-1] if recent else None


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

    def pump(
        self, source: IO[bytes], to_stderr: bool, prefix: bytes, copy: BinaryIO | None
    ) -> None:
        """Copies ``source`` line by line, each prefixed, until end of file; also to
        ``copy`` as it is (closed at the end), when given."""
        with source, copy or contextlib.nullcontext():
            while True:
                try:
                    line = source.readline(1 << 16)
                except (OSError, ValueError):
                    return
                if not line:
                    return
                if copy is not None:
                    # A full disk must not stop the job, nor the output on the terminal.
                    with contextlib.suppress(OSError):
                        copy.write(line)
                        copy.flush()
                if not line.endswith(b"\n"):
                    line += b"\n"
                self.write(to_stderr, prefix + line)


class Child:
    """A started process: its output is pumped (also into ``logs``, its stdout and stderr
    files, when given), and its exit is reported on ``events``."""

    def __init__(
        self,
        spec: ProcSpec,
        proc: subprocess.Popen[bytes],
        output: Output,
        events: queue.Queue[Child],
        logs: tuple[BinaryIO, BinaryIO] | None = None,
    ) -> None:
        self.spec = spec
        self.proc = proc
        self.returncode: int | None = None
        self.done = threading.Event()
        self._events = events
        prefix = f"[{spec.name}] ".encode()
        out_log, err_log = logs or (None, None)
        self._threads = [
            threading.Thread(
                target=output.pump, args=(proc.stdout, False, prefix, out_log), daemon=True
            ),
            threading.Thread(
                target=output.pump, args=(proc.stderr, True, prefix, err_log), daemon=True
            ),
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
        self._incidents: Path | None = None
        self._token = ""
        # The coordinator's job id: the workers' shared-memory files on this machine are
        # named by it, so that teardown can remove what killed workers left.
        self._job_id = f"run-{secrets.token_hex(8)}"
        self._base_env = {k: v for k, v in os.environ.items() if not k.startswith(settings.PREFIX)}
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
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)

    def _run(self) -> int:
        plan = self.plan
        self._warn_dropped_settings()
        self._prepare_token()
        assert self._tmp is not None
        addr_file = self._tmp / "coordinator"
        self._incidents = self._tmp / "incidents"
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
            "--job-id",
            self._job_id,
            "--incidents-file",
            str(self._incidents),
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

    def _prepare_token(self) -> None:
        """Makes the job's private directory and, unless --token-file gives one, its token
        file; every local process gets the file's path."""
        self._tmp = Path(tempfile.mkdtemp(prefix="sumflow-run-"))  # mode 0700
        if self.plan.token_file is not None:
            token_file = self.plan.token_file
        else:
            self._token = secrets.token_hex(32)
            token_file = self._tmp / "token"
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self._token + "\n")
        self._base_env[settings.JOB_TOKEN_FILE.name] = str(token_file)

    def _warn_dropped_settings(self) -> None:
        """Says which SUMFLOW_* variables of the launcher's environment the job does not
        get (none is inherited: a stale rank or coordinator would break it) and that -x
        forwards one; a setting silently lost is a run measured at the wrong setting."""
        given = {**self.plan.worker_env, **self.plan.service_env}
        dropped = sorted(
            k
            for k in os.environ
            if k.startswith(settings.PREFIX) and k not in given and k not in _SET_BY_LAUNCHER
        )
        if dropped:
            self.out.message(
                f"not passing {', '.join(dropped)} from this environment to the job; "
                f"forward with -x NAME (e.g. -x {dropped[0]})"
            )

    def _start(self, spec: ProcSpec) -> tuple[Child | None, int]:
        """Starts ``spec``; on failure prints why and returns (None, exit status)."""
        if spec.host is None:
            argv = spec.argv
            env = {**self._base_env, **spec.env}
            if spec.kind != "worker":
                env = {**self._service_env, **env}
            stdin: int = subprocess.DEVNULL
        else:
            argv = ssh_argv(self.plan, spec, os.getcwd(), os.environ)
            env = {k: v for k, v in os.environ.items() if not k.startswith(settings.PREFIX)}
            stdin = subprocess.PIPE
        logs = None
        if self.plan.output_dir is not None:
            try:
                logs = open_logs(self.plan.output_dir, spec.name)
            except OSError as e:
                self.out.message(f"cannot open the output files of {spec.name}: {e}")
                return None, 1
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
            for f in logs or ():
                f.close()
            self.out.message(f"cannot start {spec.name} ({shlex.join(argv[:1])}): {e}")
            if isinstance(e, FileNotFoundError):
                return None, 127
            return None, 126 if isinstance(e, PermissionError) else 1
        child = Child(spec, proc, self.out, self._events, logs)
        self.children.append(child)
        if proc.stdin is not None:
            try:
                proc.stdin.write(first_line(self.plan, self._token))
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
                        f"{child.describe()} {describe_exit(code)}{hint}{self._cause(child)}; "
                        f"stopping the other {others} process{'es' if others != 1 else ''}"
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

    def _cause(self, child: Child) -> str:
        """``, after ...`` naming what failed first when that is not ``child``: the process
        whose exit the launcher sees first is often one that noticed a failure (a hung
        server, a worker stuck in its own code never exits), not its cause."""
        if self._incidents is None:
            return ""
        # A stall counts while its server keeps reporting it (every stall warning).
        stall = settings.STALL_WARNING
        given = {**self.plan.worker_env, **self.plan.service_env}.get(stall.name, "")
        try:
            warning = stall.kind.convert(given) if given.strip() else stall.default
        except ValueError:
            warning = stall.default
        window = 2 * warning + _STALL_EXIT_GRACE
        cause = first_cause(read_incidents(self._incidents), time.time(), window)
        if cause is None or cause.pid == child.pid or cause.name == child.spec.name:
            return ""
        return f", after {cause.describe()}"

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
        remove_shared_memory(self._job_id)


def remove_shared_memory(job_id: str, directory: Path = Path("/dev/shm")) -> None:
    """Removes the shared-memory files the job's workers left on this machine: each is
    unlinked as soon as every worker has mapped it and at shutdown, but a worker killed in
    between leaves its files (docs/architecture.md, shared memory)."""
    for path in directory.glob(f"sumflow-{job_id}-*"):
        with contextlib.suppress(OSError):
            path.unlink()
