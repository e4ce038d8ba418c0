"""Tuned configurations persisted across runs, keyed by what makes them valid.

A configuration tuned for one model on one cluster says little about another: the best
partition size depends on the tensor sizes, and the best credit on the number of workers
and servers and on the scheduler (ByteScheduler §6.3, Table 1). So each result is stored
under a key made of the model's tensor declarations (names, dtypes, sizes, in priority
order), the numbers of workers, worker machines and servers, and the scheduler. A later
run with the same key applies the stored configuration without tuning; any difference
means tuning again. What the key cannot see (a faster network, a new sumflow) needs
``SUMFLOW_AUTOTUNE=retune``.

The file is JSON, one entry per key (docs/autotune.md shows one); writers take a lock
and replace it atomically, so concurrent jobs sharing a cache keep each other's entries.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sumflow import settings
from sumflow.tune.space import Configuration

FORMAT = "sumflow-autotune"
VERSION = 1

#: How long a writer waits for another to finish with the file, in seconds.
LOCK_TIMEOUT = 30.0


def default_path() -> Path:
    """``SUMFLOW_AUTOTUNE_FILE``, else ``$XDG_CACHE_HOME/sumflow/autotune.json`` (XDG's
    default cache directory is ``~/.cache``)."""
    explicit = settings.AUTOTUNE_FILE.read()
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "sumflow" / "autotune.json"


@dataclass(frozen=True)
class TuningKey:
    """What a tuned configuration is valid for."""

    #: (name, dtype, bytes) of every tensor the optimizer sums, in priority order.
    tensors: tuple[tuple[str, str, int], ...]
    workers: int
    worker_machines: int
    servers: int
    scheduler: str
    #: Whether the optimizer fuses gradients (its configurations carry a threshold).
    fusion: bool = False

    def to_json(self) -> dict[str, Any]:
        listing = "\n".join(f"{n}\t{d}\t{b}" for n, d, b in self.tensors).encode()
        # Named only when set, so keys stored before fusion existed keep their digests.
        fused = {"fusion": True} if self.fusion else {}
        return {
            **fused,
            "tensors_sha256": hashlib.sha256(listing).hexdigest(),
            "tensors": len(self.tensors),
            "model_bytes": sum(b for _, _, b in self.tensors),
            "largest_tensor_bytes": max((b for _, _, b in self.tensors), default=0),
            "workers": self.workers,
            "worker_machines": self.worker_machines,
            "servers": self.servers,
            "scheduler": self.scheduler,
        }

    def digest(self) -> str:
        """A short stable name for this key (the entry's name in the file)."""
        canonical = json.dumps(self.to_json(), sort_keys=True).encode()
        return hashlib.sha256(canonical).hexdigest()[:16]


@dataclass(frozen=True)
class TunedResult:
    """A finished tuning: the best configuration and how it was found."""

    best: Configuration
    score_s: float
    trials: int
    method: str
    #: The configuration the job started with and its score, when it was measured.
    baseline: Configuration | None = None
    baseline_score_s: float | None = None
    tuned_at: str = ""
    trial_log: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "best": self.best.to_json(),
            "score_s": self.score_s,
            "trials": self.trials,
            "method": self.method,
            "baseline": self.baseline.to_json() if self.baseline else None,
            "baseline_score_s": self.baseline_score_s,
            "tuned_at": self.tuned_at
            or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "trial_log": self.trial_log,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TunedResult:
        baseline = data.get("baseline")
        return cls(
            best=Configuration.from_json(data["best"]),
            score_s=float(data["score_s"]),
            trials=int(data["trials"]),
            method=str(data["method"]),
            baseline=Configuration.from_json(baseline) if baseline else None,
            baseline_score_s=data.get("baseline_score_s"),
            tuned_at=str(data.get("tuned_at", "")),
            trial_log=str(data.get("trial_log", "")),
        )


class TuningStore:
    """The JSON file of tuned configurations at `path`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def _read(self) -> dict[str, Any]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise ValueError(f"cannot read the autotune file {self.path}: {e}") from None
        fix = "delete it, or point SUMFLOW_AUTOTUNE_FILE elsewhere, and tuning starts afresh"
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the autotune file {self.path} is not JSON ({e}): {fix}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{self.path} is not a sumflow autotune file: {fix}")
        if data.get("version") != VERSION:
            raise ValueError(
                f"{self.path} has version {data.get('version')!r}; this sumflow reads "
                f"version {VERSION}: {fix}"
            )
        entries = data.get("entries")
        if not isinstance(entries, dict):
            raise ValueError(f"{self.path} has no 'entries' object: {fix}")
        return entries

    def load(self, key: TuningKey) -> TunedResult | None:
        """The stored result for `key`, or None."""
        entry = self._read().get(key.digest())
        if entry is None:
            return None
        try:
            return TunedResult.from_json(entry)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"the autotune file {self.path} has a bad entry {key.digest()} ({e}): delete "
                "the entry or the file, or tune again with SUMFLOW_AUTOTUNE=retune"
            ) from None

    def save(self, key: TuningKey, result: TunedResult) -> None:
        """Stores `result` under `key`, keeping every other entry."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            entries = self._read()
            entries[key.digest()] = {"key": key.to_json(), **result.to_json()}
            payload = json.dumps(
                {"format": FORMAT, "version": VERSION, "entries": entries}, indent=2
            )
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(payload + "\n")
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        lock_path = self.path.with_name(self.path.name + ".lock")
        deadline = time.monotonic() + LOCK_TIMEOUT
        with open(lock_path, "w") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"could not lock {lock_path} within {LOCK_TIMEOUT:.0f} s: another "
                            "process holds it while writing the autotune file"
                        ) from None
                    time.sleep(0.05)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
