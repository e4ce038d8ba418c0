"""The plan of a job: ``sumflow-run``'s arguments checked and resolved before anything
starts, and the processes it consists of."""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

from sumflow import settings
from sumflow._programs import program
from sumflow.launcher.errors import ConfigError
from sumflow.launcher.hosts import (
    Host,
    join_host_port,
    parse_hostfile,
    parse_hosts,
    slurm_hosts,
    split_host_port,
)
from sumflow.launcher.interfaces import ipv4_address

#: Shortest job token the core accepts, in bytes.
MIN_TOKEN_BYTES = 16
#: How long the coordinator has to listen unless --start-timeout says.
DEFAULT_START_TIMEOUT = 30.0
#: Where the hosts came from when a Slurm allocation gave them, for messages.
SLURM_ALLOCATION = "the Slurm allocation (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE)"

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class ElasticPlan:
    """What makes a job elastic (``--min-np``, ``--max-np``, ``--host-discovery-script``):
    workers may fail, leave and join while it runs (docs/elastic.md)."""

    #: Workers started at the beginning (-np).
    initial: int
    min_np: int
    max_np: int
    #: Run to list the hosts and their slots, or None: the hosts given are all there is.
    discovery_script: list[str] | None
    #: Failures on one host after which no worker runs there again.
    blacklist_after: int
    #: How long the job may wait with fewer than min_np workers before it fails.
    timeout: float
    #: Seconds between runs of the discovery scripts.
    discovery_interval: float
    #: Run to list the CPU-server hosts, or None: --servers/--server-hosts stay.
    server_discovery_script: list[str] | None = None
    #: The rendezvous's port (0: any free one).
    rendezvous_port: int = 0


#: The host name an elastic job's workers on this machine get (no ssh).
LOCAL_HOST = "localhost"


@dataclass
class Plan:
    """A checked configuration: everything needed to start the job."""

    command: list[str]
    num_workers: int
    #: Worker ranks grouped per machine, in rank order: (host id, ssh host or None, size).
    machines: list[tuple[str, str | None, int]]
    colocated: bool
    cpu_servers: int
    #: Where each CPU server runs over ssh (cluster form), one entry per server.
    cpu_server_hosts: list[str] | None
    engine_threads: int | None
    coordinator_bind: str
    #: The address workers and servers dial, when it is not the one the coordinator reports.
    coordinator_addr: str | None
    ssh: list[str]
    server_program: list[str] | None
    server_port: int
    token_file: Path | None
    #: Variables every worker gets besides its identity (timeouts, partition size, -x).
    worker_env: dict[str, str]
    #: Variables every server and the coordinator get (timeouts, -x).
    service_env: dict[str, str]
    coordinator_args: list[str]
    #: The coordinator's metrics port; server i's is one more than it plus i (None: off).
    metrics_port: int | None
    rust_log: str
    start_timeout: float
    #: Where each process's output is also written (--output-filename), or None.
    output_dir: Path | None
    shutdown_grace: float
    kill_timeout: float
    verbose: bool
    #: Set for an elastic job.
    elastic: ElasticPlan | None = None

    @property
    def cluster(self) -> bool:
        """Whether workers run on other hosts over ssh."""
        return any(ssh_host is not None for _, ssh_host, _ in self.machines)

    @property
    def num_servers(self) -> int:
        """Every summation server of the job: colocated ones and CPU-only ones."""
        return (len(self.machines) if self.colocated else 0) + self.cpu_servers


@dataclass
class ProcSpec:
    """One process of the job, before it starts."""

    #: Names the process in prefixes and messages: "worker 0", "server 1", "coordinator".
    name: str
    #: "worker", "server" or "coordinator".
    kind: str
    argv: list[str]
    #: The variables the launcher sets for it (on top of the inherited environment when
    #: local; the whole remote ``env`` when over ssh).
    env: dict[str, str] = field(default_factory=dict)
    #: The ssh host it runs on, or None for this machine.
    host: str | None = None


def _seconds(value: float | None, flag: str, allow_zero: bool = False) -> None:
    if value is None:
        return
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        kind = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{flag} must be {kind} number of seconds, got {value}")


def _check_program(program: str) -> None:
    """Fails unless ``program`` can be executed here, as the OS would find it."""
    if "/" in program:
        path = Path(program)
        if not path.exists():
            raise ConfigError(f"cannot run {program!r}: no such file")
        if path.is_dir() or not os.access(path, os.X_OK):
            raise ConfigError(f"cannot run {program!r}: not an executable file")
    elif shutil.which(program) is None:
        hint = ""
        if Path(program).is_file():
            hint = f" (to run the file in this directory, write ./{program})"
        raise ConfigError(f"cannot run {program!r}: no such program on PATH{hint}")


def _free_port() -> int:
    """A TCP port free on loopback now (another program may take it before the job does,
    as with any such choice; --master-port fixes it instead)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _forwarded_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not _ENV_NAME.match(name):
            raise ConfigError(f"-x {item!r}: {name!r} is not a variable name")
        if not eq:
            if name not in os.environ:
                raise ConfigError(f"-x {name}: {name} is not set here; write -x {name}=VALUE")
            value = os.environ[name]
        env[name] = value
    return env


def _cluster_hosts(args: argparse.Namespace) -> tuple[list[Host], str] | None:
    """The worker hosts of the cluster form and where they came from, for messages: -H,
    --hostfile, or the nodes of the Slurm allocation this runs in; None on one machine."""
    if args.hosts is not None:
        return parse_hosts(args.hosts), "-H"
    if args.hostfile is not None:
        try:
            text = Path(args.hostfile).read_text()
        except OSError as e:
            raise ConfigError(f"--hostfile {args.hostfile}: {e.strerror}") from None
        return parse_hostfile(text, args.hostfile), f"--hostfile {args.hostfile}"
    hosts = slurm_hosts(os.environ)
    return None if hosts is None else (hosts, SLURM_ALLOCATION)


def _coordinator_endpoints(args: argparse.Namespace, hosts_from: str) -> tuple[str, str | None]:
    """Where the coordinator listens in the cluster form, and the address the other hosts
    dial (None: the one it binds)."""
    if args.network_interface is not None:
        return f"{ipv4_address(args.network_interface)}:0", args.coordinator_addr
    if args.coordinator_bind is None:
        if hosts_from == SLURM_ALLOCATION:
            # This runs on a node of the allocation (the batch script's) or a login node;
            # either way its name is what the nodes reach it by.
            here = os.environ.get("SLURMD_NODENAME", "").strip() or socket.gethostname()
            return "0.0.0.0:0", args.coordinator_addr or here
        raise ConfigError(
            "the cluster form needs --coordinator-bind HOST:PORT, an address of this "
            "machine the other hosts can reach (e.g. 10.0.0.1:29400), or "
            "--network-interface NIC"
        )
    bind_host, _ = split_host_port(args.coordinator_bind, "--coordinator-bind")
    if args.coordinator_addr is not None:
        split_host_port(args.coordinator_addr, "--coordinator-addr", port_required=False)
    elif bind_host in ("0.0.0.0", "::"):
        raise ConfigError(
            f"--coordinator-bind {args.coordinator_bind} listens on every interface; "
            "give --coordinator-addr, the address the other hosts dial"
        )
    return args.coordinator_bind, args.coordinator_addr


def _output_dir(path: str | None) -> Path | None:
    """--output-filename's directory, created now so a bad one stops nothing half-started."""
    if path is None:
        return None
    if not path:
        raise ConfigError("--output-filename needs a directory")
    directory = Path(path).absolute()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--output-filename {path}: {e.strerror or e}") from None
    return directory


def _refuse_machine_shape(args: argparse.Namespace, why: str) -> None:
    """Refuses --local-size and --machine-per-worker, which shape the emulated machines of a
    job on one machine, where something else decides the machines (``why`` follows the
    flag in the message)."""
    for flag, given in (
        ("--local-size", args.local_size is not None),
        ("--machine-per-worker", args.machine_per_worker),
    ):
        if given:
            raise ConfigError(f"{flag} {why}")


def make_plan(args: argparse.Namespace) -> Plan:
    """Checks the parsed arguments and resolves them into a plan; raises ConfigError."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command given: write the worker program after the options")
    if args.servers is not None and args.servers < 0:
        raise ConfigError(f"--servers must be at least 0, got {args.servers}")
    if args.engine_threads is not None and args.engine_threads < 1:
        raise ConfigError(f"--engine-threads must be at least 1, got {args.engine_threads}")
    if args.partition_bytes is not None and args.partition_bytes < 2:
        raise ConfigError(f"--partition-bytes must be at least 2, got {args.partition_bytes}")
    if args.credit_bytes is not None and args.credit_bytes < 0:
        raise ConfigError(f"--credit-bytes must be at least 0, got {args.credit_bytes}")
    for value, flag in (
        (args.timeout, "--timeout"),
        (args.heartbeat_timeout, "--heartbeat-timeout"),
        (args.join_timeout, "--join-timeout"),
        (args.start_timeout, "--start-timeout"),
        (args.kill_timeout, "--kill-timeout"),
    ):
        _seconds(value, flag)
    _seconds(args.shutdown_grace, "--shutdown-grace", allow_zero=True)
    if not 0 <= args.server_port <= 65535:
        raise ConfigError(f"--server-port must be 0 to 65535, got {args.server_port}")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise ConfigError(f"--master-port must be 1 to 65535, got {args.master_port}")

    forwarded = _forwarded_env(args.env)
    ssh = shlex.split(args.ssh) if args.ssh else []
    server_program = shlex.split(args.server_program) if args.server_program else None
    if args.server_program is not None and not server_program:
        raise ConfigError("--server-program is empty")

    token_file = None
    if args.token_file is not None:
        token_file = Path(args.token_file).absolute()
        try:
            token = token_file.read_bytes().rstrip()
        except OSError as e:
            raise ConfigError(f"--token-file {args.token_file}: {e.strerror}") from None
        if len(token) < MIN_TOKEN_BYTES:
            raise ConfigError(
                f"--token-file {args.token_file}: the token must be at least "
                f"{MIN_TOKEN_BYTES} bytes, it has {len(token)}"
            )

    elastic_asked = (
        args.min_np is not None
        or args.max_np is not None
        or args.host_discovery_script is not None
        or args.server_discovery_script is not None
    )
    cluster = _cluster_hosts(args)
    if elastic_asked and cluster is None:
        _refuse_machine_shape(
            args,
            "is not for an elastic job: its workers on this machine form one machine, "
            "host localhost",
        )
        if args.np is None:
            raise ConfigError("-np N is required: the number of workers an elastic job starts with")
        # One machine: its slots are -np, unless the discovery script says otherwise.
        cluster = ([Host(LOCAL_HOST, args.np)], "-np")
    machines: list[tuple[str, str | None, int]]
    cpu_server_hosts: list[str] | None = None
    if cluster is None:
        for flag, value in (
            ("--server-hosts", args.server_hosts),
            ("--coordinator-bind", args.coordinator_bind),
            ("--coordinator-addr", args.coordinator_addr),
            ("--network-interface", args.network_interface),
        ):
            if value is not None:
                raise ConfigError(f"{flag} needs the cluster form (-H or --hostfile)")
        if args.np is None:
            raise ConfigError("-np N is required (the number of worker processes)")
        n = args.np
        if n < 1:
            raise ConfigError(f"-np must be at least 1, got {n}")
        g = 1 if args.machine_per_worker else n if args.local_size is None else args.local_size
        if g < 1:
            raise ConfigError(f"--local-size must be at least 1, got {g}")
        if n % g:
            raise ConfigError(
                f"-np {n} is not divisible by --local-size {g}: every emulated machine "
                f"runs exactly {g} workers"
            )
        machines = [(f"local-{m}", None, g) for m in range(n // g)]
        cpu_servers = args.servers or 0
        engine_threads = 1 if args.engine_threads is None else args.engine_threads
        coordinator_bind = "127.0.0.1:0"
        coordinator_addr = None
        _check_program(command[0])
    else:
        hosts, hosts_from = cluster
        _refuse_machine_shape(
            args, "is for one machine; in the cluster form each host's slots are its local size"
        )
        n = sum(h.slots for h in hosts)
        if elastic_asked:
            n = n if args.np is None else args.np
        elif args.np is not None and args.np != n:
            hint = ""
            if hosts_from == SLURM_ALLOCATION:
                hint = (
                    "; ask Slurm for the tasks (salloc/sbatch --ntasks-per-node) or leave -np out"
                )
            raise ConfigError(
                f"-np {args.np} does not match the hosts' {n} slots in all ({hosts_from}){hint}"
            )
        machines = [(h.address, None if hosts_from == "-np" else h.name, h.slots) for h in hosts]
        server_hosts = []
        if args.server_hosts is not None:
            server_hosts = [s.strip() for s in args.server_hosts.split(",")]
            if not all(server_hosts):
                raise ConfigError(f"--server-hosts {args.server_hosts!r}: empty host entry")
        cpu_servers = len(server_hosts) if args.servers is None else args.servers
        local_elastic = hosts_from == "-np"
        if cpu_servers and not server_hosts and not local_elastic:
            raise ConfigError(
                f"--servers {cpu_servers} in the cluster form needs --server-hosts to say "
                "where they run"
            )
        if server_hosts and not cpu_servers:
            raise ConfigError("--server-hosts given with --servers 0")
        cpu_server_hosts = (
            [server_hosts[k % len(server_hosts)] for k in range(cpu_servers)]
            if server_hosts
            else None
        )
        engine_threads = args.engine_threads
        if local_elastic and engine_threads is None:
            engine_threads = 1
        told = args.coordinator_bind is not None or args.network_interface is not None
        if local_elastic and not server_hosts and not told:
            # An elastic job on this machine (unless its discovery scripts list others,
            # which then need --coordinator-bind): loopback, as without elasticity.
            coordinator_bind, coordinator_addr = "127.0.0.1:0", None
            _check_program(command[0])
        else:
            coordinator_bind, coordinator_addr = _coordinator_endpoints(args, hosts_from)
        if not ssh:
            raise ConfigError("--ssh is empty")
        _check_program(ssh[0])

    if not args.colocated and cpu_servers < 1:
        raise ConfigError(
            "--no-colocated needs --servers K with K >= 1: the job needs at least one "
            "summation server"
        )

    common: dict[str, str] = {}
    coordinator_args = []
    if args.heartbeat_timeout is not None:
        common[settings.HEARTBEAT_TIMEOUT.name] = repr(float(args.heartbeat_timeout))
        coordinator_args += ["--heartbeat-timeout", common[settings.HEARTBEAT_TIMEOUT.name]]
    # horovodrun's --start-timeout is also how long its workers have to meet.
    join_timeout = args.start_timeout if args.join_timeout is None else args.join_timeout
    if join_timeout is not None:
        common[settings.JOIN_TIMEOUT.name] = repr(float(join_timeout))
        coordinator_args += ["--join-timeout", common[settings.JOIN_TIMEOUT.name]]
    if args.metrics_port is not None:
        last = args.metrics_port + (len(machines) if args.colocated else 0) + cpu_servers
        if args.metrics_port < 1 or last > 65535:
            raise ConfigError(
                f"--metrics-port {args.metrics_port}: the coordinator and every server need "
                f"a port of their own, {args.metrics_port} to {last}, within 1 to 65535"
            )
        host, _ = split_host_port(coordinator_bind, "--coordinator-bind")
        coordinator_args += ["--metrics-bind", join_host_port(host, args.metrics_port)]
    worker_env = dict(common)
    # torch.distributed's env:// rendezvous, so a worker can open gloo/nccl groups next to
    # sumflow (rank 0 of the first machine hosts the store, as under torchrun).
    worker_env["MASTER_ADDR"] = "127.0.0.1" if cluster is None else machines[0][0]
    if args.master_port is not None:
        worker_env["MASTER_PORT"] = str(args.master_port)
    else:
        worker_env["MASTER_PORT"] = str(_free_port() if cluster is None else 29500)
    if args.partition_bytes is not None:
        worker_env[settings.PARTITION_BYTES.name] = str(args.partition_bytes)
    if args.scheduler is not None:
        worker_env[settings.SCHEDULER.name] = args.scheduler
    if args.credit_bytes is not None:
        worker_env[settings.CREDIT_BYTES.name] = str(args.credit_bytes)
    if args.timeout is not None:
        worker_env[settings.TIMEOUT.name] = repr(float(args.timeout))
    worker_env.update(_trace_env(args))
    # Local emulated machines all share this one.
    per_host = n if cluster is None else max(size for _, _, size in machines)
    if per_host > 1 and "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: several workers on a machine would each start an OpenMP pool
        # as large as the machine, and threads spinning between parallel regions starve
        # the others (-x OMP_NUM_THREADS=N or the launcher's environment overrides it).
        worker_env["OMP_NUM_THREADS"] = "1"
    worker_env.update(forwarded)
    service_env = {**common, **forwarded}
    if args.wire_stats is not None:
        if not args.wire_stats:
            raise ConfigError("--wire-stats needs a directory")
        service_env[settings.WIRE_STATS_DIR.name] = str(Path(args.wire_stats).absolute())

    if "RUST_LOG" in os.environ:
        rust_log = os.environ["RUST_LOG"]
    else:
        rust_log = "info" if args.verbose else "warn"

    if not elastic_asked and args.rendezvous_port:
        raise ConfigError("--rendezvous-port is for an elastic job (--min-np, --max-np, ...)")
    elastic = _elastic_plan(args, n) if elastic_asked else None
    return Plan(
        command=command,
        num_workers=n,
        machines=machines,
        colocated=args.colocated,
        cpu_servers=cpu_servers,
        cpu_server_hosts=cpu_server_hosts,
        engine_threads=engine_threads,
        coordinator_bind=coordinator_bind,
        coordinator_addr=coordinator_addr,
        ssh=ssh,
        server_program=server_program,
        server_port=args.server_port,
        token_file=token_file,
        worker_env=worker_env,
        service_env=service_env,
        coordinator_args=coordinator_args,
        metrics_port=args.metrics_port,
        rust_log=rust_log,
        start_timeout=DEFAULT_START_TIMEOUT if args.start_timeout is None else args.start_timeout,
        output_dir=_output_dir(args.output_filename),
        shutdown_grace=args.shutdown_grace,
        kill_timeout=args.kill_timeout,
        verbose=args.verbose,
        elastic=elastic,
    )


def _elastic_plan(args: argparse.Namespace, initial: int) -> ElasticPlan:
    """The elastic part of the plan; ``initial`` workers start."""
    if initial < 1:
        raise ConfigError(f"-np must be at least 1, got {initial}")
    min_np = initial if args.min_np is None else args.min_np
    if min_np < 1:
        raise ConfigError(f"--min-np must be at least 1, got {min_np}")
    if initial < min_np:
        raise ConfigError(f"-np {initial} is below --min-np {min_np}: the job starts with -np")
    script = shlex.split(args.host_discovery_script) if args.host_discovery_script else None
    if args.host_discovery_script is not None and not script:
        raise ConfigError("--host-discovery-script is empty")
    if script is not None:
        _check_program(script[0])
    # Without discovery the hosts given are all there will be; with it, as many as it lists.
    max_np = args.max_np if args.max_np is not None else (initial if script is None else 1 << 16)
    if max_np < min_np:
        raise ConfigError(f"--max-np {max_np} is below --min-np {min_np}")
    if initial > max_np:
        raise ConfigError(f"-np {initial} is above --max-np {max_np}")
    if args.blacklist_after < 1:
        raise ConfigError(f"--blacklist-after must be at least 1, got {args.blacklist_after}")
    _seconds(args.elastic_timeout, "--elastic-timeout")
    if args.metrics_port is not None:
        raise ConfigError("--metrics-port is not for an elastic job (each epoch starts its own)")
    servers_script = (
        shlex.split(args.server_discovery_script) if args.server_discovery_script else None
    )
    if args.server_discovery_script is not None and not servers_script:
        raise ConfigError("--server-discovery-script is empty")
    if servers_script is not None:
        _check_program(servers_script[0])
    if not 0 <= args.rendezvous_port <= 65535:
        raise ConfigError(f"--rendezvous-port must be 0 to 65535, got {args.rendezvous_port}")
    return ElasticPlan(
        initial=initial,
        min_np=min_np,
        max_np=max_np,
        discovery_script=script,
        blacklist_after=args.blacklist_after,
        timeout=args.elastic_timeout,
        discovery_interval=1.0,
        server_discovery_script=servers_script,
        rendezvous_port=args.rendezvous_port,
    )


def _trace_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' ``SUMFLOW_TRACE_*`` variables from ``--trace`` and its window."""
    if args.trace is None:
        for flag, value in (
            ("--trace-start-step", args.trace_start_step),
            ("--trace-steps", args.trace_steps),
        ):
            if value is not None:
                raise ConfigError(f"{flag} needs --trace DIR, the directory traces go to")
        return {}
    if not args.trace:
        raise ConfigError("--trace needs a directory")
    env = {settings.TRACE_DIR.name: str(Path(args.trace).absolute())}
    if args.trace_start_step is not None:
        if args.trace_start_step < 0:
            raise ConfigError(f"--trace-start-step must be at least 0, got {args.trace_start_step}")
        env[settings.TRACE_START_STEP.name] = str(args.trace_start_step)
    if args.trace_steps is not None:
        if args.trace_steps < 1:
            raise ConfigError(f"--trace-steps must be at least 1, got {args.trace_steps}")
        env[settings.TRACE_STEPS.name] = str(args.trace_steps)
    return env


def build_processes(plan: Plan, coordinator: str) -> list[ProcSpec]:
    """The servers, then the workers, of ``plan`` once the coordinator listens at
    ``coordinator`` (the address they dial). The token is not in these environments."""
    specs = build_servers(plan, coordinator, [(h, ssh) for h, ssh, _ in plan.machines])
    rank = 0
    for host_id, ssh_host, size in plan.machines:
        for local_rank in range(size):
            env = {
                settings.COORDINATOR.name: coordinator,
                settings.RANK.name: str(rank),
                settings.NUM_WORKERS.name: str(plan.num_workers),
                settings.HOST_ID.name: host_id,
                settings.WORKER_NAME.name: f"worker {rank}",
                "RANK": str(rank),
                "WORLD_SIZE": str(plan.num_workers),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(size),
                **plan.worker_env,
            }
            specs.append(ProcSpec(f"worker {rank}", "worker", list(plan.command), env, ssh_host))
            rank += 1
    return specs


def build_servers(
    plan: Plan,
    coordinator: str,
    machines: list[tuple[str, str | None]],
    cpu_hosts: list[str | None] | None = None,
) -> list[ProcSpec]:
    """The summation servers of ``plan`` for worker ``machines`` (host id, ssh host or
    None): the colocated ones (with --colocated), then the CPU ones, on ``cpu_hosts`` (ssh
    host or None for this machine) when given, else where the plan says."""
    specs: list[ProcSpec] = []
    local_server = plan.server_program or program("sumflow-server")
    remote_server = plan.server_program or ["sumflow-server"]

    def server(name: str, host_id: str, ssh_host: str | None) -> ProcSpec:
        argv = [*(remote_server if ssh_host else local_server), "--coordinator", coordinator]
        bind_host = "127.0.0.1"
        if ssh_host is not None:
            advertise = Host(ssh_host, 1).address
            bind_host = "0.0.0.0"
            argv += ["--bind", join_host_port(bind_host, plan.server_port)]
            argv += ["--advertise", advertise]
        if plan.metrics_port is not None:
            port = plan.metrics_port + 1 + sum(1 for s in specs if s.kind == "server")
            argv += ["--metrics-bind", join_host_port(bind_host, port)]
        argv += ["--host-id", host_id]
        if plan.engine_threads is not None:
            argv += ["--engine-threads", str(plan.engine_threads)]
        return ProcSpec(name, "server", argv, dict(plan.service_env), ssh_host)

    if plan.colocated:
        for m, (host_id, ssh_host) in enumerate(machines):
            specs.append(server(f"server {m}", host_id, ssh_host))
    if cpu_hosts is None:
        cpu_hosts = [
            plan.cpu_server_hosts[k] if plan.cpu_server_hosts else None
            for k in range(plan.cpu_servers)
        ]
    for k, ssh_host in enumerate(cpu_hosts):
        specs.append(server(f"cpu-server {k}", f"cpu-{k}", ssh_host))
    return specs
