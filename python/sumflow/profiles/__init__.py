"""Layer profiles: models reduced to what data-parallel communication sees.

A :class:`ModelProfile` lists a model's layers in forward order, each with its parameter
tensors (float32) and its forward and backward milliseconds on a reference device. The
simulator and the benchmarks' sleeping model (``sumflow_bench.model``) run from the same
profiles. See ``docs/profiles.md``.

    from sumflow import profiles

    p = profiles.load("resnet50")              # a built-in, or a path to a JSON file
    print(p.summary())
    small = profiles.scale(p, size_scale=0.1, time_scale=0.5)
    small.save("resnet50-small.json")
"""

from __future__ import annotations

import os
from pathlib import Path

from sumflow.profiles.builtin import ReferenceDevice, builtin, names
from sumflow.profiles.format import (
    BYTES_PER_ELEMENT,
    DTYPE,
    FORMAT_VERSION,
    LayerProfile,
    ModelProfile,
    ParamSpec,
)
from sumflow.profiles.scaling import scale

__all__ = [
    "BYTES_PER_ELEMENT",
    "DTYPE",
    "FORMAT_VERSION",
    "LayerProfile",
    "ModelProfile",
    "ParamSpec",
    "ReferenceDevice",
    "builtin",
    "load",
    "names",
    "save",
    "scale",
]


def load(path_or_name: str | os.PathLike[str]) -> ModelProfile:
    """A built-in profile by name (a ``str`` equal to one of :func:`names`), else the
    profile in the JSON file at that path. A ``Path`` is always read as a file."""
    if isinstance(path_or_name, str) and path_or_name in names():
        return builtin(path_or_name)
    path = Path(path_or_name)
    if not path.is_file():
        raise ValueError(
            f"no built-in profile or file named '{path_or_name}' (built-ins: {', '.join(names())})"
        )
    return ModelProfile.load(path)


def save(profile: ModelProfile, path: str | os.PathLike[str]) -> Path:
    """Writes `profile` as JSON to `path`; returns the path."""
    return profile.save(path)
