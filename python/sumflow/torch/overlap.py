"""Crossing the global barrier (ByteScheduler §3.4): layer-wise out-of-engine dependencies.

PyTorch's training loop has a global barrier: ``optimizer.step()`` waits for every
gradient's average before any parameter is updated, so the next forward cannot start
before the last sum has arrived, and the order in which sums travel hardly matters.
Here ``step()`` only hands each parameter's pending push_pull to an *update thread* and
returns. That thread waits for the sums in priority order (the order the network sends
them) and updates each parameter as soon as its own sum is there. The dependency the
barrier enforced (the forward of a layer reads its parameters after their update) is
enforced per layer instead: a forward pre-hook on every module waits until that module's
own parameters (``recurse=False``) are updated. So the forward of the first layers, whose
sums go first, overlaps the sums of the later layers.

Every wait is bounded by the job's timeout (``SUMFLOW_TIMEOUT``) and names the parameters,
the push_pull handle and what the update thread is doing. An error on the update thread
stops it and is raised again, with its original type and message, by the next wait of the
main thread (forward pre-hook, step, zero_grad, synchronize, state_dict).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from sumflow import SumflowTimeoutError
from sumflow.torch import trace


@dataclass
class Update:
    """One parameter's update of one step."""

    param: torch.Tensor
    #: The push_pull handle of its gradient, and the tensor name it was sent under.
    handle: int
    tensor: str
    #: Waits for that push_pull (shared by the parameters of one fused span).
    wait: Callable[[], None]
    #: The number of the ``step()`` call that issued it (1 = the first).
    step: int
    #: Updates the parameter once its averaged gradient is in ``param.grad``.
    apply: Callable[[], None]
    #: The CUDA stream that was current when ``step()`` was called, so the update is
    #: ordered before the forward that reads the parameter (None on the CPU).
    stream: torch.cuda.Stream | None


@dataclass
class _Failure:
    error: BaseException
    traceback: TracebackType | None


class CrossBarrier:
    """The update thread and the per-module forward pre-hooks of one optimizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        names: dict[torch.Tensor, str],
        timeout: Callable[[], float],
    ) -> None:
        """Hooks every module of `model` that owns some of `names`' parameters. Every
        parameter must be owned by a module of `model`: nothing would wait for the update
        of another. `timeout()` is the longest wait, in seconds."""
        self._names = names
        self._timeout = timeout
        self._cond = threading.Condition()
        self._pending: dict[torch.Tensor, Update] = {}
        self._queue: deque[Update] = deque()
        self._zero_after: dict[torch.Tensor, bool] = {}
        self._draining = False
        #: What the update thread is doing, for timeout messages.
        self._doing: str | None = None
        self._failure: _Failure | None = None
        owned: set[torch.Tensor] = set()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for module_name, module in model.named_modules():
            own = [p for p in module.parameters(recurse=False) if p in names]
            if not own:
                continue
            owned.update(own)
            waiter = f"the forward of module '{module_name or type(module).__name__}'"
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(waiter, own)))
        for p in names:
            # Before autograd accumulates into the gradient the update may still read.
            self._handles.append(p.register_hook(self._gradient_hook(p)))
        orphans = [name for p, name in names.items() if p not in owned]
        if orphans:
            for h in self._handles:
                h.remove()
            raise ValueError(
                f"cross_barrier: parameters {orphans[:5]} (of {len(orphans)}) belong to no "
                "module of `model`, so no forward would wait for their update; pass the "
                "module (e.g. a ModuleList of all models) whose forward uses every parameter "
                "the optimizer updates"
            )
        self._handles.append(
            model.register_state_dict_pre_hook(
                lambda *_: self.wait_all("model.state_dict()")  # module, prefix, keep_vars
            )
        )

    def _pre_hook(
        self, waiter: str, own: list[torch.Tensor]
    ) -> Callable[[torch.nn.Module, Any], None]:
        def before_forward(module: torch.nn.Module, args: Any) -> None:
            self.wait(own, waiter)

        return before_forward

    def _gradient_hook(self, param: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def before_accumulation(grad: torch.Tensor) -> None:
            self.check_gradient(param)

        return before_accumulation

    def wait(self, params: list[torch.Tensor], waiter: str) -> None:
        """Waits until none of `params` has an update pending."""
        # Only the main thread adds pending updates, so an empty table seen here stays
        # empty: the common case (everything long updated) takes no lock.
        if not self._pending and self._failure is None:
            return
        self._wait_until(lambda: [self._pending[p] for p in params if p in self._pending], waiter)

    def wait_all(self, waiter: str) -> None:
        """Waits until every pending update is done."""
        if not self._pending and self._failure is None:
            return
        self._wait_until(lambda: list(self._pending.values()), waiter)

    def _wait_until(self, late: Callable[[], list[Update]], waiter: str) -> None:
        timeout = self._timeout()
        deadline = time.monotonic() + timeout
        with self._cond:
            self.raise_failure()
            if not late():
                return
            # The GPU idles here: the trace shows it as a wait.
            with trace.span("waits", waiter):
                while True:
                    self.raise_failure()
                    waiting_for = late()
                    if not waiting_for:
                        return
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise SumflowTimeoutError(
                            self._timeout_message(waiter, waiting_for, timeout)
                        )
                    self._cond.wait(left)

    def _timeout_message(self, waiter: str, late: list[Update], timeout: float) -> str:
        shown = ", ".join(
            f"'{self._names[u.param]}' (step {u.step}, push_pull handle {u.handle} of '{u.tensor}')"
            for u in late[:4]
        )
        more = f" and {len(late) - 4} more" if len(late) > 4 else ""
        return (
            f"{waiter} waited {timeout:g} s (SUMFLOW_TIMEOUT) for the cross-barrier update "
            f"of {shown}{more}; the update thread is {self._doing or 'not running'}"
        )

    def submit(self, updates: list[Update]) -> None:
        """Queues `updates` (in the order given) for the update thread. None of their
        parameters may have an update pending (``wait_all()`` first)."""
        with self._cond:
            self.raise_failure()
            self._pending.update((u.param, u) for u in updates)
            self._queue.extend(updates)
            if updates and not self._draining:
                self._draining = True
                # Started per burst of work and gone when the queue is empty, so an idle
                # optimizer holds no thread. Daemon: a script that ends without
                # synchronize() must not hang on a peer that stopped pushing.
                threading.Thread(
                    target=self._drain, name="sumflow-cross-barrier", daemon=True
                ).start()

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._draining = False
                    self._doing = None
                    return
                u = self._queue.popleft()
                name = self._names[u.param]
                self._doing = f"waiting for the sum of '{name}' (handle {u.handle})"
            try:
                with _on_stream(u.stream):
                    u.wait()
                    with self._cond:
                        self._doing = f"running the optimizer for '{name}'"
                    with trace.span("cross-barrier updates", name, step=u.step):
                        u.apply()
                    # Under the lock, with marking it done: a zero_grad() in between would
                    # otherwise be lost.
                    with self._cond:
                        set_to_none = self._zero_after.pop(u.param, None)
                        if set_to_none is not None:
                            zero_grad_of(u.param, set_to_none)
                        del self._pending[u.param]
                        self._cond.notify_all()
            except BaseException as e:
                note = getattr(e, "add_note", None)
                if note is not None:  # Python >= 3.11
                    note(
                        f"raised on sumflow's cross-barrier update thread by the update of "
                        f"'{name}' (step {u.step}, push_pull handle {u.handle}); the "
                        "optimizer stops here and every later wait raises this again"
                    )
                with self._cond:
                    self._failure = _Failure(e, e.__traceback__)
                    self._queue.clear()
                    self._draining = False
                    self._doing = f"stopped by {type(e).__name__} in the update of '{name}'"
                    self._cond.notify_all()
                return

    def raise_failure(self) -> None:
        """Raises the update thread's error, if it had one."""
        failure = self._failure
        if failure is not None:
            raise failure.error.with_traceback(failure.traceback)

    def check_gradient(self, param: torch.Tensor) -> None:
        """Called when autograd is about to accumulate a gradient into `param`: if its
        update is still pending, the forward read the parameter before the update (outside
        the forward of the module that owns it)."""
        self.raise_failure()
        late = self._pending.get(param)
        if late is not None:
            raise RuntimeError(
                f"a gradient of '{self._names[param]}' was computed while its cross-barrier "
                f"update of step {late.step} was still pending: the parameter was read "
                "outside the forward of the module that owns it (e.g. a weight tied into "
                "another module's forward), so that forward used its old value. Call "
                "optimizer.synchronize() before such a forward, or use "
                "DistributedOptimizer without cross_barrier"
            )

    def defer_zero_grad(self, set_to_none: bool) -> set[torch.Tensor]:
        """Marks every parameter whose update is pending to have its gradient cleared
        right after the update (it still needs the gradient); returns those parameters.
        The caller clears the others."""
        with self._cond:
            self.raise_failure()
            for p in self._pending:
                self._zero_after[p] = set_to_none
            return set(self._pending)


def once(wait: Callable[[], object]) -> Callable[[], None]:
    """`wait`, run by the first call only: the parameters of a fused span share one
    push_pull, whose handle can be synchronized once. Only the update thread calls it."""
    done = False

    def wait_once() -> None:
        nonlocal done
        if not done:
            wait()
            done = True

    return wait_once


def zero_grad_of(param: torch.Tensor, set_to_none: bool) -> None:
    """Clears one parameter's gradient as ``Optimizer.zero_grad`` does."""
    if param.grad is None:
        return
    if set_to_none:
        param.grad = None
        return
    if param.grad.grad_fn is not None:
        param.grad.detach_()
    else:
        param.grad.requires_grad_(False)
    param.grad.zero_()


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield
