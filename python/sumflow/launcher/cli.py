"""The ``sumflow-run`` command line: its parser and ``main``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from sumflow import __version__, settings
from sumflow.launcher.elastic import ElasticLauncher
from sumflow.launcher.errors import PROG, ConfigError
from sumflow.launcher.plan import make_plan
from sumflow.launcher.supervise import Launcher

DESCRIPTION = """\
Start a sumflow job: a coordinator, summation servers and N worker processes running
COMMAND, every output line prefixed by the process it came from. Without -H/--hostfile
(or a Slurm allocation of several nodes, whose nodes are then the hosts) everything runs
on this machine over loopback.

Exit status: 0 when every worker exited 0; otherwise the job is stopped and the status is
that of the first process that failed (128+N for signal N); 2 for a bad configuration;
130/143/129 when stopped by SIGINT/SIGTERM/SIGHUP.
"""

EXAMPLES = """\
examples:
  # 4 workers on this machine (local ranks 0-3, as horovodrun -np 4), which runs one
  # colocated summation server
  sumflow-run -np 4 python train.py --epochs 3

  # 4 workers as 2 emulated machines of 2 workers, plus 1 CPU-only server
  sumflow-run -np 4 --local-size 2 --servers 1 -- python train.py

  # every worker its own emulated machine, with its own colocated server
  sumflow-run -np 4 --machine-per-worker --servers 2 python train.py

  # CPU-only servers, no colocated ones
  sumflow-run -np 2 --no-colocated --servers 2 python train.py

  # cluster: 2 GPU machines of 8 workers, 2 CPU machines running servers, over ssh
  sumflow-run -H gpu1:8,gpu2:8 --server-hosts cpu1,cpu2 \\
      --coordinator-bind 10.0.0.1:29400 --ssh 'ssh -o BatchMode=yes' python train.py

  # inside salloc -N 2 --ntasks-per-node 8 (or an sbatch script): the allocation's nodes
  sumflow-run python train.py

every worker gets SUMFLOW_COORDINATOR, SUMFLOW_JOB_TOKEN_FILE (SUMFLOW_JOB_TOKEN over ssh),
SUMFLOW_RANK, SUMFLOW_NUM_WORKERS, SUMFLOW_HOST_ID, SUMFLOW_WORKER_NAME and torchrun's
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Children do not
inherit SUMFLOW_* variables from this environment; forward one with -x NAME. Over ssh they
get this environment's PATH, PYTHONPATH, LD_LIBRARY_PATH and VIRTUAL_ENV, the -x ones, and
nothing else. See docs/launcher.md.
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``sumflow-run`` argument parser."""
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=(
            "%(prog)s -np N [--servers K] [--colocated | --no-colocated] "
            "[--local-size G | --machine-per-worker] [options] [--] command [args...]"
        ),
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    job = p.add_argument_group("job")
    job.add_argument(
        "-np",
        "-n",
        dest="np",
        type=int,
        metavar="N",
        help="number of worker processes (required on one machine; in the cluster form it "
        "defaults to the sum of the hosts' slots and must equal it if given)",
    )
    job.add_argument(
        "--servers",
        type=int,
        metavar="K",
        help="CPU-only summation servers (host ids cpu-0 ... cpu-K-1) [default: 0 on one "
        "machine, one per --server-hosts entry in the cluster form]",
    )
    job.add_argument(
        "--colocated",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run one summation server on each worker machine, sharing its host id "
        "[default: on]; --no-colocated needs --servers K >= 1",
    )
    machines = job.add_mutually_exclusive_group()
    machines.add_argument(
        "--local-size",
        type=int,
        metavar="G",
        help="one machine only: workers per emulated machine; ranks are grouped G per "
        "machine, machine m has host id local-m and (with --colocated) its own server; N "
        "must be divisible by G [default: N, one machine, as horovodrun]",
    )
    machines.add_argument(
        "--machine-per-worker",
        action="store_true",
        help="one machine only: every worker is an emulated machine of its own, with its "
        "own colocated server (--local-size 1)",
    )
    job.add_argument(
        "--engine-threads",
        type=int,
        metavar="E",
        help="engines per summation server, how many threads can sum at once [default: "
        "1 on one machine, the server's own default (half the cores) in the cluster form]",
    )
    job.add_argument(
        "--partition-bytes",
        type=int,
        metavar="BYTES",
        help="largest partition a tensor is cut into (SUMFLOW_PARTITION_BYTES for workers; "
        "default: derived from each declaration and the servers; the fifo scheduler sends "
        "whole tensors)",
    )
    job.add_argument(
        "--scheduler",
        choices=settings.SCHEDULERS,
        help="when partitions enter the network (SUMFLOW_SCHEDULER for workers; "
        f"docs/scheduling.md) [default: {settings.SCHEDULER.default}]",
    )
    job.add_argument(
        "--credit-bytes",
        type=int,
        metavar="BYTES",
        help="unacknowledged bytes per server for bytescheduler and prophet, 0 for no limit "
        f"(SUMFLOW_CREDIT_BYTES for workers) [default: {settings.CREDIT_BYTES.unset}]",
    )
    job.add_argument(
        "--timeout",
        type=float,
        metavar="SECS",
        help="how long a worker waits for one operation (SUMFLOW_TIMEOUT for workers)",
    )
    job.add_argument(
        "--heartbeat-timeout",
        type=float,
        metavar="SECS",
        help="seconds of silence after which a node is declared failed (passed to the "
        "coordinator and as SUMFLOW_HEARTBEAT_TIMEOUT to every process)",
    )
    job.add_argument(
        "--join-timeout",
        type=float,
        metavar="SECS",
        help="seconds every node has to join the job (passed to the coordinator and as "
        "SUMFLOW_JOIN_TIMEOUT to every process)",
    )
    job.add_argument(
        "--wire-stats",
        metavar="DIR",
        help="each summation server writes the bytes it exchanged with the workers, per key, "
        "to DIR/server-RANK.json when it stops (SUMFLOW_WIRE_STATS_DIR for servers; read them "
        "with sumflow.torch.server_wire_bytes); over ssh, on each server's host",
    )
    job.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics (GET /metrics): the coordinator on PORT, summation "
        "server i on PORT+1+i, each on its own host (docs/metrics.md)",
    )
    job.add_argument(
        "--trace",
        metavar="DIR",
        help="record a Chrome trace of every worker into DIR (SUMFLOW_TRACE_DIR for workers; "
        "see docs/tracing.md); over ssh each host writes its workers' traces there",
    )
    job.add_argument(
        "--trace-start-step",
        type=int,
        metavar="N",
        help="first traced step, counting from 0 (SUMFLOW_TRACE_START_STEP) "
        f"[default: {settings.TRACE_START_STEP.default}]",
    )
    job.add_argument(
        "--trace-steps",
        type=int,
        metavar="N",
        help="how many steps are traced (SUMFLOW_TRACE_STEPS) "
        f"[default: {settings.TRACE_STEPS.default}]",
    )
    job.add_argument(
        "-x",
        "--env",
        dest="env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="set NAME for every process, to VALUE or to its value here (repeatable); the "
        "way to forward variables to ssh hosts, and SUMFLOW_* ones at all",
    )
    job.add_argument(
        "--token-file",
        metavar="PATH",
        help="use this job token file (at least 16 bytes) instead of a fresh token; in the "
        "cluster form it must exist at the same path on every host, and the token is then "
        "never sent over ssh",
    )
    job.add_argument(
        "--server-program",
        metavar="CMD",
        help="command that runs a summation server (shell words) [default: this "
        "environment's sumflow-server locally, sumflow-server from the PATH over ssh]",
    )

    life = p.add_argument_group("supervision")
    life.add_argument(
        "--start-timeout",
        type=float,
        metavar="SECS",
        help="how long the job has to start, as horovodrun's: the coordinator to listen, and "
        "every node to join (the join timeout, unless --join-timeout is given) [default: 30 "
        "for the coordinator; the join timeout's own default]",
    )
    life.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        metavar="SECS",
        help="after every worker exited 0, how long the coordinator and servers get to stop "
        "by themselves before they are terminated (SIGTERM, which they also handle "
        "gracefully) [default: 5]",
    )
    life.add_argument(
        "--kill-timeout",
        type=float,
        default=5.0,
        metavar="SECS",
        help="how long a process gets after SIGTERM before SIGKILL [default: 5]",
    )
    life.add_argument(
        "--output-filename",
        metavar="DIR",
        help="also write each process's output, unprefixed, to DIR/rank.N/stdout and "
        "DIR/rank.N/stderr for worker N (DIR/server.M, DIR/cpu-server.K, DIR/coordinator for "
        "the others), as horovodrun does",
    )
    life.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print each process's command and pid as it starts, and run the programs with "
        "RUST_LOG=info (unless RUST_LOG is set; the default is warn)",
    )

    cl = p.add_argument_group("cluster form (workers and servers on other hosts over ssh)")
    hosts = cl.add_mutually_exclusive_group()
    hosts.add_argument(
        "-H",
        "--hosts",
        metavar="HOST:SLOTS,...",
        help="worker hosts and how many workers each runs (HOST alone means 1 slot); ranks "
        "are assigned host by host in this order",
    )
    hosts.add_argument(
        "--hostfile",
        "-hostfile",
        metavar="FILE",
        help="worker hosts, one a line: 'host slots=N' or 'host:N' ('#' starts a comment)",
    )
    cl.add_argument(
        "--server-hosts",
        metavar="HOST,...",
        help="hosts that run the CPU-only servers, assigned round-robin",
    )
    bind = cl.add_mutually_exclusive_group()
    bind.add_argument(
        "--coordinator-bind",
        metavar="HOST:PORT",
        help="address the coordinator (on this machine) listens on; required in the cluster "
        "form unless --network-interface or a Slurm allocation gives it, e.g. "
        "10.0.0.1:29400 (port 0 picks a free port)",
    )
    bind.add_argument(
        "--network-interface",
        metavar="NIC",
        help="the coordinator listens on this machine's IPv4 address on NIC (e.g. eth0), on "
        "a free port, and the other hosts dial that address: --coordinator-bind ADDR:0 "
        "(horovodrun's flag)",
    )
    cl.add_argument(
        "--coordinator-addr",
        metavar="HOST[:PORT]",
        help="address the other hosts dial to reach the coordinator [default: the bind "
        "address; the port defaults to the bound one]",
    )
    cl.add_argument(
        "--server-port",
        type=int,
        default=0,
        metavar="PORT",
        help="port the summation servers on ssh hosts listen on (all interfaces) "
        "[default: 0, any free port]",
    )
    p.add_argument(
        "--master-port",
        type=int,
        metavar="PORT",
        help="MASTER_PORT given to every worker, for torch.distributed's env:// rendezvous "
        "alongside MASTER_ADDR (the first worker machine) [default: a free port on this "
        "machine; 29500 in the cluster form]",
    )
    cl.add_argument(
        "--ssh",
        default="ssh",
        metavar="CMD",
        help="ssh command (shell words), e.g. 'ssh -o BatchMode=yes' [default: ssh]",
    )
    el = p.add_argument_group(
        "elastic jobs (docs/elastic.md; any of these makes the job elastic, as with horovodrun)"
    )
    el.add_argument(
        "--min-np",
        type=int,
        metavar="N",
        help="fewest workers the job trains with; below it, it waits --elastic-timeout for "
        "hosts, then fails [default: -np]",
    )
    el.add_argument(
        "--max-np",
        type=int,
        metavar="N",
        help="most workers the job runs [default: -np, or no limit with --host-discovery-script]",
    )
    el.add_argument(
        "--host-discovery-script",
        metavar="CMD",
        help="run every second; prints the hosts that may run workers, one HOST:SLOTS per "
        "line (localhost: this machine); new slots get workers, which join at the next "
        "commit, and workers on hosts it stops listing leave",
    )
    el.add_argument(
        "--server-discovery-script",
        metavar="CMD",
        help="run every second; prints the hosts that run CPU summation servers, one "
        "HOST[:COUNT] per line (localhost: this machine); a change takes effect at the "
        "workers' next commit, with the placement for the new number of servers",
    )
    el.add_argument(
        "--rendezvous-port",
        type=int,
        default=0,
        metavar="PORT",
        help="port of the rendezvous workers and hand-started servers (sumflow-server "
        "--elastic HOST:PORT) ask for their places, on --coordinator-bind's host "
        "[default: 0, any free port; printed at start]",
    )
    el.add_argument(
        "--blacklist-after",
        type=int,
        default=2,
        metavar="F",
        help="failures after which a host runs no more workers [default: 2]",
    )
    el.add_argument(
        "--elastic-timeout",
        type=float,
        default=600.0,
        metavar="SECS",
        help="how long the job waits with fewer than --min-np workers [default: 600]",
    )
    p.add_argument("--version", action="version", version=f"sumflow {__version__}")
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the worker program and its arguments (after '--' if it could be mistaken "
        "for an option of sumflow-run)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The ``sumflow-run`` console script: returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = make_plan(args)
    except ConfigError as e:
        parser.error(str(e))
    if plan.elastic is not None:
        return ElasticLauncher(plan).run()
    return Launcher(plan).run()
