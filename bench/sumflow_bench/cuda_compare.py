"""Compares runs of ``sumflow_bench.cuda_training`` side by side: two trees of sumflow
(an A/B on one machine, as ``bench/cuda_check.sh``'s ``ab`` step runs them, alternating),
or any labelled sets of runs. Prints each run's backward ratio, hooks and send cost, and
plots the ratios.

    python -m sumflow_bench.cuda_compare --plot ab.png new=ab-new-*.json old=ab-old-*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "sets",
        nargs="+",
        metavar="LABEL=FILE[,FILE...]",
        help="a label and the JSON results of its runs (cuda_training --json)",
    )
    p.add_argument("--plot", type=Path, help="write the ratios as a PNG here")
    p.add_argument("--title", default="ResNet-50 backward with sumflow's hooks against plain")
    return p.parse_args(argv)


def load(sets: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """The runs of each label, in the order given."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for spec in sets:
        label, sep, files = spec.partition("=")
        if not sep or not label or not files:
            raise SystemExit(f"cuda_compare: '{spec}' is not LABEL=FILE[,FILE...]")
        for name in files.split(","):
            try:
                run = json.loads(Path(name).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise SystemExit(f"cuda_compare: cannot read {name}: {e}") from e
            if "backward_ratio" not in run:
                raise SystemExit(f"cuda_compare: {name} is not a cuda_training result")
            runs.setdefault(label, []).append(run)
    return runs


def report(runs: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| set | run | backward, plain | with sumflow | ratio | in hooks | a send | another |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for label, those in runs.items():
        for i, r in enumerate(those, 1):
            lines.append(
                f"| {label} | {i} | {r['backward_plain_s'] * 1e3:.1f} ms "
                f"| {r['backward_sumflow_s'] * 1e3:.1f} ms | {r['backward_ratio']:.3f}x "
                f"| {r['hooks_s'] * 1e3:.1f} ms | {r['send_hook_us']:.1f} us "
                f"| {r['other_hook_us']:.2f} us |"
            )
    for label, those in runs.items():
        ratios = [r["backward_ratio"] for r in those]
        lines.append(
            f"{label}: median ratio {statistics.median(ratios):.3f}x over {len(ratios)} runs "
            f"({min(ratios):.3f}-{max(ratios):.3f})"
        )
    return "\n".join(lines)


def plot(runs: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(runs)
    most = max(len(those) for those in runs.values())
    for k, (label, those) in enumerate(runs.items()):
        xs = [i + k * width for i in range(len(those))]
        ax.bar(xs, [r["backward_ratio"] for r in those], width, label=label)
    ax.axhline(1.05, color="black", linestyle="--", linewidth=1, label="1.05x (the target)")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(most)], [f"run {i + 1}" for i in range(most)])
    ax.set_ylim(0.95, max(1.1, max(r["backward_ratio"] for t in runs.values() for r in t) + 0.02))
    ax.set_ylabel("backward with sumflow / plain")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    runs = load(args.sets)
    print(report(runs))
    if args.plot:
        plot(runs, args.plot, args.title)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
