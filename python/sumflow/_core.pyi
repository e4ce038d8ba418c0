"""Typed stub of ``sumflow._core``, the Rust extension module (crates/binding)."""

from collections.abc import Sequence

__version__: str
"""The version of the core: the Cargo workspace's."""

def simd_level() -> str:
    """The SIMD kernels the summation service would use on this CPU: "avx512",
    "avx2+f16c" or "portable"."""

def run_server(argv: Sequence[str]) -> int:
    """Runs the ``sumflow-server`` program in this process and returns its exit status.

    ``argv`` is the argument list without the program name, as in ``sys.argv[1:]``.
    Returns 0 after a clean stop (and for --help), 1 when the server failed, 2 for bad
    arguments. Blocks until the server stops, with the GIL released. While it runs, SIGTERM
    and SIGINT stop it gracefully; afterwards they no longer have their default effect.
    """

def run_coordinator(argv: Sequence[str]) -> int:
    """Runs the ``sumflow-coordinator`` program in this process and returns its exit status.

    ``argv`` is the argument list without the program name, as in ``sys.argv[1:]``.
    Returns 0 when the job ended cleanly (and for --help), 1 when a node failed or not every
    node joined, 2 for bad arguments. Blocks until the job ends, with the GIL released.
    While it runs, SIGTERM and SIGINT tell every node to shut down; afterwards they no
    longer have their default effect.
    """

class SumflowError(RuntimeError):
    """Base class of every error sumflow raises. The message names what failed."""

class SumflowTimeoutError(SumflowError, TimeoutError):
    """A wait ran past its timeout; the message names what was awaited and the timeout.
    Also a builtin TimeoutError."""

class NodeFailedError(SumflowError):
    """A worker, summation server or the coordinator failed or left; the message names it
    and says why."""

class DeclarationMismatchError(SumflowError):
    """Workers declared the same tensor with different shapes, dtypes or names; the message
    names the tensor and both declarations."""

class ProtocolError(SumflowError):
    """A peer sent a message it must not send (a bug or a version mismatch); the message
    names the peer."""
