"""Batch normalisation over the whole global batch (Horovod's ``SyncBatchNorm``).

In training, the per-channel statistics are those of every worker's batch together:
each worker sums, per channel, its element count, its sum and its sum of squared
deviations from its own mean (and its count times that mean squared, to combine the
means), and one allreduce adds them up. That keeps the variance free of the cancellation
of E[x²] - E[x]², so results match ``BatchNorm`` over the concatenated batch closely.

Backward has its own formula rather than autograd through the forward's arithmetic:
with dy the output's gradient, x̂ the normalised input and N the global count, each
worker's input gets the gradient of every worker's loss,
``(dy - Σdy / N - x̂ · Σ(dy·x̂) / N) · w / std``, the two sums allreduced over the workers.
Where the loss cannot depend on the input (the sum of the outputs), both terms cancel
exactly, as in the fused kernels of ``BatchNorm``, not up to rounding. ``weight`` and
``bias`` get this worker's part of their gradient (the optimizer's allreduce adds the
parts). In evaluation it is plain batch norm with the running statistics.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from sumflow.torch import _runtime, ops


def _sum(tensor: torch.Tensor, name: str) -> torch.Tensor:
    return ops.synchronize(ops.allreduce_async(tensor, op=ops.Sum, name=name))  # type: ignore[no-any-return]


def _channels_first(t: torch.Tensor) -> torch.Tensor:
    """(N, C, ...) as (C, N * ...)."""
    return t.transpose(0, 1).reshape(t.shape[1], -1)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        name: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the output, and the global mean and unbiased variance (for the running
        statistics)."""
        channels = input.shape[1]
        # Statistics in at least float32 (half inputs too).
        flat = _channels_first(input).to(torch.promote_types(input.dtype, torch.float32))
        count = flat.shape[1]
        local_mean = flat.mean(1)
        deviations = ((flat - local_mean[:, None]) ** 2).sum(1)
        local = torch.cat(
            [
                flat.sum(1),
                deviations,
                count * local_mean * local_mean,
                torch.full_like(local_mean, float(count)),
            ]
        )
        total_sum, total_dev, total_mean_sq, total_count = _sum(local, name).split(channels)
        mean = total_sum / total_count
        # Within each worker, plus between the workers' means.
        var = (total_dev + total_mean_sq - total_count * mean * mean) / total_count
        invstd = torch.rsqrt(var + eps)
        xhat = (flat - mean[:, None]) * invstd[:, None]
        out = xhat
        if weight is not None:
            out = out * weight.to(xhat.dtype)[:, None]
        if bias is not None:
            out = out + bias.to(xhat.dtype)[:, None]
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.name = name
        ctx.count = total_count
        ctx.shape = input.shape
        ctx.dtype = input.dtype
        shaped = out.reshape(channels, input.shape[0], -1).transpose(0, 1).reshape(input.shape)
        unbiased = var * total_count / (total_count - 1).clamp(min=1)
        return shaped.to(input.dtype), mean, unbiased

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor, _mean: Any, _var: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, None, None]:
        xhat, invstd, weight = ctx.saved_tensors
        channels = xhat.shape[0]
        dy = _channels_first(grad_out.contiguous()).to(xhat.dtype)
        sum_dy = dy.sum(1)
        sum_dy_xhat = (dy * xhat).sum(1)
        totals = _sum(torch.cat([sum_dy, sum_dy_xhat]), f"{ctx.name}.grad")
        mean_dy, mean_dy_xhat = (totals / torch.cat([ctx.count, ctx.count])).split(channels)
        scale = invstd if weight is None else invstd * weight.to(xhat.dtype)
        grad_flat = (dy - mean_dy[:, None] - xhat * mean_dy_xhat[:, None]) * scale[:, None]
        shape = ctx.shape
        grad_input = grad_flat.reshape(channels, shape[0], -1).transpose(0, 1).reshape(shape)
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None else None
        return grad_input.to(ctx.dtype), grad_weight, grad_bias, None, None


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm*d`` whose training statistics span every worker's batch.
    Input of shape (N, C, ...), as the BatchNorm modules take."""

    #: How many were made in this process: every worker builds its model in the same
    #: order, so the n-th one's statistics go by the same name on every worker.
    _made = itertools.count()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sf_name = f"sync_batch_norm.{next(SyncBatchNorm._made)}"

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects at least 2-D input (N, C, ...), got {input.dim()}-D"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or _runtime.current().service.size == 1:
            plain: torch.Tensor = super().forward(input)
            return plain
        out, mean, unbiased = _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.eps, self._sf_name
        )
        if (
            self.track_running_stats
            and self.running_mean is not None
            and self.running_var is not None
        ):
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            momentum = (
                1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            )
            with torch.no_grad():
                self.running_mean.mul_(1 - momentum).add_(
                    mean.to(self.running_mean.dtype), alpha=momentum
                )
                self.running_var.mul_(1 - momentum).add_(
                    unbiased.to(self.running_var.dtype), alpha=momentum
                )
        result: torch.Tensor = out
        return result
