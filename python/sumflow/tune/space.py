"""The two knobs ByteScheduler tunes (§4.3) and the space they are searched in.

Partition size and credit trade scheduling quality against per-partition overhead
(§4.1, §4.2): small partitions preempt sooner but pay a fixed cost each, and a large
credit fills the network stack but lets urgent partitions wait behind those already
sent. Both act multiplicatively (halving a partition doubles the partitions), so both are
searched on log scales. Credit is searched as a multiple of the partition size, at least
one: a credit below one partition would never let a partition out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KIB = 1 << 10
MIB = 1 << 20

#: Partition and credit sizes are whole pages: every dtype's element size divides them,
#: so no partition ever splits an element.
ALIGN = 4 * KIB

#: Partition sizes are a quarter octave apart (at most 9% from any size asked for). The
#: service keeps the keys of every partition size a job used, on every server, so a
#: continuous range would cost a copy of the model's keys per trial; on this grid trials
#: near each other reuse sizes.
PARTITION_STEPS_PER_OCTAVE = 4


def format_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit that keeps it at least 1 (``'1.5 MiB'``)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class Configuration:
    """One point of the space, as the communication service takes it."""

    partition_bytes: int
    credit_bytes: int

    def __post_init__(self) -> None:
        for name in ("partition_bytes", "credit_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if self.credit_bytes < self.partition_bytes:
            raise ValueError(
                f"credit_bytes={self.credit_bytes} is below one partition "
                f"({self.partition_bytes} B): no partition could ever be sent"
            )

    @property
    def credit_partitions(self) -> float:
        """The credit in partitions (ByteScheduler's window, counted in partitions)."""
        return self.credit_bytes / self.partition_bytes

    def describe(self) -> str:
        """``'partition 1 MiB, credit 4 MiB (4 partitions)'``."""
        k = self.credit_partitions
        return (
            f"partition {format_bytes(self.partition_bytes)}, credit "
            f"{format_bytes(self.credit_bytes)} ({k:.3g} partition{'' if k == 1 else 's'})"
        )

    def to_json(self) -> dict[str, int]:
        return {"partition_bytes": self.partition_bytes, "credit_bytes": self.credit_bytes}

    @classmethod
    def from_json(cls, data: object) -> Configuration:
        """The configuration in `data` (``{"partition_bytes": int, "credit_bytes": int}``)."""
        if not isinstance(data, dict):
            raise ValueError(f"a configuration is an object, not {type(data).__name__}")
        missing = {"partition_bytes", "credit_bytes"} - data.keys()
        if missing:
            raise ValueError(f"a configuration needs {sorted(missing)}; got {sorted(data)}")
        return cls(data["partition_bytes"], data["credit_bytes"])


@dataclass(frozen=True)
class SearchSpace:
    """Partition sizes in [min_partition_bytes, max_partition_bytes] and credits of
    [1, max_credit_partitions] partitions, both searched on log scales.

    The defaults span what 1 to 100 Gbit/s links need: 64 KiB (P3's 160 KB partitions
    and smaller, for slow links where preempting sooner pays) to 32 MiB (a partition
    takes 2.7 ms at 100 Gbit/s, so fixed costs of ~0.3 ms per partition stay small), and
    a credit of up to 16 partitions (enough to fill the send buffers of a fast link with
    small partitions).
    """

    min_partition_bytes: int = 64 * KIB
    max_partition_bytes: int = 32 * MIB
    max_credit_partitions: float = 16.0

    def __post_init__(self) -> None:
        lo, hi = self.min_partition_bytes, self.max_partition_bytes
        for name, value in (("min_partition_bytes", lo), ("max_partition_bytes", hi)):
            if isinstance(value, bool) or not isinstance(value, int) or value < ALIGN:
                raise ValueError(f"{name} must be an integer >= {ALIGN} (one page), not {value!r}")
        if lo > hi:
            raise ValueError(f"min_partition_bytes={lo} is above max_partition_bytes={hi}")
        credit = self.max_credit_partitions
        if isinstance(credit, bool) or not isinstance(credit, (int, float)) or not credit >= 1:
            raise ValueError(
                f"max_credit_partitions must be a number >= 1 (a credit is at least one "
                f"partition), not {credit!r}"
            )

    def capped(self, largest_tensor_bytes: int) -> SearchSpace:
        """This space with partitions no larger than the power of two that holds the
        largest tensor: beyond it every tensor is one partition, so larger sizes change
        nothing and would only spend trials."""
        if largest_tensor_bytes <= 0:
            raise ValueError(f"largest_tensor_bytes must be positive, not {largest_tensor_bytes}")
        whole = 1 << max(0, math.ceil(math.log2(largest_tensor_bytes)))
        top = max(self.min_partition_bytes, min(self.max_partition_bytes, whole))
        return SearchSpace(self.min_partition_bytes, top, self.max_credit_partitions)

    def configuration(self, partition_bytes: float, credit_partitions: float) -> Configuration:
        """The configuration nearest (`partition_bytes`, `credit_partitions`) inside the
        space: the partition size on a grid of PARTITION_STEPS_PER_OCTAVE sizes per
        octave from the smallest, both sizes in whole pages."""
        if not (math.isfinite(partition_bytes) and math.isfinite(credit_partitions)):
            raise ValueError(f"not a point: ({partition_bytes}, {credit_partitions})")
        lo = self.min_partition_bytes
        p = min(max(partition_bytes, lo), self.max_partition_bytes)
        step = round(math.log2(p / lo) * PARTITION_STEPS_PER_OCTAVE)
        p = min(lo * 2 ** (step / PARTITION_STEPS_PER_OCTAVE), self.max_partition_bytes)
        partition = max(ALIGN, round(p / ALIGN) * ALIGN)
        k = min(max(credit_partitions, 1.0), self.max_credit_partitions)
        credit = max(partition, round(k * partition / ALIGN) * ALIGN)
        return Configuration(partition, credit)

    def contains(self, config: Configuration) -> bool:
        """Whether `config` lies in this space (up to the rounding to whole pages)."""
        u, v = self.unit_point(config)
        slack = 0.01
        return -slack <= u <= 1 + slack and v <= 1 + slack

    def unit_point(self, config: Configuration) -> tuple[float, float]:
        """`config` in [0, 1]^2: log partition size and log credit multiple, scaled to
        the space (where distances between configurations are measured)."""
        span_p = math.log(self.max_partition_bytes / self.min_partition_bytes) or 1.0
        span_c = math.log(self.max_credit_partitions) or 1.0
        return (
            math.log(config.partition_bytes / self.min_partition_bytes) / span_p,
            math.log(config.credit_partitions) / span_c,
        )

    def from_unit(self, u: float, v: float) -> Configuration:
        """The configuration at unit point (`u`, `v`) (inverse of ``unit_point``)."""
        p = self.min_partition_bytes * (self.max_partition_bytes / self.min_partition_bytes) ** u
        return self.configuration(p, self.max_credit_partitions**v)

    def grid(self, partition_points: int, credit_points: int) -> list[Configuration]:
        """`partition_points` x `credit_points` configurations evenly spaced on the log
        scales, partition-major (what grid search enumerates)."""
        for name, n in (("partition_points", partition_points), ("credit_points", credit_points)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive integer, not {n!r}")

        def steps(n: int) -> list[float]:
            return [0.5] if n == 1 else [i / (n - 1) for i in range(n)]

        out: list[Configuration] = []
        for u in steps(partition_points):
            for v in steps(credit_points):
                config = self.from_unit(u, v)
                if config not in out:
                    out.append(config)
        return out

    def describe(self) -> str:
        """``'partitions of 64 KiB to 32 MiB, credits of 1 to 16 partitions'``."""
        credit = (
            "credit fixed at one partition"
            if self.max_credit_partitions == 1
            else f"credits of 1 to {self.max_credit_partitions:g} partitions"
        )
        return (
            f"partitions of {format_bytes(self.min_partition_bytes)} to "
            f"{format_bytes(self.max_partition_bytes)}, {credit}"
        )

    def to_json(self) -> dict[str, float]:
        return {
            "min_partition_bytes": self.min_partition_bytes,
            "max_partition_bytes": self.max_partition_bytes,
            "max_credit_partitions": self.max_credit_partitions,
        }
