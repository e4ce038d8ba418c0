"""sumflow.torch.init() under each launcher users have, emulated on this machine: two
processes started with only the variables torchrun, horovodrun, Open MPI's mpirun, MPICH's
mpiexec or Slurm's srun set (no SUMFLOW_* variable) find each other and sum; a job spread
over machines with nothing saying where the coordinator is fails at once, saying what to
set."""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path

import pytest
from jobs import (
    Outcome,
    check_job_of_two,
    free_port_pair,
    launcher_free_env,
    run_processes,
    slurm_job_id,
)

WORKER = str(Path(__file__).with_name("launch_env_worker.py"))
#: Each two-process job ends within this many seconds (two torch imports on two cores, a
#: coordinator and a server), or the test fails.
TIMEOUT = 50.0


def torchrun_env(rank: int, port: int, job: str) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": job,
    }


def horovodrun_env(rank: int, port: int, job: str) -> dict[str, str]:
    return {
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": "2",
        "HOROVOD_LOCAL_RANK": str(rank),
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1",
        "HOROVOD_HOSTNAME": "localhost",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
    }


def open_mpi_env(rank: int, port: int, job: str) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_COMM_WORLD_NODE_RANK": str(rank),
        "OMPI_UNIVERSE_SIZE": "2",
        "PMIX_NAMESPACE": f"prterun-{job}@1",
        "PMIX_RANK": str(rank),
    }


def mpich_env(rank: int, port: int, job: str) -> dict[str, str]:
    # Hydra sets no job id: both processes are children of this test, as of Hydra's proxy.
    return {
        "PMI_RANK": str(rank),
        "PMI_SIZE": "2",
        "PMI_FD": str(5 + rank),
        "MPI_LOCALRANKID": str(rank),
        "MPI_LOCALNRANKS": "2",
    }


def slurm_env(rank: int, port: int, job: str) -> dict[str, str]:
    """What srun sets for task ``rank`` of ``srun -n 2`` on one node, ``localhost``."""
    return {
        "SLURM_JOB_ID": job,
        "SLURM_JOBID": job,
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NPROCS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NODELIST": "localhost",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURMD_NODENAME": "localhost",
    }


LAUNCHERS = {
    "torchrun": torchrun_env,
    "horovodrun": horovodrun_env,
    "open-mpi": open_mpi_env,
    "mpich": mpich_env,
    "slurm": slurm_env,
}


def check_two_workers(outcomes: list[Outcome]) -> None:
    """Both workers ended well, saw the job of two on one machine, and summed 2."""
    for o in outcomes:
        assert o.returncode == 0, f"worker {o.rank} exited {o.returncode}:\n{o.stderr[-3000:]}"
    check_job_of_two([o.stdout.strip().splitlines()[-1] for o in outcomes])
    # Each rank is the one its launcher gave.
    assert [json.loads(o.stdout.strip().splitlines()[-1])["rank"] for o in outcomes] == [0, 1]


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_two_processes_of_each_launcher_find_each_other(tmp_path: Path, launcher: str) -> None:
    port = free_port_pair()
    job = str(slurm_job_id()) if launcher == "slurm" else f"test-{secrets.token_hex(4)}"
    # Their own temporary directory: a rendezvous file stays in the test's.
    base = launcher_free_env(TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", RUST_LOG="warn")
    envs = [{**base, **LAUNCHERS[launcher](rank, port, job)} for rank in range(2)]
    started = time.monotonic()
    check_two_workers(run_processes([sys.executable, WORKER], envs, TIMEOUT))
    assert time.monotonic() - started < TIMEOUT
    # Rank 0 removed the rendezvous file it published (on one machine, without an address).
    leftovers = list(tmp_path.glob("sumflow-*/*.json"))
    assert leftovers == []


@pytest.mark.parametrize("launcher", ["open-mpi", "horovodrun"])
def test_machines_without_an_address_fail_at_once_naming_the_variables(
    tmp_path: Path, launcher: str
) -> None:
    env = LAUNCHERS[launcher](0, 0, "spread")
    # Four processes, two per machine.
    for name in ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE"):
        if name in env:
            env[name] = "4"
    base = launcher_free_env(TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    started = time.monotonic()
    (outcome,) = run_processes([sys.executable, WORKER], [{**base, **env}], TIMEOUT)
    assert outcome.returncode != 0
    assert time.monotonic() - started < 20, "it should fail before starting anything"
    assert "nothing says where the sumflow coordinator is" in outcome.stderr, outcome.stderr
    for name in ("MASTER_ADDR", "MASTER_PORT", "SUMFLOW_COORDINATOR"):
        assert name in outcome.stderr
