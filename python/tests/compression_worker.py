"""A worker process for test_compression.py: `python compression_worker.py OUTDIR`.

Averages the gradients of compression_reference.py through each of the core's
compressors and through a Python compressor registered by name, trains a small model
with a compressing DistributedOptimizer, and saves what it received, the model's
parameters and its bytes on the wire to OUTDIR/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from compression_reference import ELEMENTS, STEPS, TOPK_RATIO, gradient

import sumflow.torch as hvd
from sumflow.torch import Compression, Compressor, ErrorFeedback


class Alternate(Compressor):
    """Sends the even elements, then the odd ones, and so on: summable as sent, and
    lossless only with error feedback."""

    def __init__(self) -> None:
        self.phase = 0

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        self.phase ^= 1
        sent = tensor.reshape(-1)[1 - self.phase :: 2].contiguous()
        return sent, (tensor.shape, 1 - self.phase)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        shape, phase = ctx
        out = torch.zeros(shape.numel(), dtype=tensor.dtype)
        out[phase::2] = tensor
        return out.view(shape)


def averaged(name: str, compression: Any, steps: int = STEPS) -> list[torch.Tensor]:
    got = []
    for step in range(steps):
        g = torch.from_numpy(gradient(hvd.rank(), step))
        got.append(hvd.allreduce(g, name=name, compression=compression))
    return got


def train(compression: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(hvd.rank())
    teacher = torch.Generator().manual_seed(99)
    w = torch.randn(64, 4, generator=teacher)
    losses = []
    for _ in range(30):
        x = torch.randn(32, 64, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x @ w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def ddp(compression: Any, name: str) -> list[torch.Tensor]:
    """A few steps of DDP with sumflow's hook sending gradients through `compression`."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    net = DistributedDataParallel(model)
    net.register_comm_hook(hvd.DDPHookState(net, compression, name), hvd.ddp_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(hvd.rank())
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(16, 64, generator=gen)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    out = Path(sys.argv[1])
    hvd.init()
    Compression.register("alternate", lambda: ErrorFeedback(Alternate()))
    alternate = Compression.parse("alternate")
    halves = [
        hvd.allreduce(
            torch.from_numpy(gradient(hvd.rank(), 0)).view(50, -1),
            name="alt",
            compression=alternate,
        ).reshape(-1),
        hvd.allreduce(torch.zeros(50, ELEMENTS // 50), name="alt", compression=alternate).reshape(
            -1
        ),
    ]
    results = {
        "topk": averaged("topk", Compression.topk(TOPK_RATIO, min_elements=1000)),
        "sign": averaged("sign", Compression.sign(min_elements=1000)),
        "randomk": averaged("randomk", Compression.randomk(0.1, error_feedback=False)),
        "dithering": averaged("dithering", Compression.dithering(3)),
        "alternate": halves,
        "small": averaged("small", Compression.topk(0.01, min_elements=10_000), steps=1)[0],
        "half": hvd.allreduce(
            torch.from_numpy(gradient(hvd.rank(), 0)).half(),
            name="half",
            compression=Compression.topk(1.0, min_elements=1),
        ),
        "trained": train(Compression.topk(0.05, min_elements=1000)),
        "elements": ELEMENTS,
    }
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())
    results["ddp"] = ddp(Compression.none, "ddp-dense")
    results["ddp-topk"] = ddp(Compression.topk(1.0, min_elements=1), "ddp-topk")
    dist.destroy_process_group()
    results["wire"] = {k: (v.sent, v.received) for k, v in hvd.wire_bytes().items()}
    torch.save(results, out / f"rank{hvd.rank()}.pt")
    hvd.shutdown()


if __name__ == "__main__":
    main()
