"""The simulator's two standard figures: speedup against the number of CPU machines
(BytePS Fig. 12's question, asked of a whole iteration), and the schedulers against
bandwidth (ByteScheduler's and Prophet's)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sumflow.sim.result import Result


def pyplot() -> Any:
    """matplotlib's pyplot on the non-interactive Agg backend, or an ImportError that
    says how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plots need matplotlib: pip install 'sumflow[examples]' (or matplotlib)"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cpu_sweep(
    byteps: Mapping[int, Result],
    baseline: Result,
    path: str | Path,
    ps: Mapping[int, Result] | None = None,
) -> Path:
    """Iteration speedup over `baseline` (an all-reduce) against k, for BytePS and, if
    given, the non-colocated PS; with Eq. 7's communication-only ratio for reference."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ks = sorted(byteps)
    ax.plot(
        ks,
        [baseline.iteration_s / byteps[k].iteration_s for k in ks],
        marker="o",
        label="sumflow / BytePS (simulated)",
    )
    if ps:
        pk = sorted(ps)
        ax.plot(
            pk,
            [baseline.iteration_s / ps[k].iteration_s for k in pk],
            marker="s",
            label="non-colocated PS (simulated)",
        )
    n = baseline.config.cluster.machines
    theory = [(n * n + min(k, n) * n - 2 * min(k, n)) / (n * n) for k in ks]
    ax.plot(ks, theory, linestyle="--", color="grey", label="Eq. 7 communication only")
    ax.axhline(1.0, color="black", linewidth=0.8, label=baseline.config.architecture)
    ax.set_xlabel("CPU machines k")
    ax.set_ylabel(f"iterations/s over {baseline.config.architecture} all-reduce")
    c = baseline.config
    ax.set_title(
        f"{c.profile.name}, {c.cluster.machines} x {c.cluster.gpus_per_machine} GPUs, "
        f"{c.network.gbps:g} Gbit/s",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


def plot_schedulers(
    results: Mapping[str, Sequence[Result]], path: str | Path, *, relative_to: str = "fifo"
) -> Path:
    """Iterations/s against bandwidth, one line per scheduler (left), and the same over
    `relative_to` (right, when present)."""
    plt = pyplot()
    rel = relative_to in results
    fig, axes = plt.subplots(1, 2 if rel else 1, figsize=(11 if rel else 6.4, 4.4))
    axes = list(axes) if rel else [axes]
    for name, rs in results.items():
        gbps = [r.config.network.gbps for r in rs]
        axes[0].plot(gbps, [r.iterations_per_s for r in rs], marker="o", label=name)
        if rel:
            base = results[relative_to]
            axes[1].plot(
                gbps,
                [b.iteration_s / r.iteration_s for r, b in zip(rs, base, strict=True)],
                marker="o",
                label=name,
            )
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("NIC bandwidth, Gbit/s")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("iterations/s")
    if rel:
        axes[1].set_ylabel(f"speedup over {relative_to}")
    c = next(iter(results.values()))[0].config
    fig.suptitle(
        f"{c.profile.name}, {c.cluster.machines} x {c.cluster.gpus_per_machine} GPUs"
        f"{f' + {c.cluster.cpu_machines} CPU machines' if c.cluster.cpu_machines else ''}, "
        f"{c.architecture}",
        fontsize=10,
    )
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p
