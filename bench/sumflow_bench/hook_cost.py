"""What DistributedOptimizer's gradient hooks cost backward's thread, on the CPU.

On a GPU machine whose backward launches kernels as fast as the GPU runs them, every
microsecond of Python in a gradient hook lengthens backward (BENCHMARKS.md, CUDA). This
measures that Python where no GPU is: ResNet-50's 161 parameter shapes as CPU tensors,
`DistributedOptimizer` with CUDA's default fusion (4 MiB spans), in a job of one. Hooks
registered before and after sumflow's time each of its calls, split into those that send
a span and the others; medians over the steps after a warm-up. A send's time here
includes the CPU core's push_pull where a GPU machine's includes the staging, so compare
runs of this benchmark with each other, on one machine.

On a GPU machine, ``--device cuda`` runs the same on CUDA tensors (the chain's backward is
a few small kernels, so the hooks' own cost shows, staging included); ``--profile N``
prints the N functions the hooks spent most time in, over every timed step (cProfile,
backward's thread).

    sumflow-run -np 1 python -m sumflow_bench.hook_cost --steps 30
    sumflow-run -np 1 python -m sumflow_bench.hook_cost --device cuda --profile 25
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import sumflow.torch as hvd


def resnet50_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of torchvision's ResNet-50, in model order."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    width_in = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            shapes += [(width, width_in, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(width * 4, width, 1, 1), (width * 4,), (width * 4,)]
            if block == 0:
                shapes += [(width * 4, width_in, 1, 1), (width * 4,), (width * 4,)]
            width_in = width * 4
    return [*shapes, (1000, 2048), (1000,)]


class Chain(torch.nn.Module):
    """Parameters of the given shapes, used in order, so that backward produces their
    gradients last first, as a network's does."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], device: torch.device) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.full(shape, 0.01, device=device)) for shape in shapes
        )

    def forward(self) -> torch.Tensor:
        total = torch.zeros((), device=self.weights[0].device)
        for w in self.weights:
            total = total + w.sum()
        return total


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument(
        "--fusion", type=int, default=4 << 20, help="fusion threshold, bytes (default 4 MiB)"
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the gradients are (default cpu; cuda: the worker's local GPU)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="print the N functions the hooks spent most time in (cProfile; default none)",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.fusion < 0 or args.profile < 0:
        p.error("--steps must be at least 1, --warmup, --fusion and --profile at least 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU here")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    hvd.init()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model = Chain(resnet50_shapes(), device)
    entered: dict[int, float] = {}
    sends: list[float] = []
    others: list[float] = []
    in_flight = [0]
    timing = [False]
    # Enabled and disabled inside the hooks (backward's thread), only while timing.
    profiler = cProfile.Profile() if args.profile else None

    def enter(p: torch.Tensor) -> None:
        if profiler is not None and timing[0]:
            profiler.enable()
        entered[id(p)] = time.perf_counter()

    def leave(p: torch.Tensor) -> None:
        spent = (time.perf_counter() - entered[id(p)]) * 1e6
        sent = len(opt._sf_handles)
        if timing[0]:
            (sends if sent != in_flight[0] else others).append(spent)
            if profiler is not None:
                profiler.disable()
        in_flight[0] = sent

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(enter)
    # Any: the wrapper's state (its handles) is read to tell the sending hooks apart.
    opt: Any = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        named_parameters=model.named_parameters(),
        fusion_threshold=args.fusion,
    )
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(leave)
    per_step: list[float] = []
    for step in range(args.warmup + args.steps):
        timing[0] = step >= args.warmup
        before = sum(sends) + sum(others)
        opt.zero_grad()
        model().backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        in_flight[0] = 0
        if timing[0]:
            per_step.append(sum(sends) + sum(others) - before)
        if (step + 1) % 10 == 0:
            print(f"step {step + 1}/{args.warmup + args.steps}", file=sys.stderr, flush=True)
    hvd.shutdown()
    if profiler is not None:
        report = io.StringIO()
        pstats.Stats(profiler, stream=report).sort_stats("tottime").print_stats(args.profile)
        print(report.getvalue())
    print(
        f"{len(resnet50_shapes())} {device.type.upper()} gradients, fusion {args.fusion} B: "
        f"{statistics.median(per_step) / 1e3:.2f} ms of hooks per backward; a hook that "
        f"sends {statistics.median(sends or [0.0]):.1f} us ({len(sends) // args.steps} a "
        f"step), another {statistics.median(others or [0.0]):.2f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
