"""A worker for test_launch_envs.py and test_clusters.py: joins the job its launcher's
environment describes, sums ones across the workers and prints one JSON line of what it
saw (rank, size, local rank and size, the sum)."""

from __future__ import annotations

import json
import sys

import torch

import sumflow.torch as hvd

hvd.init()
total = hvd.allreduce(torch.ones(3), op=hvd.Sum)
seen = {
    "rank": hvd.rank(),
    "size": hvd.size(),
    "local_rank": hvd.local_rank(),
    "local_size": hvd.local_size(),
    "sum": total.tolist(),
}
# One write of the whole line: tasks share the stand-in srun's stdout, and print() writes
# the text and its newline apart when Python runs unbuffered (PYTHONUNBUFFERED).
sys.stdout.write(json.dumps(seen) + "\n")
sys.stdout.flush()
hvd.shutdown()
