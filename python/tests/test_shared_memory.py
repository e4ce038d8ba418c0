"""Workers of one machine sum in its shared memory (crates/comm/src/local): every
collective exact without a byte through a socket, the same results through the server
with ``SUMFLOW_SHARED_MEMORY=off``, no file left in /dev/shm, and a worker that dies is
named within seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
WORKER = HERE / "shared_memory_worker.py"


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}


def ours() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("sumflow-")}


def launch(np: int, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sumflow.launcher", "-np", str(np), "--timeout", "60", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.mark.parametrize(
    ("workers", "expect", "server_sockets", "shape"),
    [
        (3, "shared", "mailbox", []),
        (4, "shared", "mailbox", []),
        (3, "servers", "mailbox", []),
        (3, "servers", "unix", []),
        (3, "servers", "tcp", []),
        # Several machines of several workers (issue 23's shapes): tensors that span
        # machines go through the servers, a process set of one machine's workers stays
        # in its shared memory; with CPU-only servers too.
        (4, "machines", "mailbox", ["--local-size", "2", "--servers", "1"]),
        (6, "machines", "mailbox", ["--local-size", "3"]),
    ],
    ids=[
        "shared-3",
        "shared-4",
        "servers-mailbox",
        "servers-unix",
        "servers-tcp",
        "2x2-k1",
        "2x3-k0",
    ],
)
def test_every_collective_is_exact_in_shared_memory_and_through_the_servers(
    tmp_path: Path, workers: int, expect: str, server_sockets: str, shape: list[str]
) -> None:
    """Through the servers: through the mailbox each worker shares with a server on its
    machine (the default), through their Unix sockets alone
    (``SUMFLOW_SERVER_SHARED_MEMORY=off``) and over TCP (``SUMFLOW_LOCAL_SOCKETS=off``);
    and on several emulated machines of several workers each (sizes not divisible by the
    workers per machine, every dtype)."""
    before = ours()
    off = ["-x", "SUMFLOW_SHARED_MEMORY=off"] if expect == "servers" else [*shape]
    if server_sockets == "unix":
        off += ["-x", "SUMFLOW_SERVER_SHARED_MEMORY=off"]
    if server_sockets == "tcp":
        off += ["-x", "SUMFLOW_LOCAL_SOCKETS=off"]
    env = {**clean_env(), "RUST_LOG": "sumflow_comm=info"}
    run = launch(workers, [*off, sys.executable, str(WORKER), str(tmp_path), expect], env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in range(workers):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "ok", rank
    if expect == "servers":
        # Worker 0 says how it reached the machine's one server.
        reached = {
            "mailbox": "1 through shared memory, 0 through a Unix socket, 0 over TCP",
            "unix": "0 through shared memory, 1 through a Unix socket, 0 over TCP",
            "tcp": "0 through shared memory, 0 through a Unix socket, 1 over TCP",
        }[server_sockets]
        out = run.stdout + run.stderr
        assert f"1 summation server(s): {reached}" in out, out[-3000:]
    assert ours() <= before, f"left in /dev/shm: {ours() - before}"


DYING = """
import os, sys, time, torch
import sumflow.torch as hvd
hvd.init()
x = torch.ones(1 << 20)
hvd.allreduce_(x, name="x")
if hvd.rank() == 1:
    os._exit(3)
started = time.time()
try:
    hvd.allreduce_(x, name="x")
except Exception as e:
    print(f"rank {hvd.rank()} after {time.time() - started:.1f}s: {type(e).__name__}: {e}")
    sys.exit(1)
"""


def test_a_worker_that_dies_is_named_within_seconds(tmp_path: Path) -> None:
    script = tmp_path / "dying.py"
    script.write_text(DYING)
    started = time.monotonic()
    run = launch(3, [sys.executable, str(script)], clean_env())
    assert run.returncode != 0
    out = run.stdout + run.stderr
    assert time.monotonic() - started < 40, out[-3000:]
    assert "worker 1" in out, out[-3000:]
    assert "exited with code 3" in out, out[-3000:]


KILLED = """
import os, signal, time, torch
import sumflow.torch as hvd
hvd.init()
if hvd.rank() == 0:
    # Maps the tensor's file; worker 1 never does, so the file keeps its name.
    hvd.allreduce_async(torch.ones(1 << 16), name="orphan")
    time.sleep(1)
else:
    time.sleep(1.5)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_files_of_killed_workers_are_removed_by_the_launcher(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    before = ours()
    run = launch(2, [sys.executable, str(script)], clean_env())
    assert run.returncode != 0
    assert "signal 9" in run.stdout + run.stderr or "SIGKILL" in run.stdout + run.stderr, (
        run.stdout[-2000:] + run.stderr[-2000:]
    )
    assert ours() <= before, f"left in /dev/shm: {ours() - before}"
