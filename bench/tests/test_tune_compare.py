"""The tuner comparison (sumflow_bench.tune_compare): BO against random search on the
synthetic cluster, replays of a measured grid or of an online run's trial log, and the
errors of a bad grid file."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from sumflow.tune.search import make_searcher
from sumflow.tune.session import TuningSession
from sumflow.tune.settings import TuneSettings
from sumflow.tune.space import KIB, MIB, Configuration, SearchSpace
from sumflow.tune.store import TuningKey, TuningStore
from sumflow.tune.synthetic import SyntheticCluster
from sumflow.tune.trial_log import TrialLog
from sumflow_bench import tune_compare as compare

# --- BO against random search ---------------------------------------------------------


SEEDS = range(6)


@pytest.fixture(scope="module")
def synthetic_replays() -> dict[str, list[list[float]]]:
    objective = compare.SyntheticObjective()
    # 10 draws per trial, as the online tuner measures 10 steps per trial.
    return {
        method: [compare.replay(objective, method, seed, 10, draws=10) for seed in SEEDS]
        for method in ("bo", "random")
    }


def test_bo_comes_within_5_percent_in_10_trials_on_most_seeds(
    synthetic_replays: dict[str, list[list[float]]],
) -> None:
    final = [curve[-1] for curve in synthetic_replays["bo"]]
    assert sum(r <= 1.05 for r in final) >= len(final) - 1, final


def test_bo_beats_random_search_on_average(
    synthetic_replays: dict[str, list[list[float]]],
) -> None:
    bo = statistics.mean(c[-1] for c in synthetic_replays["bo"])
    rnd = statistics.mean(c[-1] for c in synthetic_replays["random"])
    assert bo < rnd, (bo, rnd)


def test_bo_explains_its_choices() -> None:
    objective = compare.SyntheticObjective()
    bo = make_searcher("bo", objective.space, seed=0)
    rng = random.Random(0)
    proposals = []
    for _ in range(6):
        p = bo.ask()
        assert p is not None
        bo.tell(p, objective.sample(p.config, rng))
        proposals.append(p)
    kinds = [p.detail["kind"] for p in proposals]
    assert kinds == ["initial-design"] * 3 + ["gp-expected-improvement"] * 3
    gp = proposals[-1].detail
    low, high = gp["predicted_range_s"]
    assert 0 < low <= gp["predicted_step_s"] <= high
    assert 0 < gp["expected_improvement"] < 1
    assert gp["observations"] == 5
    assert "Gaussian process over 5 measured trials predicts" in proposals[-1].reason
    # What the tuner measured itself counts towards the initial design.
    bo2 = make_searcher("bo", objective.space, seed=0)
    for k in range(3):
        bo2.observe(objective.space.from_unit(k / 4, 0.5), 0.2 + k / 100)
    assert bo2.ask().detail["kind"] == "gp-expected-improvement"  # type: ignore[union-attr]


# --- the comparison tool ----------------------------------------------------------------


def write_grid(path: Path, space: SearchSpace, samples: int = 5) -> None:
    cluster = SyntheticCluster()
    rng = random.Random(0)
    configs = [
        {**c.to_json(), "step_s": [cluster.sample(c, rng) for _ in range(samples)]}
        for c in space.grid(5, 4)
    ]
    path.write_text(json.dumps({"configs": configs, "meta": {"source": "synthetic"}}))


def test_compare_replays_a_measured_grid_and_writes_its_report(tmp_path: Path) -> None:
    grid = tmp_path / "GRID.json"
    write_grid(grid, SearchSpace())
    out, png = tmp_path / "out.json", tmp_path / "search.png"
    argv = [str(grid), "--methods", "random,grid", "--seeds", "5", "--trials", "12"]
    assert compare.main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    by_method = {m["method"]: m for m in result["methods"]}
    assert by_method["random"]["seeds"] == 5
    assert by_method["grid"]["seeds"] == 1
    # Grid search goes through the measured points partition-major: after 12 of 20 it
    # has not seen the larger partitions, and its first point is the smallest partition.
    grid_curve = by_method["grid"]["curves"][0]
    assert grid_curve[0] > 2
    assert grid_curve[-1] < grid_curve[0]
    assert png.stat().st_size > 1000
    objective = compare.load_grid(grid)
    assert len(objective.grid()) == 20
    # Replays are deterministic per seed.
    assert compare.replay(objective, "random", 2, 8) == compare.replay(objective, "random", 2, 8)


def test_compare_reads_the_trial_log_of_an_online_grid_run(tmp_path: Path) -> None:
    space = SearchSpace(256 * KIB, 4 * MIB, 4)
    tune = TuneSettings(method="grid", max_trials=5, warmup_steps=1, measure_steps=3, space=space)
    start = Configuration(4 * MIB, 16 * MIB)
    key = TuningKey(
        tensors=(("fc.weight", "f32", 4 * MIB),),
        workers=1,
        worker_machines=1,
        servers=1,
        scheduler="bytescheduler",
    )
    session = TuningSession(
        tune,
        make_searcher(tune.method, space, tune.seed),
        key,
        TuningStore(tmp_path / "autotune.json"),
        TrialLog(tmp_path / "trials.jsonl", lambda line: None),
        start,
    )
    cluster, rng, config = SyntheticCluster(), random.Random(0), start
    decision = session.begin()
    while decision.steps is not None:
        config = decision.apply or config
        decision = session.end_trial([cluster.sample(config, rng) for _ in range(decision.steps)])
    objective = compare.load_grid(tmp_path / "trials.jsonl")
    assert len(objective.grid()) == 5  # the start and the first 4 grid points


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("[]", "configs"),
        ('{"configs": [{"partition_bytes": 8192, "credit_bytes": 8192}]}', "step_s"),
        (
            '{"configs": [{"partition_bytes": 8192, "credit_bytes": 8192, "step_s": [1]}]}',
            "at least 2",
        ),
        ('{"configs": [{"partition_bytes": 8192, "credit_bytes": 4096, "step_s": [1]}]}', "below"),
    ],
)
def test_compare_names_what_is_wrong_with_a_grid_file(
    tmp_path: Path, content: str, match: str
) -> None:
    path = tmp_path / "GRID.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        compare.load_grid(path)
    assert compare.main([str(path)]) == 2
