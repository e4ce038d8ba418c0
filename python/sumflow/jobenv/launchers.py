"""Each launcher's environment, read by one pure function into a
:class:`~sumflow.jobenv.environment.LaunchEnvironment`, and :func:`detect`, which picks the
launcher that started this process.

Every parser returns None when its launcher did not start the process, and raises
ValueError, naming the variables, when it did but its variables do not make a job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from sumflow.jobenv.environment import (
    LaunchEnvironment,
    check_ranks,
    read_int,
    require_int,
    uniform_machines,
)
from sumflow.jobenv.hostlist import expand_hostlist, expand_tasks_per_node

Parser = Callable[[Mapping[str, str]], LaunchEnvironment | None]


def _first_set(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, value) of the first of ``names`` set and not empty in ``env``."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def _shown(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"{n}={env[n]}" for n in names if env.get(n, "").strip())


def _ranked(
    launcher: str,
    env: Mapping[str, str],
    names: tuple[str, str, str, str],
    *,
    job_id_from: tuple[str, ...] = (),
    host_id_from: str | None = None,
) -> LaunchEnvironment:
    """The environment of a launcher that sets rank, size, local rank and local size
    (``names``, in that order) and places the same number of processes on every machine."""
    given = names[0]
    rank, size, local_rank, local_size = (require_int(env, n, launcher, given) for n in names)
    check_ranks(launcher, names, rank, size, local_rank, local_size)
    job_id = _first_set(env, job_id_from)
    host_id = env.get(host_id_from, "").strip() if host_id_from else ""
    return LaunchEnvironment(
        launcher=launcher,
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        machines=uniform_machines(launcher, names[1], size, names[3], local_size),
        source=_shown(env, names) + (() if job_id is None else (f"{job_id[0]}={job_id[1]}",)),
        job_id=None if job_id is None else job_id[1],
        host_id=host_id or None,
    )


def from_torchrun(env: Mapping[str, str]) -> LaunchEnvironment | None:
    """torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and its run
    id ``TORCHELASTIC_RUN_ID``; also what Kubeflow's PyTorchJob and other env:// launchers
    set. Present when ``WORLD_SIZE`` is. Without ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
    each process is alone on its machine (PyTorchJob runs one per pod)."""
    size = read_int(env, "WORLD_SIZE")
    if size is None:
        return None
    rank = read_int(env, "RANK")
    if rank is None:
        if size > 1:
            raise ValueError(
                f"WORLD_SIZE={size} but RANK is not set: set RANK to this process's rank "
                "(0 to WORLD_SIZE - 1), as torchrun does"
            )
        rank = 0
    local_rank = read_int(env, "LOCAL_RANK")
    local_size = read_int(env, "LOCAL_WORLD_SIZE")
    if local_size is None:
        if local_rank is not None:
            raise ValueError(
                f"LOCAL_RANK={local_rank} without LOCAL_WORLD_SIZE: set LOCAL_WORLD_SIZE to "
                "the number of processes on each machine, as torchrun does"
            )
        local_rank, local_size = 0, 1
    elif local_rank is None:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={local_size} without LOCAL_RANK: set LOCAL_RANK to this "
            "process's rank on its machine, as torchrun does"
        )
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    check_ranks("torchrun", names, rank, size, local_rank, local_size)
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    return LaunchEnvironment(
        launcher="torchrun",
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        machines=uniform_machines("torchrun", names[1], size, names[3], local_size),
        source=_shown(env, (*names, "TORCHELASTIC_RUN_ID")),
        job_id=run_id or None,
    )


def from_horovodrun(env: Mapping[str, str]) -> LaunchEnvironment | None:
    """horovodrun's ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``,
    ``HOROVOD_LOCAL_SIZE`` and ``HOROVOD_HOSTNAME`` (the machine, as given with ``-H``).
    Its job id is the address of the run's own rendezvous server,
    ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` and ``HOROVOD_GLOO_RENDEZVOUS_PORT``, a new port per
    run. (Under its MPI mode horovodrun runs mpirun, and :func:`from_open_mpi` applies.)"""
    if not env.get("HOROVOD_RANK", "").strip():
        return None
    launch = _ranked(
        "horovodrun",
        env,
        ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
        host_id_from="HOROVOD_HOSTNAME",
    )
    names = ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT")
    if all(env.get(n, "").strip() for n in names):
        addr, port = (env[n].strip() for n in names)
        return dataclasses.replace(
            launch, source=launch.source + _shown(env, names), job_id=f"{addr}:{port}"
        )
    return launch


def from_open_mpi(env: Mapping[str, str]) -> LaunchEnvironment | None:
    """Open MPI's ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK`` and ``_LOCAL_SIZE``
    (mpirun, mpiexec, and horovodrun in its MPI mode). Its job id is the PMIx namespace
    (``PMIX_NAMESPACE``, Open MPI 4 and 5), else ``OMPI_MCA_ess_base_jobid`` or
    ``OMPI_MCA_orte_hnp_uri`` (Open MPI 3 and 4)."""
    if not env.get("OMPI_COMM_WORLD_RANK", "").strip():
        return None
    return _ranked(
        "Open MPI",
        env,
        (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        job_id_from=("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_hnp_uri"),
    )


def from_mpich(env: Mapping[str, str]) -> LaunchEnvironment | None:
    """MPICH's and Intel MPI's Hydra (mpiexec): ``PMI_RANK``, ``PMI_SIZE``,
    ``MPI_LOCALRANKID`` and ``MPI_LOCALNRANKS``. Hydra sets no job id (``PMI_JOBID`` is
    used where a PMI server sets one); a machine's processes share their parent, Hydra's
    proxy, which keys the rendezvous file instead."""
    if not env.get("PMI_RANK", "").strip():
        return None
    return _ranked(
        "MPICH",
        env,
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        job_id_from=("PMI_JOBID",),
    )


def _slurm_nodes(env: Mapping[str, str]) -> tuple[str, list[str]]:
    found = _first_set(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    if found is None:
        raise ValueError(
            "SLURM_STEP_NUM_TASKS says srun started this process, but no node list is set "
            "(SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST)"
        )
    name, text = found
    return name, expand_hostlist(text, name)


def _slurm_tasks_per_node(env: Mapping[str, str], nodes: int, size: int) -> tuple[str, list[int]]:
    found = _first_set(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if found is not None:
        name, text = found
        counts = expand_tasks_per_node(text, name)
    else:
        per_node = read_int(env, "SLURM_NTASKS_PER_NODE")
        if per_node is None:
            raise ValueError(
                "srun started this process, but none of SLURM_STEP_TASKS_PER_NODE, "
                "SLURM_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE says how many tasks each node runs"
            )
        name, counts = "SLURM_NTASKS_PER_NODE", [per_node] * nodes
    if len(counts) != nodes or sum(counts) != size:
        raise ValueError(
            f"{name}={env[name]} does not describe {size} tasks on {nodes} nodes "
            "(SLURM_STEP_NUM_TASKS and the node list)"
        )
    return name, counts


def from_slurm(env: Mapping[str, str]) -> LaunchEnvironment | None:
    """srun's ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``),
    ``SLURM_LOCALID``, ``SLURM_NODEID``, the step's node list (``SLURM_STEP_NODELIST``, else
    ``SLURM_JOB_NODELIST`` or ``SLURM_NODELIST``, compressed as ``node[01-03,07]``) and tasks
    per node (``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE`` or
    ``SLURM_NTASKS_PER_NODE``). The coordinator's host is the step's first node; the job id
    is ``SLURM_JOB_ID.SLURM_STEP_ID``; the machine is ``SLURMD_NODENAME``. Present only in
    a task srun started (``SLURM_STEP_NUM_TASKS`` is srun's: a batch script has
    ``SLURM_PROCID=0`` and the allocation's ``SLURM_NTASKS`` too, but is no task of a
    step)."""
    if not env.get("SLURM_STEP_NUM_TASKS", "").strip():
        return None
    launcher, given = "Slurm", "SLURM_STEP_NUM_TASKS"
    size = require_int(env, given, launcher, given)
    rank = require_int(env, "SLURM_PROCID", launcher, given)
    local_rank = require_int(env, "SLURM_LOCALID", launcher, given)
    node_id = require_int(env, "SLURM_NODEID", launcher, given)
    list_name, nodes = _slurm_nodes(env)
    if not 0 <= node_id < len(nodes):
        raise ValueError(f"SLURM_NODEID={node_id} is not a node of {list_name} ({len(nodes)})")
    counts_name, counts = _slurm_tasks_per_node(env, len(nodes), size)
    names = ("SLURM_PROCID", given, "SLURM_LOCALID", counts_name)
    check_ranks(launcher, names, rank, size, local_rank, counts[node_id])
    job = env.get("SLURM_JOB_ID", "").strip() or env.get("SLURM_JOBID", "").strip()
    step = env.get("SLURM_STEP_ID", "").strip() or env.get("SLURM_STEPID", "").strip()
    shown = ("SLURM_PROCID", given, "SLURM_LOCALID", "SLURM_NODEID", list_name, counts_name)
    return LaunchEnvironment(
        launcher=launcher,
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=counts[node_id],
        machines=len(nodes),
        source=_shown(env, (*shown, "SLURM_JOB_ID", "SLURM_STEP_ID")),
        job_id=f"{job}.{step}" if job else None,
        host_id=env.get("SLURMD_NODENAME", "").strip() or None,
        coordinator_host=nodes[0],
    )


#: The launchers that set their own variables, in the order they are tried: torchrun and
#: horovodrun set their ranks and win over anything inherited; MPI's win over the Slurm
#: step its daemons inherited (see :func:`detect`).
PARSERS: tuple[Parser, ...] = (from_torchrun, from_horovodrun, from_open_mpi, from_mpich)
#: Each MPI launcher's rank and size variables, by parser.
_MPI_RANK_SIZE = {
    from_open_mpi: ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    from_mpich: ("PMI_RANK", "PMI_SIZE"),
}


def _srun_itself(
    env: Mapping[str, str], rank_name: str, size_name: str
) -> LaunchEnvironment | None:
    """Slurm's environment, when srun started this process itself and also set the MPI
    variables ``rank_name`` and ``size_name`` (``srun --mpi=pmi2``): they agree with its own."""
    if not env.get(rank_name, "").strip():
        return None
    slurm = from_slurm(env)
    mpi = (read_int(env, rank_name), read_int(env, size_name))
    return slurm if slurm is not None and mpi == (slurm.rank, slurm.size) else None


def detect(env: Mapping[str, str]) -> LaunchEnvironment | None:
    """The launcher that started this process, from its environment ``env``; None when
    none did (a job of one). An MPI launcher's variables win over a Slurm step's, which its
    processes inherit from the daemons srun started, unless both agree on rank and size:
    then srun started the process itself (``srun --mpi=pmi2``) and Slurm's node list says
    where the coordinator goes."""
    for parse in PARSERS:
        if parse in _MPI_RANK_SIZE:
            slurm = _srun_itself(env, *_MPI_RANK_SIZE[parse])
            if slurm is not None:
                return slurm
        found = parse(env)
        if found is not None:
            return found
    slurm = from_slurm(env)
    if slurm is None:
        _refuse_a_slurm_batch_script(env)
    return slurm


def _refuse_a_slurm_batch_script(env: Mapping[str, str]) -> None:
    """A batch script or an salloc shell has the allocation's ``SLURM_NTASKS`` but is no
    task of a step: running the training there would be a job of one where the allocation
    says there are more."""
    ntasks = read_int(env, "SLURM_NTASKS")
    if ntasks is not None and ntasks > 1:
        raise ValueError(
            f"SLURM_NTASKS={ntasks}: this Slurm allocation has {ntasks} tasks, but srun did "
            "not start this process (SLURM_STEP_NUM_TASKS is not set), so it would train "
            "alone: start the workers with `srun python train.py` (or sumflow-run), or "
            "unset SLURM_NTASKS for a job of one"
        )
