"""Where the coordinator of a job another launcher started is, and which process starts
it: a pure decision from the :class:`~sumflow.jobenv.environment.LaunchEnvironment` and a
few variables (docs/launcher.md, "Other launchers").

In this order:

1. ``MASTER_ADDR`` (and ``MASTER_PORT``, default 29500) set: the coordinator listens on
   ``MASTER_PORT + 1`` of ``MASTER_ADDR``, and rank 0 starts it (torch.distributed's
   rendezvous keeps ``MASTER_PORT`` itself).
2. The launcher names a host for it (Slurm: the step's first node): it listens there, on
   ``MASTER_PORT + 1`` when ``MASTER_PORT`` is set, else on a port derived from the job id
   (:func:`slurm_port`); rank 0, which srun places on that node, starts it.
3. Every process on one machine (local size = size): rank 0 starts it on a free loopback
   port and publishes the address in a rendezvous file (:mod:`sumflow.jobenv.rendezvous`),
   in a private directory of the system's temporary directory, named after the launcher's
   job id (or, when it sets none, after the parent process the machine's processes share).
4. Otherwise nothing says where it is, and :func:`locate` fails at once saying what to set.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sumflow.jobenv.environment import LaunchEnvironment, read_int

#: torch.distributed's default ``MASTER_PORT``.
DEFAULT_MASTER_PORT = 29500
#: The ports :func:`slurm_port` picks from: below Linux's ephemeral range (32768 up), so
#: no client socket of the machine holds one by chance.
SLURM_PORTS = range(20000, 30000)
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Coordinator:
    """Where a launched job's coordinator is, and whether this process starts it."""

    #: Whether this process starts the coordinator.
    starts_it: bool
    #: ``HOST:PORT`` the starter binds (port 0 when a rendezvous file carries the address).
    bind: str
    #: ``HOST:PORT`` every process dials; None when it is read from ``rendezvous_file``.
    address: str | None
    #: Where rank 0 publishes the address (and the job token), on one machine only.
    rendezvous_file: Path | None
    #: Whether the job stays on this machine's loopback (servers bind and advertise it).
    loopback: bool
    #: How it was found, for messages.
    how: str


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind_host(host: str) -> str:
    return "127.0.0.1" if host in _LOOPBACK else "0.0.0.0"


def _master_port(env: Mapping[str, str]) -> int | None:
    port = read_int(env, "MASTER_PORT")
    if port is not None and not 1 <= port <= 65534:
        raise ValueError(
            f"MASTER_PORT={port}: expected 1 to 65534 (the coordinator listens on MASTER_PORT + 1)"
        )
    return port


def slurm_port(job_id: str | None) -> int:
    """The coordinator's port for a Slurm job step without ``MASTER_PORT``: the same on
    every task (a hash of ``JOB.STEP``), and different for steps sharing a first node."""
    if job_id is None:
        return DEFAULT_MASTER_PORT + 1
    return SLURM_PORTS.start + zlib.crc32(job_id.encode()) % len(SLURM_PORTS)


def rendezvous_path(
    launch: LaunchEnvironment, *, temp_dir: Path, uid: int, parent_pid: int
) -> Path:
    """The rendezvous file of a one-machine job: ``TEMP/sumflow-UID/LAUNCHER-HASH.json``,
    the hash of the launcher's job id, else of the parent process (Hydra's proxy, mpirun),
    which every process of the job on a machine shares."""
    key = launch.job_id if launch.job_id is not None else f"parent process {parent_pid}"
    slug = re.sub(r"[^a-z0-9]+", "-", launch.launcher.lower()).strip("-")
    digest = hashlib.sha256(f"{launch.launcher}:{key}".encode()).hexdigest()[:16]
    return temp_dir / f"sumflow-{uid}" / f"{slug}-{digest}.json"


#: How each launcher hands MASTER_ADDR and MASTER_PORT to every process, for messages.
_SET_MASTER = {
    "Open MPI": "`mpirun -x MASTER_ADDR=node1 -x MASTER_PORT=29500 ...`",
    "MPICH": "`mpiexec -genv MASTER_ADDR node1 -genv MASTER_PORT 29500 ...`",
    "horovodrun": "`MASTER_ADDR=node1 MASTER_PORT=29500 horovodrun ...` (it passes its "
    "environment on)",
}


def _not_found(launch: LaunchEnvironment) -> ValueError:
    example = _SET_MASTER.get(launch.launcher, "`export MASTER_ADDR=node1 MASTER_PORT=29500`")
    return ValueError(
        f"{launch.describe()} puts {launch.size} processes on {launch.machines} machines, "
        "and nothing says where the sumflow coordinator is: set MASTER_ADDR to rank 0's "
        "host (an address every machine reaches) and MASTER_PORT to a free port there (rank 0 "
        f"starts the coordinator on MASTER_PORT + 1), the same on every process, e.g. {example}; "
        "or set SUMFLOW_COORDINATOR=HOST:PORT (and SUMFLOW_JOB_TOKEN) to join a coordinator "
        "and servers you started"
    )


def locate(
    launch: LaunchEnvironment,
    env: Mapping[str, str],
    *,
    temp_dir: Path,
    uid: int,
    parent_pid: int,
) -> Coordinator:
    """Where ``launch``'s coordinator is (see the module docs); ``env`` holds
    ``MASTER_ADDR`` and ``MASTER_PORT`` if set. Raises ValueError, saying what to set, when
    the processes span machines and nothing gives an address."""
    starts_it = launch.rank == 0
    master = env.get("MASTER_ADDR", "").strip()
    master_port = _master_port(env)
    if master:
        port = (master_port or DEFAULT_MASTER_PORT) + 1
        return Coordinator(
            starts_it=starts_it,
            bind=_join(_bind_host(master), port),
            address=_join(master, port),
            rendezvous_file=None,
            loopback=master in _LOOPBACK,
            how=f"MASTER_ADDR={master}, MASTER_PORT + 1 = {port}",
        )
    host = launch.coordinator_host
    if host is not None:
        if master_port is not None:
            port, why = master_port + 1, "MASTER_PORT + 1"
        else:
            port, why = slurm_port(launch.job_id), "a port derived from the job id"
        if starts_it and launch.host_id not in (None, host):
            raise ValueError(
                f"{launch.describe()}: rank 0 runs on {launch.host_id}, not on the step's first "
                f"node {host}, where the coordinator goes: set MASTER_ADDR to rank 0's node "
                "(and MASTER_PORT) on every task"
            )
        return Coordinator(
            starts_it=starts_it,
            bind=_join(_bind_host(host), port),
            address=_join(host, port),
            rendezvous_file=None,
            loopback=host in _LOOPBACK,
            how=f"the first node of the job step, {host}, port {port} ({why})",
        )
    if launch.local_size == launch.size:
        path = rendezvous_path(launch, temp_dir=temp_dir, uid=uid, parent_pid=parent_pid)
        return Coordinator(
            starts_it=starts_it,
            bind="127.0.0.1:0",
            address=None,
            rendezvous_file=path,
            loopback=True,
            how=f"the rendezvous file {path}",
        )
    raise _not_found(launch)


def derived_token(launch: LaunchEnvironment, address: str) -> str:
    """The job token of a job without ``SUMFLOW_JOB_TOKEN``: the same on every process, from
    the launcher's job id, the coordinator's address and the size; anyone who knows those
    can compute it."""
    job_id = launch.job_id if launch.job_id is not None else "none"
    return hashlib.sha256(f"sumflow:{job_id}:{address}:{launch.size}".encode()).hexdigest()
