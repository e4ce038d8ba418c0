"""docs/clusters.md's recipes, run as written and emulated on this machine: the sbatch
script under a stand-in for srun in an allocation of one node and two tasks, and the
PyTorchJob manifest as the training operator would start its two pods. Each job's two
workers must find each other and sum."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import (
    check_job_of_two,
    free_port_pair,
    launcher_free_env,
    run_processes,
    slurm_job_id,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "clusters.md"
WORKER = Path(__file__).with_name("launch_env_worker.py")
#: Each job ends within this many seconds, or the test fails.
TIMEOUT = 50.0

#: Stands in for srun inside an allocation of one node: starts SLURM_NTASKS tasks of its
#: command with the variables srun sets for each, and exits with the first failure.
FAKE_SRUN = """\
#!/bin/sh
i=0
pids=
while [ "$i" -lt "$SLURM_NTASKS" ]; do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 SLURM_STEP_ID=0 SLURM_STEPID=0 \\
  SLURM_STEP_NUM_TASKS=$SLURM_NTASKS SLURM_STEP_NUM_NODES=1 \\
  SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST SLURM_STEP_TASKS_PER_NODE=$SLURM_NTASKS \\
  "$@" &
  pids="$pids $!"
  i=$((i + 1))
done
status=0
for p in $pids; do wait "$p" || status=$?; done
exit "$status"
"""


def code_block(language: str, containing: str) -> str:
    """The first ```language block of docs/clusters.md that contains `containing`."""
    for block in re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.S):
        if containing in block:
            return str(block)
    raise AssertionError(f"docs/clusters.md has no {language} block with {containing!r}")


def test_the_documented_sbatch_script_runs_its_tasks(tmp_path: Path) -> None:
    batch = tmp_path / "train.sbatch"
    batch.write_text(code_block("sh", "#SBATCH"))
    assert "srun python train.py" in batch.read_text()
    shutil.copy(WORKER, tmp_path / "train.py")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    job = str(slurm_job_id())
    # What sbatch gives the batch script of an allocation of one node, two tasks.
    env = launcher_free_env(
        PATH=f"{bin_dir}:{Path(sys.executable).parent}:{launcher_free_env()['PATH']}",
        TMPDIR=str(tmp_path),
        OMP_NUM_THREADS="1",
        RUST_LOG="warn",
        SLURM_JOB_ID=job,
        SLURM_JOBID=job,
        SLURM_JOB_NODELIST="localhost",
        SLURM_NODELIST="localhost",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NNODES="1",
        SLURM_NTASKS="2",
        SLURM_TASKS_PER_NODE="2",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        SLURMD_NODENAME="localhost",
    )
    out = subprocess.run(
        ["bash", str(batch)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    check_job_of_two(out.stdout.strip().splitlines())
    # The script's own token: nothing was derived, so nothing warned.
    assert "derived" not in out.stderr, out.stderr


def pod_env(container: dict[str, Any], pod: str, secret: str) -> dict[str, str]:
    """The container's env entries as Kubernetes resolves them: values as written, the
    Secret's key, the pod's own name."""
    env = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
            continue
        source = entry["valueFrom"]
        if "secretKeyRef" in source:
            env[entry["name"]] = secret
        else:
            assert source["fieldRef"]["fieldPath"] == "metadata.name", source
            env[entry["name"]] = pod
    return env


def test_the_documented_pytorchjob_runs_its_pods(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML (which optuna brings) reads the manifest")
    manifest = yaml.safe_load(code_block("yaml", "kind: PyTorchJob"))
    name = manifest["metadata"]["name"]
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    pods = [
        (kind, index, spec["template"]["spec"]["containers"][0])
        for kind in ("Master", "Worker")
        for spec in [replicas[kind]]
        for index in range(spec["replicas"])
    ]
    assert len(pods) == 2
    shutil.copy(WORKER, tmp_path / "train.py")
    # The training operator's variables; MASTER_ADDR stands for the master's Service, and
    # a free port for the default 23456, which another job here may hold.
    port = free_port_pair()
    commands, envs = set(), []
    for rank, (kind, index, container) in enumerate(pods):
        pod = f"{name}-{kind.lower()}-{index}"
        env = launcher_free_env(
            PATH=f"{Path(sys.executable).parent}:{launcher_free_env()['PATH']}",
            TMPDIR=str(tmp_path),
            OMP_NUM_THREADS="1",
            RUST_LOG="warn",
            PYTHONUNBUFFERED="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(len(pods)),
            RANK=str(rank),
        )
        env.update(pod_env(container, pod, secret="k8s-secret-token-0123456789abcdef"))
        assert env["SUMFLOW_HOST_ID"] == pod
        envs.append(env)
        commands.add(tuple(container["command"]))
    assert commands == {("python", "train.py")}
    outcomes = run_processes(["python", "train.py"], envs, TIMEOUT, cwd=tmp_path)
    for o in outcomes:
        assert o.returncode == 0, f"pod {o.rank} exited {o.returncode}:\n{o.stderr[-3000:]}"
        assert "derived" not in o.stderr  # the Secret's token
    lines = [o.stdout.strip().splitlines()[-1] for o in outcomes]
    # Each pod is a machine of its own: local rank 0 of 1, unlike check_job_of_two's.
    seen = [json.loads(line) for line in lines]
    assert [(s["rank"], s["size"], s["local_rank"], s["local_size"]) for s in seen] == [
        (0, 2, 0, 1),
        (1, 2, 0, 1),
    ]
    assert all(s["sum"] == [2.0, 2.0, 2.0] for s in seen)
