"""GradientFlow's coarse-grained sparse communication in plain numpy, for test_csc.py:
Algorithm 1 (momentum SGD correction) and the chunk selection of §3.2 for `WORKERS`
workers in one process, written from the paper, independently of sumflow.torch.csc."""

from __future__ import annotations

import math

import numpy as np

WORKERS = 2
STEPS = 10
SHAPES = [(7, 10), (33,), (3, 3)]
#: 112 gradients in chunks of 16: 7 chunks, the last one short.
CONFIG = {
    "lr": 0.1,
    "momentum": 0.9,
    "density": 0.3,
    "chunk_elements": 16,
    "warmup_steps": 4,
    "group_chunks": 2,
}


def initial_weights() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def gradients(rank: int, step: int) -> list[np.ndarray]:
    """Worker `rank`'s gradients at `step`: chunks of very different sizes, so the
    selection is far from ties."""
    rng = np.random.default_rng(1000 * step + rank)
    out = []
    for s in SHAPES:
        scale = rng.uniform(0.01, 3.0, size=s)
        out.append((rng.standard_normal(s) * scale).astype(np.float32))
    return out


def reference() -> tuple[list[list[int]], list[list[np.ndarray]]]:
    """The chunks sent at each step and every worker's weights after it (the same on all
    workers), for the configuration above."""
    lr, m = CONFIG["lr"], CONFIG["momentum"]
    c, density, warmup = CONFIG["chunk_elements"], CONFIG["density"], CONFIG["warmup_steps"]
    sizes = [int(np.prod(s)) for s in SHAPES]
    n = sum(sizes)
    chunks = math.ceil(n / c)
    w = np.concatenate([x.ravel() for x in initial_weights()])
    hg = [np.zeros(n, np.float32) for _ in range(WORKERS)]  # historical gradients
    hu = np.zeros(n, np.float32)  # historical updates (momentum)
    important = list(range(chunks))
    sent_log, weights_log = [], []
    for t in range(STEPS):
        sent_log.append(important)
        chunk_of = np.arange(n) // c
        is_important = np.isin(chunk_of, important)
        # Preprocess: g = g + hg, then the important chunks are summed over workers.
        g = [np.concatenate([x.ravel() for x in gradients(r, t)]) + hg[r] for r in range(WORKERS)]
        total = np.sum(g, axis=0, dtype=np.float32)
        for r in range(WORKERS):
            g[r] = np.where(is_important, total, g[r]).astype(np.float32)
            hg[r] = np.where(is_important, 0, m * g[r]).astype(np.float32)
        # SGD update of important weights only, with the average.
        avg = g[0] / WORKERS
        hu = np.where(is_important, m * hu + lr * avg, hu).astype(np.float32)
        w = np.where(is_important, w - hu, w).astype(np.float32)
        split = np.split(w, np.cumsum(sizes)[:-1])
        weights_log.append([x.reshape(s) for x, s in zip(split, SHAPES, strict=True)])
        # Selection for t + 1: L1 norms, important ones divided by the workers, summed.
        norms = np.zeros(chunks, np.float32)
        for r in range(WORKERS):
            padded = np.zeros(chunks * c, np.float32)
            padded[:n] = np.abs(g[r])
            local = padded.reshape(chunks, c).sum(axis=1)
            local[important] /= WORKERS
            norms += local
        step = t + 1
        d = density if step >= warmup else 1 - (1 - density) * step / warmup
        count = min(chunks, max(1, math.ceil(d * chunks - 1e-9)))
        order = sorted(range(chunks), key=lambda i: (-norms[i], i))
        important = sorted(order[:count])
    return sent_log, weights_log
