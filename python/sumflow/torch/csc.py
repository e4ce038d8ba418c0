"""Coarse-grained sparse communication (CSC, GradientFlow §3.2 and its Algorithm 1).

The gradients of all parameters form one flat pool, cut into chunks of ``chunk_elements``
(32K by default). Each step only the *important* chunks go to the summation service, and
every worker picks the same ones, so they travel as ordinary dense push_pulls: no index
lists, no sparse sums on the servers. The choice for step t + 1 is made at the end of step
t from each chunk's L1 norm summed over workers: a chunk that was sent holds the sum of
every worker's gradients, identical everywhere, so each worker counts its norm divided by
the number of workers; a chunk that was not sent holds the worker's own gradient. The
norms are summed by one more push_pull (4 bytes per chunk), whose result is the same bytes
on every worker, so every worker sorts the same numbers the same way.

A gradient left out is not thrown away: it is kept, scaled by the momentum as Algorithm 1
prescribes, and added to the next step's gradient before the exchange (momentum SGD
correction); a weight whose chunk was not sent is not updated and keeps its momentum until
it is. Training starts dense and ramps the sparsity linearly to its final value over
``warmup_steps``, as the paper does to keep early, large gradients.

``CoarseSparseSGD`` is the optimizer that does all of it; it communicates by itself, so
use it instead of ``DistributedOptimizer``, not inside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from sumflow.torch import _runtime, ops
from sumflow.torch.compression import Compression

#: How the optimizer's sums are issued: summed (not averaged), priority 0, uncompressed,
#: unscaled.
_SUM = (ops.Sum, 0, Compression.none, 1.0, 1.0)

#: Chunk size of GradientFlow's evaluation.
DEFAULT_CHUNK_ELEMENTS = 32 * 1024
#: Important chunks per push_pull: messages of a few MiB keep per-message costs small, and
#: the count of distinct message shapes (each a declaration) stays bounded.
DEFAULT_GROUP_CHUNKS = 8


def density_at(step: int, density: float, warmup_steps: int) -> float:
    """The fraction of chunks sent at `step` (from 0): 1 at the start of the warm-up,
    ramping linearly in sparsity to `density` at `warmup_steps`, then `density`."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return density
    return 1.0 - (1.0 - density) * step / warmup_steps


def chunks_sent(chunks: int, density: float) -> int:
    """How many of `chunks` chunks a step at `density` sends: at least one."""
    return min(chunks, max(1, math.ceil(density * chunks - 1e-9)))


def select_chunks(norms: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the `count` chunks with the largest norms, ascending; equal norms
    go to the lower index, so every worker given the same norms picks the same chunks."""
    order = torch.sort(norms, descending=True, stable=True).indices
    return torch.sort(order[:count]).values


def chunk_l1_norms(rows: torch.Tensor, sent: torch.Tensor, workers: int) -> torch.Tensor:
    """The L1 norm of each row of `rows` (one chunk per row) in float32, the rows in
    `sent` (which hold the sum over `workers`) divided by `workers`."""
    norms = rows.abs().sum(dim=1, dtype=torch.float32)
    norms[sent] /= workers
    return norms


class CoarseSparseSGD(torch.optim.Optimizer):
    """Momentum SGD whose gradients cross the network as GradientFlow's coarse-grained
    sparse communication: each step sends only the ``density`` fraction of gradient chunks
    with the largest norms, chosen identically on every worker (see the module docs).

    Args:
        params: the parameters (one group; all of one floating dtype and device).
        lr: the learning rate.
        momentum: momentum factor, also the factor kept gradients are scaled by.
        density: fraction of chunks sent each step after the warm-up, in (0, 1]; 0.15 is
            GradientFlow's 85% sparsity.
        chunk_elements: gradients per chunk.
        warmup_steps: steps over which sparsity ramps linearly from 0 (dense).
        group_chunks: important chunks sent per push_pull.
        name: prefix of the tensors it declares; unique per optimizer of a job.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        momentum: float = 0.9,
        *,
        density: float = 0.15,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        warmup_steps: int = 0,
        group_chunks: int = DEFAULT_GROUP_CHUNKS,
        name: str = "CoarseSparseSGD",
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if chunk_elements < 1 or group_chunks < 1 or warmup_steps < 0:
            raise ValueError(
                "chunk_elements and group_chunks must be at least 1 and warmup_steps at "
                f"least 0, got {chunk_elements}, {group_chunks}, {warmup_steps}"
            )
        super().__init__(params, {"lr": lr, "momentum": momentum})
        if len(self.param_groups) != 1:
            raise ValueError(
                "CoarseSparseSGD takes one parameter group: its chunks cut across parameters, "
                "so a chunk could straddle two learning rates"
            )
        self._params: list[torch.Tensor] = list(self.param_groups[0]["params"])
        dtypes = {p.dtype for p in self._params}
        devices = {p.device for p in self._params}
        if len(dtypes) != 1 or not self._params[0].is_floating_point() or len(devices) != 1:
            raise ValueError(
                "CoarseSparseSGD pools every gradient into one tensor: give it parameters "
                f"of one floating dtype on one device (got {sorted(map(str, dtypes))} on "
                f"{sorted(map(str, devices))})"
            )
        self.density = density
        self.chunk_elements = chunk_elements
        self.warmup_steps = warmup_steps
        self.group_chunks = group_chunks
        self.name = name
        self.numel = sum(p.numel() for p in self._params)
        self.chunks = math.ceil(self.numel / chunk_elements)
        like = self._params[0]
        # Whole chunks: the last one's tail stays zero, so every chunk is a row.
        shape = (self.chunks, chunk_elements)
        self._pool = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self._kept = torch.zeros_like(self._pool)
        self._momentum = torch.zeros_like(self._pool)
        # Each step's weight change, kept to spare an allocation of the pool's size per step.
        self._delta = torch.zeros_like(self._pool)
        self.steps = 0
        #: The chunks the next step sends, ascending.
        self.important = torch.arange(self.chunks)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Exchanges the important chunks, updates their weights, and chooses the next
        step's chunks (one push_pull of the chunk norms, skipped while the next step is
        dense)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._step()
        return loss

    def _step(self) -> None:
        group = self.param_groups[0]
        lr, momentum = group["lr"], group["momentum"]
        workers = _runtime.current().service.size
        flat = self._pool.view(-1)
        at = 0
        for p in self._params:
            n = p.numel()
            if p.grad is None:
                flat[at : at + n].zero_()
            else:
                flat[at : at + n].copy_(p.grad.reshape(-1))
            at += n
        self._pool += self._kept

        sent = self.important
        self._exchange(sent)

        # Algorithm 1: a gradient not sent is kept, scaled by the momentum; one sent is
        # spent, and only its weight moves (the others keep their momentum as it was).
        torch.mul(self._pool, momentum, out=self._kept)
        self._kept[sent] = 0
        self._momentum[sent] = self._momentum[sent] * momentum + self._pool[sent] * (lr / workers)
        self._delta.zero_()
        self._delta[sent] = self._momentum[sent]
        flat_delta = self._delta.view(-1)
        at = 0
        for p in self._params:
            n = p.numel()
            p.sub_(flat_delta[at : at + n].view_as(p))
            at += n

        self.steps += 1
        count = chunks_sent(self.chunks, density_at(self.steps, self.density, self.warmup_steps))
        if count == self.chunks:
            self.important = torch.arange(self.chunks)
            return
        norms = chunk_l1_norms(self._pool, sent, workers)
        # Every worker sums the same tensors by construction: the declared path, with no
        # agreement step.
        ops.synchronize(ops.issue_declared(f"allreduce.{self.name}.norms", norms, *_SUM))
        self.important = select_chunks(norms, count)

    def _exchange(self, chunks: torch.Tensor) -> None:
        """Sums the pool's `chunks` over workers in place, `group_chunks` per push_pull
        (so a message's shape is one of a bounded few: a full group, or a shorter tail)."""
        handles = []
        for start in range(0, len(chunks), self.group_chunks):
            part = chunks[start : start + self.group_chunks]
            buffer = self._pool[part].reshape(-1)
            full = len(part) == self.group_chunks
            tag = f"group{start // self.group_chunks}" if full else f"tail{len(part)}"
            handle = ops.issue_declared(f"allreduce.{self.name}.{tag}", buffer, *_SUM)
            handles.append((part, buffer, handle))
        for part, buffer, handle in handles:
            ops.synchronize(handle)
            self._pool[part] = buffer.view(len(part), self.chunk_elements)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, with the kept gradients, momentum, step count and the
        next step's chunks."""
        state = super().state_dict()
        state["csc"] = {
            "steps": self.steps,
            "important": self.important.clone(),
            "kept": self._kept.clone(),
            "momentum": self._momentum.clone(),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a ``state_dict()`` of a CoarseSparseSGD over the same parameters."""
        state_dict = dict(state_dict)
        csc = state_dict.pop("csc", None)
        if csc is None:
            raise ValueError("not a CoarseSparseSGD state_dict: it has no 'csc' entry")
        if csc["kept"].shape != self._pool.shape:
            raise ValueError(
                f"the state_dict pools gradients as {tuple(csc['kept'].shape)} chunks x "
                f"elements, this optimizer as {tuple(self._pool.shape)}"
            )
        super().load_state_dict(state_dict)
        self.steps = int(csc["steps"])
        self.important = csc["important"].clone()
        self._kept.copy_(csc["kept"])
        self._momentum.copy_(csc["momentum"])
