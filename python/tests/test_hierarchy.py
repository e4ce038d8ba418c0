"""Aggregation inside each machine first (issue 23, BytePS §4.2.2): on two emulated
machines, the bytes the workers exchange with the summation servers per sum do not grow
with the workers per machine, where summing every worker's tensor on the servers (shared
memory off) multiplies them by it; and every sum stays exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: Sums a 4 MiB float32 tensor (integers, so exact) three times and writes, from rank 0,
#: the bytes every worker exchanged with the servers for them, summed over workers.
WORKER = textwrap.dedent(
    """
    import json, sys, torch
    import sumflow.torch as hvd
    from sumflow.torch import _runtime

    def moved():
        per_key, untied = _runtime.current().service.wire_bytes()
        return sum(s + r for _, _, s, r in per_key) + untied[0] + untied[1]

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = torch.arange(1 << 20, dtype=torch.float32) % 1000
    hvd.allreduce(x, name="warm-up")
    before = moved()
    for i in range(3):
        got = hvd.allreduce(x + r + i, op=hvd.Sum, name="g")
        want = n * (x + i) + n * (n - 1) / 2
        assert torch.equal(got, want), (i, (got - want).abs().max())
    mine = torch.tensor([moved() - before], dtype=torch.int64)
    total = hvd.allreduce(mine, op=hvd.Sum, name="bytes")
    if r == 0:
        open(sys.argv[1], "w").write(json.dumps(int(total)))
    """
)


def total_bytes(tmp_path: Path, per_machine: int, extra: list[str]) -> int:
    out = tmp_path / f"bytes-{per_machine}-{len(extra)}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "sumflow.launcher",
            "-np",
            str(2 * per_machine),
            "--local-size",
            str(per_machine),
            "--timeout",
            "60",
            *extra,
            sys.executable,
            "-c",
            WORKER,
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return int(json.loads(out.read_text()))


@pytest.mark.parametrize("per_machine", [2, 3])
def test_bytes_per_sum_do_not_grow_with_the_workers_per_machine(
    tmp_path: Path, per_machine: int
) -> None:
    one = total_bytes(tmp_path, 1, [])
    several = total_bytes(tmp_path, per_machine, [])
    # 3 sums of 4 MiB, pushed and pulled once per machine, to two machines' servers.
    assert one >= 3 * 2 * 2 * (4 << 20), one
    assert abs(several - one) <= 0.05 * one, (several, one)
    if per_machine == 2:
        flat = total_bytes(tmp_path, per_machine, ["-x", "SUMFLOW_SHARED_MEMORY=off"])
        assert flat >= 1.9 * one, (flat, one)
