"""Gradient compression applied around push_pull: Horovod's interface, the core's
compressors, and a registry for your own.

Three kinds of compressor:

- **Casts** (``Compression.fp16``, ``Compression.bf16``) halve the bytes on the wire. The
  summation servers accumulate 16-bit pushes in f32 and round once, so the sum loses no
  more than the cast itself. With mixed precision training, unscale gradients
  (``GradScaler.unscale_``) only after ``optimizer.synchronize()``; fp16 overflows to inf
  for values above 65504, which GradScaler detects and skips like any other overflow.
- **Core compressors** (``Compression.topk``, ``.randomk``, ``.sign``, ``.dithering``) run
  in sumflow's core on every partition of a float tensor: the worker compresses each
  partition as it goes out, keeping what compression dropped in a residual when error
  feedback is on; the summation server decodes the pushes, sums them and compresses the
  sum again (with a residual of its own); the worker decodes the sum in place. Tensors
  with fewer than ``min_elements`` elements go uncompressed.
- **Your own**, in Python: any object with ``compress(tensor) -> (wire, ctx)`` and
  ``decompress(wire, ctx) -> tensor`` whose wire tensors the servers can sum elementwise
  (the same shape and dtype on every worker, and the sum of the wire tensors decodes to
  what you want: a cast, a projection, a random-k with a seed shared by the workers).
  Wrap it in ``ErrorFeedback`` to keep what it loses per tensor, and ``register`` it to
  select it by name (``Compression.get``, ``SUMFLOW_COMPRESSION``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from sumflow import settings

#: What the core is told about a tensor's compression: (compressor, parameter, feedback).
CoreSpec = tuple[str, float, bool]


class Compressor:
    """Horovod's interface. Subclasses override both methods (static, class or instance
    methods alike): the servers sum what ``compress`` returns, elementwise, over the
    workers, and ``decompress`` turns that sum back into the tensor's form."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor to send and the context ``decompress`` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The summed tensor in the original form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
    """`tensor` in `dtype` if it is floating point, with its own dtype as context."""
    if tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype), tensor.dtype
    return tensor, None


def _uncast(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
    return tensor if ctx is None else tensor.to(ctx)


class _CastCompressor(Compressor):
    wire_dtype: torch.dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return _cast(tensor, cls.wire_dtype)

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return _uncast(tensor, ctx)


class FP16Compressor(_CastCompressor):
    """Sends floating-point tensors as float16."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Sends floating-point tensors as bfloat16 (float32's range, fewer mantissa bits)."""

    wire_dtype = torch.bfloat16


#: Below this many elements the core compressors leave a tensor alone by default: a
#: bias or a batch-norm vector saves a few bytes at best, and loses accuracy for it.
DEFAULT_MIN_ELEMENTS = 4096


class CoreCompressor(Compressor):
    """A compressor the core runs on each partition, on the workers and the servers
    (see the module's docstring). Float tensors travel as float32 (cast back after);
    integer tensors and tensors smaller than ``min_elements`` go uncompressed."""

    def __init__(self, name: str, param: float, error_feedback: bool, min_elements: int) -> None:
        if not isinstance(min_elements, int) or min_elements < 1:
            raise ValueError(f"min_elements must be a positive int, not {min_elements!r}")
        self.name = name
        self.param = float(param)
        self.error_feedback = bool(error_feedback)
        self.min_elements = min_elements

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        return _cast(tensor, torch.float32)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        return _uncast(tensor, ctx)

    def core_spec(self, wire: torch.Tensor) -> CoreSpec | None:
        """How the core compresses `wire` (what ``compress`` returned): ``None`` leaves it
        uncompressed."""
        if wire.dtype != torch.float32 or wire.numel() < self.min_elements:
            return None
        return (self.name, self.param, self.error_feedback)

    def __repr__(self) -> str:
        param = "" if self.name == "sign" else f"{self.param:g}, "
        return (
            f"Compression.{self.name}({param}error_feedback={self.error_feedback}, "
            f"min_elements={self.min_elements})"
        )


def _ratio(name: str, ratio: float) -> float:
    if not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"{name}: ratio must be in (0, 1], not {ratio!r}")
    return float(ratio)


class ErrorFeedback(Compressor):
    """Error feedback for a Python compressor: per tensor, what ``compress`` followed by
    ``decompress`` of this worker's own wire tensor lost is kept and added to the tensor's
    next input, so nothing is lost, only delayed. Each tensor gets its own (shallow) copy
    of `inner`, so a compressor with state (a phase, a seed) keeps it per tensor. The
    core's compressors have their own feedback (``error_feedback=True``)."""

    def __init__(self, inner: Compressor | type[Compressor]) -> None:
        self.inner = inner
        self._tensors: dict[str, _TensorErrorFeedback] = {}

    def for_tensor(self, name: str) -> Compressor:
        """The compressor of tensor `name`, holding its residual (the same one each call)."""
        bound = self._tensors.get(name)
        if bound is None:
            bound = self._tensors[name] = _TensorErrorFeedback(copy.copy(self.inner))
        return bound

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        """What a tensor's wire form looks like: a throwaway copy's output, without
        feedback, so no state moves. sumflow's operations compress through
        ``for_tensor(name)``."""
        return copy.copy(self.inner).compress(tensor)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        return self.inner.decompress(tensor, ctx)

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"


class _TensorErrorFeedback(Compressor):
    def __init__(self, inner: Compressor | type[Compressor]) -> None:
        self.inner = inner
        self.residual: torch.Tensor | None = None

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        x = tensor if self.residual is None else tensor + self.residual
        wire, ctx = self.inner.compress(x)
        # This worker's own share of the sum, decoded now, before the wire tensor is
        # overwritten by the sum.
        self.residual = x - self.inner.decompress(wire.clone(), ctx).to(x.dtype)
        return wire, ctx

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        return self.inner.decompress(tensor, ctx)


AnyCompressor = Compressor | type[Compressor]
_registry: dict[str, Callable[..., AnyCompressor]] = {}


class Compression:
    """The compressors: ``none``, ``fp16`` and ``bf16`` (Horovod's), the core's
    ``topk(...)``, ``randomk(...)``, ``sign(...)`` and ``dithering(...)``, and any
    registered by name (``register``, ``get``, ``parse``)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def topk(
        ratio: float = 0.01,
        *,
        error_feedback: bool = True,
        min_elements: int = DEFAULT_MIN_ELEMENTS,
    ) -> CoreCompressor:
        """Sends the ``ratio`` of each partition's elements with the largest magnitudes
        (indices and values); the servers send the top ``ratio`` of each sum."""
        return CoreCompressor("topk", _ratio("topk", ratio), error_feedback, min_elements)

    @staticmethod
    def randomk(
        ratio: float = 0.01,
        *,
        error_feedback: bool = True,
        min_elements: int = DEFAULT_MIN_ELEMENTS,
    ) -> CoreCompressor:
        """Sends a ``ratio`` of each partition's elements drawn at random, the same on
        every worker (values only); the servers sum them exactly."""
        return CoreCompressor("randomk", _ratio("randomk", ratio), error_feedback, min_elements)

    @staticmethod
    def sign(
        *, error_feedback: bool = True, min_elements: int = DEFAULT_MIN_ELEMENTS
    ) -> CoreCompressor:
        """Sends one bit per element and the partition's mean magnitude (1-bit SGD with a
        scale); the servers send the sum's signs and mean magnitude."""
        return CoreCompressor("sign", 0.0, error_feedback, min_elements)

    @staticmethod
    def dithering(
        levels: int = 7,
        *,
        error_feedback: bool = False,
        min_elements: int = DEFAULT_MIN_ELEMENTS,
    ) -> CoreCompressor:
        """Stochastic quantisation of each element to one of ``levels`` (1 to 127) levels
        of the partition's largest magnitude, unbiased; 2 bits per element for 1 level, 4
        up to 7, 8 above."""
        if not isinstance(levels, int) or not 1 <= levels <= 127:
            raise ValueError(f"dithering: levels must be an int from 1 to 127, not {levels!r}")
        return CoreCompressor("dithering", float(levels), error_feedback, min_elements)

    @staticmethod
    def register(
        name: str, factory: Callable[..., AnyCompressor], *, replace: bool = False
    ) -> None:
        """Makes ``factory(**params)`` available as ``Compression.get(name, **params)``."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(
                f"a compressor name must be a non-empty string without ':', not {name!r}"
            )
        if name in _registry and not replace:
            raise ValueError(f"a compressor named {name!r} is registered already (replace=True)")
        _registry[name] = factory

    @staticmethod
    def names() -> list[str]:
        """The registered names."""
        return sorted(_registry)

    @staticmethod
    def get(name: str, **params: Any) -> AnyCompressor:
        """The compressor registered as `name`, made with `params`."""
        try:
            factory = _registry[name]
        except KeyError:
            raise ValueError(
                f"no compressor named {name!r}; registered: {', '.join(Compression.names())}"
            ) from None
        try:
            return factory(**params)
        except TypeError as e:
            raise ValueError(f"compressor {name!r} does not take {params}: {e}") from None

    @staticmethod
    def parse(spec: str) -> AnyCompressor:
        """A compressor from text, ``name`` or ``name:key=value,key=value`` (values are
        read as Python literals: numbers, True/False), e.g. ``topk:ratio=0.01`` or
        ``dithering:levels=3,error_feedback=True``."""
        name, _, rest = spec.strip().partition(":")
        params: dict[str, Any] = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"compressor spec {spec!r}: {item!r} is not key=value")
            params[key.strip()] = _literal(value.strip(), spec)
        return Compression.get(name, **params)

    @staticmethod
    def from_env(default: AnyCompressor = NoneCompressor) -> AnyCompressor:
        """``SUMFLOW_COMPRESSION``'s compressor (see ``parse``), or `default` if unset."""
        spec = settings.COMPRESSION.read()
        if spec is None:
            return default
        try:
            return Compression.parse(spec)
        except ValueError as e:
            raise settings.COMPRESSION.invalid(spec, str(e)) from None


def _literal(text: str, spec: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    raise ValueError(f"compressor spec {spec!r}: {text!r} is not a number or True/False")


for _name, _factory in (
    ("none", lambda: NoneCompressor),
    ("fp16", lambda: FP16Compressor),
    ("bf16", lambda: BF16Compressor),
    ("topk", Compression.topk),
    ("randomk", Compression.randomk),
    ("sign", Compression.sign),
    ("dithering", Compression.dithering),
):
    Compression.register(_name, _factory)


def bind(compression: AnyCompressor, name: str) -> Any:
    """The compressor to use for tensor `name`: its own, for compressors with state per
    tensor (``for_tensor``), else `compression` itself."""
    for_tensor = getattr(compression, "for_tensor", None)
    return compression if for_tensor is None else for_tensor(name)


def core_spec(compression: Any, wire: torch.Tensor) -> CoreSpec | None:
    """What the core is told to do with `wire` (a compressor's output): compress it with
    one of its codecs, or nothing."""
    spec = getattr(compression, "core_spec", None)
    return spec(wire) if spec is not None else None
