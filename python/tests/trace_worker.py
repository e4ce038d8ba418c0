"""A worker process for test_trace.py: ``python trace_worker.py STEPS``.

Each step records a forward span holding a nested layer span, an allreduce inside a wait
span and a decision instant, then ends with ``trace.mark_step()``.
"""

from __future__ import annotations

import sys
import time

import torch

import sumflow.torch as hvd
from sumflow.torch import trace

hvd.init()
for step in range(int(sys.argv[1])):
    with trace.span("compute", "forward", step=step):
        x = torch.full((1000,), float(hvd.rank() + 1))
        with trace.span("compute", "layer", index=0, kind="linear"):
            time.sleep(0.002)
    with trace.span("waits", "allreduce", step=step):
        hvd.allreduce_(x, op=hvd.Sum, name="x")
    assert x[0].item() == sum(range(1, hvd.size() + 1))
    trace.instant("tuner", "decision", step=step, better=True, score=0.5)
    trace.mark_step()
hvd.shutdown()
