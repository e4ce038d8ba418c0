"""Elastic training on scikit-learn's digits: the job goes on when workers fail or join.

The model, data and evaluation are ``train_digits.py``'s. What the job must not lose lives
in ``hvd.elastic.TorchState`` (model, optimizer, an ``ElasticSampler``, the epoch and the
step count) and is committed every ``--commit-every`` steps and at every epoch's end; the
training function runs under ``hvd.elastic.run``. When a worker dies the others go back
to the last commit and carry on without it; a worker started later (a slot that
``--host-discovery-script`` adds) joins at the next commit and receives the state. The
learning rate follows the number of workers (the global batch grows with them), and the
sampler shards only what is left of the epoch over the workers there are.

    sumflow-run -np 4 --min-np 2 python examples/train_digits_elastic.py
    sumflow-run -np 4 --min-np 2 python examples/train_digits_elastic.py \\
        --kill-worker w2 --kill-at-step 60          # a crash mid-training

Rank 0 prints one line per epoch, one per change of membership (with the time of the first
step after it) and the final metrics; ``--json PATH`` writes
them to a file as well.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from train_digits import DigitsNet, batches, evaluate, load_split, summed

import sumflow.torch as hvd


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        description="Train a small CNN on the digits in an elastic sumflow job.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=32, help="images per worker per step")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate per worker")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--seed", type=int, default=42, help="seed of the split, shuffles, init")
    p.add_argument("--test-fraction", type=float, default=0.2, help="share held out")
    p.add_argument("--commit-every", type=int, default=10, help="steps between commits")
    p.add_argument("--kill-worker", help="this worker (SUMFLOW_ELASTIC_WORKER) kills itself")
    p.add_argument("--kill-at-step", type=int, default=-1, help="... at this step (job-wide)")
    p.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="seconds each step also sleeps: a stand-in for a larger model's compute",
    )
    p.add_argument("--min-accuracy", type=float, default=0.0, help="fail below this (0 to 1)")
    p.add_argument("--json", type=Path, help="write the final metrics to this JSON file")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.lr <= 0 or args.commit_every < 1:
        p.error("--epochs, --batch-size and --commit-every must be at least 1, --lr positive")
    if args.pause < 0:
        p.error("--pause must be at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Trains through changes of membership, evaluates, reports; the exit status."""
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)  # several workers share this machine's cores
    torch.manual_seed(args.seed)
    me = os.environ.get("SUMFLOW_ELASTIC_WORKER", "")

    train_x, train_y, test_x, test_y = load_split(args.seed, args.test_fraction)
    model = DigitsNet()
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_x, shuffle=True, seed=args.seed)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, steps=0)
    changes: list[dict[str, float]] = []
    interrupted: list[bool] = []

    def on_reset() -> None:
        # The global batch changed with the membership: so does the rate.
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        interrupted.append(True)

    state.register_reset_callbacks([on_reset])

    def train_epoch(state: hvd.elastic.TorchState) -> tuple[float, float]:
        model.train()
        loss_sum = correct = 0.0
        for i, batch in enumerate(batches(torch.tensor(list(sampler)), args.batch_size)):
            if me == args.kill_worker and state.steps == args.kill_at_step:
                print(f"killing {me} at step {state.steps} at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = train_x[batch], train_y[batch]
            optimizer.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            optimizer.step()
            if interrupted:
                # Unix time, so that it compares with a failure's on another process.
                changes.append({"workers": hvd.size(), "first_step_at": time.time()})
                if hvd.rank() == 0:
                    print(
                        f"membership change: {hvd.size()} workers, first step at "
                        f"{changes[-1]['first_step_at']:.3f}",
                        flush=True,
                    )
                interrupted.clear()
            if args.pause:
                time.sleep(args.pause)
            loss_sum += loss.item() * len(y)
            correct += (logits.argmax(dim=1) == y).sum().item()
            sampler.record_batch(i, args.batch_size)
            state.steps += 1
            if state.steps % args.commit_every == 0:
                state.commit()
        return loss_sum, correct

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < args.epochs:
            loss_sum, correct = train_epoch(state)
            loss_total, correct_total = summed([loss_sum, correct], "train.metrics")
            if hvd.rank() == 0:
                # Counts from the last membership's part of the epoch only, after a change.
                print(
                    f"epoch {state.epoch + 1:>3}/{args.epochs}  {hvd.size()} workers  "
                    f"loss sum {loss_total:9.2f}  correct {correct_total:5.0f}",
                    flush=True,
                )
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()

    start = time.perf_counter()
    train(state)
    seconds = time.perf_counter() - start
    accuracy, test_loss = evaluate(model, test_x, test_y, hvd.rank(), hvd.size())
    metrics = {
        "accuracy": accuracy,
        "test_loss": test_loss,
        "workers": hvd.size(),
        "steps": state.steps,
        "seconds": seconds,
        "changes": changes,
    }
    if hvd.rank() == 0:
        print(
            f"test accuracy {accuracy:.2%} (loss {test_loss:.4f}) after {args.epochs} epochs "
            f"and {state.steps} steps, {hvd.size()} workers at the end, {seconds:.1f} s",
            flush=True,
        )
        if args.json is not None:
            args.json.write_text(json.dumps(metrics, indent=2) + "\n")
    hvd.shutdown()
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
