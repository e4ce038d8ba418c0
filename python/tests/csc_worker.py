"""A worker process for test_csc.py: `python csc_worker.py OUTDIR`.

Trains three parameters with CoarseSparseSGD on gradients drawn from `csc_reference`
(the same per rank and step as the reference uses), and saves to OUTDIR/rank<r>.pt the
chunks each step sent, the weights after each step, and a state_dict taken midway, with
the weights a fresh optimizer restored from it reaches, and the bytes it exchanged with
the servers per tensor.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from csc_reference import CONFIG, STEPS, gradients, initial_weights

import sumflow.torch as hvd
from sumflow.torch.csc import CoarseSparseSGD


def make(weights: list[torch.Tensor]) -> tuple[list[torch.Tensor], CoarseSparseSGD]:
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    return params, CoarseSparseSGD(params, **CONFIG)


def train(params: list[torch.Tensor], opt: CoarseSparseSGD, steps: range) -> tuple[list, list]:
    sent, weights = [], []
    for step in steps:
        for p, g in zip(params, gradients(hvd.rank(), step), strict=True):
            p.grad = torch.from_numpy(g)
        sent.append(opt.important.tolist())
        opt.step()
        weights.append([p.detach().clone() for p in params])
    return sent, weights


def main() -> None:
    out = Path(sys.argv[1])
    hvd.init()
    params, opt = make([torch.from_numpy(w) for w in initial_weights()])
    half = STEPS // 2
    sent, weights = train(params, opt, range(half))
    checkpoint = opt.state_dict()
    rest_sent, rest_weights = train(params, opt, range(half, STEPS))
    # A second optimizer, restored from the checkpoint, must continue identically.
    params2, opt2 = make(weights[-1])
    opt2.name = "restored"
    opt2.load_state_dict(checkpoint)
    restored_sent, restored_weights = train(params2, opt2, range(half, STEPS))
    torch.save(
        {
            "sent": sent + rest_sent,
            "weights": weights + rest_weights,
            "restored_sent": restored_sent,
            "restored_weights": restored_weights,
            "wire": {k: (v.sent, v.received) for k, v in hvd.wire_bytes().items()},
            "wire_total": hvd.total_wire_bytes(),
        },
        out / f"rank{hvd.rank()}.pt",
    )
    hvd.shutdown()


if __name__ == "__main__":
    main()
