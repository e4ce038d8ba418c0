"""Scaling profiles for emulated networks.

A benchmark on an emulated network (network namespaces and ``tc`` on one machine) has a
fraction of a real cluster's bandwidth and no GPU. To make its results say something about
the real cluster, what must carry over is the balance between communicating and computing.
:func:`sumflow.profiles.scale` shrinks a profile's tensors and stretches or shrinks its
times; :func:`scales_for_emulation` picks the two factors for a given pair of bandwidths.
"""

from __future__ import annotations

from dataclasses import dataclass

from sumflow import _core
from sumflow.profiles.format import BYTES_PER_ELEMENT, ModelProfile
from sumflow.profiles.scaling import check_factor, scaled_numel

#: DistributedDataParallel's default bucket size.
DEFAULT_BUCKET_CAP_MB = 25.0


@dataclass(frozen=True)
class EmulationScales:
    """Scales for one profile on one emulated network, and why.

    Attributes:
        size_scale: tensor element factor for :func:`scale`.
        time_scale: time factor for :func:`scale`.
        compute_s: one iteration's forward + backward after scaling.
        param_bytes: the scaled profile's parameter bytes (rounding included).
        partition_bytes: sumflow's default partition size scaled the same way, so a tensor
            is cut into as many partitions as on the real cluster.
        bucket_cap_mb: DDP's default bucket size scaled the same way, so DDP builds as many
            buckets as on the real cluster.
        reason: one line saying how the scales were chosen.
    """

    size_scale: float
    time_scale: float
    compute_s: float
    param_bytes: int
    partition_bytes: int
    bucket_cap_mb: float
    reason: str


def scales_for_emulation(
    profile: ModelProfile,
    *,
    reference_gbps: float,
    emulated_gbps: float,
    target_s: tuple[float, float] = (0.1, 1.0),
    aim_s: float = 0.3,
    max_size_scale: float = 1.0,
) -> EmulationScales:
    """Scales that make an emulated network of `emulated_gbps` behave like the real
    cluster of `reference_gbps` for `profile`.

    Why: on the real cluster an iteration computes for C (the profile's forward + backward)
    and moves B bytes per worker at bandwidth R, so communication takes about k * B / R,
    with k set by the system (push and pull, ring steps...). Whether training is
    communication-bound, and how much of the communication overlaps backward, depends on
    the ratio (k * B / R) / C. On the emulated network the model moves ``B * size_scale``
    bytes at bandwidth E and computes for ``C * time_scale``, so the ratio is the real one
    exactly when ``size_scale / time_scale = E / R``, whatever k is.

    That leaves one free factor. `time_scale` is chosen to put one iteration's compute at
    `aim_s` (default 0.3 s), inside `target_s` (default 0.1-1.0 s): long enough that sleep
    granularity, per-message latency and Python overheads, which are not scaled, stay small
    against it, short enough that a benchmark of tens of iterations takes seconds. Then
    ``size_scale = time_scale * E / R``. If that would exceed `max_size_scale` (default 1:
    tensors never grow past the real model's, which would only cost memory), `size_scale` is
    capped and `time_scale` lowered to keep the ratio; if compute then falls below
    ``target_s[0]`` the emulated network is too fast for this model and ValueError says so.

    What is not preserved: latencies (per message, per partition) are the emulated
    network's, not scaled; and tensors small enough to round to 1 element (see
    :func:`scale`) carry slightly more than their share. Use the returned
    `partition_bytes` and `bucket_cap_mb` to keep the number of partitions and DDP buckets
    of the real cluster.
    """
    check_factor("reference_gbps", reference_gbps)
    check_factor("emulated_gbps", emulated_gbps)
    check_factor("aim_s", aim_s)
    check_factor("max_size_scale", max_size_scale)
    low, high = target_s
    check_factor("target_s[0]", low)
    check_factor("target_s[1]", high)
    if not low <= aim_s <= high:
        raise ValueError(f"aim_s={aim_s:g} s is outside target_s=({low:g}, {high:g}) s")
    compute_s = profile.compute_ms / 1e3
    if compute_s <= 0:
        raise ValueError(f"profile '{profile.name}' has no compute time to scale")
    bw_ratio = emulated_gbps / reference_gbps
    time_scale = aim_s / compute_s
    size_scale = time_scale * bw_ratio
    capped = size_scale > max_size_scale
    if capped:
        size_scale = max_size_scale
        time_scale = size_scale / bw_ratio
    scaled_compute_s = compute_s * time_scale
    if scaled_compute_s < low:
        raise ValueError(
            f"profile '{profile.name}': keeping the real cluster's communication/compute "
            f"ratio at {emulated_gbps:g} Gbit/s emulated vs {reference_gbps:g} Gbit/s real "
            f"needs tensors x{aim_s / compute_s * bw_ratio:.3g} for {aim_s:g} s of compute; "
            f"at the largest size scale (x{max_size_scale:g}) compute would be "
            f"{scaled_compute_s:.3g} s, below {low:g} s. Emulate a slower network or "
            "raise max_size_scale."
        )
    param_bytes = sum(scaled_numel(p.numel, size_scale) for p in profile.params()) * (
        BYTES_PER_ELEMENT
    )
    # Whole elements of 64-byte lines, at least 1 KiB: tiny partitions would only measure
    # per-message overhead.
    partition_bytes = max(1024, round(_core.DEFAULT_PARTITION_BYTES * size_scale / 64) * 64)
    bucket_cap_mb = DEFAULT_BUCKET_CAP_MB * size_scale
    why_time = (
        f"time x{time_scale:.4g} puts one iteration's compute at {scaled_compute_s * 1e3:.0f} ms"
        + (
            f" (lowered from {aim_s * 1e3:.0f} ms: size is capped at x{max_size_scale:g})"
            if capped
            else ""
        )
    )
    reason = (
        f"{profile.name}: {profile.compute_ms:.1f} ms of compute at reference; {why_time}; "
        f"{emulated_gbps:g} Gbit/s emulated vs {reference_gbps:g} Gbit/s real keeps the "
        f"communication/compute ratio with tensors x{size_scale:.4g} "
        f"({param_bytes / 1e6:.2f} MB of {profile.param_bytes / 1e6:.1f} MB)"
    )
    return EmulationScales(
        size_scale=size_scale,
        time_scale=time_scale,
        compute_s=scaled_compute_s,
        param_bytes=param_bytes,
        partition_bytes=partition_bytes,
        bucket_cap_mb=bucket_cap_mb,
        reason=reason,
    )
