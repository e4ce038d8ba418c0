"""Where a cluster job runs: host lists (``-H``), host files (``--hostfile``), a Slurm
allocation's nodes, and ``HOST:PORT`` addresses, IPv6 ones in brackets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sumflow.jobenv.hostlist import expand_hostlist, expand_tasks_per_node
from sumflow.launcher.errors import ConfigError


@dataclass(frozen=True)
class Host:
    """A cluster machine: the name ssh reaches it by, and how many workers it runs."""

    name: str
    slots: int

    @property
    def address(self) -> str:
        """The host without any ``user@``: its identity and the address servers advertise."""
        return self.name.rsplit("@", 1)[-1]


def parse_host_entry(item: str, where: str) -> tuple[Host, bool]:
    """``host``, ``host:slots`` or ``[v6addr]:slots`` (``where`` names the source); also
    says whether the slots were given."""
    item = item.strip()
    slots_text: str | None = None
    if item.startswith("["):
        end = item.find("]")
        if end < 0:
            raise ConfigError(f"{where}: missing ']' in {item!r}")
        name, rest = item[1:end], item[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ConfigError(f"{where}: expected ':SLOTS' after ']' in {item!r}")
            slots_text = rest[1:]
    elif item.count(":") == 1:
        name, slots_text = item.split(":")
    else:
        name = item
    if not name:
        raise ConfigError(f"{where}: empty host name in {item!r}")
    slots = 1 if slots_text is None else _slots(slots_text, name, where)
    return Host(name, slots), slots_text is not None


def _slots(text: str, name: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise ConfigError(f"{where}: slots of {name} must be a number, got {text!r}") from None
    if slots < 1:
        raise ConfigError(f"{where}: {name} needs at least 1 slot, got {slots}")
    return slots


def parse_hosts(text: str) -> list[Host]:
    """The value of ``-H``: ``host1:slots,host2:slots``."""
    hosts = []
    for item in text.split(","):
        if not item.strip():
            raise ConfigError(f"-H {text!r}: empty host entry")
        hosts.append(parse_host_entry(item, f"-H {text!r}")[0])
    return _no_duplicates(hosts, "-H")


def parse_hostfile(text: str, path: str) -> list[Host]:
    """A host file: lines ``host slots=N`` or ``host:N`` or ``host``; ``#`` comments."""
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{lineno}"
        first, *fields = line.split()
        host, explicit = parse_host_entry(first, where)
        for f in fields:
            key, eq, value = f.partition("=")
            if key != "slots" or not eq:
                raise ConfigError(f"{where}: unknown field {f!r} (expected slots=N)")
            if explicit:
                raise ConfigError(f"{where}: slots given twice for {host.name}")
            host, explicit = Host(host.name, _slots(value, host.name, where)), True
        hosts.append(host)
    if not hosts:
        raise ConfigError(f"--hostfile {path}: no hosts in it")
    return _no_duplicates(hosts, f"--hostfile {path}")


def slurm_hosts(env: Mapping[str, str]) -> list[Host] | None:
    """The nodes of the Slurm allocation this runs in (``salloc``, ``sbatch``), with its
    tasks per node as slots: ``SLURM_JOB_NODELIST`` (else ``SLURM_NODELIST``) and
    ``SLURM_TASKS_PER_NODE``. None outside an allocation, and in one of a single node when
    this is that node (``SLURMD_NODENAME``): the job then runs on this machine alone."""
    for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        text = env.get(name, "").strip()
        if text:
            break
    else:
        return None
    try:
        nodes = expand_hostlist(text, name)
        tasks = env.get("SLURM_TASKS_PER_NODE", "").strip()
        if not tasks:
            raise ValueError(
                f"{name}={text} without SLURM_TASKS_PER_NODE: give the hosts with -H or --hostfile"
            )
        slots = expand_tasks_per_node(tasks, "SLURM_TASKS_PER_NODE")
    except ValueError as e:
        raise ConfigError(f"the Slurm allocation: {e}") from None
    if len(slots) != len(nodes) or min(slots) < 1:
        raise ConfigError(
            f"the Slurm allocation: SLURM_TASKS_PER_NODE={tasks} does not give each of the "
            f"{len(nodes)} nodes of {name}={text} one task or more"
        )
    if len(nodes) == 1 and env.get("SLURMD_NODENAME", "").strip() == nodes[0]:
        return None
    return _no_duplicates([Host(n, s) for n, s in zip(nodes, slots, strict=True)], name)


def _no_duplicates(hosts: list[Host], where: str) -> list[Host]:
    seen: set[str] = set()
    for h in hosts:
        if h.address in seen:
            raise ConfigError(f"{where}: host {h.address} is listed twice")
        seen.add(h.address)
    return hosts


def split_host_port(text: str, what: str, port_required: bool = True) -> tuple[str, int | None]:
    """``host:port`` or ``[v6]:port`` (port optional unless ``port_required``)."""
    if text.startswith("["):
        end = text.find("]")
        rest = text[end + 1 :]
        if end < 0 or (rest and not rest.startswith(":")):
            raise ConfigError(f"{what} {text!r}: expected HOST:PORT")
        host, port_text = text[1:end], (rest[1:] if rest else None)
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" not in text:
        host, port_text = text, None
    else:
        raise ConfigError(f"{what} {text!r}: write IPv6 addresses as [ADDR]:PORT")
    if not host:
        raise ConfigError(f"{what} {text!r}: no host")
    if port_text is None:
        if port_required:
            raise ConfigError(f"{what} {text!r}: expected HOST:PORT")
        return host, None
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{what} {text!r}: the port must be a number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{what} {text!r}: the port must be 0 to 65535")
    return host, port


def join_host_port(host: str, port: int) -> str:
    """``host:port``, bracketing IPv6 addresses."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
