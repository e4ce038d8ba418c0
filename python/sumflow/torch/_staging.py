"""Host staging: the core reads and writes host memory only.

CPU tensors that are contiguous are summed where they are. Others go through a host
buffer: non-contiguous CPU tensors through a contiguous copy, CUDA tensors through pinned
host memory filled and drained on a side stream, so the copies overlap the compute on the
default stream. Pinned buffers are cached by tensor name and reused every iteration.
"""

from __future__ import annotations

import threading

import torch

_pinned: dict[str, torch.Tensor] = {}
_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=index)
        return stream


def to_host(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself when the core can use it, else a host copy (ready when this
    returns: the copy is waited for on the side stream)."""
    if tensor.device.type == "cpu":
        return tensor if tensor.is_contiguous() else tensor.contiguous()
    if tensor.device.type != "cuda":
        raise TypeError(
            f"tensor '{name}' is on {tensor.device}: sumflow handles CPU and CUDA tensors"
        )
    with _lock:
        host = _pinned.get(name)
    if host is None or host.dtype != tensor.dtype or host.numel() != tensor.numel():
        host = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=True)
        with _lock:
            _pinned[name] = host
    stream = _side_stream(tensor.device)
    # The gradient was produced on the current stream: copy only once it is complete.
    stream.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(stream):
        host.copy_(tensor.reshape(-1), non_blocking=True)
    stream.synchronize()
    return host


def copy_back(host: torch.Tensor, tensor: torch.Tensor) -> None:
    """Writes the summed `host` buffer into `tensor`, ordered before any later work on
    the current stream."""
    if tensor.device.type == "cpu":
        tensor.copy_(host.view_as(tensor))
        return
    stream = _side_stream(tensor.device)
    with torch.cuda.stream(stream):
        tensor.copy_(host.view(tensor.shape), non_blocking=True)
    # The pinned buffer is reused next iteration: finish reading it before returning.
    stream.synchronize()
    torch.cuda.current_stream(tensor.device).wait_stream(stream)


def clear() -> None:
    """Frees the cached pinned buffers."""
    with _lock:
        _pinned.clear()
