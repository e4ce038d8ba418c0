"""The knobs ByteScheduler tunes (§4.3), GradientFlow's fusion threshold, and the space
they are searched in.

Partition size and credit trade scheduling quality against per-partition overhead
(§4.1, §4.2): small partitions preempt sooner but pay a fixed cost each, and a large
credit fills the network stack but lets urgent partitions wait behind those already
sent. Both act multiplicatively (halving a partition doubles the partitions), so both are
searched on log scales. Credit is searched as a multiple of the partition size, at least
one: a credit below one partition would never let a partition out. When the optimizer
fuses gradients (lazy allreduce, §3.1), its threshold theta is a third knob, also on a log
scale: larger spans cost fewer messages but start later.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from sumflow import settings

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


#: The fusion thresholds searched when the optimizer fuses and nothing else is asked
#: (``SUMFLOW_AUTOTUNE_FUSION_BYTES``): from fusing only vectors of a few KB to spans of
#: the largest partitions.
DEFAULT_FUSION_RANGE = settings.AUTOTUNE_FUSION_BYTES.default


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")


@dataclass(frozen=True)
class Configuration:
    """One point of the space, as the communication service and the optimizer take it."""

    partition_bytes: int
    credit_bytes: int
    #: The fusion threshold theta; None where the optimizer does not fuse.
    fusion_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("partition_bytes", "credit_bytes"):
            _positive_int(name, getattr(self, name))
        if self.fusion_bytes is not None:
            _positive_int("fusion_bytes", self.fusion_bytes)
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
        fusion = (
            f", fusion {format_bytes(self.fusion_bytes)}" if self.fusion_bytes is not None else ""
        )
        return (
            f"partition {format_bytes(self.partition_bytes)}, credit "
            f"{format_bytes(self.credit_bytes)} ({k:.3g} partition{'' if k == 1 else 's'})"
            f"{fusion}"
        )

    def to_json(self) -> dict[str, int]:
        out = {"partition_bytes": self.partition_bytes, "credit_bytes": self.credit_bytes}
        if self.fusion_bytes is not None:
            out["fusion_bytes"] = self.fusion_bytes
        return out

    @classmethod
    def from_json(cls, data: object) -> Configuration:
        """The configuration in `data` (``{"partition_bytes": int, "credit_bytes": int}``,
        and ``"fusion_bytes"`` where the optimizer fuses)."""
        if not isinstance(data, dict):
            raise ValueError(f"a configuration is an object, not {type(data).__name__}")
        missing = {"partition_bytes", "credit_bytes"} - data.keys()
        if missing:
            raise ValueError(f"a configuration needs {sorted(missing)}; got {sorted(data)}")
        return cls(data["partition_bytes"], data["credit_bytes"], data.get("fusion_bytes"))


@dataclass(frozen=True)
class SearchSpace:
    """Partition sizes in [min_partition_bytes, max_partition_bytes], credits of
    [1, max_credit_partitions] partitions and, where the optimizer fuses, fusion
    thresholds in [min_fusion_bytes, max_fusion_bytes] (0, 0: not searched), all
    searched on log scales.

    The defaults span what 1 to 100 Gbit/s links need: 64 KiB (P3's 160 KB partitions
    and smaller, for slow links where preempting sooner pays) to 32 MiB (a partition
    takes 2.7 ms at 100 Gbit/s, so fixed costs of ~0.3 ms per partition stay small), and
    a credit of up to 16 partitions (enough to fill the send buffers of a fast link with
    small partitions).
    """

    min_partition_bytes: int = settings.AUTOTUNE_PARTITION_BYTES.default[0]
    max_partition_bytes: int = settings.AUTOTUNE_PARTITION_BYTES.default[1]
    max_credit_partitions: float = settings.AUTOTUNE_MAX_CREDIT_PARTITIONS.default
    min_fusion_bytes: int = 0
    max_fusion_bytes: int = 0

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
        flo, fhi = self.min_fusion_bytes, self.max_fusion_bytes
        if (flo, fhi) != (0, 0):
            for name, value in (("min_fusion_bytes", flo), ("max_fusion_bytes", fhi)):
                if isinstance(value, bool) or not isinstance(value, int) or value < ALIGN:
                    raise ValueError(
                        f"{name} must be an integer >= {ALIGN} (one page), or both 0 for no "
                        f"fusion, not {value!r}"
                    )
            if flo > fhi:
                raise ValueError(f"min_fusion_bytes={flo} is above max_fusion_bytes={fhi}")

    @property
    def tunes_fusion(self) -> bool:
        """Whether the fusion threshold is a knob of this space."""
        return self.max_fusion_bytes > 0

    @property
    def dims(self) -> int:
        """The knobs searched: 2, or 3 with fusion."""
        return 3 if self.tunes_fusion else 2

    def with_fusion(self, low: int, high: int) -> SearchSpace:
        """This space with fusion thresholds in [low, high] (0, 0: none)."""
        return dataclasses.replace(self, min_fusion_bytes=low, max_fusion_bytes=high)

    def capped(self, largest_tensor_bytes: int) -> SearchSpace:
        """This space with partitions no larger than the power of two that holds the
        largest tensor: beyond it every tensor is one partition, so larger sizes change
        nothing and would only spend trials."""
        if largest_tensor_bytes <= 0:
            raise ValueError(f"largest_tensor_bytes must be positive, not {largest_tensor_bytes}")
        whole = 1 << max(0, math.ceil(math.log2(largest_tensor_bytes)))
        top = max(self.min_partition_bytes, min(self.max_partition_bytes, whole))
        return dataclasses.replace(self, max_partition_bytes=top)

    def configuration(
        self, partition_bytes: float, credit_partitions: float, fusion_bytes: float | None = None
    ) -> Configuration:
        """The configuration nearest (`partition_bytes`, `credit_partitions`,
        `fusion_bytes`) inside the space: partition size and fusion threshold on grids of
        PARTITION_STEPS_PER_OCTAVE sizes per octave from the smallest, every size in
        whole pages. `fusion_bytes` is ignored, and None in the result, where the space
        does not search it."""
        point = (partition_bytes, credit_partitions, 1.0 if fusion_bytes is None else fusion_bytes)
        if not all(math.isfinite(x) for x in point):
            raise ValueError(f"not a point: {point}")
        partition = _on_grid(partition_bytes, self.min_partition_bytes, self.max_partition_bytes)
        k = min(max(credit_partitions, 1.0), self.max_credit_partitions)
        credit = max(partition, round(k * partition / ALIGN) * ALIGN)
        fusion = None
        if self.tunes_fusion:
            if fusion_bytes is None:
                raise ValueError("this space searches the fusion threshold: give fusion_bytes")
            fusion = _on_grid(fusion_bytes, self.min_fusion_bytes, self.max_fusion_bytes)
        return Configuration(partition, credit, fusion)

    def contains(self, config: Configuration) -> bool:
        """Whether `config` lies in this space (up to the rounding to whole pages)."""
        if (config.fusion_bytes is not None) != self.tunes_fusion:
            return False
        point = self.unit_point(config)
        slack = 0.01
        return all(-slack <= x <= 1 + slack for x in point)

    def unit_point(self, config: Configuration) -> tuple[float, ...]:
        """`config` in [0, 1]^dims: log partition size, log credit multiple and log
        fusion threshold, scaled to the space (where distances between configurations
        are measured)."""
        span_p = math.log(self.max_partition_bytes / self.min_partition_bytes) or 1.0
        span_c = math.log(self.max_credit_partitions) or 1.0
        point = (
            math.log(config.partition_bytes / self.min_partition_bytes) / span_p,
            math.log(config.credit_partitions) / span_c,
        )
        if not self.tunes_fusion:
            return point
        if config.fusion_bytes is None:
            raise ValueError(f"{config.describe()} has no fusion threshold; this space does")
        span_f = math.log(self.max_fusion_bytes / self.min_fusion_bytes) or 1.0
        return (*point, math.log(config.fusion_bytes / self.min_fusion_bytes) / span_f)

    def from_unit(self, *point: float) -> Configuration:
        """The configuration at a unit point of ``dims`` coordinates (inverse of
        ``unit_point``)."""
        if len(point) != self.dims:
            raise ValueError(f"a point of this space has {self.dims} coordinates, not {len(point)}")
        u, v = point[0], point[1]
        p = self.min_partition_bytes * (self.max_partition_bytes / self.min_partition_bytes) ** u
        fusion = None
        if self.tunes_fusion:
            ratio = self.max_fusion_bytes / self.min_fusion_bytes
            fusion = self.min_fusion_bytes * ratio ** point[2]
        return self.configuration(p, self.max_credit_partitions**v, fusion)

    def grid(
        self, partition_points: int, credit_points: int, fusion_points: int = 1
    ) -> list[Configuration]:
        """`partition_points` x `credit_points` (x `fusion_points`, where the space
        searches fusion) configurations evenly spaced on the log scales, partition-major
        (what grid search enumerates)."""
        for name, n in (
            ("partition_points", partition_points),
            ("credit_points", credit_points),
            ("fusion_points", fusion_points),
        ):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive integer, not {n!r}")

        def steps(n: int) -> list[float]:
            return [0.5] if n == 1 else [i / (n - 1) for i in range(n)]

        out: list[Configuration] = []
        for u in steps(partition_points):
            for v in steps(credit_points):
                for w in steps(fusion_points) if self.tunes_fusion else [None]:
                    config = self.from_unit(u, v) if w is None else self.from_unit(u, v, w)
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
        fusion = (
            f", fusion thresholds of {format_bytes(self.min_fusion_bytes)} to "
            f"{format_bytes(self.max_fusion_bytes)}"
            if self.tunes_fusion
            else ""
        )
        return (
            f"partitions of {format_bytes(self.min_partition_bytes)} to "
            f"{format_bytes(self.max_partition_bytes)}, {credit}{fusion}"
        )

    def to_json(self) -> dict[str, float]:
        out: dict[str, float] = {
            "min_partition_bytes": self.min_partition_bytes,
            "max_partition_bytes": self.max_partition_bytes,
            "max_credit_partitions": self.max_credit_partitions,
        }
        if self.tunes_fusion:
            out["min_fusion_bytes"] = self.min_fusion_bytes
            out["max_fusion_bytes"] = self.max_fusion_bytes
        return out


def _on_grid(size: float, lo: int, hi: int) -> int:
    """`size` clamped to [lo, hi], on the grid of PARTITION_STEPS_PER_OCTAVE sizes per
    octave from `lo`, in whole pages."""
    x = min(max(size, lo), hi)
    step = round(math.log2(x / lo) * PARTITION_STEPS_PER_OCTAVE)
    x = min(lo * 2 ** (step / PARTITION_STEPS_PER_OCTAVE), hi)
    return max(ALIGN, round(x / ALIGN) * ALIGN)
