"""The scheduler benchmark's report: markdown tables, the targets' verdicts, and plots.

Input is the harness's results (``results["training"]``: one record per (profile,
bandwidth) cell with a per-system ``summary``, see :mod:`sumflow_bench.training`). Tables
have one row per profile and system and one column per reference bandwidth.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sumflow_bench import targets, theory


def _cells(results: dict[str, Any]) -> list[dict[str, Any]]:
    return list(results.get("training") or [])


def _axes(cells: list[dict[str, Any]]) -> tuple[list[str], list[float], list[str]]:
    """Models, bandwidths and system names, in run order."""
    models = list(dict.fromkeys(c["model"] for c in cells))
    gbits = sorted({c["reference_gbit"] for c in cells})
    systems = list(dict.fromkeys(name for c in cells for name in c["summary"]))
    return models, gbits, systems


def rates(results: dict[str, Any]) -> dict[tuple[str, float], dict[str, float]]:
    """Median iterations/s by (model, bandwidth) and system: the verdicts' input."""
    return {
        (c["model"], c["reference_gbit"]): {
            name: s["iterations_per_s"] for name, s in c["summary"].items()
        }
        for c in _cells(results)
    }


def ceiling(results: dict[str, Any], cell: dict[str, Any]) -> float | None:
    """The most iterations/s the cell allows: communication at BytePS Eq. 6's optimum over
    the measured link (for k = 0, a ring all-reduce's time) with the compute entirely
    hidden under it, or the compute alone if that is longer. No system can beat it; a
    system that overlaps nothing gets 1 / (communication + compute). None without a link
    check."""
    link = results.get("link")
    if not link:
        return None
    cfg = results["config"]
    comm_s = theory.optimal_time(
        cfg["workers"], cfg.get("scheduler_k", 0), cell["megabytes"] * 1e6, link["b_mbit"] * 1e6 / 8
    )
    return 1 / max(comm_s, float(cell["compute_s"]))


def _table(
    results: dict[str, Any],
    title: str,
    value: Callable[[dict[str, Any], str], str | None],
    last: tuple[str, Callable[[dict[str, Any]], str | None]] | None = None,
) -> list[str]:
    """One table: rows (model, system), columns bandwidths; `value(cell, system)` is the
    entry, None for a system the cell lacks (shown as "-"). `last`, (label, entry of a
    cell), adds a row per model after its systems."""
    cells = _cells(results)
    models, gbits, systems = _axes(cells)
    by_key = {(c["model"], c["reference_gbit"]): c for c in cells}
    lines = [
        f"**{title}**",
        "",
        "| profile | system | " + " | ".join(f"{g:g} Gbit/s" for g in gbits) + " |",
        "|---|---|" + "---|" * len(gbits),
    ]
    for model in models:
        first = True
        for name in systems:
            row = []
            label = name
            for g in gbits:
                cell = by_key.get((model, g))
                entry = None
                if cell is not None and name in cell["summary"]:
                    label = cell["summary"][name]["label"]
                    entry = value(cell, name)
                row.append(entry if entry is not None else "-")
            if all(e == "-" for e in row):
                continue
            lead = f"| {model} |" if first else "| |"
            lines.append(f"{lead} {label} | " + " | ".join(row) + " |")
            first = False
        if last is not None and not first:
            last_label, last_entry = last
            texts = [
                (last_entry(by_key[model, g]) if (model, g) in by_key else None) or "-"
                for g in gbits
            ]
            lines.append(f"| | *{last_label}* | " + " | ".join(texts) + " |")
    lines.append("")
    return lines


def _rate(cell: dict[str, Any], name: str, flag: float | None) -> str:
    s = cell["summary"][name]
    text = f"{s['iterations_per_s']:.2f}"
    if s["runs"] > 1:
        text += f" ({s['min_iterations_per_s']:.2f}-{s['max_iterations_per_s']:.2f})"
    if flag is not None and s.get("cpu") is not None and s["cpu"] > flag:
        text += " (CPU over limit)"
    return text


def _ratios(cell: dict[str, Any], name: str) -> str:
    s = cell["summary"]
    mine = s[name]["iterations_per_s"]
    parts = [
        f"{mine / s[base]['iterations_per_s']:.2f}x" if base in s else "-"
        for base in ("fifo", "ddp")
    ]
    return " / ".join(parts)


def _idle(cell: dict[str, Any], name: str) -> str:
    s = cell["summary"][name]
    return f"{s['idle_ms']:.0f}"


def markdown(results: dict[str, Any]) -> str:
    """The scheduler benchmark's tables, the tuner's runs and the verdicts."""
    cfg = results["config"]
    flag = cfg.get("cpu_flag")
    repeats = cfg.get("repeats", 1)
    lines = [
        f"Scheduler benchmark: {cfg['workers']} workers, sumflow with "
        f"{cfg.get('scheduler_k', 0)} CPU-server hosts, links of {cfg['rate_mbit']:g} Mbit/s "
        f"scaled to each reference bandwidth; {cfg.get('iterations')} measured iterations "
        f"after {cfg.get('warmup_iterations')} warm-up ones per run"
        + (f", {repeats} runs per system (median, range in brackets)" if repeats > 1 else "")
        + ".",
        "",
    ]

    def top(cell: dict[str, Any]) -> str | None:
        best = ceiling(results, cell)
        return None if best is None else f"{best:.2f}"

    def headroom(cell: dict[str, Any]) -> str | None:
        best = ceiling(results, cell)
        if best is None:
            return None
        return " / ".join(
            f"{best / cell['summary'][b]['iterations_per_s']:.2f}x" if b in cell["summary"] else "-"
            for b in ("fifo", "ddp")
        )

    lines += _table(
        results,
        "iterations/s",
        lambda cell, name: _rate(cell, name, flag),
        ("ceiling: Eq. 6 communication, compute hidden", top),
    )
    lines += _table(
        results, "ratio to fifo / to DDP-gloo (iterations/s)", _ratios, ("ceiling", headroom)
    )
    lines += _table(results, "idle (waiting, not computing) ms per iteration, median", _idle)
    lines += _tuning(results)
    lines += ["**Targets**", ""]
    lines += [f"- {line}" for line in verdict_lines(results)]
    lines.append("")
    return "\n".join(lines)


def _tuning(results: dict[str, Any]) -> list[str]:
    cells = [c for c in _cells(results) if c.get("tuning")]
    if not cells:
        return []
    lines = [
        "**Tuning runs** (a tuned system: the tuner's trials in a tuning run; the "
        "measured run applies the best configuration it stored)",
        "",
        "| profile | Gbit/s | system | trials | best configuration | first trial's step / "
        "best's | measured run |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        for run in cell["tuning"]:
            tuner = run.get("tuner") or {}
            trials = tuner.get("trials") or []
            scores = [t["score_s"] for t in trials if t.get("score_s")]
            gain = f"{scores[0] / min(scores):.2f}x" if scores else "-"
            measured = [r for r in cell["runs"] if r["name"] == run["name"]]
            lines.append(
                f"| {cell['model']} | {cell['reference_gbit']:g} | {run['label']} | "
                f"{len(trials)} | "
                f"{_config(tuner.get('applied'))} | {gain} | "
                f"{', '.join(_applied(r) for r in measured) or 'not run'} |"
            )
    lines.append("")
    return lines


def _config(config: Any) -> str:
    if not isinstance(config, dict):
        return "none stored"
    partition, credit = config.get("partition_bytes"), config.get("credit_bytes")
    if not (isinstance(partition, int) and isinstance(credit, int)):
        return str(config)
    return f"partition {partition} B, credit {credit} B ({credit / partition:.3g} partitions)"


def _applied(run: dict[str, Any]) -> str:
    """Whether a tuned system's measured run applied the stored configuration."""
    events = (run.get("tuner") or {}).get("events") or []
    if "reuse" in events:
        return "reused it"
    return "tuned again" if "trial" in events else "did not tune"


def verdict_lines(results: dict[str, Any]) -> list[str]:
    """Each target's verdict, one line each."""
    return [v.line() for v in targets.verdicts(rates(results))]


def _plot_style() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rates(results: dict[str, Any], path: Path) -> None:
    """Iterations/s against the reference bandwidth, one panel per profile, one line per
    system."""
    plt = _plot_style()
    cells = _cells(results)
    models, gbits, systems = _axes(cells)
    by_key = {(c["model"], c["reference_gbit"]): c for c in cells}
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for name in systems:
            xs, ys, label = [], [], name
            for g in gbits:
                cell = by_key.get((model, g))
                if cell is not None and name in cell["summary"]:
                    xs.append(g)
                    ys.append(cell["summary"][name]["iterations_per_s"])
                    label = cell["summary"][name]["label"]
            if xs:
                dashed = name == "ddp"
                ax.plot(
                    xs, ys, "--" if dashed else "-", color="k" if dashed else None, label=label,
                    marker="o", ms=3,
                )  # fmt: skip
        ax.set_xscale("log")
        ax.set_xticks(gbits)
        ax.set_xticklabels([f"{g:g}" for g in gbits])
        ax.set_xlabel("reference bandwidth (Gbit/s)")
        ax.set_title(model)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("iterations/s")
    axes[0][-1].legend(fontsize=7)
    cfg = results["config"]
    fig.suptitle(f"{cfg['workers']} workers, links {cfg['rate_mbit']:g} Mbit/s scaled", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_idle(results: dict[str, Any], path: Path) -> None:
    """Idle ms per iteration as grouped bars: one panel per profile, a group per
    bandwidth, a bar per system."""
    plt = _plot_style()
    cells = _cells(results)
    models, gbits, systems = _axes(cells)
    by_key = {(c["model"], c["reference_gbit"]): c for c in cells}
    width = 0.8 / max(1, len(systems))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for j, name in enumerate(systems):
            xs, ys, label = [], [], name
            for i, g in enumerate(gbits):
                cell = by_key.get((model, g))
                if cell is not None and name in cell["summary"]:
                    xs.append(i + (j - (len(systems) - 1) / 2) * width)
                    ys.append(cell["summary"][name]["idle_ms"])
                    label = cell["summary"][name]["label"]
            ax.bar(xs, ys, width, label=label)
        ax.set_xticks(range(len(gbits)))
        ax.set_xticklabels([f"{g:g} Gbit/s" for g in gbits])
        ax.set_title(model)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("idle ms per iteration")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
