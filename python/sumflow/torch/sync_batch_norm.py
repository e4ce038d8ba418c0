"""Batch normalisation over the whole global batch (Horovod's ``SyncBatchNorm``).

In training, each worker's per-channel sum, sum of squares and count are summed over the
workers with the differentiable allreduce, so the statistics are those of every worker's
batch together, and the backward pass flows through the same sums (each worker's input
gets the gradient of every worker's loss). In evaluation it is plain batch norm with the
running statistics.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from sumflow.torch import _runtime
from sumflow.torch.autograd import allreduce
from sumflow.torch.ops import Sum


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm*d`` whose training statistics span every worker's batch.
    Input of shape (N, C, ...), as the BatchNorm modules take."""

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
        channels = input.shape[1]
        # Channels first, everything else flattened: (C, N * ...).
        flat = input.transpose(0, 1).reshape(channels, -1)
        count = torch.full((channels,), float(flat.shape[1]), dtype=flat.dtype, device=flat.device)
        local = torch.cat([flat.sum(1), (flat * flat).sum(1), count])
        total = allreduce(local, op=Sum, name=f"sync_batch_norm.{id(self)}")
        total_sum, total_sq, total_count = total.split(channels)
        mean = total_sum / total_count
        var = total_sq / total_count - mean * mean
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
                unbiased = var * total_count / (total_count - 1).clamp(min=1)
                self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.detach(), alpha=momentum)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out: torch.Tensor = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out
