"""sumflow.jobenv without starting anything: each launcher's environment read into a
LaunchEnvironment, which launcher wins when several left variables, where the coordinator
is, the derived job token, Slurm's compressed lists, and the rendezvous file."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest

from sumflow.jobenv import rendezvous
from sumflow.jobenv.coordinator import (
    Coordinator,
    derived_token,
    locate,
    rendezvous_path,
    slurm_port,
)
from sumflow.jobenv.environment import LaunchEnvironment
from sumflow.jobenv.hostlist import expand_hostlist, expand_tasks_per_node
from sumflow.jobenv.launchers import (
    detect,
    from_horovodrun,
    from_mpich,
    from_open_mpi,
    from_slurm,
    from_torchrun,
)

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "TORCHELASTIC_RUN_ID": "run7",
}
HOROVODRUN = {
    "HOROVOD_RANK": "2",
    "HOROVOD_SIZE": "4",
    "HOROVOD_LOCAL_RANK": "0",
    "HOROVOD_LOCAL_SIZE": "2",
    "HOROVOD_HOSTNAME": "gpu2",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
    "HOROVOD_GLOO_RENDEZVOUS_PORT": "41234",
}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "PMIX_NAMESPACE": "prterun-host-1234@1",
    "OMPI_MCA_ess_base_jobid": "99",
}
MPICH = {
    "PMI_RANK": "5",
    "PMI_SIZE": "8",
    "MPI_LOCALRANKID": "1",
    "MPI_LOCALNRANKS": "4",
    "PMI_FD": "6",
}
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "4",
    "SLURM_NTASKS": "5",
    "SLURM_STEP_NUM_TASKS": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NODELIST": "node[07-08],gpu1",
    "SLURM_STEP_TASKS_PER_NODE": "3,2,0",
    "SLURMD_NODENAME": "node08",
}


def launched(env: dict[str, str]) -> LaunchEnvironment:
    """The environment ``detect`` finds in ``env``, which must have one."""
    launch = detect(env)
    assert launch is not None
    return launch


def fields(launch: LaunchEnvironment | None) -> tuple[object, ...]:
    assert launch is not None
    return (
        launch.launcher,
        launch.rank,
        launch.size,
        launch.local_rank,
        launch.local_size,
        launch.machines,
        launch.job_id,
        launch.host_id,
        launch.coordinator_host,
    )


# ---- Slurm's compressed lists ---------------------------------------------------------------


def test_slurm_host_lists_expand_in_order_keeping_zero_padding() -> None:
    assert expand_hostlist("node[01-03,07],gpu5", "V") == [
        "node01",
        "node02",
        "node03",
        "node07",
        "gpu5",
    ]
    assert expand_hostlist("r[1-2]-n[8-9]", "V") == ["r1-n8", "r1-n9", "r2-n8", "r2-n9"]
    assert expand_hostlist("node[098-101]", "V") == ["node098", "node099", "node100", "node101"]
    assert expand_hostlist("localhost", "V") == ["localhost"]
    for bad, why in [
        ("node[1-", "missing ']'"),
        ("a]", "']' without '['"),
        ("n[a-b]", "'a-b' is not N or N-M"),
        ("n[3-1]", "runs backwards"),
        ("a,,b", "empty host entry"),
        ("n[[1]]", "nested"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"V={bad!r}: ") + ".*" + re.escape(why)):
            expand_hostlist(bad, "V")


def test_slurm_tasks_per_node_expand() -> None:
    assert expand_tasks_per_node("2(x3),1", "V") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4", "V") == [4]
    with pytest.raises(ValueError, match=r"V='2\(3\)': '2\(3\)' is not N or N\(xM\)"):
        expand_tasks_per_node("2(3)", "V")


# ---- each launcher ----------------------------------------------------------------------------


def test_each_launcher_read_into_one_environment() -> None:
    assert fields(from_torchrun(TORCHRUN)) == ("torchrun", 3, 4, 1, 2, 2, "run7", None, None)
    assert fields(from_horovodrun(HOROVODRUN)) == (
        *("horovodrun", 2, 4, 0, 2, 2, "10.0.0.1:41234", "gpu2", None),
    )
    assert fields(from_open_mpi(OPEN_MPI)) == (
        *("Open MPI", 1, 2, 1, 2, 1, "prterun-host-1234@1", None, None),
    )
    assert fields(from_mpich(MPICH)) == ("MPICH", 5, 8, 1, 4, 2, None, None, None)
    assert fields(from_slurm(SLURM)) == ("Slurm", 4, 5, 1, 2, 3, "4242.0", "node08", "node07")
    # Open MPI 4 without PMIx's namespace: its ORTE job id.
    older = {k: v for k, v in OPEN_MPI.items() if k != "PMIX_NAMESPACE"}
    assert fields(from_open_mpi(older))[6] == "99"
    # Kubeflow's PyTorchJob: one process per pod, no LOCAL_RANK or LOCAL_WORLD_SIZE.
    pod = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0"}
    assert fields(from_torchrun(pod)) == ("torchrun", 1, 3, 0, 1, 3, None, None, None)
    # The variables it came from, for messages.
    launch = from_open_mpi(OPEN_MPI)
    assert launch is not None
    assert launch.describe() == (
        "Open MPI (OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_LOCAL_RANK=1,"
        " OMPI_COMM_WORLD_LOCAL_SIZE=2, PMIX_NAMESPACE=prterun-host-1234@1)"
    )


def test_a_launcher_that_did_not_start_the_process_is_not_seen() -> None:
    for parse in (from_torchrun, from_horovodrun, from_open_mpi, from_mpich, from_slurm):
        assert parse({}) is None
        assert parse({"PATH": "/bin", "SLURM_JOB_ID": "1", "MASTER_ADDR": "x"}) is None
    assert detect({"HOME": "/root"}) is None
    # A batch script of one task trains alone, as asked.
    assert detect({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": ""}, "OMPI_COMM_WORLD_LOCAL_SIZE is not set"),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_RANK": "2"}, "OMPI_COMM_WORLD_RANK=2 is not a rank of"),
        ({**MPICH, "PMI_SIZE": "x"}, "PMI_SIZE='x' is not an integer"),
        ({**MPICH, "PMI_SIZE": "7"}, "PMI_SIZE=7 is not a multiple of MPI_LOCALNRANKS=4"),
        ({**HOROVODRUN, "HOROVOD_LOCAL_RANK": "2"}, "HOROVOD_LOCAL_RANK=2 is not a rank of"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK is not set"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "without LOCAL_WORLD_SIZE"),
        ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, "does not describe 5 tasks on 3"),
        ({**SLURM, "SLURM_NODEID": "3"}, "SLURM_NODEID=3 is not a node of SLURM_STEP_NODELIST"),
        ({**SLURM, "SLURM_STEP_NODELIST": "node[1-"}, "SLURM_STEP_NODELIST='node[1-'"),
        (
            {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"},
            "srun did not start this process (SLURM_STEP_NUM_TASKS is not set)",
        ),
    ],
)
def test_variables_that_do_not_make_a_job_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        detect(env)


def test_the_launcher_that_started_the_process_wins() -> None:
    # torchrun inside an srun step (one torchrun per node): torchrun's ranks.
    assert launched({**SLURM, **TORCHRUN}).launcher == "torchrun"
    # mpirun inside an allocation: its processes inherit the Slurm step of the daemons srun
    # started (one per node), which disagrees with MPI's ranks.
    daemon_step = {
        **SLURM,
        "SLURM_PROCID": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NODEID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "node[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    }
    assert launched({**daemon_step, **MPICH}).launcher == "MPICH"
    # srun --mpi=pmi2 sets PMI's variables itself, agreeing with Slurm's: Slurm's node list
    # then places the coordinator.
    launch = launched({**SLURM, "PMI_RANK": "4", "PMI_SIZE": "5", "PMI_FD": "3"})
    assert (launch.launcher, launch.coordinator_host) == ("Slurm", "node07")
    # horovodrun before Open MPI, torchrun before both.
    assert launched({**OPEN_MPI, **HOROVODRUN}).launcher == "horovodrun"


# ---- where the coordinator is -------------------------------------------------------------


def where(launch_env: dict[str, str], **env: str) -> Coordinator:
    """Where ``locate`` puts the coordinator of ``launch_env`` with ``env`` added."""
    return locate(
        launched(launch_env),
        {**launch_env, **env},
        temp_dir=Path("/tmp"),
        uid=1000,
        parent_pid=4321,
    )


def test_master_addr_and_port_place_the_coordinator_for_any_launcher() -> None:
    c = where(OPEN_MPI, MASTER_ADDR="node1", MASTER_PORT="29600")
    assert (c.address, c.bind, c.starts_it, c.loopback) == (
        "node1:29601",
        "0.0.0.0:29601",
        False,
        False,
    )
    assert c.rendezvous_file is None
    rank0 = {**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0"}
    c = where(rank0, MASTER_ADDR="127.0.0.1")
    assert (c.address, c.bind, c.starts_it, c.loopback) == (
        "127.0.0.1:29501",
        "127.0.0.1:29501",
        True,
        True,
    )
    # Even under Slurm, MASTER_ADDR decides.
    assert where(SLURM, MASTER_ADDR="10.1.1.1", MASTER_PORT="29500").address == "10.1.1.1:29501"
    with pytest.raises(ValueError, match=r"MASTER_PORT=65535: expected 1 to 65534"):
        where(OPEN_MPI, MASTER_ADDR="node1", MASTER_PORT="65535")


def test_slurm_puts_the_coordinator_on_the_first_node_of_the_step() -> None:
    c = where(SLURM)
    port = slurm_port("4242.0")
    assert c.address == f"node07:{port}"
    assert (c.bind, c.starts_it, c.loopback) == (f"0.0.0.0:{port}", False, False)
    assert port in range(20000, 30000)
    assert slurm_port("4242.1") != port  # another step of the job, maybe on the same node
    assert where(SLURM, MASTER_PORT="29000").address == "node07:29001"
    rank0 = {**SLURM, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    rank0["SLURMD_NODENAME"] = "node07"
    assert where(rank0).starts_it
    rank0["SLURMD_NODENAME"] = "node08"
    with pytest.raises(ValueError, match="rank 0 runs on node08, not on the step's first node"):
        where(rank0)


def test_one_machine_meets_through_a_rendezvous_file_keyed_by_the_job() -> None:
    c = where(OPEN_MPI)
    digest = hashlib.sha256(b"Open MPI:prterun-host-1234@1").hexdigest()[:16]
    assert c.rendezvous_file == Path(f"/tmp/sumflow-1000/open-mpi-{digest}.json")
    assert (c.address, c.bind, c.starts_it, c.loopback) == (None, "127.0.0.1:0", False, True)
    assert where({**OPEN_MPI, "OMPI_COMM_WORLD_RANK": "0"}).starts_it
    # MPICH's Hydra sets no job id: the processes' shared parent, its proxy, keys the file.
    launch = launched({**MPICH, "PMI_RANK": "1", "PMI_SIZE": "4"})
    paths = {
        rendezvous_path(launch, temp_dir=Path("/t"), uid=1, parent_pid=pid) for pid in (7, 7, 8)
    }
    assert len(paths) == 2
    assert all(p.parent == Path("/t/sumflow-1") and p.name.startswith("mpich-") for p in paths)


@pytest.mark.parametrize("env", [OPEN_MPI, MPICH, HOROVODRUN, TORCHRUN])
def test_machines_without_an_address_fail_at_once_saying_what_to_set(env: dict[str, str]) -> None:
    spread = {**env, "OMPI_COMM_WORLD_SIZE": "4"} if env is OPEN_MPI else env
    with pytest.raises(ValueError, match="nothing says where the sumflow coordinator is") as e:
        where(spread)
    for name in ("MASTER_ADDR", "MASTER_PORT", "SUMFLOW_COORDINATOR"):
        assert name in str(e.value)
    assert "machines" in str(e.value)


def test_the_derived_token_is_the_same_on_every_process_and_differs_per_job() -> None:
    a = launched(TORCHRUN)
    b = launched({**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0"})
    c = launched({**TORCHRUN, "TORCHELASTIC_RUN_ID": "run8"})
    assert derived_token(a, "h:1") == derived_token(b, "h:1") != derived_token(c, "h:1")
    assert derived_token(a, "h:1") != derived_token(a, "h:2")
    # What the torchrun path derived before launchers were generalised.
    assert derived_token(a, "h:1") == hashlib.sha256(b"sumflow:run7:h:1:4").hexdigest()


# ---- the rendezvous file ------------------------------------------------------------------


def test_the_rendezvous_file_is_private_whole_and_removed_by_its_writer(tmp_path: Path) -> None:
    path = tmp_path / "sumflow-test" / "job.json"
    assert rendezvous.read(path) is None
    rendezvous.publish(path, "127.0.0.1:4000", "secret")
    assert rendezvous.read(path) == ("127.0.0.1:4000", "secret")
    assert rendezvous.await_published(path, 1.0, "") == ("127.0.0.1:4000", "secret")
    assert oct(path.parent.stat().st_mode & 0o777) == oct(0o700)
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    assert [p.name for p in path.parent.iterdir()] == ["job.json"]  # no partial file left
    rendezvous.withdraw(path)
    assert not path.exists()


def test_a_crashed_jobs_file_is_ignored_and_waits_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sumflow-test" / "job.json"
    rendezvous.publish(path, "127.0.0.1:4000", "secret")
    gone = subprocess.Popen(["true"])
    gone.wait()
    text = path.read_text().replace(f'"pid": {os.getpid()}', f'"pid": {gone.pid}')
    path.write_text(text)
    assert rendezvous.read(path) is None
    rendezvous.withdraw(path)  # not this process's: left alone
    assert path.exists()
    with pytest.raises(TimeoutError, match=rf"in {re.escape(str(path))} within 0.2 s.*set X"):
        rendezvous.await_published(path, 0.2, "set X")


def test_a_rendezvous_directory_others_can_enter_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ValueError, match=r"no one else can enter \(mode 0700\).*TMPDIR"):
        rendezvous.publish(shared / "job.json", "a:1", "t")
    with pytest.raises(ValueError, match=r"no one else can enter"):
        rendezvous.await_published(shared / "job.json", 0.1, "")
