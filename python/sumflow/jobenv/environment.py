"""What a launcher's environment says about one process of a job: the
:class:`LaunchEnvironment` every launcher's parser returns, and the checks they share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnvironment:
    """One process of a job, as its launcher describes it in the environment."""

    #: The launcher, as messages name it: "torchrun", "horovodrun", "Open MPI", "MPICH",
    #: "Slurm".
    launcher: str
    rank: int
    size: int
    #: Its rank among the processes on its machine, and how many those are.
    local_rank: int
    local_size: int
    #: Worker machines in the job; each runs one colocated summation server.
    machines: int
    #: The variables it was read from, ``NAME=value``, for messages.
    source: tuple[str, ...]
    #: The launcher's id of this run of the job (the job token and the rendezvous file are
    #: derived from it), when the launcher sets one.
    job_id: str | None = None
    #: The launcher's name for this machine, when it has one; processes with the same one
    #: share a summation server.
    host_id: str | None = None
    #: Where the launcher puts the coordinator, when its environment says (Slurm: the first
    #: node of the job step).
    coordinator_host: str | None = None

    def describe(self) -> str:
        """``Open MPI (OMPI_COMM_WORLD_RANK=0, ...)``: the launcher and what it set."""
        return f"{self.launcher} ({', '.join(self.source)})"


def read_int(env: Mapping[str, str], name: str) -> int | None:
    """The integer variable ``name`` of ``env``, or None when unset or empty."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def require_int(env: Mapping[str, str], name: str, launcher: str, given: str) -> int:
    """Like :func:`read_int`, but the variable must be set: ``given`` names the variable
    that showed the launcher (``OMPI_COMM_WORLD_RANK``)."""
    value = read_int(env, name)
    if value is None:
        raise ValueError(
            f"{given} says {launcher} started this process, but {name} is not set: sumflow "
            f"needs it to know the job (set it, or unset {given} if {launcher} is not "
            "starting this job)"
        )
    return value


def check_ranks(
    launcher: str,
    names: tuple[str, str, str, str],
    rank: int,
    size: int,
    local_rank: int,
    local_size: int,
) -> None:
    """Fails unless 0 <= rank < size and 0 <= local_rank < local_size <= size; ``names``
    are the variables of the four, in that order."""
    rank_name, size_name, local_rank_name, local_size_name = names
    if size < 1:
        raise ValueError(f"{size_name}={size}: a job has at least one process")
    if not 0 <= rank < size:
        raise ValueError(f"{rank_name}={rank} is not a rank of {size_name}={size} ({launcher})")
    if not 1 <= local_size <= size:
        raise ValueError(
            f"{local_size_name}={local_size} is not 1 to {size_name}={size} ({launcher})"
        )
    if not 0 <= local_rank < local_size:
        raise ValueError(
            f"{local_rank_name}={local_rank} is not a rank of {local_size_name}={local_size} "
            f"({launcher})"
        )


def uniform_machines(launcher: str, size_name: str, size: int, local_name: str, local: int) -> int:
    """How many machines ``size`` processes fill at ``local`` per machine; fails unless
    every machine runs the same number (nothing else says how many machines there are)."""
    if size % local:
        raise ValueError(
            f"{size_name}={size} is not a multiple of {local_name}={local}: sumflow under "
            f"{launcher} needs the same number of workers on every machine"
        )
    return size // local
