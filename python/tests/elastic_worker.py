"""A worker of test_elastic.py: trains a one-weight model in an elastic job, through
failures and joins, and prints what every step saw.

Each step's gradient is 1 on every worker, so averaged it is 1 whatever the membership and
the final weight is exactly -lr * steps when no step is lost or counted twice; every step
also sums 1 over the workers, which must equal the membership's size.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

import sumflow.torch as hvd

STEPS = int(os.environ.get("ELASTIC_TEST_STEPS", "40"))
VICTIM = os.environ.get("ELASTIC_TEST_VICTIM")
KILL_AT = int(os.environ.get("ELASTIC_TEST_KILL_AT", "-1"))
PAUSE = float(os.environ.get("ELASTIC_TEST_PAUSE", "0.05"))
ME = os.environ.get("SUMFLOW_ELASTIC_WORKER", "?")
#: At this step worker w0 creates this file (a discovery script then lists one more slot).
GROW_AT = int(os.environ.get("ELASTIC_TEST_GROW_AT", "-1"))
GROW_FILE = os.environ.get("ELASTIC_TEST_GROW_FILE")


def main() -> None:
    hvd.init()
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.125), named_parameters=model.named_parameters()
    )
    state = hvd.elastic.TorchState(model, optimizer, step=0, sizes=[])
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.step < STEPS:
            if ME == VICTIM and state.step == KILL_AT:
                print(f"killing myself at step {state.step} at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if ME == "w0" and state.step == GROW_AT and GROW_FILE:
                open(GROW_FILE, "w").close()
            optimizer.zero_grad()
            model.weight.sum().backward()
            optimizer.step()
            counted = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="count").item()
            if counted != hvd.size():
                raise AssertionError(f"step {state.step}: summed {counted} over {hvd.size()}")
            state.step += 1
            state.sizes.append(hvd.size())
            state.commit()
            time.sleep(PAUSE)

    train(state)
    result = {
        "worker": ME,
        "rank": hvd.rank(),
        "size": hvd.size(),
        "weight": model.weight.detach().flatten().tolist(),
        "sizes": state.sizes,
        "resets": resets,
    }
    print("RESULT " + json.dumps(result), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
