"""The harness's results as a markdown table and PNG plots (BytePS Fig. 12 style)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GBIT = 1e9 / 8


def _cpu(run: dict[str, Any], flag: float) -> str:
    cpu = run.get("cpu")
    if cpu is None:
        return "n/a"
    return f"{cpu:.0%}" + (" (over limit)" if cpu > flag else "")


def _per_gb(run: dict[str, Any]) -> str:
    """Core-seconds per GB summed, against gloo's where the run has that ratio, and its
    split by role."""
    per_gb = run.get("cpu_seconds_per_gb")
    if not per_gb:
        return "n/a"
    ratio = f" ({run['cpu_vs_gloo']:.2f}x)" if "cpu_vs_gloo" in run else ""
    roles = ", ".join(f"{role} {s:.2f}" for role, s in per_gb.items() if role != "busy")
    return f"{per_gb['busy']:.2f} s{ratio}: {roles}"


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown: configuration, link check, goodput, training."""
    cfg = results["config"]
    flag = cfg["cpu_flag"]
    lines = [
        f"Emulated cluster: {cfg['workers']} worker hosts + up to "
        f"{cfg.get('cpu_hosts', max(cfg['cpu_servers']))} "
        f"CPU-server hosts, {cfg['rate_mbit']:g} Mbit/s per direction per host, MTU "
        f"{cfg['mtu']}, delay {cfg['delay_ms']:g} ms.",
        "",
    ]
    link = results.get("link")
    if link:
        lines += [
            f"Link check (iperf3, both directions at once, {link['seconds']:g} s): "
            f"{link['forward_mbit']:.0f} and {link['reverse_mbit']:.0f} Mbit/s, "
            f"{link['ratio']:.3f}x the configured rate; B = {link['b_mbit']:.0f} Mbit/s "
            "is used for the theory lines (as BytePS Fig. 12 uses the measured goodput).",
            "",
        ]
    goodput = results.get("goodput")
    if goodput:
        lines += [
            "| system | k (CPU-server hosts) | goodput per worker | Eq. 6 optimum | "
            "vs optimum | vs gloo all-reduce | CPU | CPU per GB summed | "
            "worker NIC bytes per round |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        gloo = goodput["gloo"]
        lines.append(
            f"| gloo all_reduce | - | {gloo['goodput_gbit']:.3f} Gbit/s | "
            f"{goodput['allreduce_theory_gbit']:.3f} Gbit/s (all-reduce, Table 1) | "
            f"{gloo['goodput_gbit'] / goodput['allreduce_theory_gbit']:.2f}x | 1.00x | "
            f"{_cpu(gloo, flag)} | {_per_gb(gloo)} | {_nic(gloo, 'ring traffic')} |"
        )
        for run in goodput["sumflow"]:
            lines.append(
                f"| sumflow push_pull | {run['k']} | {run['goodput_gbit']:.3f} Gbit/s | "
                f"{run['optimum_gbit']:.3f} Gbit/s | **{run['vs_optimum']:.2f}x** | "
                f"**{run['vs_gloo']:.2f}x** | {_cpu(run, flag)} | {_per_gb(run)} | "
                f"{_nic(run, 'Eq. 6 traffic')} |"
            )
        lines.append("")
    training = results.get("training")
    if training and cfg.get("schedulers") is None and cfg.get("grid") is None:
        lines += [
            "| model (scaled) | system | iterations/s | vs DDP/gloo | compute per iteration | "
            "idle per iteration | CPU |",
            "|---|---|---|---|---|---|---|",
        ]
        for cell in training:
            for run in cell["runs"]:
                lines.append(
                    f"| {cell_name(cell, training)} ({cell['megabytes']:.1f} MB) | "
                    f"{run['label']} | {run['iterations_per_s']:.2f} | "
                    f"**{run['vs_ddp']:.2f}x** | {run['compute_ms']:.0f} ms | "
                    f"{run['idle_ms']:.0f} ms | {_cpu(run, flag)} |"
                )
        lines.append("")
    return "\n".join(lines)


def _nic(run: dict[str, Any], model: str) -> str:
    """The most any worker host's switch port carried per round, one way, against the
    traffic the model says (runs from before the ports were counted have none)."""
    if "nic_bytes" not in run:
        return "-"
    return f"{run['nic_bytes']['most'] / 1e6:.2f} MB ({run['nic_vs_model']:.3f}x {model})"


def cell_name(cell: dict[str, Any], cells: list[dict[str, Any]]) -> str:
    """A training cell's model, with its reference bandwidth when the run has several."""
    gbits = {c.get("reference_gbit") for c in cells}
    return str(cell["model"]) + (f" @ {cell['reference_gbit']:g} Gbit/s" if len(gbits) > 1 else "")


def plot_goodput(results: dict[str, Any], path: Path) -> None:
    """Goodput per worker against k, with the Eq. 6 optimum, Table 1's all-reduce and
    non-colocated PS lines and the measured gloo all-reduce."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sumflow_bench import theory

    g = results["goodput"]
    n = results["config"]["workers"]
    b = results["link"]["b_mbit"] * 1e6 / 8
    ks = [run["k"] for run in g["sumflow"]]
    kk = list(range(0, max(ks) + 1))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(
        kk, [1 / theory.optimal_time(n, k, 1, b) / GBIT for k in kk], "k-", label="optimum (Eq. 6)"
    )
    ax.plot(
        [k for k in kk if k],
        [1 / theory.noncolocated_ps_time(n, k, 1, b) / GBIT for k in kk if k],
        "k:",
        label="non-colocated PS (Table 1)",
    )
    ax.axhline(
        1 / theory.allreduce_time(n, 1, b) / GBIT,
        color="grey",
        ls="--",
        label="all-reduce (Table 1)",
    )
    ax.axhline(g["gloo"]["goodput_gbit"], color="tab:orange", label="gloo all_reduce (measured)")
    ax.plot(
        ks,
        [r["goodput_gbit"] for r in g["sumflow"]],
        "o-",
        color="tab:blue",
        label="sumflow (measured)",
    )
    ax.set_xlabel("CPU-server hosts k")
    ax.set_ylabel("goodput per worker (Gbit/s)")
    ax.set_title(f"{n} worker hosts, {results['config']['rate_mbit']:g} Mbit/s links")
    ax.set_xticks(kk)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_training(results: dict[str, Any], path: Path) -> None:
    """Iterations/s per model and system, as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    training = results["training"]
    labels = [run["label"] for run in training[0]["runs"]]
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for j, label in enumerate(labels):
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(training))]
        ys = [
            next(r["iterations_per_s"] for r in m["runs"] if r["label"] == label) for m in training
        ]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks(range(len(training)))
    ax.set_xticklabels([cell_name(m, training) for m in training])
    ax.set_ylabel("iterations/s")
    cfg = results["config"]
    ax.set_title(f"training, {cfg['workers']} workers, {cfg['rate_mbit']:g} Mbit/s")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
