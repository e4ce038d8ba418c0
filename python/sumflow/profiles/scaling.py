"""Scaling a profile: its tensors shrunk or grown, its times stretched or shrunk, its
layers, tensors and their order kept.

An emulated network or a quick simulation wants a smaller model whose communication has
the same shape; ``sumflow_bench.scaling`` picks the two factors that keep a real
cluster's balance between communicating and computing on an emulated network.
"""

from __future__ import annotations

import math

from sumflow.profiles.format import LayerProfile, ModelProfile, ParamSpec


def check_factor(name: str, value: float, *, zero: bool = False) -> None:
    """Raises ValueError naming `name` unless `value` is a finite number > 0 (>= 0 with
    `zero`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise ValueError(f"{name} must be a finite number {'>=' if zero else '>'} 0, got {value!r}")


def scaled_numel(numel: int, size_scale: float) -> int:
    """Elements of a tensor of `numel` elements after scaling: ``max(1, round(numel *
    size_scale))`` (a tensor never vanishes, so tensor count and order survive)."""
    return max(1, round(numel * size_scale))


def scale(profile: ModelProfile, *, size_scale: float, time_scale: float) -> ModelProfile:
    """`profile` with every tensor's element count multiplied by `size_scale` (> 0) and
    every time by `time_scale` (>= 0; 0 leaves communication alone).

    Each tensor becomes 1-D, of :func:`scaled_numel` elements: its shape cannot be scaled
    in general, and communication sees only its size. Names, tensor count, layer count and
    order are kept, so priorities, partitioning per tensor and the backward order are
    those of the original model. Tensors of a few elements round to at least 1, so at a
    small `size_scale` the total is slightly above ``param_bytes * size_scale``; compare
    the result's ``param_bytes``. The scales are appended to ``source``."""
    check_factor("size_scale", size_scale)
    check_factor("time_scale", time_scale, zero=True)
    layers = tuple(
        LayerProfile(
            layer.name,
            tuple(ParamSpec(p.name, (scaled_numel(p.numel, size_scale),)) for p in layer.params),
            layer.forward_ms * time_scale,
            layer.backward_ms * time_scale,
        )
        for layer in profile.layers
    )
    return ModelProfile(
        name=profile.name,
        source=(
            f"{profile.source} Scaled: tensors x{size_scale:g} (flattened to 1-D), times "
            f"x{time_scale:g}."
        ),
        device=profile.device,
        batch_size=profile.batch_size,
        sample=profile.sample,
        layers=layers,
    )
