"""Aggregation inside each machine first (issue 23, BytePS §4.2.2): on two emulated
machines, the bytes the workers exchange with the summation servers per sum do not grow
with the workers per machine, where summing every worker's tensor on the servers (shared
memory off) multiplies them by it; and every sum stays exact (the worker checks)."""

from __future__ import annotations

import pytest

from sumflow_bench.machine_bytes import total_bytes


@pytest.mark.parametrize("per_machine", [2, 3])
def test_bytes_per_sum_do_not_grow_with_the_workers_per_machine(per_machine: int) -> None:
    # The defaults: no flag.
    one = total_bytes(2, 1, [])
    several = total_bytes(2, per_machine, [])
    # 3 sums of 4 MiB, pushed and pulled once per machine, two machines.
    assert one >= 3 * 2 * 2 * (4 << 20), one
    assert abs(several - one) <= 0.05 * one, (several, one)
    if per_machine == 2:
        flat = total_bytes(2, per_machine, ["-x", "SUMFLOW_SHARED_MEMORY=off"])
        assert flat >= 1.9 * one, (flat, one)
