"""Horovod's elastic API (``hvd.elastic``) on sumflow: training that goes on when workers
fail, leave or join.

Run the script with ``sumflow-run --min-np N`` (or ``--max-np``,
``--host-discovery-script``), wrap the training function in :func:`run` and keep what it
needs in a :class:`TorchState`::

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)

When a worker fails the others' collectives raise (``NodeFailedError``, a timeout); ``run``
goes back to the last commit, leaves the broken membership, takes its place in the next
one from the launcher, gives everyone rank 0's state and calls the function again. Workers
that start later join at the next ``commit()``, which interrupts every worker at once
(``HostsUpdatedInterrupt``). Each membership is a job of its own (fresh coordinator and
summation servers), so no sum mixes two memberships. docs/elastic.md has the details.
Outside an elastic job ``run`` syncs once and calls the function; failures end the job.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sumflow import DeclarationMismatchError, SumflowError
from sumflow.torch import _runtime
from sumflow.torch.elastic.sampler import ElasticSampler
from sumflow.torch.elastic.state import HostsUpdatedInterrupt, ObjectState, State, TorchState

__all__ = [
    "ElasticSampler",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "run",
]

#: Failures in a row, with no commit in between, after which ``run`` gives up: training
#: that cannot get from one commit to the next is not recovering.
MAX_RESETS_WITHOUT_COMMIT = 5

R = TypeVar("R")


def _say(text: str) -> None:
    print(f"sumflow elastic: {text}", file=sys.stderr, flush=True)


def _recoverable(error: BaseException) -> bool:
    """Whether a membership change can cure `error`: a failed or stalled peer or
    coordinator, not a mistake in the script (tensors declared differently)."""
    return isinstance(error, SumflowError) and not isinstance(error, DeclarationMismatchError)


def _next_membership() -> None:
    """Leaves the current membership and joins the next (blocks until the launcher has
    formed it; exits the process when this worker is not part of it)."""
    import sumflow.torch as hvd

    # The membership is broken: leaving it cannot be clean.
    with contextlib.suppress(SumflowError):
        hvd.shutdown()
    hvd.init()


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Wraps a training function ``func(state, *args, **kwargs)`` so that it survives
    changes of membership (see the module docs)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        if not isinstance(state, State):
            raise TypeError(
                f"{func.__name__}: the first argument of an elastic.run function is its "
                f"state (a sumflow.torch.elastic.State), not {type(state).__name__}"
            )
        elastic = _runtime.elastic_client() is not None
        failures: list[str] = []
        commits = state.commits
        skip_sync = False
        began: float | None = None
        while True:
            try:
                if not skip_sync:
                    state.sync()
                if began is not None:
                    now = _runtime.current()
                    _say(
                        f"resumed in epoch {now.epoch} as worker {now.service.rank} of "
                        f"{now.service.size}, {time.monotonic() - began:.2f} s after the "
                        "interruption"
                    )
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                reason = "the membership changes at this commit (workers join or leave)"
                skip_sync = e.skip_sync
            except Exception as e:
                if not (elastic and _recoverable(e)):
                    raise
                if state.commits != commits:
                    failures.clear()
                commits = state.commits
                failures.append(f"{type(e).__name__}: {e}")
                if len(failures) > MAX_RESETS_WITHOUT_COMMIT:
                    raise RuntimeError(
                        f"{len(failures)} failures in a row without a commit in between; "
                        f"giving up. The last: {failures[-1]}"
                    ) from e
                reason = f"{failures[-1]}; back to commit {state.commits}"
                state.restore()
                skip_sync = False
            began = time.monotonic()
            rt = _runtime.running()
            where = f"epoch {rt.epoch}" if rt is not None else "the job"
            _say(f"leaving {where}: {reason}")
            _next_membership()
            state.on_reset()

    return wrapper
