"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation"), Horovod's
``op=hvd.Adasum``: tensors combined pairwise so that what two workers' gradients share is
counted once and what is orthogonal is added.

Two tensors combine as ``(1 - a·b / 2|a|²) a + (1 - a·b / 2|b|²) b``: their sum when
they are orthogonal, their average when they are equal. N workers (a power of two, as in
Horovod) combine along a binary tree over their ranks: 0 with 1 and 2 with 3, then those
two results, and so on. Dot products and norms are taken in float64, the combination in
float32 (float64 for float64 tensors), per tensor.

sumflow's servers add; they cannot form this. Each worker therefore gathers every
member's tensor (the allgather's path: each tensor kept on its holder's machine, pulled
once by the others) and combines the tree itself, the same operations in the same order
on every worker, so all end bit-for-bit equal. That moves N times a tensor's bytes to each
worker instead of twice: fine for the jobs of 2-16 workers Adasum is used with, not a
substitute for Average at hundreds.

``DistributedOptimizer(..., op=Adasum)`` is Horovod's delta optimizer: each parameter is
updated by the wrapped optimizer alone as soon as its gradient is ready, the update (new
value less the old) is combined by Adasum, and the parameter becomes the old value plus
the combined update at ``step()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from sumflow.torch import _work, negotiate, ops, per_parameter, process_sets, relay
from sumflow.torch.compression import Compression, Compressor

#: What Adasum combines: floating-point tensors.
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two flat tensors of the working dtype (float32 or float64)."""
    wide_a, wide_b = a.double(), b.double()
    dot = float(torch.dot(wide_a, wide_b))
    norm_a = float(torch.dot(wide_a, wide_a))
    norm_b = float(torch.dot(wide_b, wide_b))
    # A zero tensor adds nothing, and the other passes unchanged.
    coef_a = 1.0 - dot / (2.0 * norm_a) if norm_a > 0.0 else 1.0
    coef_b = 1.0 - dot / (2.0 * norm_b) if norm_b > 0.0 else 1.0
    return a * coef_a + b * coef_b


def combine(rows: torch.Tensor) -> torch.Tensor:
    """Adasum of the rows of `rows` (one flat tensor per worker, in rank order; their
    count a power of two) along the binary tree over ranks, in `rows`' dtype."""
    count = rows.shape[0]
    if count < 1 or count & (count - 1):
        raise ValueError(f"Adasum combines a power-of-two number of tensors, not {count}")
    work = torch.float64 if rows.dtype == torch.float64 else torch.float32
    level = list(rows.to(work).unbind(0))
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0].to(rows.dtype)


def check(name: str, tensor: torch.Tensor, members: int, compression: Any) -> None:
    """Refuses what Adasum cannot combine, before anything is sent."""
    if tensor.dtype not in FLOATS:
        raise TypeError(
            f"'{name}': op=Adasum combines float16, bfloat16, float32 and float64 tensors, "
            f"not {tensor.dtype}"
        )
    if members & (members - 1):
        raise ValueError(
            f"'{name}': op=Adasum needs a power-of-two number of workers (as in Horovod), "
            f"and this one has {members}"
        )
    if compression is not Compression.none:
        raise ValueError(
            f"'{name}': op=Adasum gathers tensors as they are; it takes no compression "
            f"(given {getattr(compression, '__name__', compression)!r})"
        )


def combined_work(
    name: str,
    tensors: list[torch.Tensor],
    prescale_factor: float,
    postscale_factor: float,
    group: process_sets.Group,
    single: bool,
) -> _work.CoreWork:
    """The data stage of an agreed Adasum of each of `tensors` over the group's workers:
    every member's tensors gathered, then combined here; the work's result is the list of
    combined tensors, each shaped and placed as its input."""
    flats = [t.detach().reshape(1, -1) for t in tensors]
    counts = [[1] * len(flats)] * group.size
    outs, regions = relay.gathered(name, flats, counts, group, single)

    def finish() -> list[torch.Tensor]:
        results = []
        for gathered, t in zip(outs, tensors, strict=True):
            scaled = gathered if prescale_factor == 1.0 else gathered * prescale_factor
            result = combine(scaled)
            if postscale_factor != 1.0:
                result = result * postscale_factor
            results.append(result.reshape(t.shape).to(t.device))
        return results

    return relay.relay_work(name, regions, finish)


def allreduce_async_(
    tensor: torch.Tensor,
    name: str,
    group: process_sets.Group,
    prescale_factor: float,
    postscale_factor: float,
    request: negotiate.Request,
) -> int:
    """Starts combining `tensor` by Adasum over the group's workers, in place (the
    agreement `request` already names it); returns the handle."""

    def write_back(results: list[torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            tensor.copy_(results[0])
        return tensor

    def start(rows: list[negotiate.Row]) -> _work.Work:
        scales = (prescale_factor, postscale_factor)
        return combined_work(name, [tensor], *scales, group, True).then(write_back)

    return ops.negotiated(request, group, start)


class AdasumOptimizer(torch.optim.Optimizer):
    """The methods ``DistributedOptimizer(..., op=Adasum)`` adds to the wrapped optimizer
    (see the module's note)."""

    _sf_base: type[torch.optim.Optimizer]
    _sf_names: dict[torch.Tensor, str]
    _sf_passes: int
    _sf_counts: dict[torch.Tensor, int]
    _sf_starts: dict[torch.Tensor, torch.Tensor]
    _sf_handles: dict[torch.Tensor, int]
    _sf_process_set: Any
    _sf_local: bool
    _sf_hooks: list[Any]
    _sf_skip: bool

    def _sf_adasum_setup(
        self,
        base: type[torch.optim.Optimizer],
        names: dict[torch.Tensor, str],
        backward_passes_per_step: int,
        process_set: Any,
        local: bool,
    ) -> None:
        self._sf_base = base
        self._sf_names = names
        self._sf_passes = backward_passes_per_step
        self._sf_counts = {}
        self._sf_starts = {}
        self._sf_handles = {}
        self._sf_process_set = process_set
        self._sf_local = local
        self._sf_skip = False
        self._sf_hooks = [
            p.register_post_accumulate_grad_hook(self._sf_grad_ready) for p in self._sf_trainable()
        ]

    def _sf_trainable(self) -> Iterator[torch.Tensor]:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    yield p

    def _sf_grad_ready(self, p: torch.Tensor) -> None:
        self._sf_counts[p] = self._sf_counts.get(p, 0) + 1
        if self._sf_counts[p] >= self._sf_passes and p not in self._sf_handles:
            self._sf_send(p)

    def _sf_place(self, p: torch.Tensor) -> tuple[dict[str, Any], int]:
        """The hyper-parameters of `p`'s group as they are now, and its index there."""
        for group in self.param_groups:
            for index, q in enumerate(group["params"]):
                if q is p:
                    return per_parameter.hyperparameters(group), index
        raise ValueError(f"parameter '{self._sf_names[p]}' is in none of the optimizer's groups")

    def _sf_send(self, p: torch.Tensor) -> None:
        """Updates `p` alone and starts combining the update (the new value less the old)
        across workers; ``p`` holds the update until ``synchronize``."""
        hyper, index = self._sf_place(p)
        start = self._sf_starts.get(p)
        if start is None:
            start = self._sf_starts[p] = torch.empty_like(p, requires_grad=False)
        with torch.no_grad():
            start.copy_(p)
            per_parameter.step_one(self._sf_base, self.__dict__, p, hyper, index, self._sf_names[p])
            if self._sf_local:
                self._sf_handles[p] = -1
                return
            p.sub_(start)
        try:
            self._sf_handles[p] = ops.allreduce_async_(
                p.data,
                name=f"DistributedOptimizer.adasum.{self._sf_names[p]}",
                op=ops.Adasum,
                process_set=self._sf_process_set,
            )
        except BaseException:
            # The parameter keeps its locally updated value rather than the bare update.
            with torch.no_grad():
                p.add_(start)
            raise

    def synchronize(self) -> None:
        """Waits for every update sent and applies the combined ones; a parameter whose
        gradient never came is updated (with nothing, unless its state moves it) and sent
        now, as every worker must send every parameter."""
        for p in self._sf_trainable():
            if p not in self._sf_handles:
                self._sf_send(p)
        handles, self._sf_handles = self._sf_handles, {}
        self._sf_counts.clear()
        pending = [(p, h) for p, h in handles.items() if h >= 0]
        applied = 0
        try:
            for p, handle in pending:
                ops.synchronize(handle)
                with torch.no_grad():
                    p.add_(self._sf_starts[p])
                applied += 1
        except BaseException:
            # A failed combination (a peer lost) leaves every parameter still holding its
            # bare update at its locally updated value, not at the update alone.
            with torch.no_grad():
                for p, _ in pending[applied:]:
                    p.add_(self._sf_starts[p])
            raise

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's idiom after an explicit ``synchronize()``: ``step()`` inside it only
        evaluates the closure (the updates were applied by ``synchronize``)."""
        self._sf_skip = True
        try:
            yield
        finally:
            self._sf_skip = False

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        if not self._sf_skip:
            self.synchronize()
        return loss


def check_optimizer(
    optimizer: torch.optim.Optimizer,
    compression: type[Compressor] | Compressor,
    backward_passes_per_step: int,
    process_set: Any,
) -> bool:
    """Refuses an optimizer Adasum cannot wrap; returns whether this worker is outside the
    process set (then it steps on its own, as in Horovod)."""
    per_parameter.check_separable(optimizer)
    if compression is not Compression.none:
        raise ValueError(
            "DistributedOptimizer(op=Adasum) combines the updates as they are: it takes no "
            f"compression (given {getattr(compression, '__name__', compression)!r})"
        )
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, not {backward_passes_per_step}")
    if isinstance(process_set, process_sets.ProcessSet) and not process_set.included():
        return True
    group = process_sets.group_of(process_set, "DistributedOptimizer")
    for g in optimizer.param_groups:
        for p in g["params"]:
            check("DistributedOptimizer(op=Adasum)", p, group.size, Compression.none)
    return False
