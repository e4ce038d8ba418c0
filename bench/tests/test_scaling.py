"""Scaling profiles for an emulated network (sumflow_bench.scaling): the real cluster's
communication/compute ratio kept, the caps and the range."""

from __future__ import annotations

import pytest

from sumflow import profiles
from sumflow_bench.scaling import scales_for_emulation


@pytest.mark.parametrize("name", profiles.names())
@pytest.mark.parametrize(("reference", "emulated"), [(25.0, 1.0), (10.0, 0.25), (10.0, 2.0)])
def test_scales_for_emulation_keep_the_comm_compute_ratio(
    name: str, reference: float, emulated: float
) -> None:
    p = profiles.builtin(name)
    s = scales_for_emulation(p, reference_gbps=reference, emulated_gbps=emulated)
    assert s.size_scale / s.time_scale == pytest.approx(emulated / reference)
    assert s.compute_s == pytest.approx(0.3)
    scaled = profiles.scale(p, size_scale=s.size_scale, time_scale=s.time_scale)
    assert scaled.compute_ms / 1e3 == pytest.approx(s.compute_s)
    assert scaled.param_bytes == s.param_bytes
    # Bandwidth-bound communication time over compute, real cluster vs emulated.
    real = (p.param_bytes * 8 / (reference * 1e9)) / (p.compute_ms / 1e3)
    emul = (scaled.param_bytes * 8 / (emulated * 1e9)) / (scaled.compute_ms / 1e3)
    assert emul == pytest.approx(real, rel=0.01)
    assert s.partition_bytes == pytest.approx((4 << 20) * s.size_scale, abs=64)
    assert s.bucket_cap_mb == pytest.approx(25 * s.size_scale)
    assert s.reason.startswith(f"{name}: ")


def test_scales_for_emulation_cap_and_range() -> None:
    p = profiles.builtin("resnet50")  # 91 ms of compute at reference
    # Emulated as fast as real: 0.3 s of compute would need tensors x3.3; capped at 1.
    s = scales_for_emulation(p, reference_gbps=10, emulated_gbps=10, target_s=(0.05, 1))
    assert s.size_scale == 1.0
    assert s.time_scale == pytest.approx(1.0)
    assert "capped" in s.reason
    with pytest.raises(ValueError, match=r"below 0\.1 s"):
        scales_for_emulation(p, reference_gbps=10, emulated_gbps=10)
    with pytest.raises(ValueError, match="outside target_s"):
        scales_for_emulation(p, reference_gbps=10, emulated_gbps=1, aim_s=2.0)
    s = scales_for_emulation(p, reference_gbps=10, emulated_gbps=1, aim_s=0.8)
    assert s.compute_s == pytest.approx(0.8)
