"""Bytes per sum against the workers per machine (issue 23, BytePS §4.2.2).

Runs jobs of ``--machines`` machines on this one (``sumflow-run --local-size G``, each
machine's workers sharing a host id and ``/dev/shm``), G workers each, for every G given,
by default (a tensor spanning machines is aggregated inside each machine first) and with
``SUMFLOW_SHARED_MEMORY=off`` (every worker's tensor summed on the servers). Each job
sums a float32 tensor of ``--mib`` MiB ``--sums`` times (integers, so every sum is
checked exactly) and counts the bytes its workers exchanged with the summation servers
for those sums (the core's wire accounting, frames whole), summed over workers. A
machine then carries one push and one pull of the tensor per sum, whatever G: the table
gives the bytes per machine per sum over that (``/ 2S``), and each job's bytes against
the same job at G = 1.

    python -m sumflow_bench.machine_bytes --machines 2 --per-machine 1 2 3 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

#: argv: OUT MIB SUMS. Sums (exactly) and writes, from rank 0, the bytes every worker
#: exchanged with the servers for the sums, summed over workers.
WORKER = textwrap.dedent(
    """
    import json, sys, torch
    import sumflow.torch as hvd
    from sumflow.torch import _runtime

    def moved():
        per_key, untied = _runtime.current().service.wire_bytes()
        return sum(s + r for _, _, s, r in per_key) + untied[0] + untied[1]

    out, mib, sums = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = torch.arange(mib << 18, dtype=torch.float32) % 1000
    hvd.allreduce(x, name="warm-up")
    before = moved()
    for i in range(sums):
        got = hvd.allreduce(x + r + i, op=hvd.Sum, name="g")
        want = n * (x + i) + n * (n - 1) / 2
        assert torch.equal(got, want), (i, (got - want).abs().max())
    mine = torch.tensor([moved() - before], dtype=torch.int64)
    total = hvd.allreduce(mine, op=hvd.Sum, name="bytes")
    if r == 0:
        open(out, "w").write(json.dumps(int(total)))
    """
)


def total_bytes(
    machines: int, per_machine: int, extra: list[str], mib: int = 4, sums: int = 3
) -> int:
    """Runs one job; the bytes its workers exchanged with the servers for the sums."""
    with tempfile.TemporaryDirectory(prefix="sumflow-machine-bytes-") as tmp:
        out = Path(tmp) / "bytes.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
        argv = [sys.executable, "-m", "sumflow.launcher", "-np", str(machines * per_machine)]
        argv += ["--local-size", str(per_machine), "--timeout", "60", *extra]
        argv += [sys.executable, "-c", WORKER, str(out), str(mib), str(sums)]
        run = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=600, check=False
        )
        if run.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv[3:9])} failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
            )
        return int(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--per-machine", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--mib", type=int, default=4, help="the tensor's size")
    parser.add_argument("--sums", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the table here too")
    args = parser.parse_args()
    per_sum = 2 * (args.mib << 20)
    rows = []
    base: dict[str, int] = {}
    print("| workers per machine | summed | bytes | per machine per sum / 2S | vs G = 1 |")
    print("|---|---|---|---|---|")
    for how, extra in (("aggregated", []), ("flat", ["-x", "SUMFLOW_SHARED_MEMORY=off"])):
        for g in args.per_machine:
            got = total_bytes(args.machines, g, extra, args.mib, args.sums)
            base.setdefault(how, got)
            share = got / (args.machines * args.sums * per_sum)
            rows.append({"per_machine": g, "shared_memory": how, "bytes": got})
            print(f"| {g} | {how} | {got:,} | {share:.4f} | {got / base[how]:.4f}x |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
