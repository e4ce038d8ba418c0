"""The rendezvous file of a one-machine job (:func:`sumflow.jobenv.coordinator.locate`):
rank 0 publishes the coordinator's address and the job token in it, the others wait for it.

The file lives in a directory only this user can enter (mode 0700, checked by both sides),
because it holds the token. It is written whole (a private temporary file renamed over
it), so a reader never sees half of it, and it names the process that wrote it: a file
whose writer is gone is a crashed job's, and readers ignore it. Rank 0 removes it when it
leaves the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from pathlib import Path


def _private_dir(directory: Path) -> None:
    """Creates ``directory`` (mode 0700) unless it exists; fails unless it is a directory
    of this user's that no one else can enter."""
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    st = directory.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(
            f"{directory} must be a directory of this user's that no one else can enter "
            "(mode 0700), because it holds job tokens: remove it, or set TMPDIR to "
            "another directory on every process"
        )


def publish(path: Path, address: str, token: str) -> None:
    """Writes ``path`` atomically: the coordinator's ``address``, the job ``token`` and this
    process's id."""
    _private_dir(path.parent)
    text = json.dumps({"address": address, "token": token, "pid": os.getpid()})
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(partial, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read(path: Path) -> tuple[str, str] | None:
    """(address, token) from ``path``, or None while it is missing or its writer is gone."""
    try:
        published = json.loads(path.read_text())
        pid, address, token = int(published["pid"]), published["address"], published["token"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"the rendezvous file {path} cannot be read: {e!r}") from None
    if not _alive(pid):
        return None
    return str(address), str(token)


def await_published(path: Path, timeout: float, hint: str) -> tuple[str, str]:
    """Polls ``path`` until rank 0 has published; (address, token). After ``timeout``
    seconds, TimeoutError naming the file and ``hint`` (what to check or set)."""
    _private_dir(path.parent)
    deadline = time.monotonic() + timeout
    while True:
        found = read(path)
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank 0 did not publish the coordinator's address in {path} within "
                f"{timeout:g} s (SUMFLOW_JOIN_TIMEOUT): {hint}"
            )
        time.sleep(0.05)


def withdraw(path: Path) -> None:
    """Removes ``path`` if this process published it."""
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
        if json.loads(path.read_text())["pid"] == os.getpid():
            path.unlink()
