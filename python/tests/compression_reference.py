"""What the core's compressors do to a push_pull, in plain numpy, written from their
definitions: each worker compresses its gradient plus its residual, the server sums the
decoded pushes plus its own residual and compresses the sum again, and every worker gets
that, decoded, divided by the number of workers. Shared by compression_worker.py (the
gradients) and test_compression.py (the expected results)."""

from __future__ import annotations

import numpy as np

WORKERS = 2
STEPS = 5
ELEMENTS = 5000
TOPK_RATIO = 0.02


def gradient(rank: int, step: int, elements: int = ELEMENTS) -> np.ndarray:
    """Worker `rank`'s gradient at `step`: distinct magnitudes, so top-k has no ties."""
    return np.random.default_rng(1000 * rank + step).standard_normal(elements, dtype=np.float32)


def topk(x: np.ndarray, k: int) -> np.ndarray:
    """`x` with all but its k largest magnitudes zeroed."""
    out = np.zeros_like(x)
    keep = np.argsort(-np.abs(x), kind="stable")[:k]
    out[keep] = x[keep]
    return out


def sign(x: np.ndarray) -> np.ndarray:
    """Every element as +-(mean magnitude), negative where `x` is."""
    scale = np.float32(np.cumsum(np.abs(x).astype(np.float64))[-1] / x.size)
    return np.where(x < 0, -scale, scale).astype(np.float32)


def averages(compress, steps: int = STEPS, workers: int = WORKERS) -> list[np.ndarray]:
    """What every worker receives at each step, with error feedback on workers and server."""
    residual = [np.zeros(ELEMENTS, np.float32) for _ in range(workers)]
    server = np.zeros(ELEMENTS, np.float32)
    out = []
    for step in range(steps):
        total = np.zeros(ELEMENTS, np.float32)
        for r in range(workers):
            x = gradient(r, step) + residual[r]
            sent = compress(x)
            residual[r] = x - sent
            total = total + sent
        s = server + total
        summed = compress(s)
        server = s - summed
        out.append(summed / np.float32(workers))
    return out
