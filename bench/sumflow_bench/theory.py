"""Communication time per iteration in theory (BytePS §2.3, Table 1; §4.1, Eq. 1, 2, 6, 7).

``n`` GPU (worker) machines, ``k`` extra CPU machines, model size ``m`` bytes, per-direction
NIC bandwidth ``b`` bytes/s; full bisection bandwidth, sending and receiving overlapped.
Goodput is what the benchmarks measure: bytes of gradient synchronized per second per
worker, ``m / t``.

Eq. 4 as printed reads t_c = M_SSCPU / B; a CPU machine moves its share to and from each
of the n workers, so it is n M_SSCPU / B, and only with the n do Eq. 1, 2 and 6 follow
from t_c = t_g (the tests check that they do).
"""

from __future__ import annotations


def _check(n: int, k: int, m: float, b: float) -> None:
    if n < 1:
        raise ValueError(f"n (worker machines) must be at least 1, got {n}")
    if k < 0:
        raise ValueError(f"k (CPU machines) must be at least 0, got {k}")
    if m < 0:
        raise ValueError(f"model size must be >= 0, got {m}")
    if not b > 0:
        raise ValueError(f"bandwidth must be positive, got {b}")


def allreduce_time(n: int, m: float, b: float) -> float:
    """Ring all-reduce (Table 1): 2(n-1)M / (nB); it cannot use CPU machines."""
    _check(n, 0, m, b)
    return 2 * (n - 1) * m / (n * b)


def colocated_ps_time(n: int, m: float, b: float) -> float:
    """Colocated PS (Table 1): a server on every worker machine, the same as all-reduce."""
    return allreduce_time(n, m, b)


def noncolocated_ps_time(n: int, k: int, m: float, b: float) -> float:
    """Non-colocated PS (Table 1): max(M/B, nM/(kB)), servers only on the k CPU machines."""
    _check(n, k, m, b)
    if k < 1:
        raise ValueError("a non-colocated PS needs at least one CPU machine (k >= 1)")
    return max(m / b, n * m / (k * b))


def cpu_server_share(n: int, k: int) -> float:
    """Eq. 1: the fraction of the model each CPU machine's summation service sums."""
    _check(n, k, 0, 1)
    if k == 0:
        return 0.0
    if n < 2 or k >= n:
        return 1.0 / k
    return 2 * (n - 1) / (n * n + k * n - 2 * k)


def gpu_server_share(n: int, k: int) -> float:
    """Eq. 2: the fraction of the model each worker machine's summation service sums."""
    _check(n, k, 0, 1)
    if k == 0:
        return 1.0 / n
    if n < 2 or k >= n:
        return 0.0
    return (n - k) / (n * n + k * n - 2 * k)


def optimal_time(n: int, k: int, m: float, b: float) -> float:
    """Eq. 6, BytePS's optimum: 2n(n-1)M / ((n^2 + kn - 2k)B), for 0 <= k <= n and n >= 2.

    Beyond those bounds it falls back as §4.1 says: more CPU machines than workers do not
    help (k is capped at n, where the time is M/B); one worker needs no communication.
    """
    _check(n, k, m, b)
    if n == 1:
        return 0.0
    k = min(k, n)
    return 2 * n * (n - 1) * m / ((n * n + k * n - 2 * k) * b)


def acceleration_ratios(n: int, k: int) -> tuple[float, float]:
    """Eq. 7: (gamma_a, gamma_p), the optimum's speedup over all-reduce and over a
    non-colocated PS with the same k CPU machines (k >= 1)."""
    _check(n, k, 0, 1)
    if k < 1 or n < 2 or k > n:
        raise ValueError(f"Eq. 7 needs n >= 2 and 1 <= k <= n, got n={n}, k={k}")
    q = n * n + k * n - 2 * k
    return q / (n * n), q / (2 * k * (n - 1))


def goodput(m: float, t: float) -> float:
    """Bytes synchronized per second per worker: m / t (infinite when t is 0)."""
    return float("inf") if t == 0 else m / t
