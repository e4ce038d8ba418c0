"""Data-parallel training of a small CNN on scikit-learn's digits, through sumflow.

The data set ships with scikit-learn (1797 grey 8x8 images of the digits 0 to 9), so
nothing is downloaded. Every worker makes the same seeded train/test split, takes its own
shard of the training set each epoch (a seeded shuffle, like PyTorch's
DistributedSampler), and averages gradients with the others through
``sumflow.torch.DistributedOptimizer``. Rank 0's initial weights and optimizer state are
broadcast to everyone first. The learning rate is the per-worker rate times the number of
workers, since the global batch grows with them (Goyal et al., 2017). The test accuracy is
computed on shards of the test set and summed across workers with ``allreduce``.

With ``--adasum`` the workers' updates are combined by Adasum (``op=hvd.Adasum``, Horovod's
delta optimizer) at the per-worker rate instead. With ``--asynchronous`` the workers train
asynchronously (``AsyncOptimizer``, BytePS §4.3): each applies its own gradients at the
per-worker rate and pushes the change to the summation servers, which keep the parameters;
``--staleness N`` bounds how far a worker may run ahead of the slowest.
``--slow-rank R --slow-factor F`` makes one worker F times slower (it sleeps after each
step), to see what asynchrony buys the others.

Run it with the launcher, or alone as a job of one::

    sumflow-run -np 4 --servers 2 python examples/train_digits.py
    python examples/train_digits.py --epochs 10 --json digits.json

Rank 0 prints one line per epoch (plus a progress bar when its stderr is a terminal) and
the final metrics; ``--json PATH`` writes them to a file as well.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

import sumflow.torch as hvd


class DigitsNet(nn.Module):
    """Two 3x3 convolutions, one 2x2 max-pool and two linear layers (38k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of 1x8x8 images."""
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def load_split(
    seed: int, test_fraction: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits as (train images, train labels, test images, test labels): images scaled
    to [0, 1] with shape (N, 1, 8, 8). The split is stratified and seeded, so it is the
    same on every worker."""
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        list(range(len(labels))),
        test_size=test_fraction,
        random_state=seed,
        stratify=digits.target,
    )
    train = torch.tensor(train_idx)
    test = torch.tensor(test_idx)
    return images[train], labels[train], images[test], labels[test]


def shard(n: int, rank: int, size: int, seed: int, epoch: int) -> torch.Tensor:
    """This worker's sample indices for one epoch, as DistributedSampler draws them: a
    permutation seeded by (seed, epoch), identical on every worker, padded by wrapping
    around to a multiple of ``size``, then every ``size``-th index from ``rank`` on. Every
    worker gets the same number, so all make the same number of optimizer steps."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=generator)
    total = math.ceil(n / size) * size
    if total > n:
        order = torch.cat([order, order[: total - n]])
    return order[rank:total:size]


def batches(indices: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    """Consecutive batches of ``indices`` (the last one may be smaller)."""
    for start in range(0, len(indices), batch_size):
        yield indices[start : start + batch_size]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description="Train a small CNN on scikit-learn's digits across sumflow workers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="images per worker per step")
    parser.add_argument(
        "--lr",
        type=float,
        default=0.02,
        help="learning rate per worker; the optimizer uses lr x number of workers",
    )
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--seed", type=int, default=42, help="seed of the split, shuffles, init")
    parser.add_argument(
        "--test-fraction", type=float, default=0.2, help="share of the images held out"
    )
    parser.add_argument(
        "--fp16", action="store_true", help="send gradients as float16 (Compression.fp16)"
    )
    parser.add_argument(
        "--compression",
        metavar="SPEC",
        help="send gradients through this compressor (Compression.parse): e.g. topk:ratio=0.01, "
        "randomk:ratio=0.1, sign, dithering:levels=7, fp16",
    )
    parser.add_argument(
        "--csc",
        type=float,
        metavar="DENSITY",
        help="coarse-grained sparse communication (CoarseSparseSGD): send this fraction of "
        "gradient chunks each step, e.g. 0.15 for 85%% sparsity",
    )
    parser.add_argument(
        "--csc-chunk",
        type=int,
        default=256,
        help="CSC: gradients per chunk (151 chunks of this 38k-parameter model; the paper's 32K "
        "chunks suit models of millions)",
    )
    parser.add_argument(
        "--csc-warmup-epochs",
        type=float,
        default=2.0,
        help="CSC: epochs over which sparsity ramps up from dense",
    )
    parser.add_argument(
        "--asynchronous",
        action="store_true",
        help="asynchronous training (AsyncOptimizer): each worker applies its own gradients "
        "at the per-worker lr and pushes the change; the servers keep the parameters",
    )
    parser.add_argument(
        "--adasum",
        action="store_true",
        help="combine the workers' updates by Adasum (DistributedOptimizer(op=Adasum), a "
        "power-of-two number of workers) at the per-worker lr, instead of averaging gradients",
    )
    parser.add_argument(
        "--staleness",
        type=int,
        help="with --asynchronous: at most this many steps ahead of the slowest worker",
    )
    parser.add_argument(
        "--slow-rank", type=int, help="this worker sleeps after each step (see --slow-factor)"
    )
    parser.add_argument(
        "--slow-factor",
        type=float,
        default=2.0,
        help="--slow-rank's steps take this many times as long as its own compute",
    )
    parser.add_argument(
        "--min-accuracy",
        type=float,
        default=0.0,
        help="exit with status 1 when the test accuracy ends below this (0 to 1)",
    )
    parser.add_argument("--json", type=Path, help="write the final metrics to this JSON file")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.lr <= 0:
        parser.error("--epochs and --batch-size must be at least 1 and --lr positive")
    if not 0.0 < args.test_fraction < 1.0:
        parser.error("--test-fraction must lie between 0 and 1")
    if sum([args.csc is not None, args.fp16, args.compression is not None]) > 1:
        parser.error("--csc, --fp16 and --compression are separate experiments: give one")
    if args.csc is not None and not 0.0 < args.csc <= 1.0:
        parser.error("--csc must lie in (0, 1]")
    if args.csc_chunk < 1 or args.csc_warmup_epochs < 0:
        parser.error("--csc-chunk must be at least 1 and --csc-warmup-epochs at least 0")
    if args.staleness is not None and not args.asynchronous:
        parser.error("--staleness bounds --asynchronous training")
    if args.asynchronous and (args.csc is not None or args.fp16 or args.compression):
        parser.error("--asynchronous sends raw parameter changes: no --csc, --fp16, --compression")
    if args.adasum and (args.asynchronous or args.csc is not None or args.fp16 or args.compression):
        parser.error(
            "--adasum combines raw updates: no --asynchronous, --csc, --fp16 or --compression"
        )
    if args.slow_factor < 1.0:
        parser.error("--slow-factor must be at least 1")
    if args.compression is not None:
        try:
            hvd.Compression.parse(args.compression)
        except ValueError as e:
            parser.error(f"--compression: {e}")
    return args


def summed(values: Sequence[float], name: str) -> list[float]:
    """``values`` summed element-wise over all workers (one allreduce)."""
    total = hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=hvd.Sum, name=name)
    return [float(v) for v in total]


def evaluate(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, rank: int, size: int
) -> tuple[float, float]:
    """(accuracy, mean loss) on the whole test set: each worker scores every size-th
    image from its rank on, and the counts are summed over the workers."""
    model.eval()
    with torch.no_grad():
        logits = model(images[rank::size])
        mine = labels[rank::size]
        loss = F.cross_entropy(logits, mine, reduction="sum").item()
        correct = (logits.argmax(dim=1) == mine).sum().item()
    loss_sum, correct_sum, count = summed([loss, correct, len(mine)], "test.metrics")
    return correct_sum / count, loss_sum / count


def gradient_traffic(
    before: dict[str, hvd.WireBytes],
    after: dict[str, hvd.WireBytes],
    only: Callable[[str], bool] = lambda name: True,
) -> hvd.WireBytes:
    """The bytes exchanged between two ``wire_bytes()`` readings for the tensors `only`
    accepts, but the metrics' sums."""
    total = hvd.WireBytes()
    for name, b in after.items():
        if not name.endswith(".metrics") and only(name):
            total = total + (b - before.get(name, hvd.WireBytes()))
    return total


def is_norms(name: str) -> bool:
    """CSC's exchange of chunk norms (the rest is gradients)."""
    return name.endswith(".norms")


def main(argv: Sequence[str] | None = None) -> int:
    """Trains, evaluates, reports; returns the exit status."""
    args = parse_args(argv)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if size > 1:
        # Several workers share this machine's cores: one thread each avoids oversubscription.
        torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    train_x, train_y, test_x, test_y = load_split(args.seed, args.test_fraction)
    model = DigitsNet()
    # Synchronous steps average the workers' gradients, so the rate grows with them;
    # asynchronous workers each apply their own, and their changes add up on the servers.
    # Adasum adds orthogonal updates and averages agreeing ones: no scaling either.
    lr = args.lr if args.asynchronous or args.adasum else args.lr * size
    steps = math.ceil(math.ceil(len(train_y) / size) / args.batch_size)
    # Every worker starts from rank 0's weights (and optimizer state).
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer: torch.optim.Optimizer
    if args.csc is not None:
        optimizer = hvd.CoarseSparseSGD(
            model.parameters(),
            lr=lr,
            momentum=args.momentum,
            density=args.csc,
            chunk_elements=args.csc_chunk,
            warmup_steps=round(args.csc_warmup_epochs * steps),
        )
        sent_as = f"chunks of {args.csc_chunk}, {args.csc:.0%} of them per step (CSC)"
    else:
        sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
        hvd.broadcast_optimizer_state(sgd, root_rank=0)
        if args.compression is not None:
            compression = hvd.Compression.parse(args.compression)
            sent_as = repr(compression)
        else:
            compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none
            sent_as = "float16" if args.fp16 else "float32"
        if args.asynchronous:
            optimizer = hvd.AsyncOptimizer(
                sgd, named_parameters=model.named_parameters(), staleness=args.staleness
            )
            bound = "unbounded" if args.staleness is None else f"staleness {args.staleness}"
            sent_as = f"parameter changes, asynchronously ({bound})"
        else:
            optimizer = hvd.DistributedOptimizer(
                sgd,
                named_parameters=model.named_parameters(),
                compression=compression,
                op=hvd.Adasum if args.adasum else hvd.Average,
            )
            if args.adasum:
                sent_as = "parameter updates, combined by Adasum"

    if rank == 0:
        print(
            f"digits: {len(train_y)} training and {len(test_y)} test images; {size} worker(s), "
            f"batch {args.batch_size} per worker ({args.batch_size * size} in all), "
            f"{steps} steps per epoch; lr {lr:g}; gradients sent as {sent_as}",
            flush=True,
        )
    show_bar = rank == 0 and sys.stderr.isatty()
    train_seconds = 0.0
    train_samples = 0.0
    train_steps = 0
    wire_before = hvd.wire_bytes()
    steps_before_last_epoch = 0
    own_seconds = 0.0  # this worker's time in its steps, waits at epoch ends left out
    for epoch in range(args.epochs):
        if epoch == args.epochs - 1:
            # The last epoch alone: CSC's warm-up is over, every step is as sparse as asked.
            wire_last = hvd.wire_bytes()
            steps_before_last_epoch = train_steps
        model.train()
        loss_sum = correct = count = 0.0
        bar = tqdm(total=steps, desc=f"epoch {epoch + 1}", leave=False, disable=not show_bar)
        start = time.perf_counter()
        for batch in batches(shard(len(train_y), rank, size, args.seed, epoch), args.batch_size):
            step_start = time.perf_counter()
            x, y = train_x[batch], train_y[batch]
            optimizer.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(y)
            correct += (logits.argmax(dim=1) == y).sum().item()
            count += len(y)
            train_steps += 1
            if rank == args.slow_rank:
                time.sleep((time.perf_counter() - step_start) * (args.slow_factor - 1.0))
            own_seconds += time.perf_counter() - step_start
            bar.update()
        elapsed = time.perf_counter() - start
        bar.close()
        # Sums over workers: loss, correct, samples, and seconds (for the mean epoch time).
        loss_sum, correct, count, seconds = summed(
            [loss_sum, correct, count, elapsed], "train.metrics"
        )
        seconds /= size
        train_seconds += seconds
        train_samples += count
        if rank == 0:
            tqdm.write(
                f"epoch {epoch + 1:>3}/{args.epochs}  loss {loss_sum / count:.4f}  "
                f"train accuracy {correct / count:6.2%}  {count / seconds:8.0f} samples/s",
                file=sys.stdout,
            )
            sys.stdout.flush()

    wire_after = hvd.wire_bytes()
    wire = gradient_traffic(wire_before, wire_after)
    last_epoch_steps = train_steps - steps_before_last_epoch
    last_gradients = gradient_traffic(wire_last, wire_after, lambda n: not is_norms(n))
    last_norms = gradient_traffic(wire_last, wire_after, is_norms)
    accuracy, test_loss = evaluate(model, test_x, test_y, rank, size)
    samples_per_s = train_samples / train_seconds
    # Each worker's steps per second in its own steps (one slot per rank, summed).
    rates = summed(
        [train_steps / own_seconds if r == rank else 0.0 for r in range(size)], "rates.metrics"
    )
    metrics = {
        "accuracy": accuracy,
        "test_loss": test_loss,
        "samples_per_s": samples_per_s,
        "train_seconds": train_seconds,
        "epochs": args.epochs,
        "workers": size,
        "batch_size": args.batch_size,
        "lr": lr,
        "fp16": args.fp16,
        "compression": args.compression,
        "csc_density": args.csc,
        "csc_chunk": args.csc_chunk if args.csc is not None else None,
        "asynchronous": args.asynchronous,
        "staleness": args.staleness,
        "slow_rank": args.slow_rank,
        "slow_factor": args.slow_factor if args.slow_rank is not None else None,
        "steps_per_s_by_rank": rates,
        # Rank 0's bytes to and from the summation servers per training step for its
        # gradients (CSC's norm exchange included), counted at its sockets.
        "wire_sent_per_step": wire.sent / train_steps,
        "wire_received_per_step": wire.received / train_steps,
        # The same over the last epoch, gradients and CSC's norms apart.
        "last_epoch_gradients_sent_per_step": last_gradients.sent / last_epoch_steps,
        "last_epoch_gradients_received_per_step": last_gradients.received / last_epoch_steps,
        "last_epoch_norms_sent_per_step": last_norms.sent / last_epoch_steps,
        "last_epoch_norms_received_per_step": last_norms.received / last_epoch_steps,
    }
    if rank == 0:
        print(
            f"test accuracy {accuracy:.2%} (loss {test_loss:.4f}) after {args.epochs} epochs; "
            f"training: {samples_per_s:.0f} samples/s in all over {size} worker(s), "
            f"{train_seconds:.1f} s; {wire.sent / train_steps / 1e3:.1f} kB sent and "
            f"{wire.received / train_steps / 1e3:.1f} kB received per step by rank 0; "
            f"last epoch: gradients {last_gradients.sent / last_epoch_steps / 1e3:.2f} kB sent, "
            f"{last_gradients.received / last_epoch_steps / 1e3:.2f} kB received per step; "
            f"steps/s by rank: {', '.join(f'{r:.0f}' for r in rates)}"
            + (
                f", norms {last_norms.sent / last_epoch_steps / 1e3:.2f} kB sent"
                if last_norms.sent
                else ""
            ),
            flush=True,
        )
        if args.json is not None:
            args.json.write_text(json.dumps(metrics, indent=2) + "\n")
    hvd.shutdown()
    if accuracy < args.min_accuracy:
        if rank == 0:
            print(
                f"test accuracy {accuracy:.2%} is below --min-accuracy {args.min_accuracy:.2%}",
                file=sys.stderr,
            )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
