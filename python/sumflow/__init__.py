"""sumflow: communication for data-parallel training, PyTorch first.

Workers push gradient partitions to a summation service that runs on spare CPU machines and
on the GPU machines themselves, and pull back the sum, as in BytePS; the optimizer stays on
the workers. The core (wire protocol, summation server, coordinator, communication service)
is Rust, in the extension module ``sumflow._core``; it sees host buffers only and is not
built against torch, so one wheel serves every CPython >= 3.10 and every PyTorch release.

This package re-exports what is public in the core:

- ``__version__``: the version of the core (the Cargo workspace's).
- ``simd_level()``: the SIMD kernels the summation service would use on this CPU.
- ``run_server(argv)`` / ``run_coordinator(argv)``: the ``sumflow-server`` and
  ``sumflow-coordinator`` programs, run in this process (also installed as console scripts).
- The exceptions: ``SumflowError`` (a ``RuntimeError``) and its subclasses
  ``SumflowTimeoutError`` (also a ``TimeoutError``), ``NodeFailedError``,
  ``DeclarationMismatchError`` and ``ProtocolError``.
"""

from sumflow._core import (
    DeclarationMismatchError,
    NodeFailedError,
    ProtocolError,
    SumflowError,
    SumflowTimeoutError,
    __version__,
    run_coordinator,
    run_server,
    simd_level,
)

__all__ = [
    "DeclarationMismatchError",
    "NodeFailedError",
    "ProtocolError",
    "SumflowError",
    "SumflowTimeoutError",
    "__version__",
    "run_coordinator",
    "run_server",
    "simd_level",
]
