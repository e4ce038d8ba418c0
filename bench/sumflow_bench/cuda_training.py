"""ResNet-50 trained on CUDA through sumflow: what the CUDA staging adds to backward, and
the sums checked.

Every worker holds three copies of torchvision's ResNet-50 with the same parameters: one
plain (no hooks: the backward pass without sumflow), one with an empty Python hook on
every parameter (the least any per-gradient hook costs, Horovod's and sumflow's alike:
autograd calls into Python once per gradient), and one under ``DistributedOptimizer``
(whose gradient hooks queue each gradient's copy to host memory and hand it to the
summation as the copy completes). Each step runs the same batch through all three, in
turn, and times each backward pass from its start until the last kernel on the compute
stream is done (wall clock: a hook that blocks the CPU counts as much as GPU time). The
ratio of the medians, sumflow's to plain, is what the staging adds; ``step()`` (the wait
for the sums and the update) is timed apart.

On the first step every worker also checks its averaged gradients against the average it
computes itself, on a third copy, from every worker's batch (each worker's batch is
generated from its rank).

    sumflow-run -np 1 python -m sumflow_bench.cuda_training --steps 30 --json np1.json

Workers pick GPU ``local_rank % device_count``: several may share one GPU (correct, but
their timings then share it too). Needs torchvision.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import importlib
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import sumflow.torch as hvd
from sumflow.torch import _runtime


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--batch", type=int, default=64, help="images per worker (default 64)")
    p.add_argument("--json", type=Path, help="rank 0 writes the results here")
    p.add_argument("--plot", type=Path, help="rank 0 plots every step's backward time here")
    p.add_argument(
        "--profile-hooks",
        action="store_true",
        help="after the timed steps, profile sumflow's hooks through one backward pass "
        "(cProfile, on backward's thread) and print where their time goes",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1:
        p.error("--steps and --batch must be at least 1, --warmup at least 0")
    return args


def resnet50(device: torch.device) -> torch.nn.Module:
    try:
        torchvision = importlib.import_module("torchvision")
    except ImportError:
        sys.exit("cuda_training needs torchvision (pip install torchvision)")
    torch.manual_seed(0)
    model: torch.nn.Module = torchvision.models.resnet50().to(device)
    return model


def batch_of(rank: int, size: int, step: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    images = torch.randn(size, 3, 224, 224, generator=gen)
    labels = torch.randint(0, 1000, (size,), generator=gen)
    return images.to(device), labels.to(device)


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    images, labels = batch
    return torch.nn.functional.cross_entropy(model(images), labels)


def check_average(
    model: torch.nn.Module, reference: torch.nn.Module, args: argparse.Namespace
) -> float:
    """Compares `model`'s gradients (averaged by sumflow) with the average of every
    worker's gradients computed here on `reference`; returns the largest relative error."""
    device = next(model.parameters()).device
    sums = [torch.zeros_like(p) for p in reference.parameters()]
    for r in range(hvd.size()):
        reference.zero_grad()
        loss_of(reference, batch_of(r, args.batch, 0, device)).backward()
        for s, p in zip(sums, reference.parameters(), strict=True):
            s += grad_of(p)
    worst = 0.0
    for (name, p), s in zip(model.named_parameters(), sums, strict=True):
        want = s / hvd.size()
        scale = float(want.abs().max()) or 1.0
        error = float((grad_of(p) - want).abs().max()) / scale
        worst = max(worst, error)
        if error > 1e-4:
            raise AssertionError(f"averaged gradient of {name} off by {error:.2e} (relative)")
    return worst


def grad_of(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:
        raise AssertionError("a parameter of ResNet-50 got no gradient")
    return p.grad


def timed_backward(loss: torch.Tensor) -> float:
    stream = torch.cuda.current_stream()
    start = time.perf_counter()
    loss.backward()
    stream.synchronize()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    hvd.init()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    # The same algorithms every run, so the check's reference matches bit for bit in
    # everything but the order of the sum.
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    model = resnet50(device)
    plain = copy.deepcopy(model)
    empty = copy.deepcopy(model)
    for p in empty.parameters():
        p.register_post_accumulate_grad_hook(lambda p: None)
    reference = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    empty_opt = torch.optim.SGD(empty.parameters(), lr=0.01, momentum=0.9)
    # Hooks run in the order they were registered: one before sumflow's and one after
    # time what sumflow's costs backward's thread.
    hook_s = [0.0]
    entered: dict[torch.Tensor, float] = {}

    profiler: list[cProfile.Profile] = []

    def enter(p: torch.Tensor) -> None:
        if profiler:
            profiler[0].enable()
        entered[p] = time.perf_counter()

    # Each hook's time, split by whether it sent a span (the work of a send) or not.
    sends_us: list[float] = []
    others_us: list[float] = []
    in_flight = [0]

    def leave(p: torch.Tensor) -> None:
        spent = time.perf_counter() - entered[p]
        hook_s[0] += spent
        sent = len(opt._sf_handles)
        (sends_us if sent != in_flight[0] else others_us).append(spent * 1e6)
        in_flight[0] = sent
        if profiler:
            profiler[0].disable()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(enter)
    opt: Any = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    log = print if hvd.rank() == 0 else (lambda *a, **k: None)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(leave)
    log(f"ResNet-50, batch {args.batch} per worker, {hvd.size()} workers on {device}")

    loss_of(model, batch_of(hvd.rank(), args.batch, 0, device)).backward()
    opt.synchronize()
    error = check_average(model, reference, args)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    log(f"step 0: averaged gradients match the reference (largest relative error {error:.1e})")

    plain_s: list[float] = []
    empty_s: list[float] = []
    sumflow_s: list[float] = []
    step_s: list[float] = []
    in_hooks_s: list[float] = []
    for step in range(1, args.warmup + args.steps + 1):
        batch = batch_of(hvd.rank(), args.batch, step, device)
        plain_opt.zero_grad()
        loss = loss_of(plain, batch)
        torch.cuda.synchronize()
        plain_time = timed_backward(loss)
        plain_opt.step()
        empty_opt.zero_grad()
        loss = loss_of(empty, batch)
        torch.cuda.synchronize()
        empty_time = timed_backward(loss)
        empty_opt.step()
        opt.zero_grad()
        loss = loss_of(model, batch)
        torch.cuda.synchronize()
        hooks_before = hook_s[0]
        sumflow_time = timed_backward(loss)
        hooks_time = hook_s[0] - hooks_before
        start = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        step_time = time.perf_counter() - start
        in_flight[0] = 0
        if step > args.warmup:
            plain_s.append(plain_time)
            empty_s.append(empty_time)
            sumflow_s.append(sumflow_time)
            step_s.append(step_time)
            in_hooks_s.append(hooks_time)
            if (step - args.warmup) % 10 == 0:
                log(f"  step {step - args.warmup}/{args.steps}")
    if args.profile_hooks:
        # Enabled and disabled inside the hooks: cProfile follows one thread, backward's.
        profiler.append(cProfile.Profile())
        opt.zero_grad()
        loss_of(model, batch_of(hvd.rank(), args.batch, 0, device)).backward()
        opt.step()
        if hvd.rank() == 0:
            report = io.StringIO()
            pstats.Stats(profiler.pop(), stream=report).sort_stats("tottime").print_stats(30)
            print(report.getvalue())
    # Every worker ends with the same parameters.
    total = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    totals = hvd.allgather(total.reshape(1).cpu(), name="parameter totals")
    if not torch.all(totals == totals[0]):
        raise AssertionError(f"workers' parameters differ: sums {totals.tolist()}")
    plain_med, sumflow_med = statistics.median(plain_s), statistics.median(sumflow_s)
    # Who queued and awaited the copies to host memory (SUMFLOW_CUDA_STAGING).
    staging = "driver" if _runtime.current().driver_staging else "python"
    empty_med = statistics.median(empty_s)
    result = {
        "rank": hvd.rank(),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "workers": hvd.size(),
        "batch": args.batch,
        "steps": args.steps,
        "backward_plain_s": plain_med,
        "backward_sumflow_s": sumflow_med,
        "backward_ratio": sumflow_med / plain_med,
        "backward_empty_hooks_s": empty_med,
        "empty_hooks_ratio": empty_med / plain_med,
        "step_s": statistics.median(step_s),
        "hooks_s": statistics.median(in_hooks_s),
        "gradients": sum(1 for _ in model.parameters()),
        "staging": staging,
        # Without fusion every hook sends: no other hook to time (0).
        "send_hook_us": statistics.median(sends_us or [0.0]),
        "sends": len(sends_us) // (args.warmup + args.steps + 1),
        "other_hook_us": statistics.median(others_us or [0.0]),
        "check_relative_error": error,
        "plain_s": plain_s,
        "empty_s": empty_s,
        "sumflow_s": sumflow_s,
    }
    log(
        f"backward: {plain_med * 1e3:.1f} ms plain, {sumflow_med * 1e3:.1f} ms with sumflow's "
        f"hooks ({sumflow_med / plain_med:.3f}x; empty hooks {empty_med * 1e3:.1f} ms, "
        f"{empty_med / plain_med:.3f}x), {result['hooks_s'] * 1e3:.1f} ms of it in "
        f"sumflow's {result['gradients']} hooks; step() {result['step_s'] * 1e3:.1f} ms; "
        f"copies staged by the {staging} thread; a hook that sends "
        f"{result['send_hook_us']:.1f} us ({result['sends']} a step), another "
        f"{result['other_hook_us']:.2f} us"
    )
    hvd.shutdown()
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (
        ("plain_s", "without sumflow"),
        ("empty_s", "empty Python hooks"),
        ("sumflow_s", "sumflow hooks"),
    ):
        ax.plot([t * 1e3 for t in result[key]], marker=".", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("backward pass (ms)")
    ax.set_title(
        f"ResNet-50 backward on {result['device']}, {result['workers']} worker(s): "
        f"{result['backward_ratio']:.3f}x"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    if result["rank"] == 0:
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        if args.plot:
            plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
