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
#: "STEP:MARK:ACK": at STEP, before its gradient is pushed, worker w0 creates MARK and
#: waits for ACK, so that the others' pushes of that round wait on the servers meanwhile.
HOLD = os.environ.get("ELASTIC_TEST_HOLD", "")
#: "STEP:PATH,...": at each STEP worker w0 creates PATH (a discovery script reads them).
MARKS = [
    (int(step), path)
    for step, path in (
        m.split(":", 1) for m in os.environ.get("ELASTIC_TEST_MARKS", "").split(",") if m
    )
]


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
            for step, path in MARKS:
                if ME == "w0" and state.step == step:
                    open(path, "w").close()
            if HOLD and ME == "w0" and state.step == int(HOLD.split(":")[0]):
                _, mark, ack = HOLD.split(":")
                open(mark, "w").close()
                deadline = time.monotonic() + 60
                while not os.path.exists(ack) and time.monotonic() < deadline:
                    time.sleep(0.01)
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
