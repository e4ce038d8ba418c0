"""sumflow_bench.cuda_compare: runs of cuda_training side by side, table and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sumflow_bench.cuda_compare import main


def result(path: Path, ratio: float, send_us: float) -> str:
    path.write_text(
        json.dumps(
            {
                "backward_plain_s": 0.022,
                "backward_sumflow_s": 0.022 * ratio,
                "backward_ratio": ratio,
                "hooks_s": 0.001,
                "send_hook_us": send_us,
                "other_hook_us": 3.0,
            }
        )
    )
    return str(path)


def test_runs_are_tabled_by_label_with_each_labels_median(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = [result(tmp_path / f"new{i}.json", r, 30.0) for i, r in enumerate((1.03, 1.05, 1.04))]
    old = [result(tmp_path / f"old{i}.json", r, 70.0) for i, r in enumerate((1.10, 1.06))]
    plot = tmp_path / "ab.png"
    assert main(["--plot", str(plot), f"new={','.join(new)}", f"old={','.join(old)}"]) == 0
    out = capsys.readouterr().out
    assert "| new | 3 | 22.0 ms | 22.9 ms | 1.040x | 1.0 ms | 30.0 us | 3.00 us |" in out
    assert "new: median ratio 1.040x over 3 runs (1.030-1.050)" in out
    assert "old: median ratio 1.080x over 2 runs (1.060-1.100)" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_malformed_set_or_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="is not LABEL=FILE"):
        main(["no-label"])
    with pytest.raises(SystemExit, match=r"cannot read .*missing\.json"):
        main([f"a={tmp_path / 'missing.json'}"])
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(SystemExit, match="is not a cuda_training result"):
        main([f"a={other}"])
