"""Local sumflow jobs for tests: a coordinator and summation servers as processes, and
workers as threads of the test process (each with its own CommunicationService)."""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sumflow import _core
from sumflow.jobenv.coordinator import slurm_port

#: Every wait in these tests is bounded; this is the bound for a job's start.
START_TIMEOUT = 30.0


def script(name: str) -> str:
    """The installed console script `name`, from this interpreter's environment."""
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    assert found, f"console script {name} is not installed (pip install -e .)"
    return found


@dataclass
class Job:
    """A running coordinator and its servers; workers join with `service(i)`."""

    coordinator: str
    token: str
    workers: int
    machines: int
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def host_id(self, worker: int) -> str:
        """The machine of worker `worker`: workers are spread evenly over the machines."""
        return f"local-{worker * self.machines // self.workers}"

    def service(self, worker: int, **options: Any) -> _core.CommunicationService:
        """Joins the job as worker `worker` (blocks until every node has joined)."""
        options.setdefault("join_timeout", START_TIMEOUT)
        return _core.CommunicationService(
            self.coordinator,
            self.token,
            host_id=self.host_id(worker),
            rank=worker,
            name=f"worker {worker}",
            **options,
        )

    def run_workers(
        self, body: Callable[[_core.CommunicationService], Any], **options: Any
    ) -> list[Any]:
        """Runs `body(service)` on one thread per worker; returns the results by rank and
        re-raises the first worker's exception."""
        results: list[Any] = [None] * self.workers
        errors: list[BaseException | None] = [None] * self.workers

        def worker(i: int) -> None:
            try:
                svc = self.service(i, **options)
                try:
                    results[i] = body(svc)
                finally:
                    svc.shutdown("test done")
            except BaseException as e:
                errors[i] = e

        threads = [
            threading.Thread(target=worker, args=(i,), daemon=True) for i in range(self.workers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
            assert not t.is_alive(), "a worker thread did not finish within 120 s"
        for e in errors:
            if e is not None:
                raise e
        return results


@contextmanager
def local_job(
    tmp_path: Path,
    workers: int,
    cpu_servers: int = 0,
    *,
    colocated: bool = True,
    machines: int | None = None,
    heartbeat_timeout: float = 10.0,
    service_logs: list[str] | None = None,
) -> Iterator[Job]:
    """Starts a coordinator, one colocated server per machine (unless `colocated` is
    False) and `cpu_servers` CPU servers; stops them all on exit. ``service_logs``: given,
    the services log at info level, and their logs (the coordinator's first) are appended
    to it once they stopped."""
    machines = machines or workers
    token = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
    env.update(SUMFLOW_JOB_TOKEN=token, RUST_LOG="warn" if service_logs is None else "info")
    servers = (machines if colocated else 0) + cpu_servers
    addr_file = tmp_path / f"coordinator-{secrets.token_hex(4)}"
    procs: list[subprocess.Popen[str]] = []

    def start(args: list[str]) -> None:
        procs.append(
            subprocess.Popen(
                args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        )

    try:
        start(
            [
                script("sumflow-coordinator"),
                "--bind=127.0.0.1:0",
                f"--workers={workers}",
                f"--servers={servers}",
                f"--heartbeat-timeout={heartbeat_timeout}",
                f"--join-timeout={START_TIMEOUT}",
                f"--addr-file={addr_file}",
            ]
        )
        deadline = time.monotonic() + START_TIMEOUT
        while not (addr_file.exists() and addr_file.read_text().strip()):
            assert procs[0].poll() is None, f"coordinator exited: {procs[0].communicate()[1]}"
            assert time.monotonic() < deadline, "the coordinator did not write its address"
            time.sleep(0.01)
        coordinator = addr_file.read_text().strip()
        hosts = [f"local-{m}" for m in range(machines)] if colocated else []
        hosts += [f"cpu-{j}" for j in range(cpu_servers)]
        for host in hosts:
            start(
                [
                    script("sumflow-server"),
                    f"--coordinator={coordinator}",
                    f"--host-id={host}",
                    "--engine-threads=1",
                    f"--heartbeat-timeout={heartbeat_timeout}",
                ]
            )
        yield Job(coordinator, token, workers, machines, procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                _, err = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if service_logs is not None:
                service_logs.append(err)


@dataclass
class Outcome:
    """How one worker process ended."""

    rank: int
    returncode: int
    stdout: str
    stderr: str


def run_worker_processes(
    tmp_path: Path,
    workers: int,
    argv: list[str],
    cpu_servers: int = 0,
    *,
    colocated: bool = True,
    heartbeat_timeout: float = 10.0,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    service_logs: list[str] | None = None,
    machines: int | None = None,
) -> list[Outcome]:
    """Runs `argv` as `workers` worker processes of a local job, with the environment
    sumflow-run gives workers (and MASTER_ADDR/MASTER_PORT for a gloo process group);
    returns how each ended. ``service_logs`` and ``machines`` (default: one per worker):
    as for ``local_job``."""
    with local_job(
        tmp_path,
        workers,
        cpu_servers,
        colocated=colocated,
        machines=machines,
        heartbeat_timeout=heartbeat_timeout,
        service_logs=service_logs,
    ) as job:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            master_port = s.getsockname()[1]
        envs = []
        for rank in range(workers):
            worker_env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
            worker_env.update(
                SUMFLOW_COORDINATOR=job.coordinator,
                SUMFLOW_JOB_TOKEN=job.token,
                SUMFLOW_RANK=str(rank),
                SUMFLOW_HOST_ID=job.host_id(rank),
                SUMFLOW_WORKER_NAME=f"worker {rank}",
                SUMFLOW_HEARTBEAT_TIMEOUT=str(heartbeat_timeout),
                SUMFLOW_JOIN_TIMEOUT=str(START_TIMEOUT),
                RANK=str(rank),
                WORLD_SIZE=str(workers),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master_port),
                OMP_NUM_THREADS="1",
                RUST_LOG="warn",
                **(env or {}),
            )
            envs.append(worker_env)
        return run_processes([sys.executable, *argv], envs, timeout)


def assert_every_worker_reported_ok(tmp_path: Path, outcomes: list[Outcome]) -> None:
    """Every worker exited 0 and wrote "ok" to tmp_path/rank<r>.txt (the workers' own
    checks; otherwise the file lists what failed)."""
    for o in outcomes:
        assert o.returncode == 0, f"worker {o.rank} exited {o.returncode}:\n{o.stderr[-3000:]}"
        report = (tmp_path / f"rank{o.rank}.txt").read_text()
        assert report == "ok", f"worker {o.rank}:\n{report}"


def run_processes(
    command: list[str], envs: list[dict[str, str]], timeout: float, cwd: Path | None = None
) -> list[Outcome]:
    """Runs `command` once per environment of `envs` (the i-th is rank i), in `cwd`, and
    returns how each ended; after `timeout` seconds every one still running is killed."""
    procs = [
        subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]
    outcomes = []
    deadline = time.monotonic() + timeout
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            err += f"\n[test harness: worker {rank} killed after {timeout:.0f} s]"
        outcomes.append(Outcome(rank, p.returncode, out, err))
    return outcomes


#: Variables by which a launcher tells a process about its job (torchrun, horovodrun, Open
#: MPI, MPICH, Slurm): none may leak from the test's own environment into a job's.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
LAUNCHER_PREFIXES = (
    "SUMFLOW_",
    "TORCHELASTIC_",
    "MASTER_",
    "HOROVOD_",
    "OMPI_",
    "PMIX_",
    "PMI_",
    "MPI_LOCAL",
    "SLURM",
)


def launcher_free_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's or sumflow's variables, plus
    `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARIABLES and not k.startswith(LAUNCHER_PREFIXES)
    }
    env.update(extra)
    return env


def slurm_job_id() -> int:
    """A Slurm job id whose coordinator port (step 0, no MASTER_PORT) is free here."""
    for _ in range(200):
        job = secrets.randbelow(10**6)
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", slurm_port(f"{job}.0")))
        except OSError:
            continue
        return job
    raise RuntimeError("no Slurm job id whose coordinator port is free")


def check_job_of_two(lines: list[str]) -> None:
    """Two workers of launch_env_worker.py saw a job of two on one machine and summed 2:
    `lines` are what they printed, one JSON line each, in any order."""
    seen = sorted((json.loads(line) for line in lines), key=lambda s: int(s["rank"]))
    assert [s["rank"] for s in seen] == [0, 1], lines
    for s in seen:
        assert (s["size"], s["local_rank"], s["local_size"]) == (2, s["rank"], 2), s
        assert s["sum"] == [2.0, 2.0, 2.0], s


def free_port_pair() -> int:
    """A port P with P and P + 1 free, below Linux's ephemeral range (32768 up): a
    coordinator under torchrun's variables binds MASTER_PORT + 1, and a port-0 bind (the
    summation server's, any client socket's) could take an ephemeral P + 1 first (seen once
    in CI)."""
    rng = random.Random()
    for _ in range(200):
        p = rng.randrange(20000, 32000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
        except OSError:
            continue
        return p
    raise RuntimeError("no free pair of ports in 20000-32000")
