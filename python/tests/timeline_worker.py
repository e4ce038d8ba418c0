"""A worker process for test_trace.py: ``python timeline_worker.py DIR``.

Runs an allreduce before, three operations (allreduce, allgather, broadcast) in a script
span and a DistributedOptimizer step between ``start_timeline(DIR/timeline-rank{r}.json,
mark_cycles=True)`` and ``stop_timeline()``, then one more allreduce after it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import sumflow.torch as hvd
from sumflow.torch import trace

hvd.init()
rank, size = hvd.rank(), hvd.size()
model = torch.nn.Linear(4, 2)
# Fused, one parameter a span (so each keeps its own name): spans are sent by prepared sums.
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1),
    named_parameters=model.named_parameters(),
    fusion_threshold=1,
)
hvd.allreduce(torch.ones(10), name="before")
hvd.start_timeline(Path(sys.argv[1]) / f"timeline-rank{rank}.json", mark_cycles=True)
with trace.span("script", "operations"):
    x = hvd.allreduce(torch.full((1000,), float(rank + 1)), op=hvd.Sum, name="x")
    g = hvd.allgather(torch.full((2, 3), float(rank)), name="g")
    b = hvd.broadcast(torch.full((5,), float(rank + 7)), root_rank=0, name="b")
model(torch.ones(3, 4)).sum().backward()
optimizer.step()
hvd.stop_timeline()
hvd.allreduce(torch.ones(10), name="after")
assert x[0].item() == sum(range(1, size + 1))
assert g.shape == (2 * size, 3)
assert g[-1, 0].item() == size - 1
assert b[0].item() == 7.0
hvd.shutdown()
