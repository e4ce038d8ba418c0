"""The harnesses' shared ending: results.json written whatever happens, and the exit status
that says what did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sumflow_bench.jobs import JobFailed, report, run_recorded
from sumflow_bench.netns import ClusterError, ClusterUnavailable


@pytest.mark.parametrize(
    ("failure", "status"),
    [
        (None, None),
        (ClusterUnavailable("no root"), 2),
        (ClusterError("veth pair"), 2),
        (JobFailed("the job exited 1"), 1),
    ],
)
def test_results_are_written_whatever_happens(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    failure: Exception | None,
    status: int | None,
) -> None:
    results: dict[str, list[int]] = {"runs": []}

    def jobs() -> None:
        results["runs"].append(1)
        if failure is not None:
            raise failure

    assert run_recorded("some_harness", tmp_path, results, jobs) == status
    assert json.loads((tmp_path / "results.json").read_text()) == {"runs": [1]}
    if failure is not None:
        assert f"sumflow_bench.some_harness: {failure}" in capsys.readouterr().err


def test_an_unexpected_error_still_leaves_the_results(tmp_path: Path) -> None:
    def jobs() -> None:
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        run_recorded("some_harness", tmp_path, {"runs": []}, jobs)
    assert (tmp_path / "results.json").exists()


def test_the_report_is_written_printed_and_plotted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plotted: list[Path] = []
    assert report(tmp_path, "| a | b |", plotted.append, "fig.png") == 0
    assert (tmp_path / "results.md").read_text() == "| a | b |"
    assert "| a | b |" in capsys.readouterr().out
    assert plotted == [tmp_path / "fig.png"]
