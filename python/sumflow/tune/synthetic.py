"""A synthetic step-time model for testing tuners without a cluster.

It follows ByteScheduler's analysis of the two knobs (§4.1, §4.2), so it has the shape
the tuner meets in practice, an interior optimum on a non-smooth surface:

- every partition costs a fixed overhead θ, and partitions are counted per tensor with a
  ceiling (Σ ⌈s_i / δ⌉ θ), so small partitions pay and the surface has steps;
- a transfer cannot start its pull before a whole partition was pushed, nor be preempted
  mid-partition: about 2δ / B;
- a credit below the bandwidth-delay product leaves the link idle between windows
  (transfers take S / B · (1 + bdp / c)), while every credit byte already handed to the
  network delays the urgent first layers of the next iteration (w · c / B);
- fewer than two partitions in flight loses the push/pull overlap.

Noise is multiplicative and log-normal, with rare stalls, as measured step times have.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from sumflow.tune.space import MIB, Configuration

#: Tensor sizes in bytes of a model with a few large tensors among many small ones
#: (about 100 MiB, a convolutional body and two dense layers).
TENSORS = (
    [4 * 1024, 64 * 1024, 256 * 1024, 576 * 1024] * 4
    + [1 * MIB, 2 * MIB, 2 * MIB, 4 * MIB, 4 * MIB, 9 * MIB]
    + [64 * MIB, 4 * MIB, 16 * 1024]
)


@dataclass(frozen=True)
class SyntheticCluster:
    """The model's parameters: bandwidth, per-partition overhead, round trip, compute."""

    bandwidth_bytes_per_s: float = 10e9 / 8
    partition_overhead_s: float = 50e-6
    round_trip_s: float = 1e-3
    #: How many times per iteration the urgent layers wait behind credit already sent.
    preemptions: float = 4.0
    compute_s: float = 0.05
    noise: float = 0.03
    stall_probability: float = 0.02
    stall_s: float = 0.05

    def step_time(self, config: Configuration) -> float:
        """The noiseless step time of `config`, in seconds."""
        b = self.bandwidth_bytes_per_s
        delta, credit = config.partition_bytes, config.credit_bytes
        total = sum(TENSORS)
        partitions = sum(math.ceil(s / delta) for s in TENSORS)
        bdp = b * self.round_trip_s
        transfer = total / b * (1 + bdp / credit)
        overhead = partitions * self.partition_overhead_s
        granularity = 2 * delta / b
        preemption = self.preemptions * credit / b
        no_overlap = 0.2 * total / b * max(0.0, 2 - config.credit_partitions)
        return self.compute_s + transfer + overhead + granularity + preemption + no_overlap

    def sample(self, config: Configuration, rng: random.Random) -> float:
        """One measured step time of `config`: the step time with noise."""
        t = self.step_time(config) * rng.lognormvariate(0.0, self.noise)
        if rng.random() < self.stall_probability:
            t += self.stall_s
        return t
