"""The ``sumflow-run`` launcher (``sumflow.launcher``): configuration checks, the
environment of each worker, prefixed output, supervision and teardown, and the cluster form
over a fake ssh that runs every "remote" command on this machine."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import pytest

from sumflow import _core
from sumflow.launcher.cli import build_parser
from sumflow.launcher.errors import ConfigError
from sumflow.launcher.hosts import parse_hostfile, parse_hosts, slurm_hosts
from sumflow.launcher.logs import log_dir
from sumflow.launcher.plan import ProcSpec, build_processes, make_plan
from sumflow.launcher.ssh import remote_command, ssh_argv
from sumflow.launcher.supervise import Incident, first_cause, read_incidents

#: Every subprocess call of this file ends within this many seconds, or the test fails.
TIMEOUT = 60

LAUNCHER = [sys.executable, "-m", "sumflow.launcher"]
HAS_COMM = hasattr(_core, "CommunicationService")
needs_comm = pytest.mark.skipif(
    not HAS_COMM,
    reason="sumflow._core has no CommunicationService yet (the extension module predates it)",
)

#: A worker that joins the job, sums a buffer through the summation service and leaves.
SUM_WORKER = """\
import os, sys
import numpy as np
from sumflow import _core

token = open(os.environ["SUMFLOW_JOB_TOKEN_FILE"]).read().strip() \\
    if "SUMFLOW_JOB_TOKEN_FILE" in os.environ else os.environ["SUMFLOW_JOB_TOKEN"]
svc = _core.CommunicationService(os.environ["SUMFLOW_COORDINATOR"], token,
                                 host_id=os.environ["SUMFLOW_HOST_ID"],
                                 rank=int(os.environ["SUMFLOW_RANK"]),
                                 name=os.environ["SUMFLOW_WORKER_NAME"])
a = np.full(1000, float(svc.rank + 1), dtype=np.float32)
tid = svc.declare("x", "f32", a.size)
h = svc.push_pull(tid, a, a.ctypes.data, a.nbytes, 0, False)
svc.wait(h, 30.0)
expected = sum(range(1, svc.size + 1))
assert (a == expected).all(), (a[:4], expected)
print(f"sum ok on rank {svc.rank}: {expected}", flush=True)
svc.shutdown("done")
"""

#: A worker that records its environment and its token file's mode in DIR/RANK.json.
ENV_WORKER = """\
import json, os, stat, sys
from pathlib import Path

env = {k: v for k, v in os.environ.items()
       if k.startswith("SUMFLOW_") or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                            "LOCAL_WORLD_SIZE", "RUST_LOG", "FORWARDED",
                                            "MASTER_ADDR", "MASTER_PORT")}
info = {"env": env, "cwd": os.getcwd()}
path = env.get("SUMFLOW_JOB_TOKEN_FILE")
if path:
    st = os.stat(path)
    info["token_mode"] = stat.S_IMODE(st.st_mode)
    info["dir_mode"] = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
    info["token"] = Path(path).read_text().strip()
Path(sys.argv[1], env["SUMFLOW_RANK"] + ".json").write_text(json.dumps(info))
"""

#: A worker that writes its pid to DIR/RANK.pid; rank 1 then waits for rank 0's file and
#: does what argv[2] says ("exit3", "sigkill"); every other rank sleeps.
PID_WORKER = """\
import os, signal, sys, time
from pathlib import Path

d, action = Path(sys.argv[1]), sys.argv[2]
rank = os.environ["RANK"]
(d / (rank + ".tmp")).write_text(str(os.getpid()))
(d / (rank + ".tmp")).rename(d / (rank + ".pid"))
if rank == "1" and action != "sleep":
    deadline = time.monotonic() + 30
    while not (d / "0.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    if action == "exit3":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""

#: Stands in for ssh: logs the host and the command, drops the options and the host, and
#: runs the command here.
FAKE_SSH = """\
#!/bin/sh
while [ $# -gt 0 ]; do
  case "$1" in
    -o) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=$1
shift
printf '%s\\t%s\\n' "$host" "$*" >> "{log}"
exec sh -c "$*"
"""


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without SUMFLOW_* and RUST_LOG, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_") and k != "RUST_LOG"}
    env.update(extra)
    return env


def run(
    args: list[str], env: dict[str, str] | None = None, timeout: float = TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Runs the launcher with ``args`` to its end."""
    return subprocess.run(
        [*LAUNCHER, *args],
        env=clean_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def started(stderr: str) -> dict[str, int]:
    """The pids the launcher reports in --verbose mode, by process name."""
    return {
        m.group(1): int(m.group(2))
        for m in re.finditer(r"^sumflow-run: started (.+?)(?: on \S+)? \(pid (\d+)\)", stderr, re.M)
    }


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def assert_all_gone(pids: list[int]) -> None:
    # The launcher has reaped them all before exiting; allow a moment for the kernel.
    deadline = time.monotonic() + 5
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if not gone(p)] == []


def wait_for(paths: list[Path], proc: subprocess.Popen[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate(timeout=TIMEOUT)
        assert time.monotonic() < deadline, f"{paths} did not appear"
        time.sleep(0.02)


# ----------------------------------------------------------------------------------------
# Configuration: checked before anything starts
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["-np", "0", "true"], "-np must be at least 1"),
        (["true"], "-np N is required"),
        (["-np", "2"], "no command given"),
        (["-np", "2", "--"], "no command given"),
        (["-np", "2", "--no-colocated", "true"], "--no-colocated needs --servers K"),
        (["-np", "2", "--no-colocated", "--servers", "0", "true"], "--no-colocated needs"),
        (["-np", "2", "--servers", "-1", "true"], "--servers must be at least 0"),
        (["-np", "3", "--local-size", "2", "true"], "-np 3 is not divisible by --local-size 2"),
        (["-np", "2", "--local-size", "0", "true"], "--local-size must be at least 1"),
        (
            ["-H", "a", "--coordinator-bind", "127.0.0.1:0", "--machine-per-worker", "true"],
            "--machine-per-worker is for one machine",
        ),
        (
            ["-np", "2", "--min-np", "1", "--local-size", "2", "true"],
            "--local-size is not for an elastic job",
        ),
        (["-np", "2", "sumflow-no-such-program"], "no such program on PATH"),
        (["-np", "2", "./no/such/file.sh"], "no such file"),
        (["-np", "2", "--timeout", "0", "true"], "--timeout must be a positive number"),
        (["-np", "2", "--heartbeat-timeout", "nan", "true"], "--heartbeat-timeout must be"),
        (["-np", "2", "--server-hosts", "h", "true"], "needs the cluster form"),
        (["-np", "2", "--token-file", "/no/such/token", "true"], "--token-file"),
        (["-np", "2", "-x", "SUMFLOW_NOT_SET_ANYWHERE", "true"], "is not set here"),
        (["-np", "2", "--master-port", "0", "true"], "--master-port must be 1 to 65535"),
        (["-H", "a:1", "true"], "needs --coordinator-bind"),
        (["-H", "a:0", "--coordinator-bind", "127.0.0.1:0", "true"], "at least 1 slot"),
        (["-H", "a,a", "--coordinator-bind", "127.0.0.1:0", "true"], "listed twice"),
        (
            ["-H", "a:1,b:2", "-np", "2", "--coordinator-bind", "127.0.0.1:0", "true"],
            "-np 2 does not match the hosts' 3 slots",
        ),
        (["-H", "a", "--coordinator-bind", "0.0.0.0:29400", "true"], "--coordinator-addr"),
        (["-H", "a", "--coordinator-bind", "127.0.0.1:0", "--servers", "1", "true"], "where"),
        (["--hostfile", "/no/such/hostfile", "--coordinator-bind", "x:1", "true"], "hostfile"),
        (["-hostfile", "/no/such/hostfile", "--coordinator-bind", "x:1", "true"], "hostfile"),
        (["-np", "2", "--network-interface", "lo", "true"], "needs the cluster form"),
        (["-H", "a", "--network-interface", "no-such-nic0", "true"], "no such interface here"),
        (["-np", "2", "--start-timeout", "0", "true"], "--start-timeout must be a positive"),
    ],
)
def test_configuration_errors_exit_2_and_start_nothing(args: list[str], reason: str) -> None:
    out = run(["--verbose", *args])
    assert out.returncode == 2, out
    assert f"sumflow-run: error: {reason}" in out.stderr or (
        "sumflow-run: error:" in out.stderr and reason in out.stderr
    ), out.stderr
    assert "started" not in out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout == ""


def test_help_documents_every_option() -> None:
    out = run(["--help"])
    assert out.returncode == 0, out.stderr
    for flag in (
        "-np",
        "--servers",
        "--no-colocated",
        "--local-size",
        "--machine-per-worker",
        "--engine-threads",
        "--partition-bytes",
        "--scheduler",
        "--credit-bytes",
        "--timeout",
        "--heartbeat-timeout",
        "--join-timeout",
        "--shutdown-grace",
        "--token-file",
        "--hostfile",
        "--ssh",
        "--coordinator-bind",
        "--coordinator-addr",
        "--server-hosts",
        "--master-port",
        "--wire-stats",
        "--network-interface",
        "--output-filename",
        "--start-timeout",
        "--version",
        "examples:",
    ):
        assert flag in out.stdout, flag


def test_version_is_sumflows() -> None:
    out = run(["--version"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"sumflow {_core.__version__}"


def test_horovodruns_spellings_mean_the_same() -> None:
    parser = build_parser()
    args = parser.parse_args(["-hostfile", "hosts.txt", "-np", "2", "true"])
    assert (args.hostfile, args.np) == ("hosts.txt", 2)
    # --network-interface: the coordinator listens on the interface's address, any port,
    # and the others dial the address it binds.
    plan = make_plan(parser.parse_args(["-H", "a:1", "--network-interface", "lo", "true"]))
    assert (plan.coordinator_bind, plan.coordinator_addr) == ("127.0.0.1:0", None)
    with pytest.raises(SystemExit):
        parser.parse_args(
            ["-H", "a", "--network-interface", "lo", "--coordinator-bind", "x:1", "true"]
        )
    # --start-timeout: the coordinator's start and, unless --join-timeout says, the join.
    plan = make_plan(parser.parse_args(["-np", "2", "--start-timeout", "45", "true"]))
    assert plan.start_timeout == 45
    assert plan.worker_env["SUMFLOW_JOIN_TIMEOUT"] == plan.service_env["SUMFLOW_JOIN_TIMEOUT"]
    assert float(plan.worker_env["SUMFLOW_JOIN_TIMEOUT"]) == 45
    assert plan.coordinator_args == ["--join-timeout", "45.0"]
    plan = make_plan(
        parser.parse_args(["-np", "2", "--start-timeout", "45", "--join-timeout", "90", "true"])
    )
    assert (plan.start_timeout, plan.coordinator_args) == (45, ["--join-timeout", "90.0"])
    plan = make_plan(parser.parse_args(["-np", "2", "true"]))
    assert plan.start_timeout == 30
    assert "SUMFLOW_JOIN_TIMEOUT" not in plan.worker_env


def test_ssh_forwards_the_programs_paths_and_the_given_variables() -> None:
    """As horovodrun: PATH, PYTHONPATH, LD_LIBRARY_PATH and VIRTUAL_ENV (an activated
    virtualenv) reach every remote process, -x variables too and over them; nothing else."""
    parser = build_parser()
    plan = make_plan(
        parser.parse_args(
            [
                *("-H", "gpu1:1", "--coordinator-bind", "10.0.0.1:29400"),
                *("-x", "PATH=/x/bin", "-x", "NCCL_DEBUG=INFO", "python", "train.py"),
            ]
        )
    )
    specs = build_processes(plan, "10.0.0.1:29400")
    local = {
        "PATH": "/venv/bin:/usr/bin",
        "PYTHONPATH": "/src",
        "LD_LIBRARY_PATH": "/opt/lib",
        "VIRTUAL_ENV": "/venv",
        "HOME": "/home/me",
        "SECRET": "no",
    }
    for spec in specs:
        argv = ssh_argv(plan, spec, "/work", local)
        assert argv[:2] == ["ssh", "gpu1"]
        # The remote command line: sh -c WRAPPER sumflow-run CWD env VAR=VALUE... ARGV.
        words = shlex.split(argv[2])
        assigned = words[words.index("env") + 1 : words.index(spec.argv[0])]
        env = dict(a.split("=", 1) for a in assigned)
        assert env["PYTHONPATH"] == "/src"
        assert env["LD_LIBRARY_PATH"] == "/opt/lib"
        assert env["VIRTUAL_ENV"] == "/venv"
        assert env["PATH"] == "/x/bin"  # -x wins
        assert env["NCCL_DEBUG"] == "INFO"
        assert env["RUST_LOG"] == plan.rust_log
        assert "HOME" not in env
        assert "SECRET" not in env
        assert words[words.index(spec.argv[0]) :] == spec.argv
    worker = specs[-1]
    assert ssh_argv(plan, worker, "/", {})[2].count("PYTHONPATH") == 0


def test_a_slurm_allocations_nodes_are_the_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside salloc or sbatch, without -H or --hostfile, the allocation's nodes and tasks
    per node are the hosts; the coordinator listens on every interface and the nodes dial
    this node's name."""
    allocation = {
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "gpu[01-02,07]",
        "SLURM_TASKS_PER_NODE": "2(x2),1",
        "SLURMD_NODENAME": "gpu01",
    }
    hosts = slurm_hosts(allocation)
    assert hosts is not None
    assert [(h.name, h.slots) for h in hosts] == [("gpu01", 2), ("gpu02", 2), ("gpu07", 1)]
    # One node, and this is it: the job runs here, on one machine.
    assert (
        slurm_hosts({**allocation, "SLURM_JOB_NODELIST": "gpu01", "SLURM_TASKS_PER_NODE": "4"})
        is None
    )
    # One node seen from a login node (salloc's shell): it is a host like any other.
    login = {"SLURM_JOB_NODELIST": "gpu05", "SLURM_TASKS_PER_NODE": "4"}
    assert [(h.name, h.slots) for h in slurm_hosts(login) or []] == [("gpu05", 4)]
    assert slurm_hosts({"SLURM_TASKS_PER_NODE": "4"}) is None
    for env, message in [
        ({**allocation, "SLURM_TASKS_PER_NODE": "2"}, "does not give each of the 3 nodes"),
        ({**allocation, "SLURM_JOB_NODELIST": "gpu[01-"}, "SLURM_JOB_NODELIST='gpu[01-'"),
        ({"SLURM_JOB_NODELIST": "a,b"}, "without SLURM_TASKS_PER_NODE"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            slurm_hosts(env)

    for name, value in allocation.items():
        monkeypatch.setenv(name, value)
    parser = build_parser()
    plan = make_plan(parser.parse_args(["python", "train.py"]))
    assert plan.cluster
    assert plan.machines == [("gpu01", "gpu01", 2), ("gpu02", "gpu02", 2), ("gpu07", "gpu07", 1)]
    assert (plan.num_workers, plan.coordinator_bind, plan.coordinator_addr) == (
        5,
        "0.0.0.0:0",
        "gpu01",
    )
    workers = [s for s in build_processes(plan, "gpu01:4000") if s.kind == "worker"]
    assert [(s.host, s.env["LOCAL_RANK"]) for s in workers] == [
        ("gpu01", "0"),
        ("gpu01", "1"),
        ("gpu02", "0"),
        ("gpu02", "1"),
        ("gpu07", "0"),
    ]
    with pytest.raises(ConfigError, match=r"-np 8 does not match .* --ntasks-per-node"):
        make_plan(parser.parse_args(["-np", "8", "python", "train.py"]))
    # -H still decides where it is given.
    plan = make_plan(
        parser.parse_args(["-H", "x:1", "--coordinator-bind", "10.0.0.1:1", "python", "t.py"])
    )
    assert plan.machines == [("x", "x", 1)]


def test_host_lists_and_host_files() -> None:
    hosts = parse_hosts("gpu1:8,user@gpu2:4,gpu3,[fe80::1]:2")
    assert [(h.name, h.slots, h.address) for h in hosts] == [
        ("gpu1", 8, "gpu1"),
        ("user@gpu2", 4, "gpu2"),
        ("gpu3", 1, "gpu3"),
        ("fe80::1", 2, "fe80::1"),
    ]
    text = "# cluster\n\ngpu1 slots=8   # the first\ngpu2:4\n  gpu3\n"
    assert [(h.name, h.slots) for h in parse_hostfile(text, "hf")] == [
        ("gpu1", 8),
        ("gpu2", 4),
        ("gpu3", 1),
    ]
    for bad, reason in [
        ("gpu1 slots=x\n", "hf:1: slots of gpu1 must be a number"),
        ("gpu1:2 slots=2\n", "hf:1: slots given twice"),
        ("gpu1 max=2\n", "hf:1: unknown field 'max=2'"),
        ("# nothing\n", "no hosts"),
        ("a\nb\na:2\n", "host a is listed twice"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(reason)):
            parse_hostfile(bad, "hf")


def test_plan_places_ranks_machines_and_servers() -> None:
    parser = build_parser()
    plan = make_plan(
        parser.parse_args(["-np", "4", "--local-size", "2", "--servers", "1", "--", "true"])
    )
    specs = build_processes(plan, "127.0.0.1:1234")
    assert [s.name for s in specs] == [
        "server 0",
        "server 1",
        "cpu-server 0",
        "worker 0",
        "worker 1",
        "worker 2",
        "worker 3",
    ]
    host_ids = [s.argv[s.argv.index("--host-id") + 1] for s in specs[:3]]
    assert host_ids == ["local-0", "local-1", "cpu-0"]
    assert all(s.argv[s.argv.index("--engine-threads") + 1] == "1" for s in specs[:3])
    w3 = specs[-1].env
    assert (w3["RANK"], w3["LOCAL_RANK"], w3["LOCAL_WORLD_SIZE"]) == ("3", "1", "2")
    assert w3["SUMFLOW_HOST_ID"] == "local-1"
    assert plan.num_servers == 3

    plan = make_plan(
        parser.parse_args(
            [
                *("-H", "a:2,u@b:1", "--server-hosts", "c", "--servers", "2"),
                *("--coordinator-bind", "127.0.0.1:0", "true"),
            ]
        )
    )
    specs = build_processes(plan, "10.0.0.1:29400")
    assert [(s.name, s.host) for s in specs] == [
        ("server 0", "a"),
        ("server 1", "u@b"),
        ("cpu-server 0", "c"),
        ("cpu-server 1", "c"),
        ("worker 0", "a"),
        ("worker 1", "a"),
        ("worker 2", "u@b"),
    ]
    assert specs[1].argv[specs[1].argv.index("--advertise") + 1] == "b"
    assert specs[6].env["SUMFLOW_HOST_ID"] == "b"
    assert (specs[6].env["MASTER_ADDR"], specs[6].env["MASTER_PORT"]) == ("a", "29500")
    plan = make_plan(parser.parse_args(["-np", "2", "--master-port", "29611", "true"]))
    env = build_processes(plan, "127.0.0.1:1")[-1].env
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29611")
    assert "--engine-threads" not in specs[0].argv


def test_one_machine_is_one_machine_unless_told_otherwise() -> None:
    """As horovodrun: -np N on one machine gives local ranks 0..N-1 of local size N, and
    the machine one colocated server; --machine-per-worker emulates a machine per worker."""
    parser = build_parser()

    def layout(argv: list[str]) -> tuple[list[str], list[tuple[str, str, str]], int]:
        plan = make_plan(parser.parse_args(argv))
        specs = build_processes(plan, "127.0.0.1:1")
        servers = [s.argv[s.argv.index("--host-id") + 1] for s in specs if s.kind == "server"]
        workers = [
            (s.env["LOCAL_RANK"], s.env["LOCAL_WORLD_SIZE"], s.env["SUMFLOW_HOST_ID"])
            for s in specs
            if s.kind == "worker"
        ]
        return servers, workers, plan.num_servers

    assert layout(["-np", "3", "--servers", "2", "true"]) == (
        ["local-0", "cpu-0", "cpu-1"],
        [("0", "3", "local-0"), ("1", "3", "local-0"), ("2", "3", "local-0")],
        3,
    )
    assert layout(["-np", "3", "--machine-per-worker", "true"]) == (
        ["local-0", "local-1", "local-2"],
        [("0", "1", "local-0"), ("0", "1", "local-1"), ("0", "1", "local-2")],
        3,
    )
    assert layout(["-np", "2", "--local-size", "1", "true"]) == layout(
        ["-np", "2", "--machine-per-worker", "true"]
    )


def test_workers_sharing_a_machine_get_one_openmp_thread_unless_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = build_parser()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def worker_env(argv: list[str]) -> dict[str, str]:
        plan = make_plan(parser.parse_args(argv))
        return build_processes(plan, "127.0.0.1:1")[-1].env

    assert worker_env(["-np", "2", "true"])["OMP_NUM_THREADS"] == "1"
    assert worker_env(["-np", "2", "-x", "OMP_NUM_THREADS=4", "true"])["OMP_NUM_THREADS"] == "4"
    assert "OMP_NUM_THREADS" not in worker_env(["-np", "1", "true"])
    # Set in the launcher's environment: inherited as it is, not overridden.
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in worker_env(["-np", "2", "true"])


def test_remote_wrapper_passes_the_token_on_stdin_and_stops_on_eof(tmp_path: Path) -> None:
    spec = ProcSpec(
        "worker 0",
        "worker",
        ["sh", "-c", 'echo "token=$SUMFLOW_JOB_TOKEN a=$A pwd=$(pwd)"; exit 7'],
        {"A": 'it\'s "quoted" $HOME'},
        "h",
    )
    cmd = remote_command(spec, str(tmp_path))
    assert "s3cret" not in cmd
    # The launcher keeps ssh's stdin open while the job runs: closing it stops the command.
    proc = subprocess.Popen(
        ["sh", "-c", cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdin is not None
        proc.stdin.write("s3cret\n")
        proc.stdin.flush()
        assert proc.wait(timeout=TIMEOUT) == 7
        assert proc.stdout is not None
        assert proc.stdout.read() == f'token=s3cret a=it\'s "quoted" $HOME pwd={tmp_path}\n'
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=TIMEOUT)

    # When stdin closes (the launcher stopped or died), the command gets SIGTERM.
    spec = ProcSpec("worker 0", "worker", ["sleep", "30"], {}, "h")
    proc = subprocess.Popen(
        ["sh", "-c", remote_command(spec, "/")],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    try:
        assert proc.stdin is not None
        proc.stdin.write(b"\n")
        proc.stdin.flush()
        time.sleep(0.3)
        assert proc.poll() is None
        proc.stdin.close()
        assert proc.wait(timeout=TIMEOUT) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ----------------------------------------------------------------------------------------
# One machine
# ----------------------------------------------------------------------------------------


def test_every_output_line_is_prefixed_with_its_process(tmp_path: Path) -> None:
    worker = script(
        tmp_path,
        "w.py",
        "import os, sys\n"
        "r = os.environ['SUMFLOW_RANK']\n"
        "for i in range(50):\n"
        "    print(f'hello from {r} line {i}', flush=True)\n"
        "print(f'to stderr from {r}', file=sys.stderr)\n"
        "sys.stdout.write(f'no newline from {r}')\n",
    )
    out = run(["-v", "-np", "2", "--shutdown-grace", "0.2", sys.executable, str(worker)])
    assert out.returncode == 0, out
    for r in range(2):
        for i in range(50):
            assert f"[worker {r}] hello from {r} line {i}\n" in out.stdout
        assert f"[worker {r}] to stderr from {r}\n" in out.stderr
        assert f"[worker {r}] no newline from {r}\n" in out.stdout
    assert "[coordinator] " in out.stderr  # RUST_LOG=info with --verbose
    assert all(line.startswith("[worker ") for line in out.stdout.splitlines())
    for line in out.stderr.splitlines():
        assert re.match(r"(\[(worker \d|server \d|coordinator)\]|sumflow-run:) ", line), line


def test_workers_that_never_join_end_the_job_after_the_default_grace() -> None:
    # Workers that use only torch.distributed exit 0 without joining; the coordinator and
    # servers, still waiting for them, are stopped after the grace, not after a join timeout.
    started = time.monotonic()
    out = run(["-np", "2", "--", sys.executable, "-c", "pass"])
    assert out.returncode == 0, out
    assert "still running 5 s later (--shutdown-grace)" in out.stderr, out.stderr
    assert time.monotonic() - started < 30


def test_worker_environment(tmp_path: Path) -> None:
    worker = script(tmp_path, "w.py", ENV_WORKER)
    out = run(
        [
            "-v",
            "-np",
            "4",
            "--local-size",
            "2",
            "--partition-bytes",
            "65536",
            "--scheduler",
            "prophet",
            "--credit-bytes",
            "131072",
            "--timeout",
            "12.5",
            "--heartbeat-timeout",
            "7",
            "--join-timeout",
            "40",
            "-x",
            "FORWARDED",
            "-x",
            "SUMFLOW_EXTRA=yes",
            "--shutdown-grace",
            "0.2",
            "--",
            sys.executable,
            str(worker),
            str(tmp_path),
        ],
        env=clean_env(SUMFLOW_RANK="99", SUMFLOW_STALE="x", FORWARDED="fwd"),
    )
    assert out.returncode == 0, out
    infos = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    tokens = {info["token"] for info in infos}
    assert len(tokens) == 1
    token = tokens.pop()
    assert re.fullmatch("[0-9a-f]{64}", token)
    assert token not in out.stdout + out.stderr
    for r, info in enumerate(infos):
        env = info["env"]
        assert env["RANK"] == env["SUMFLOW_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["SUMFLOW_NUM_WORKERS"] == "4"
        assert env["LOCAL_RANK"] == str(r % 2)
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["SUMFLOW_HOST_ID"] == f"local-{r // 2}"
        assert env["SUMFLOW_WORKER_NAME"] == f"worker {r}"
        assert re.fullmatch(r"127\.0\.0\.1:\d+", env["SUMFLOW_COORDINATOR"])
        assert env["SUMFLOW_PARTITION_BYTES"] == "65536"
        assert env["SUMFLOW_SCHEDULER"] == "prophet"
        assert env["SUMFLOW_CREDIT_BYTES"] == "131072"
        assert float(env["SUMFLOW_TIMEOUT"]) == 12.5
        assert float(env["SUMFLOW_HEARTBEAT_TIMEOUT"]) == 7
        assert float(env["SUMFLOW_JOIN_TIMEOUT"]) == 40
        assert env["RUST_LOG"] == "info"
        assert env["FORWARDED"] == "fwd"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] == infos[0]["env"]["MASTER_PORT"]
        assert 0 < int(env["MASTER_PORT"]) < 65536
        assert env["SUMFLOW_EXTRA"] == "yes"
        assert "SUMFLOW_STALE" not in env
        assert "SUMFLOW_JOB_TOKEN" not in env
        assert info["token_mode"] == 0o600
        assert info["dir_mode"] == 0o700
        assert info["cwd"] == os.getcwd()
    # The private directory is removed when the job ends.
    assert not Path(infos[0]["env"]["SUMFLOW_JOB_TOKEN_FILE"]).parent.exists()
    # The coordinator got the timeouts as flags too, and the servers their host ids.
    assert "--heartbeat-timeout 7.0 --join-timeout 40.0" in out.stderr
    assert "--host-id local-1 --engine-threads 1" in out.stderr
    assert "--workers 4 --servers 2 " in out.stderr


def test_each_processs_output_is_also_written_to_its_own_files(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    worker = script(
        tmp_path,
        "w.py",
        "import os, sys\n"
        "r = os.environ['RANK']\n"
        "print(f'out {r}', flush=True)\n"
        "print(f'err {r}', file=sys.stderr, flush=True)\n",
    )
    out = run(
        [
            *("-np", "2", "--output-filename", str(logs), "--shutdown-grace", "0.2"),
            *(sys.executable, str(worker)),
        ]
    )
    assert out.returncode == 0, out
    for r in range(2):
        assert (logs / f"rank.{r}" / "stdout").read_text() == f"out {r}\n"
        assert (logs / f"rank.{r}" / "stderr").read_text() == f"err {r}\n"
        assert f"[worker {r}] out {r}\n" in out.stdout  # and still on the terminal, prefixed
    assert (logs / "coordinator" / "stderr").exists()
    assert (logs / "server.0" / "stdout").exists()
    assert log_dir(logs, "cpu-server 3") == logs / "cpu-server.3"
    # An elastic job's names: workers by name (ranks change), servers by membership.
    assert log_dir(logs, "worker w2") == logs / "worker.w2"
    assert log_dir(logs, "server 0 e1") == logs / "server.0.e1"
    assert log_dir(logs, "coordinator e1") == logs / "coordinator.e1"


def test_settings_in_the_launchers_environment_are_named_as_not_passed(tmp_path: Path) -> None:
    worker = script(tmp_path, "w.py", "import os; print(os.environ.get('SUMFLOW_TIMEOUT'))\n")
    env = clean_env(SUMFLOW_STALL_WARNING="5", SUMFLOW_TIMEOUT="7", SUMFLOW_RANK="3")
    r = run(["-np", "1", "-x", "SUMFLOW_TIMEOUT", sys.executable, str(worker)], env=env)
    assert r.returncode == 0, r.stderr
    # Forwarded with -x: passed, not named. The rank the launcher sets itself: not named.
    assert "[worker 0] 7" in r.stdout, r.stdout
    notes = [line for line in r.stderr.splitlines() if "not passing" in line]
    assert notes == [
        "sumflow-run: not passing SUMFLOW_STALL_WARNING from this environment to the job; "
        "forward with -x NAME (e.g. -x SUMFLOW_STALL_WARNING)"
    ], r.stderr


def test_rust_log_defaults_to_warn_and_a_token_file_is_used_as_given(tmp_path: Path) -> None:
    token = tmp_path / "job.token"
    token.write_text("a-token-of-at-least-16-bytes\n")
    token.chmod(0o600)
    worker = script(tmp_path, "w.py", ENV_WORKER)
    out = run(
        [
            "-np",
            "1",
            "--token-file",
            str(token),
            "--shutdown-grace",
            "0.2",
            sys.executable,
            str(worker),
            str(tmp_path),
        ]
    )
    assert out.returncode == 0, out
    info = json.loads((tmp_path / "0.json").read_text())
    assert info["env"]["RUST_LOG"] == "warn"
    assert info["env"]["SUMFLOW_JOB_TOKEN_FILE"] == str(token)
    assert info["token"] == "a-token-of-at-least-16-bytes"
    assert token.exists()


@pytest.mark.parametrize(
    ("action", "code", "message"),
    [("exit3", 3, "exited with code 3"), ("sigkill", 137, "was killed by SIGKILL")],
)
def test_a_failing_worker_stops_the_job(
    tmp_path: Path, action: str, code: int, message: str
) -> None:
    worker = script(tmp_path, "w.py", PID_WORKER)
    t0 = time.monotonic()
    out = run(
        ["-v", "-np", "2", "--servers", "1", sys.executable, str(worker), str(tmp_path), action]
    )
    assert out.returncode == code, out
    assert time.monotonic() - t0 < 30
    pids = started(out.stderr)
    assert set(pids) == {"coordinator", "server 0", "cpu-server 0", "worker 0", "worker 1"}
    assert re.search(
        rf"^sumflow-run: worker 1 \(pid {pids['worker 1']}\) {message}", out.stderr, re.M
    ), out.stderr
    assert int((tmp_path / "0.pid").read_text()) == pids["worker 0"]
    assert_all_gone(list(pids.values()))


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_launcher_stops_the_job(tmp_path: Path, sig: int, code: int) -> None:
    worker = script(tmp_path, "w.py", PID_WORKER)
    proc = subprocess.Popen(
        [*LAUNCHER, "-v", "-np", "2", sys.executable, str(worker), str(tmp_path), "sleep"],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for([tmp_path / "0.pid", tmp_path / "1.pid"], proc)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, err
    assert f"sumflow-run: received {signal.Signals(sig).name}; stopping every process" in err
    pids = started(err)
    assert len(pids) == 4, err  # coordinator, one colocated server, two workers
    assert_all_gone(list(pids.values()))


@needs_comm
@pytest.mark.parametrize("colocated", ["--colocated", "--no-colocated"])
def test_a_job_sums_and_ends_cleanly(tmp_path: Path, colocated: str) -> None:
    worker = script(tmp_path, "w.py", SUM_WORKER)
    out = run(["-v", "-np", "2", "--servers", "1", colocated, sys.executable, str(worker)])
    assert out.returncode == 0, out
    for r in range(2):
        assert f"[worker {r}] sum ok on rank {r}: 3" in out.stdout
    assert "still running" not in out.stderr  # everything stopped by itself
    assert "warning" not in out.stderr
    assert_all_gone(list(started(out.stderr).values()))


WIRE_WORKER = """
import json, sys
import torch
import sumflow.torch as hvd
from sumflow.torch import _runtime

hvd.init()
for step in range(3):
    hvd.allreduce(torch.ones(5000), name="a")
    hvd.allreduce(torch.ones(300, dtype=torch.float64), name="b")
keys, _ = _runtime.current().service.wire_bytes()
with open(f"{sys.argv[1]}/worker{hvd.rank()}.json", "w") as f:
    json.dump([[key, sent, received] for _, key, sent, received in keys], f)
hvd.shutdown()
"""


@needs_comm
def test_servers_count_per_key_the_bytes_the_workers_count(tmp_path: Path) -> None:
    """Every byte a server reads is one a worker wrote on the same stream: per key, the
    servers' counts (written at their end) equal the workers' summed, both ways."""
    worker = script(tmp_path, "w.py", WIRE_WORKER)
    stats = tmp_path / "stats"
    out = run(
        [
            *("-np", "2", "--machine-per-worker", "--servers", "1", "--partition-bytes", "8192"),
            *("--wire-stats", str(stats), sys.executable, str(worker), str(tmp_path)),
        ]
    )
    assert out.returncode == 0, out
    from sumflow.torch import server_wire_bytes

    servers = server_wire_bytes(stats)
    # Two colocated servers and a CPU server, sharing the partitions.
    assert sorted(servers) == ["server-0", "server-1", "server-2"]
    assert sum(1 for s in servers.values() if s.keys) >= 2
    workers: dict[int, list[int]] = {}
    for r in range(2):
        for key, sent, received in json.loads((tmp_path / f"worker{r}.json").read_text()):
            got = workers.setdefault(key, [0, 0])
            got[0] += sent
            got[1] += received
    assert len(workers) >= 4  # "a" in three partitions, "b" in one
    seen: dict[int, list[int]] = {}
    for s in servers.values():
        for key, b in s.keys.items():
            assert key not in seen, f"key {key} on two servers"
            seen[key] = [b.received, b.sent]
    assert seen == workers


# ----------------------------------------------------------------------------------------
# Cluster form, over a fake ssh
# ----------------------------------------------------------------------------------------


def cluster_args(tmp_path: Path) -> tuple[list[str], Path]:
    log = tmp_path / "ssh.log"
    ssh = script(tmp_path, "fake_ssh.sh", FAKE_SSH.replace("{log}", str(log)))
    ssh.chmod(ssh.stat().st_mode | stat.S_IXUSR)
    server = Path(sysconfig.get_path("scripts")) / "sumflow-server"
    server_program = str(server) if server.exists() else "sumflow-server"
    args = [
        "-H",
        "localhost:1,127.0.0.1:1",
        "--server-hosts",
        "localhost",
        "--coordinator-bind",
        "127.0.0.1:0",
        "--ssh",
        f"{ssh} -o BatchMode=yes",
        "--server-program",
        server_program,
    ]
    return args, log


@pytest.mark.parametrize("token_file", [False, True], ids=["fresh-token", "token-file"])
def test_cluster_form_runs_every_process_over_ssh(tmp_path: Path, token_file: bool) -> None:
    args, log = cluster_args(tmp_path)
    if token_file:
        token = tmp_path / "job.token"
        token.write_text("shared-token-0123456789\n")
        args += ["--token-file", str(token)]
    worker = script(tmp_path, "w.py", ENV_WORKER)
    out = run(["-v", *args, "--shutdown-grace", "0.2", sys.executable, str(worker), str(tmp_path)])
    assert out.returncode == 0, out
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    assert Counter(host for host, _ in lines) == {"localhost": 3, "127.0.0.1": 2}
    assert sum("--host-id cpu-0" in cmd for _, cmd in lines) == 1
    infos = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for r, (info, host) in enumerate(zip(infos, ["localhost", "127.0.0.1"], strict=True)):
        env = info["env"]
        assert env["RANK"] == str(r)
        assert env["WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == "0"
        assert env["LOCAL_WORLD_SIZE"] == "1"
        assert env["SUMFLOW_HOST_ID"] == host
        assert re.fullmatch(r"127\.0\.0\.1:\d+", env["SUMFLOW_COORDINATOR"])
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("localhost", "29500")
        assert info["cwd"] == os.getcwd()
        if token_file:
            assert env["SUMFLOW_JOB_TOKEN_FILE"] == str(tmp_path / "job.token")
            assert "SUMFLOW_JOB_TOKEN" not in env
        else:
            assert re.fullmatch("[0-9a-f]{64}", env["SUMFLOW_JOB_TOKEN"])
            assert "SUMFLOW_JOB_TOKEN_FILE" not in env
            # Sent on ssh's stdin, never on a command line.
            assert env["SUMFLOW_JOB_TOKEN"] not in log.read_text()
            assert env["SUMFLOW_JOB_TOKEN"] not in out.stderr
    assert_all_gone(list(started(out.stderr).values()))


@needs_comm
def test_cluster_form_job_sums_and_ends_cleanly(tmp_path: Path) -> None:
    args, log = cluster_args(tmp_path)
    worker = script(tmp_path, "w.py", SUM_WORKER)
    out = run(["-v", *args, sys.executable, str(worker)])
    assert out.returncode == 0, out
    for r in range(2):
        assert f"[worker {r}] sum ok on rank {r}: 3" in out.stdout
    assert "still running" not in out.stderr
    assert Counter(line.split("\t")[0] for line in log.read_text().splitlines()) == {
        "localhost": 3,
        "127.0.0.1": 2,
    }


def _incident(kind: str, rank: int, at: float) -> dict[str, object]:
    return {
        "time": at,
        "kind": kind,
        "role": "worker",
        "rank": rank,
        "name": f"worker {rank}",
        "host_id": "node-a",
        "pid": 100 + rank,
        "reason": "why",
    }


def test_the_first_failure_is_blamed_before_any_stall_and_old_stalls_not_at_all(
    tmp_path: Path,
) -> None:
    path = tmp_path / "incidents"
    lines = [
        json.dumps(_incident("stalled", 3, 100.0)),
        json.dumps(_incident("failed", 1, 200.0)),
        json.dumps(_incident("failed", 2, 201.0)),
        '{"time": 202.0, "kind": "fail',  # being written
    ]
    path.write_text("\n".join(lines))
    incidents = read_incidents(path)
    assert [i.rank for i in incidents] == [3, 1, 2]
    cause = first_cause(incidents, at=205.0, stall_window=3.0)
    assert cause is not None
    assert cause.rank == 1
    assert cause.describe() == "worker 1 'worker 1' (pid 101 on node-a) failed: why"

    stalls = [
        Incident(**_incident("stalled", r, t))  # type: ignore[arg-type]
        for r, t in ((3, 100.0), (2, 150.0))
    ]
    assert first_cause(stalls, at=152.0, stall_window=3.0) == stalls[1]
    assert first_cause(stalls, at=160.0, stall_window=3.0) is None, "a stall that ended"
    assert read_incidents(tmp_path / "missing") == []
