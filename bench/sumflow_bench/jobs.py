"""Running a distributed job on the emulated hosts, two ways:

- :func:`run_sumflow_job`: ``sumflow-run`` in its cluster form, started inside the first
  worker host (which also hosts the coordinator), reaching the other hosts through the
  cluster's ssh stand-in: the launcher users run on a real cluster;
- :func:`run_torch_job`: one process per worker host with torchrun's environment (RANK,
  WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), for torch.distributed baselines.

Each job's full output goes to a log file; worker 0's lines and the launcher's messages are
echoed, and a failing job's last lines are shown. Every job has a time limit, after which
all its processes are killed and the error says which job it was.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sumflow import settings
from sumflow._programs import program
from sumflow_bench.netns import ClusterError, ClusterUnavailable, EmulatedCluster, EmulatedHost

#: Port of torch.distributed's store on the first worker host.
TORCH_MASTER_PORT = 29500


class JobFailed(RuntimeError):
    """A benchmark job exited non-zero or ran past its time limit."""


@dataclass(frozen=True)
class JobResult:
    seconds: float


def run_harness(harness: str, body: Callable[[], None], save: Callable[[], None]) -> int | None:
    """Runs a harness's jobs (``body``) and then ``save`` whatever happens. Returns the
    harness's exit status on a failure, said on stderr: 2 without an emulated cluster, 1
    when a job failed; None once it ran."""
    try:
        body()
    except (ClusterUnavailable, ClusterError) as e:
        print(f"sumflow_bench.{harness}: {e}", file=sys.stderr)
        return 2
    except JobFailed as e:
        print(f"sumflow_bench.{harness}: {e}", file=sys.stderr)
        return 1
    finally:
        save()
    return None


def run_recorded(
    harness: str, out: Path, results: dict[str, Any], body: Callable[[], None]
) -> int | None:
    """:func:`run_harness` for a harness whose record is ``results``, written to
    ``out/results.json`` whatever happens."""

    def save() -> None:
        (out / "results.json").write_text(json.dumps(results, indent=1))

    return run_harness(harness, body, save)


def report(out: Path, table: str, plot: Callable[[Path], None], png: str) -> int:
    """Writes and prints a harness's table (results.md) and its plot; exit status 0."""
    (out / "results.md").write_text(table)
    print(table)
    plot(out / png)
    return 0


def read_result(path: Path, what: str) -> dict[str, Any]:
    """The JSON result a job's rank 0 wrote to `path`; JobFailed if there is none."""
    try:
        result: dict[str, Any] = json.loads(path.read_text())
        return result
    except (OSError, ValueError) as e:
        raise JobFailed(f"{what} left no readable result in {path}: {e}") from None


def _echo(line: str) -> bool:
    return line.startswith(("[worker 0]", "sumflow-run:")) or "Error" in line


def _pump(
    source: IO[bytes], prefix: str, log: IO[str], tail: deque[str], lock: threading.Lock
) -> None:
    for raw in source:
        line = prefix + raw.decode(errors="replace").rstrip("\n")
        with lock:
            log.write(line + "\n")
            log.flush()
            tail.append(line)
            if _echo(line):
                print(f"    {line}", file=sys.stderr, flush=True)


def _run(
    what: str,
    commands: Sequence[tuple[str, list[str], dict[str, str]]],
    log_path: Path,
    timeout: float,
) -> JobResult:
    """Starts every (prefix, argv, env) at once; waits for all; on the first failure or at
    the time limit kills the rest (their whole process groups) and raises JobFailed."""
    tail: deque[str] = deque(maxlen=40)
    lock = threading.Lock()
    start = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    with log_path.open("w") as log:
        try:
            for prefix, argv, env in commands:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                procs.append(proc)
                assert proc.stdout is not None
                t = threading.Thread(target=_pump, args=(proc.stdout, prefix, log, tail, lock))
                t.start()
                pumps.append(t)
            failed: str | None = None
            while failed is None and any(p.poll() is None for p in procs):
                bad = [p for p in procs if p.returncode not in (None, 0)]
                if bad:
                    failed = f"exited with status {bad[0].returncode}"
                elif time.monotonic() - start > timeout:
                    failed = f"ran past its {timeout:g} s limit"
                time.sleep(0.1)
            if failed is None and any(p.returncode != 0 for p in procs):
                failed = f"exited with status {next(p.returncode for p in procs if p.returncode)}"
        finally:
            for proc in procs:
                if proc.poll() is None:
                    _kill_group(proc)
            for t in pumps:
                t.join(10)
    if failed is not None:
        shown = "\n".join(f"    {line}" for line in tail)
        raise JobFailed(f"{what} {failed}; its last lines ({log_path}):\n{shown}")
    return JobResult(time.monotonic() - start)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_sumflow_job(
    cluster: EmulatedCluster,
    workers: Sequence[EmulatedHost],
    cpu_servers: Sequence[EmulatedHost],
    worker_argv: Sequence[str],
    *,
    what: str,
    log_path: Path,
    timeout: float,
    launcher_args: Sequence[str] = (),
    per_host: int = 1,
) -> JobResult:
    """``worker_argv`` on ``per_host`` workers on each host in ``workers`` (local ranks 0
    to per_host - 1, as on a machine with that many GPUs), a colocated summation server on
    each of them and one on each host in ``cpu_servers``, through ``sumflow-run``."""
    if per_host < 1:
        raise ValueError(f"per_host must be at least 1, not {per_host}")
    first = workers[0]
    argv = [
        *(sys.executable, "-m", "sumflow.launcher"),
        *("-H", ",".join(f"{h.address}:{per_host}" for h in workers)),
        *("--coordinator-bind", f"{first.address}:0"),
        *("--ssh", cluster.ssh_command()),
        *("--server-program", " ".join(program("sumflow-server"))),
        *("--shutdown-grace", "10"),
    ]
    if cpu_servers:
        argv += ["--server-hosts", ",".join(h.address for h in cpu_servers)]
    argv += [*launcher_args, "--", *worker_argv]
    env = dict(os.environ)
    return _run(what, [("", cluster.command(first, argv), env)], log_path, timeout)


def run_torch_job(
    cluster: EmulatedCluster,
    workers: Sequence[EmulatedHost],
    worker_argv: Sequence[str],
    *,
    what: str,
    log_path: Path,
    timeout: float,
    per_host: int = 1,
) -> JobResult:
    """``worker_argv`` on ``per_host`` processes per host in ``workers``, with torchrun's
    variables (the store on the first host)."""
    commands = []
    base = {k: v for k, v in os.environ.items() if not k.startswith(settings.PREFIX)}
    size = len(workers) * per_host
    for m, host in enumerate(workers):
        for local in range(per_host):
            rank = m * per_host + local
            env = dict(
                base,
                RANK=str(rank),
                WORLD_SIZE=str(size),
                LOCAL_RANK=str(local),
                LOCAL_WORLD_SIZE=str(per_host),
                MASTER_ADDR=workers[0].address,
                MASTER_PORT=str(TORCH_MASTER_PORT),
                GLOO_SOCKET_IFNAME="eth0",
            )
            commands.append((f"[worker {rank}] ", cluster.command(host, list(worker_argv)), env))
    return _run(what, commands, log_path, timeout)
