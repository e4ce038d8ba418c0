"""The harness's training benchmark: real training loops on sleeping layer-profile models.

For each profile, the scales that keep the real cluster's communication/computation ratio
on the emulated network (:func:`sumflow.profiles.scales_for_emulation`: ``--reference-gbit``
real against ``--rate-mbit`` emulated), then, on the same hosts: DDP with gloo, sumflow's
DistributedOptimizer with colocated servers only (k = 0, the same machines as DDP), and
with k = n CPU-server hosts added.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Protocol

from sumflow import profiles
from sumflow.bench.cpu import CpuSampler
from sumflow.bench.jobs import read_result, run_sumflow_job, run_torch_job
from sumflow.bench.netns import EmulatedCluster


class _Progress(Protocol):
    def step(self, text: str) -> None: ...


def training_runs(
    args: argparse.Namespace,
    cluster: EmulatedCluster,
    sampler: CpuSampler,
    tmp: Path,
    progress: _Progress,
    models: list[dict[str, Any]],
) -> None:
    """Every profile in ``args.models``, three systems each, appended to ``models`` as each
    profile finishes (so a failure later keeps what was measured)."""
    n = args.workers
    workers, spare = cluster.hosts[:n], cluster.hosts[n:]
    k_extra = min(n, len(spare))
    logs = args.out / "logs"
    for name in args.models:
        profile = profiles.load(name)
        scales = profiles.scales_for_emulation(
            profile,
            reference_gbps=args.reference_gbit,
            emulated_gbps=args.rate_mbit / 1e3,
        )
        print(f"    {scales.reason}", file=sys.stderr, flush=True)
        partition_bytes = args.train_partition_bytes or scales.partition_bytes
        worker = [
            *(sys.executable, "-m", "sumflow.bench.train_worker", "--profile", name),
            *("--size-scale", repr(scales.size_scale), "--time-scale", repr(scales.time_scale)),
            *("--iterations", str(args.iterations), "--warmup", str(args.warmup_iterations)),
        ]
        runs = []
        configs: list[tuple[str, str, int]] = [
            ("DDP/gloo", "ddp-gloo", 0),
            ("sumflow k=0", "sumflow", 0),
        ]
        if k_extra:
            configs.append((f"sumflow k={k_extra}", "sumflow", k_extra))
        for label, system, k in configs:
            progress.step(f"training {name}: {label}")
            out = tmp / f"train-{name}-{system}-k{k}.json"
            tag = f"train-{name}-{system}-k{k}"
            if system == "ddp-gloo":
                argv = [*worker, "--system", system, "--bucket-cap-mb", repr(scales.bucket_cap_mb)]
                run_torch_job(
                    cluster,
                    workers,
                    [*argv, "--json", str(out)],
                    what=f"training {name} {label}",
                    log_path=logs / f"{tag}.log",
                    timeout=args.job_timeout,
                )
            else:
                argv = [
                    *worker,
                    "--system",
                    system,
                    "--partition-bytes",
                    str(partition_bytes),
                ]
                run_sumflow_job(
                    cluster,
                    workers,
                    spare[:k],
                    [*argv, "--json", str(out)],
                    what=f"training {name} {label}",
                    log_path=logs / f"{tag}.log",
                    timeout=args.job_timeout,
                )
            run = read_result(out, f"training {name} {label}")
            run["label"] = label
            run["k"] = k
            run["cpu"] = sampler.utilisation(*run["window"])
            runs.append(run)
            print(
                f"    {label}: {run['iterations_per_s']:.2f} iterations/s",
                file=sys.stderr,
                flush=True,
            )
        ddp = runs[0]["iterations_per_s"]
        for run in runs:
            run["vs_ddp"] = run["iterations_per_s"] / ddp
        models.append(
            {
                "model": name,
                "megabytes": scales.param_bytes / 1e6,
                "size_scale": scales.size_scale,
                "time_scale": scales.time_scale,
                "partition_bytes": partition_bytes,
                "bucket_cap_mb": scales.bucket_cap_mb,
                "scaling": scales.reason,
                "runs": runs,
            }
        )
