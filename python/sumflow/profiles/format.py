"""The layer-profile format: what a model's layers hold and how long they compute.

A :class:`ModelProfile` is a model reduced to what data-parallel communication sees: its
layers in forward order, each with its parameter tensors (name and shape, float32) and
the milliseconds its forward and backward passes take on a stated reference device at a
stated batch size. The sleeping benchmark model (``sumflow_bench.model``) and the
discrete-event simulator read the same objects, so a profile means the same thing to both.

Profiles are immutable and validated when built, from code or from JSON; every error is a
``ValueError`` that names the field and, where there is one, the layer. The JSON form is
documented in ``docs/profiles.md``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

#: The JSON format's version; :func:`ModelProfile.from_dict` refuses any other.
FORMAT_VERSION = 1
#: Every parameter tensor of a profile is float32 (version 1 knows no other dtype).
DTYPE = "float32"
#: Bytes per element of :data:`DTYPE`.
BYTES_PER_ELEMENT = 4

PathLike = Union[str, "os.PathLike[str]"]

_MODEL_KEYS = ("version", "name", "source", "device", "batch_size", "sample", "dtype", "layers")
_LAYER_KEYS = ("name", "forward_ms", "backward_ms", "params")
_PARAM_KEYS = ("name", "shape")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: its name (unique in the model) and shape; dtype float32.

    A shape of ``()`` is a scalar (one element); every dimension is a positive integer."""

    name: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"parameter name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.shape, tuple):
            raise ValueError(
                f"parameter '{self.name}': field 'shape' must be a tuple of dimensions, "
                f"got {self.shape!r}"
            )
        for d in self.shape:
            # bool is an int subclass; a shape of [true, 3] is a mistake, not a 1x3 tensor.
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ValueError(
                    f"parameter '{self.name}': field 'shape' must hold positive integers, "
                    f"got {list(self.shape)!r}"
                )

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size in bytes (float32)."""
        return self.numel * BYTES_PER_ELEMENT


@dataclass(frozen=True)
class LayerProfile:
    """One layer: its parameter tensors and its compute times at the reference batch.

    A layer may own no parameter (an operation that costs time but has nothing to
    communicate, e.g. a projection through a weight owned by an earlier layer)."""

    name: str
    params: tuple[ParamSpec, ...]
    forward_ms: float
    backward_ms: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"layer name must be a non-empty string, got {self.name!r}")
        for field_name in ("forward_ms", "backward_ms"):
            v = getattr(self, field_name)
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < 0
            ):
                raise ValueError(
                    f"layer '{self.name}': field '{field_name}' must be a finite number "
                    f">= 0 (milliseconds), got {v!r}"
                )
        if not isinstance(self.params, tuple) or not all(
            isinstance(p, ParamSpec) for p in self.params
        ):
            raise ValueError(f"layer '{self.name}': field 'params' must be a tuple of ParamSpec")
        seen: set[str] = set()
        for p in self.params:
            if p.name in seen:
                raise ValueError(f"layer '{self.name}': duplicate parameter name '{p.name}'")
            seen.add(p.name)

    @property
    def param_bytes(self) -> int:
        """Bytes of this layer's parameters (and of its gradients)."""
        return sum(p.nbytes for p in self.params)

    @property
    def compute_ms(self) -> float:
        """Forward plus backward milliseconds."""
        return self.forward_ms + self.backward_ms


@dataclass(frozen=True)
class ModelProfile:
    """A model as data-parallel communication sees it.

    Attributes:
        name: short identifier, e.g. ``"resnet50"``.
        source: where the sizes and the times come from, and every assumption behind them.
        device: the reference device the times are for, e.g. ``"NVIDIA V100 SXM2, FP32"``.
        batch_size: samples per worker per iteration that the times are for.
        sample: what one sample is, e.g. ``"image 3x224x224"``.
        layers: in forward order; backward visits them in reverse.
    """

    name: str
    source: str
    device: str
    batch_size: int
    sample: str
    layers: tuple[LayerProfile, ...]

    def __post_init__(self) -> None:
        for field_name in ("name", "source", "device", "sample"):
            v = getattr(self, field_name)
            if not isinstance(v, str) or (field_name == "name" and not v):
                raise ValueError(
                    f"profile field '{field_name}' must be a "
                    f"{'non-empty ' if field_name == 'name' else ''}string, got {v!r}"
                )
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int):
            raise ValueError(
                f"profile '{self.name}': field 'batch_size' must be an integer, "
                f"got {self.batch_size!r}"
            )
        if self.batch_size < 1:
            raise ValueError(
                f"profile '{self.name}': field 'batch_size' must be >= 1, got {self.batch_size}"
            )
        if not isinstance(self.layers, tuple) or not all(
            isinstance(layer, LayerProfile) for layer in self.layers
        ):
            raise ValueError(
                f"profile '{self.name}': field 'layers' must be a tuple of LayerProfile"
            )
        if not self.layers:
            raise ValueError(f"profile '{self.name}': field 'layers' must not be empty")
        layer_names: set[str] = set()
        owner: dict[str, str] = {}
        for layer in self.layers:
            if layer.name in layer_names:
                raise ValueError(f"profile '{self.name}': duplicate layer name '{layer.name}'")
            layer_names.add(layer.name)
            for p in layer.params:
                if p.name in owner:
                    raise ValueError(
                        f"profile '{self.name}': layer '{layer.name}': duplicate parameter "
                        f"name '{p.name}' (already in layer '{owner[p.name]}')"
                    )
                owner[p.name] = layer.name

    # ---- totals -------------------------------------------------------------------------

    def params(self) -> Iterator[ParamSpec]:
        """Every parameter tensor, in forward order."""
        for layer in self.layers:
            yield from layer.params

    @property
    def num_tensors(self) -> int:
        """Number of parameter tensors."""
        return sum(len(layer.params) for layer in self.layers)

    @property
    def num_params(self) -> int:
        """Number of parameter elements."""
        return sum(p.numel for p in self.params())

    @property
    def param_bytes(self) -> int:
        """Bytes of all parameters, which is also the gradient bytes one worker sends per
        iteration."""
        return self.num_params * BYTES_PER_ELEMENT

    @property
    def forward_ms(self) -> float:
        """Forward milliseconds of one iteration at the reference batch."""
        return math.fsum(layer.forward_ms for layer in self.layers)

    @property
    def backward_ms(self) -> float:
        """Backward milliseconds of one iteration at the reference batch."""
        return math.fsum(layer.backward_ms for layer in self.layers)

    @property
    def compute_ms(self) -> float:
        """Forward plus backward milliseconds of one iteration."""
        return self.forward_ms + self.backward_ms

    def summary(self) -> str:
        """One line: name, tensors, parameters, bytes and compute times."""
        return (
            f"{self.name}: {len(self.layers)} layers, {self.num_tensors} tensors, "
            f"{self.num_params:,} parameters ({self.param_bytes / 1e6:.1f} MB), "
            f"forward {self.forward_ms:.1f} ms + backward {self.backward_ms:.1f} ms "
            f"at batch {self.batch_size} on {self.device}"
        )

    # ---- JSON ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (see ``docs/profiles.md``)."""
        return {
            "version": FORMAT_VERSION,
            "name": self.name,
            "source": self.source,
            "device": self.device,
            "batch_size": self.batch_size,
            "sample": self.sample,
            "dtype": DTYPE,
            "layers": [
                {
                    "name": layer.name,
                    "forward_ms": layer.forward_ms,
                    "backward_ms": layer.backward_ms,
                    "params": [{"name": p.name, "shape": list(p.shape)} for p in layer.params],
                }
                for layer in self.layers
            ],
        }

    @classmethod
    def from_dict(cls, data: Any) -> ModelProfile:
        """Builds a profile from its JSON form, refusing missing or unknown fields, a wrong
        ``version`` or ``dtype``, and every value :class:`ModelProfile` refuses."""
        top = _fields(data, _MODEL_KEYS, "profile")
        version = top["version"]
        if isinstance(version, bool) or version != FORMAT_VERSION:
            raise ValueError(
                f"profile field 'version' is {version!r}; this sumflow reads version "
                f"{FORMAT_VERSION} only"
            )
        if top["dtype"] != DTYPE:
            raise ValueError(f"profile field 'dtype' must be {DTYPE!r}, got {top['dtype']!r}")
        raw_layers = top["layers"]
        if not isinstance(raw_layers, list):
            raise ValueError(f"profile field 'layers' must be a list, got {_kind(raw_layers)}")
        layers = []
        for i, raw in enumerate(raw_layers):
            where = f"layer {i}"
            if isinstance(raw, Mapping) and isinstance(raw.get("name"), str):
                where += f" ('{raw['name']}')"
            try:
                fields = _fields(raw, _LAYER_KEYS, where)
                raw_params = fields["params"]
                if not isinstance(raw_params, list):
                    raise ValueError(
                        f"{where}: field 'params' must be a list, got {_kind(raw_params)}"
                    )
                params = []
                for j, rp in enumerate(raw_params):
                    pf = _fields(rp, _PARAM_KEYS, f"{where}: parameter {j}")
                    shape = pf["shape"]
                    if not isinstance(shape, list):
                        raise ValueError(
                            f"{where}: parameter {j}: field 'shape' must be a list, "
                            f"got {_kind(shape)}"
                        )
                    params.append(ParamSpec(pf["name"], tuple(shape)))
                layers.append(
                    LayerProfile(
                        fields["name"], tuple(params), fields["forward_ms"], fields["backward_ms"]
                    )
                )
            except ValueError as e:
                msg = str(e)
                # LayerProfile names the layer by name only; the file's reader also wants
                # its position, so swap that prefix for `where`.
                own = f"layer '{raw.get('name')}': " if isinstance(raw, Mapping) else ""
                if own and msg.startswith(own):
                    msg = msg[len(own) :]
                raise ValueError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        return cls(
            name=top["name"],
            source=top["source"],
            device=top["device"],
            batch_size=top["batch_size"],
            sample=top["sample"],
            layers=tuple(layers),
        )

    def to_json(self) -> str:
        """The JSON text, one layer per line block, ending in a newline."""
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        """Parses and validates JSON text."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"profile is not valid JSON: {e}") from None
        return cls.from_dict(data)

    def save(self, path: PathLike) -> Path:
        """Writes the JSON form to `path` (created or replaced); returns the path."""
        p = Path(path)
        p.write_text(self.to_json())
        return p

    @classmethod
    def load(cls, path: PathLike) -> ModelProfile:
        """Reads a profile from a JSON file; errors name the file."""
        p = Path(path)
        try:
            return cls.from_json(p.read_text())
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None


def _kind(value: Any) -> str:
    return (
        f"{type(value).__name__} {value!r}"
        if not isinstance(value, (list, dict))
        else (type(value).__name__)
    )


def _fields(data: Any, keys: Sequence[str], where: str) -> dict[str, Any]:
    """`data` as a dict holding exactly `keys`; the error names `where` and the field."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {_kind(data)}")
    for k in keys:
        if k not in data:
            raise ValueError(f"{where}: missing field '{k}'")
    unknown = sorted(set(data) - set(keys))
    if unknown:
        raise ValueError(f"{where}: unknown field '{unknown[0]}' (known fields: {', '.join(keys)})")
    return dict(data)
