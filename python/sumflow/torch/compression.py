"""Gradient compression applied around push_pull, Horovod's interface.

A compressor turns a tensor into what is sent (``compress``) and the summed result back
(``decompress``). ``Compression.fp16`` and ``Compression.bf16`` halve the bytes on the
wire; the summation servers accumulate 16-bit pushes in f32 and round once, so the sum
loses no more than the cast itself. With mixed precision training, unscale gradients
(``GradScaler.unscale_``) only after ``optimizer.synchronize()``; fp16 overflows to inf
for values above 65504, which GradScaler detects and skips like any other overflow.
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Interface: subclasses override both static methods."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor to send and the context ``decompress`` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The summed tensor in the original form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    wire_dtype: torch.dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        if tensor.is_floating_point() and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Sends floating-point tensors as float16."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Sends floating-point tensors as bfloat16 (float32's range, fewer mantissa bits)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The available compressors: ``Compression.none``, ``.fp16`` and ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
