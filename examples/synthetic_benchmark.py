"""Synthetic training throughput through sumflow, in the format of Horovod's and BytePS's
PyTorch synthetic benchmarks (``pytorch_synthetic_benchmark.py``).

Every worker trains a model on one fixed random batch, so only compute and gradient
communication are measured. The models are built in (no torchvision) and small enough for
a CPU: ``resnet20`` (He et al.'s CIFAR ResNet-20, 0.27M parameters, compute-bound),
``resnet18`` (a CIFAR-style ResNet-18, 11.2M parameters) and ``mlp`` (three linear layers
of 1024, 4.2M parameters, communication-bound). Inputs are 3x32x32 images with 10 classes.

    sumflow-run -np 4 --servers 2 python examples/synthetic_benchmark.py --model mlp
    python examples/synthetic_benchmark.py --num-iters 5        # a job of one

Rank 0 prints the model, batch size and number of workers, then one line per iteration,
``Iter #k: X img/sec per worker``, then ``Img/sec per worker: mean +-1.96*std`` and
``Total img/sec on N worker(s): ...``. CUDA is used when available (``--no-cuda`` to not).
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import sumflow.torch as hvd


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet: a 3x3 stem, stages of basic blocks, global pooling, a
    classifier."""

    def __init__(self, widths: Sequence[int], blocks: Sequence[int], classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        layers: list[nn.Module] = []
        cin = widths[0]
        for stage, (width, count) in enumerate(zip(widths, blocks, strict=True)):
            for b in range(count):
                stride = 2 if stage > 0 and b == 0 else 1
                layers.append(BasicBlock(cin, width, stride))
                cin = width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of 3x32x32 images."""
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def mlp(classes: int = 10) -> nn.Module:
    """Flattened 3x32x32 inputs through two hidden layers of 1024."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(3 * 32 * 32, 1024),
        nn.ReLU(inplace=True),
        nn.Linear(1024, 1024),
        nn.ReLU(inplace=True),
        nn.Linear(1024, classes),
    )


MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet20": lambda: ResNet([16, 32, 64], [3, 3, 3]),
    "resnet18": lambda: ResNet([64, 128, 256, 512], [2, 2, 2, 2]),
    "mlp": mlp,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (Horovod's flags, plus --model choices of our own and --json)."""
    parser = argparse.ArgumentParser(
        description="PyTorch synthetic benchmark through sumflow",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet20", help="model")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument(
        "--num-warmup-batches", type=int, default=10, help="batches before timing starts"
    )
    parser.add_argument(
        "--num-batches-per-iter", type=int, default=10, help="batches per benchmark iteration"
    )
    parser.add_argument("--num-iters", type=int, default=10, help="benchmark iterations")
    parser.add_argument("--no-cuda", action="store_true", help="run on the CPU even with CUDA")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per worker on the CPU (0: 1 with several workers, else torch's)",
    )
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    if min(args.batch_size, args.num_batches_per_iter, args.num_iters) < 1:
        parser.error("--batch-size, --num-batches-per-iter and --num-iters must be at least 1")
    if args.num_warmup_batches < 0:
        parser.error("--num-warmup-batches must not be negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status."""
    args = parse_args(argv)
    hvd.init()
    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    elif args.threads > 0:
        torch.set_num_threads(args.threads)
    elif hvd.size() > 1:
        torch.set_num_threads(1)
    device = torch.device("cuda" if cuda else "cpu")
    kind = "GPU" if cuda else "CPU"

    torch.manual_seed(0)
    model = MODELS[args.model]().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, 32, 32, device=device)
    target = torch.randint(0, 10, (args.batch_size,), device=device)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()

    def log(line: str) -> None:
        if hvd.rank() == 0:
            print(line, flush=True)

    params = sum(p.numel() for p in model.parameters())
    log(f"Model: {args.model} ({params / 1e6:.2f}M parameters)")
    log(f"Batch size: {args.batch_size}")
    log(
        f"Number of workers: {hvd.size()} ({kind}; gradients as "
        f"{'float16' if args.fp16_allreduce else 'float32'})"
    )

    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{x}: {img_sec:.1f} img/sec per worker")
        img_secs.append(img_sec)

    mean = float(np.mean(img_secs))
    conf = float(1.96 * np.std(img_secs))
    size = hvd.size()
    log(f"Img/sec per worker: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {size} worker(s): {size * mean:.1f} +-{size * conf:.1f}")
    if hvd.rank() == 0 and args.json is not None:
        result = {
            "model": args.model,
            "parameters": params,
            "batch_size": args.batch_size,
            "workers": size,
            "device": kind,
            "fp16_allreduce": args.fp16_allreduce,
            "img_sec_per_worker": img_secs,
            "img_sec_per_worker_mean": mean,
            "img_sec_per_worker_conf": conf,
            "img_sec_total": size * mean,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
