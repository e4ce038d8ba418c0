"""Commands run on other hosts over ssh, and how they end with the job."""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from sumflow import settings
from sumflow.launcher.errors import PROG
from sumflow.launcher.plan import Plan, ProcSpec

#: Run on the remote side of every ssh command. Arguments: the directory to work in, then
#: the command. It reads one line from stdin first: the job token, or an empty line when
#: the job uses a token file. The command then runs with stdin from /dev/null while the
#: shell keeps reading the rest of stdin; when that reaches end of file (the launcher
#: stopped the job, died, or its ssh connection dropped) it sends SIGTERM to the command,
#: so no process outlives its job on a remote host. The exit status is the command's.
REMOTE_WRAPPER = (
    'cd "$1" 2>/dev/null; shift; '
    "IFS= read -r t || exit 255; "
    'if [ -n "$t" ]; then SUMFLOW_JOB_TOKEN=$t; export SUMFLOW_JOB_TOKEN; fi; t=; '
    "exec 3<&0; "
    '"$@" </dev/null 3<&- & c=$!; '
    '{ while read -r _; do :; done <&3; kill -TERM "$c" 2>/dev/null; } & w=$!; '
    "exec 3<&-; "
    'wait "$c"; s=$?; kill "$w" 2>/dev/null; exit "$s"'
)


def remote_command(spec: ProcSpec, cwd: str) -> str:
    """The command line ssh runs on ``spec.host``: REMOTE_WRAPPER around
    ``env VAR=VALUE ... argv``, quoted for a POSIX shell."""
    assignments = [f"{k}={v}" for k, v in spec.env.items()]
    return shlex.join(["sh", "-c", REMOTE_WRAPPER, PROG, cwd, "env", *assignments, *spec.argv])


#: The variables of this environment every remote process gets, as horovodrun forwards
#: them: where programs and Python modules are found (an activated virtualenv included, by
#: its PATH and VIRTUAL_ENV) and the libraries they load.
FORWARDED = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")


def remote_env(plan: Plan, spec: ProcSpec, local_env: Mapping[str, str]) -> dict[str, str]:
    """The variables ``spec`` runs with on its host: :data:`FORWARDED` ones set in
    ``local_env``, the programs' log level, the spec's own variables (``-x`` ones included,
    which override the forwarded ones) and, with ``--token-file``, where the token file is.
    Nothing else of ``local_env`` crosses."""
    env = {name: local_env[name] for name in FORWARDED if name in local_env}
    env.update({"RUST_LOG": plan.rust_log, **spec.env})
    if plan.token_file is not None:
        env[settings.JOB_TOKEN_FILE.name] = str(plan.token_file)
    return env


def ssh_argv(plan: Plan, spec: ProcSpec, cwd: str, local_env: Mapping[str, str]) -> list[str]:
    """The local command that runs ``spec`` on its host through ``plan``'s ssh, in ``cwd``,
    with :func:`remote_env`."""
    assert spec.host is not None, f"{spec.name} runs on this machine, not over ssh"
    remote = ProcSpec(spec.name, spec.kind, spec.argv, remote_env(plan, spec, local_env), spec.host)
    return [*plan.ssh, spec.host, remote_command(remote, cwd)]


def first_line(plan: Plan, token: str) -> bytes:
    """What the launcher writes to an ssh child's stdin first, for REMOTE_WRAPPER: the job
    token, or an empty line when every host reads the token file instead."""
    return ("" if plan.token_file is not None else token).encode() + b"\n"
