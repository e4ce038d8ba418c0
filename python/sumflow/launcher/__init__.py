"""``sumflow-run``: start a whole sumflow job with one command.

On one machine (the default) it starts, over loopback only, a coordinator, one colocated
summation server per worker machine (this one, or each emulated machine of
``--local-size``/``--machine-per-worker``), optional CPU-only summation servers, and the N
worker processes running the user's command::

    sumflow-run -np 4 python train.py --epochs 3
    sumflow-run -np 4 --local-size 2 --servers 1 -- python train.py

With ``-H host1:slots,host2:slots`` or ``--hostfile FILE``, or inside a Slurm allocation of
several nodes, it runs the workers and servers on those hosts over ssh and the coordinator
on this machine (see ``docs/launcher.md``).

What it guarantees:

- The configuration is checked before anything starts; a bad one is reported as
  ``sumflow-run: error: <reason>`` with exit status 2.
- A fresh job token is generated per job and handed to local processes through a private
  file (``SUMFLOW_JOB_TOKEN_FILE``), never on a command line.
- Every output line of every process is printed whole, prefixed with its origin
  (``[worker 0] ``, ``[server 1] ``, ``[cpu-server 0] ``, ``[coordinator] ``).
- When every worker has exited 0, the coordinator and servers get a grace period to stop
  by themselves and the launcher exits 0. When any process fails first, the launcher names
  it, stops every other process (SIGTERM to its process group, then SIGKILL) and exits with
  the failed process's status (128 + signal number for a signal death). SIGINT, SIGTERM
  and SIGHUP to the launcher stop the job the same way (exit 130, 143, 129).

The package's modules, each with one job: :mod:`~sumflow.launcher.cli` (the command line),
:mod:`~sumflow.launcher.plan` (the checked plan of a job, from the arguments),
:mod:`~sumflow.launcher.hosts` (host lists, host files, a Slurm allocation's nodes,
``HOST:PORT``), :mod:`~sumflow.launcher.interfaces` (a network interface's address),
:mod:`~sumflow.launcher.ssh` (commands run on other hosts, and what of this environment
they get), :mod:`~sumflow.launcher.supervise` (children, prefixed output, teardown) and
:mod:`~sumflow.launcher.logs` (per-process output files).
"""

from sumflow.launcher.cli import main

__all__ = ["main"]
