"""sumflow.tune: the search space, the drivers, persistence and its keying, the online
protocol with a fake service on several ranks, the trial log, and settings from the
environment. BO against random search on the synthetic cluster, and the offline comparison
tool, are tested with the tool, in bench/tests/test_tune_compare.py."""

from __future__ import annotations

import json
import math
import random
import statistics
import threading
from pathlib import Path
from typing import Any

import pytest

from sumflow.tune import settings
from sumflow.tune.online import OnlineTuner
from sumflow.tune.score import trimmed_mean
from sumflow.tune.search import GridSearch, RandomSearch, make_searcher
from sumflow.tune.session import Decision, TuningSession
from sumflow.tune.settings import TuneSettings
from sumflow.tune.space import ALIGN, KIB, MIB, Configuration, SearchSpace
from sumflow.tune.store import TunedResult, TuningKey, TuningStore
from sumflow.tune.synthetic import SyntheticCluster
from sumflow.tune.trial_log import TrialLog

# --- the search space -------------------------------------------------------------------


def test_configuration_refuses_a_credit_below_one_partition() -> None:
    with pytest.raises(ValueError, match="below one partition"):
        Configuration(1 * MIB, 512 * KIB)
    with pytest.raises(ValueError, match="positive integer"):
        Configuration(0, 1)
    with pytest.raises(ValueError, match="positive integer"):
        Configuration(1.5, 2)  # type: ignore[arg-type]
    assert Configuration(1 * MIB, 4 * MIB).credit_partitions == 4
    assert Configuration.from_json({"partition_bytes": 8192, "credit_bytes": 8192}) == (
        Configuration(8192, 8192)
    )
    with pytest.raises(ValueError, match="needs"):
        Configuration.from_json({"partition_bytes": 8192})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_partition_bytes": 100}, "one page"),
        ({"min_partition_bytes": 8 * MIB, "max_partition_bytes": 1 * MIB}, "above"),
        ({"max_credit_partitions": 0.5}, ">= 1"),
        ({"max_credit_partitions": True}, ">= 1"),
        ({"max_partition_bytes": 1.0e6}, "integer"),
    ],
)
def test_search_space_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SearchSpace(**kwargs)


def test_every_point_of_the_space_is_a_valid_page_aligned_configuration() -> None:
    space = SearchSpace()
    rng = random.Random(1)
    for _ in range(500):
        c = space.from_unit(rng.random(), rng.random())
        assert c.partition_bytes % ALIGN == 0
        assert c.credit_bytes % ALIGN == 0
        assert space.min_partition_bytes <= c.partition_bytes <= space.max_partition_bytes
        # Quarter octaves, so trials reuse partition sizes (and the service's keys).
        steps = math.log2(c.partition_bytes / space.min_partition_bytes) * 4
        assert steps == pytest.approx(round(steps), abs=0.2)  # up to half a page off
        assert 1 <= c.credit_partitions <= space.max_credit_partitions * (1 + 1e-3)
        assert space.contains(c)
        u, v = space.unit_point(c)
        assert space.from_unit(u, v) == c
    # Points outside are clamped in; configurations outside are recognised.
    assert space.configuration(1, 0.1) == Configuration(64 * KIB, 64 * KIB)
    assert not space.contains(Configuration(1 * ALIGN, 1 * ALIGN))
    assert not space.contains(Configuration(1 * MIB, 64 * MIB))


def test_grid_and_cap() -> None:
    space = SearchSpace(64 * KIB, 16 * MIB, 8)
    grid = space.grid(3, 2)
    assert [c.partition_bytes for c in grid[::2]] == [64 * KIB, 1 * MIB, 16 * MIB]
    assert [c.credit_partitions for c in grid[:2]] == [1, 8]
    # Nothing changes beyond the largest tensor, so partitions stop there.
    assert space.capped(3 * MIB).max_partition_bytes == 4 * MIB
    assert space.capped(10).max_partition_bytes == 64 * KIB
    with pytest.raises(ValueError, match="positive integer"):
        space.grid(0, 2)


def test_a_fusing_optimizer_adds_the_threshold_as_a_third_knob() -> None:
    space = SearchSpace(64 * KIB, 16 * MIB, 8).with_fusion(16 * KIB, 4 * MIB)
    assert (space.dims, SearchSpace().dims) == (3, 2)
    rng = random.Random(2)
    for _ in range(200):
        c = space.from_unit(rng.random(), rng.random(), rng.random())
        assert c.fusion_bytes is not None
        assert c.fusion_bytes % ALIGN == 0
        assert 16 * KIB <= c.fusion_bytes <= 4 * MIB
        assert space.contains(c)
        assert space.from_unit(*space.unit_point(c)) == c
    # A configuration without a threshold is not of this space, nor one with it of a 2-D one.
    assert not space.contains(Configuration(1 * MIB, 1 * MIB))
    assert not SearchSpace().contains(Configuration(1 * MIB, 1 * MIB, 64 * KIB))
    with pytest.raises(ValueError, match="3 coordinates, not 2"):
        space.from_unit(0.5, 0.5)
    assert len(space.grid(3, 2, 3)) == 18
    assert space.grid(1, 1, 3)[-1].fusion_bytes == 4 * MIB
    assert "fusion thresholds of 16 KiB to 4 MiB" in space.describe()
    c = Configuration(1 * MIB, 2 * MIB, 256 * KIB)
    assert Configuration.from_json(c.to_json()) == c
    assert c.describe().endswith(", fusion 256 KiB")
    assert "fusion_bytes" not in Configuration(1 * MIB, 2 * MIB).to_json()
    with pytest.raises(ValueError, match="fusion_bytes must be a positive integer"):
        Configuration(1 * MIB, 2 * MIB, 0)
    with pytest.raises(ValueError, match="both 0 for no fusion"):
        SearchSpace(min_fusion_bytes=16 * KIB)
    # Bayesian optimisation models all three and says so.
    bo = make_searcher("bo", space, seed=0)
    proposals = []
    for _ in range(5):
        p = bo.ask()
        assert p is not None
        assert space.contains(p.config)
        # Faster with larger spans and partitions, up to a point.
        score = sum(abs(x - 0.7) for x in space.unit_point(p.config)) + 1
        bo.tell(p, score)
        proposals.append(p)
    assert "octaves of fusion threshold" in proposals[-1].reason
    assert "fusion_octaves" in proposals[-1].detail["length_scales"]
    # A key stored before fusion keeps its digest; a fusing optimizer's is another.
    assert key().digest() == key(fusion=False).digest() != key(fusion=True).digest()


def test_trimmed_mean_drops_rare_stalls_but_keeps_recurring_costs() -> None:
    steady = [0.1] * 9 + [5.0]
    assert trimmed_mean(steady) == pytest.approx(0.1)
    recurring = [0.1, 0.1, 0.3] * 4
    assert trimmed_mean(recurring) > statistics.median(recurring)
    assert trimmed_mean([0.2]) == 0.2
    with pytest.raises(ValueError, match="at least one"):
        trimmed_mean([])
    with pytest.raises(ValueError, match="finite"):
        trimmed_mean([0.1, float("nan")])


# --- the drivers ------------------------------------------------------------------------


def test_random_and_grid_search_are_seeded_and_finite() -> None:
    space = SearchSpace()
    a, b, c = (RandomSearch(space, seed) for seed in (3, 3, 4))
    draws = [[s.ask().config for _ in range(5)] for s in (a, b, c)]
    assert draws[0] == draws[1] != draws[2]
    grid = GridSearch.of_space(space, 2, 2)
    seen = [grid.ask() for _ in range(5)]
    assert [p is None for p in seen] == [False] * 4 + [True]
    assert "point 4 of 4" in seen[3].reason  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="unknown search method"):
        make_searcher("sgd", space)


# --- persistence ------------------------------------------------------------------------

TENSORS = (("fc.weight", "f32", 4 * MIB), ("fc.bias", "f32", 4096))


def key(**changes: Any) -> TuningKey:
    fields: dict[str, Any] = {
        "tensors": TENSORS,
        "workers": 4,
        "worker_machines": 4,
        "servers": 4,
        "scheduler": "bytescheduler",
    }
    fields.update(changes)
    return TuningKey(**fields)


def test_store_round_trip_and_keying(tmp_path: Path) -> None:
    store = TuningStore(tmp_path / "cache" / "autotune.json")
    assert store.load(key()) is None
    result = TunedResult(
        Configuration(1 * MIB, 4 * MIB), 0.1, 10, "bo", Configuration(4 * MIB, 16 * MIB), 0.2
    )
    store.save(key(), result)
    got = store.load(key())
    assert got is not None
    assert (got.best, got.score_s, got.trials, got.method) == (result.best, 0.1, 10, "bo")
    assert got.baseline == result.baseline
    assert got.baseline_score_s == 0.2
    assert got.tuned_at  # stamped when saved
    # Anything that changes what is optimal is a different key.
    for other in (
        key(tensors=(("fc.weight", "f32", 8 * MIB), TENSORS[1])),
        key(tensors=(("fc.weight", "f16", 4 * MIB), TENSORS[1])),
        key(tensors=TENSORS[::-1]),
        key(workers=8),
        key(worker_machines=2),
        key(servers=2),
        key(scheduler="p3"),
    ):
        assert other.digest() != key().digest()
        assert store.load(other) is None
    # A second entry keeps the first.
    store.save(key(workers=8), result)
    assert store.load(key()) is not None
    assert store.load(key(workers=8)) is not None
    data = json.loads(store.path.read_text())
    entry = data["entries"][key().digest()]
    assert entry["key"]["workers"] == 4
    assert entry["key"]["model_bytes"] == 4 * MIB + 4096


def test_store_refuses_files_it_does_not_understand(tmp_path: Path) -> None:
    path = tmp_path / "autotune.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"not JSON.*SUMFLOW_AUTOTUNE_FILE"):
        TuningStore(path).load(key())
    path.write_text(json.dumps({"format": "sumflow-autotune", "version": 99, "entries": {}}))
    with pytest.raises(ValueError, match="version 99"):
        TuningStore(path).load(key())
    path.write_text(
        json.dumps({"format": "sumflow-autotune", "version": 1, "entries": {key().digest(): {}}})
    )
    with pytest.raises(ValueError, match="bad entry"):
        TuningStore(path).load(key())


def test_default_store_path_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sumflow.tune.store import default_path

    monkeypatch.delenv("SUMFLOW_AUTOTUNE_FILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_path() == tmp_path / "sumflow" / "autotune.json"
    monkeypatch.setenv("SUMFLOW_AUTOTUNE_FILE", str(tmp_path / "x.json"))
    assert default_path() == tmp_path / "x.json"


# --- settings ---------------------------------------------------------------------------


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SUMFLOW_AUTOTUNE", "SUMFLOW_AUTOTUNE_TRIALS", "SUMFLOW_AUTOTUNE_SECONDS"):
        monkeypatch.delenv(var, raising=False)
    assert not settings.enabled_in_env()
    monkeypatch.setenv("SUMFLOW_AUTOTUNE", "1")
    assert settings.enabled_in_env()
    assert not settings.from_env().retune
    monkeypatch.setenv("SUMFLOW_AUTOTUNE", "retune")
    assert settings.from_env().retune
    monkeypatch.setenv("SUMFLOW_AUTOTUNE_TRIALS", "7")
    monkeypatch.setenv("SUMFLOW_AUTOTUNE_SECONDS", "90")
    monkeypatch.setenv("SUMFLOW_AUTOTUNE_METHOD", "random")
    monkeypatch.setenv("SUMFLOW_AUTOTUNE_PARTITION_BYTES", "65536:4194304")
    s = settings.from_env()
    assert (s.max_trials, s.max_seconds, s.method) == (7, 90.0, "random")
    assert s.space.max_partition_bytes == 4 * MIB
    assert not s.space.tunes_fusion  # unless the optimizer fuses, then its default range
    monkeypatch.setenv("SUMFLOW_AUTOTUNE_FUSION_BYTES", "16384:1048576")
    assert settings.from_env().space.max_fusion_bytes == 1 * MIB
    monkeypatch.setenv("SUMFLOW_AUTOTUNE_TRIALS", "0")
    with pytest.raises(ValueError, match="SUMFLOW_AUTOTUNE_TRIALS='0': expected an integer >= 1"):
        settings.from_env()
    monkeypatch.setenv("SUMFLOW_AUTOTUNE_TRIALS", "x")
    with pytest.raises(ValueError, match="SUMFLOW_AUTOTUNE_TRIALS='x'"):
        settings.from_env()
    monkeypatch.setenv("SUMFLOW_AUTOTUNE", "maybe")
    with pytest.raises(ValueError, match="retune"):
        settings.enabled_in_env()
    with pytest.raises(ValueError, match="method"):
        TuneSettings(method="sgd")


# --- rank 0's session -------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def session(
    tmp_path: Path, lines: list[str], start: Configuration | None, **kw: Any
) -> TuningSession:
    s = TuneSettings(
        **{"method": "grid", "max_trials": 4, "warmup_steps": 1, "measure_steps": 3, **kw}
    )
    space = SearchSpace(256 * KIB, 4 * MIB, 4)
    return TuningSession(
        s,
        GridSearch.of_space(space, 2, 2),
        key(),
        TuningStore(tmp_path / "autotune.json"),
        TrialLog(tmp_path / "trials.jsonl", lines.append),
        start,
        Clock(),
    )


def test_session_measures_the_start_first_applies_the_best_and_stores_it(
    tmp_path: Path,
) -> None:
    lines: list[str] = []
    start = Configuration(4 * MIB, 16 * MIB)
    s = session(tmp_path, lines, start)
    assert s.begin() == Decision(None, 4)  # the start runs as it is
    with pytest.raises(ValueError, match="runs 4 steps"):
        s.end_trial([0.1])
    scores = iter([0.5, 0.25, 0.125, 0.375])
    decisions = []
    for _ in range(4):
        v = next(scores)
        decisions.append(s.end_trial([9.0, v, v, v]))  # the warm-up step is not scored
    grid = GridSearch.of_space(SearchSpace(256 * KIB, 4 * MIB, 4), 2, 2)
    assert [d.apply for d in decisions[:3]] == [grid.ask().config for _ in range(3)]  # type: ignore[union-attr]
    assert decisions[3].steps is None
    best = decisions[1].apply  # trial 3 (score 0.125) ran what trial 2's decision applied
    assert decisions[3].apply == best
    stored = TuningStore(tmp_path / "autotune.json").load(key())
    assert stored is not None
    assert (stored.best, stored.score_s, stored.trials, stored.baseline_score_s) == (
        best,
        0.125,
        4,
        0.5,
    )
    assert "75.0% faster than at the start" in lines[-1]
    events = [json.loads(x) for x in (tmp_path / "trials.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["start"] + ["propose", "trial"] * 4 + ["finish"]
    trial3 = events[6]
    assert trial3["trial"] == 3
    assert trial3["score_s"] == 0.125
    assert trial3["step_s"] == [0.125] * 3
    assert trial3["warmup_step_s"] == [9.0]
    assert trial3["reason"].startswith("grid search: point 2 of 4")
    assert trial3["best"]["trial"] == 3
    with pytest.raises(RuntimeError, match="no trial running"):
        s.end_trial([0.1] * 4)


def test_a_later_run_reuses_the_stored_result_unless_told_to_retune(tmp_path: Path) -> None:
    first = session(tmp_path, [], Configuration(4 * MIB, 16 * MIB), max_trials=1)
    first.begin()
    done = first.end_trial([0.1] * 4)
    lines: list[str] = []
    again = session(tmp_path, lines, Configuration(4 * MIB, 16 * MIB))
    assert again.begin() == Decision(done.apply, None)
    assert "SUMFLOW_AUTOTUNE=retune" in lines[-1]
    retune = session(tmp_path, [], Configuration(4 * MIB, 16 * MIB), retune=True)
    assert retune.begin() == Decision(None, 4)


def test_a_store_that_cannot_be_written_loses_the_result_not_the_job(tmp_path: Path) -> None:
    lines: list[str] = []
    (tmp_path / "file").write_text("")
    s = TuningSession(
        TuneSettings(method="grid", max_trials=1, warmup_steps=0, measure_steps=1, retune=True),
        GridSearch.of_space(SearchSpace(), 2, 2),
        key(),
        TuningStore(tmp_path / "file" / "autotune.json"),
        TrialLog(None, lines.append),
        Configuration(4 * MIB, 16 * MIB),
    )
    s.begin()
    assert s.end_trial([0.1]) == Decision(Configuration(4 * MIB, 16 * MIB), None)
    assert "NOT stored" in lines[-1]


def test_the_time_budget_stops_before_a_trial_would_pass_it(tmp_path: Path) -> None:
    lines: list[str] = []
    s = session(tmp_path, lines, None, max_trials=10, max_seconds=25.0)
    clock = s._clock
    assert isinstance(clock, Clock)
    d = s.begin()
    assert d.apply is not None  # no known start: the first proposal runs at once
    clock.now += 10
    assert s.end_trial([0.1] * 4).steps == 4
    clock.now += 10
    assert s.end_trial([0.1] * 4).steps is None
    assert "would pass the 25 s budget" in lines[-1]


# --- the online protocol on several ranks -----------------------------------------------


class FakeService:
    """Records reconfigure calls with the step they were made at."""

    def __init__(self, start: Configuration) -> None:
        self.config = start
        self.step = 0
        self.calls: list[tuple[int, Configuration]] = []

    def reconfigure(
        self,
        partition_bytes: int | None = None,
        credit_bytes: int | None = None,
        fusion_bytes: int | None = None,
    ) -> None:
        assert partition_bytes is not None
        assert credit_bytes is not None
        self.config = Configuration(partition_bytes, credit_bytes, fusion_bytes)
        self.calls.append((self.step, self.config))


class FakeBroadcast:
    """rank 0's object on every rank, with a barrier on either side like a real one."""

    def __init__(self, ranks: int) -> None:
        self._barrier = threading.Barrier(ranks, timeout=30)
        self._slot: Any = None

    def __call__(self, rank: int, obj: Any) -> Any:
        if rank == 0:
            self._slot = obj
        self._barrier.wait()
        got = self._slot
        self._barrier.wait()
        return got


def run_ranks(
    tmp_path: Path,
    ranks: int,
    steps: int,
    tune: TuneSettings,
    lines: list[str],
    errors: list[BaseException] | None = None,
) -> list[FakeService]:
    """`ranks` workers training `steps` steps on the synthetic cluster, each rank's clock
    advancing by its configuration's step time. Workers' exceptions go to `errors` when
    given, else the first is raised."""
    cluster = SyntheticCluster()
    start = Configuration(4 * MIB, 16 * MIB)
    broadcast = FakeBroadcast(ranks)
    services = [FakeService(start) for _ in range(ranks)]
    drains = [0] * ranks
    raise_first = errors is None
    errors = [] if errors is None else errors

    def worker(rank: int) -> None:
        try:
            clock = Clock()
            svc = services[rank]

            def open_session() -> TuningSession:
                return TuningSession(
                    tune,
                    make_searcher(tune.method, tune.space, tune.seed),
                    key(),
                    TuningStore(tmp_path / "autotune.json"),
                    TrialLog(tmp_path / "trials.jsonl", lines.append),
                    start,
                    clock,
                )

            def drain() -> None:
                drains[rank] += 1

            tuner = OnlineTuner(
                svc,
                lambda obj: broadcast(rank, obj),
                drain,
                open_session if rank == 0 else None,
                clock,
            )
            rng = random.Random(rank)
            for _ in range(steps):
                clock.now += cluster.sample(svc.config, rng)
                svc.step += 1
                tuner.after_step()
            assert tuner.done
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank is stuck"
    if errors:
        if raise_first:
            raise errors[0]
        return services
    assert drains == [tune.max_trials + 1] * ranks
    return services


def test_a_failure_on_rank_0_fails_every_rank_at_once_naming_it(tmp_path: Path) -> None:
    (tmp_path / "autotune.json").write_text("{not json")
    errors: list[BaseException] = []
    tune = TuneSettings(method="random", max_trials=3, warmup_steps=1, measure_steps=2)
    run_ranks(tmp_path, 3, 10, tune, [], errors)
    assert len(errors) == 3
    assert sum(isinstance(e, ValueError) and "not JSON" in str(e) for e in errors) == 1
    others = [str(e) for e in errors if isinstance(e, RuntimeError)]
    assert len(others) == 2
    assert all(m.startswith("auto-tuning failed on rank 0: ValueError:") for m in others)


def test_every_rank_switches_at_the_same_steps_to_rank_0s_choices(tmp_path: Path) -> None:
    tune = TuneSettings(method="random", max_trials=5, warmup_steps=2, measure_steps=5, seed=4)
    lines: list[str] = []
    services = run_ranks(tmp_path, 3, 60, tune, lines)
    calls = services[0].calls
    trial = tune.warmup_steps + tune.measure_steps
    # Boundary 1 keeps the start (measured as trial 1); then one switch per boundary, the
    # last one to the best configuration.
    assert [step for step, _ in calls] == [1 + k * trial for k in range(1, tune.max_trials + 1)]
    for svc in services[1:]:
        assert svc.calls == calls
    events = [json.loads(x) for x in (tmp_path / "trials.jsonl").read_text().splitlines()]
    trials = [e for e in events if e["event"] == "trial"]
    best = min(trials, key=lambda e: e["score_s"])
    assert calls[-1][1] == Configuration.from_json(best["config"])
    assert events[-1]["event"] == "finish"
    assert events[-1]["best"]["trial"] == best["trial"]
    assert all(len(e["step_s"]) == tune.measure_steps for e in trials)
    assert any(line.startswith("trial 3/5: ") and "why: random search" in line for line in lines)


def test_online_bo_on_the_synthetic_cluster(tmp_path: Path) -> None:
    tune = TuneSettings(method="bo", max_trials=6, warmup_steps=1, measure_steps=4)
    lines: list[str] = []
    services = run_ranks(tmp_path, 2, 40, tune, lines)
    assert services[0].calls == services[1].calls
    assert any("Gaussian process over" in line for line in lines)
    final = services[0].config
    cluster = SyntheticCluster()
    assert cluster.step_time(final) < cluster.step_time(Configuration(4 * MIB, 16 * MIB))


# --- a real job -------------------------------------------------------------------------

TUNE_WORKER = str(Path(__file__).with_name("tune_worker.py"))


def tuned_job(tmp_path: Path, out: Path, optimizer: str = "sync") -> list[dict[str, Any]]:
    """Two workers training tune_worker's model (`optimizer`: sync, cross the barrier, or
    fused: cross it fusing gradients) under SUMFLOW_AUTOTUNE=1 with a grid over
    partitions (and fusion thresholds) of 4 to 32 KiB: 4 trials of 1 warm-up + 2 measured
    steps."""
    import torch
    from jobs import run_worker_processes

    out.mkdir()
    env = {
        "SUMFLOW_AUTOTUNE": "1",
        "SUMFLOW_AUTOTUNE_METHOD": "grid",
        "SUMFLOW_AUTOTUNE_TRIALS": "4",
        "SUMFLOW_AUTOTUNE_WARMUP_STEPS": "1",
        "SUMFLOW_AUTOTUNE_MEASURE_STEPS": "2",
        "SUMFLOW_AUTOTUNE_PARTITION_BYTES": "4096:32768",
        "SUMFLOW_AUTOTUNE_FUSION_BYTES": "4096:32768",
        "SUMFLOW_AUTOTUNE_FILE": str(tmp_path / "autotune.json"),
        "SUMFLOW_AUTOTUNE_LOG": str(out / "trials.jsonl"),
        "SUMFLOW_PARTITION_BYTES": "16384",
        "SUMFLOW_CREDIT_BYTES": "32768",
    }
    outcomes = run_worker_processes(out, 2, [TUNE_WORKER, str(out), optimizer], 1, env=env)
    for o in outcomes:
        assert o.returncode == 0, f"worker {o.rank} exited {o.returncode}:\n{o.stderr[-3000:]}"
    assert "sumflow autotune: " in outcomes[0].stderr
    assert "sumflow autotune: " not in outcomes[1].stderr  # only rank 0 explains itself
    return [torch.load(out / f"rank{o.rank}.pt", weights_only=False) for o in outcomes]


def one_process_reference() -> dict[str, Any]:
    import torch
    from tune_worker import STEPS, batch, make_optimizer, model

    m = model()
    opt = make_optimizer(m.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        xs, ys = zip(*(batch(step, r, 2) for r in range(2)), strict=True)
        torch.nn.functional.cross_entropy(m(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return m.state_dict()


@pytest.mark.parametrize("optimizer", ["sync", "cross"])
def test_a_tuned_job_switches_every_worker_at_the_same_step_and_sums_right(
    tmp_path: Path, optimizer: str
) -> None:
    import torch

    got = tuned_job(tmp_path, tmp_path / "first", optimizer)
    schedules = [r["schedules"] for r in got]
    assert schedules[0] == schedules[1]
    # After step k (1-based) the schedule is what boundary k applied: the start until the
    # first proposal at step 4, then one grid point per trial, then the best from step 13.
    changes = [k + 1 for k in range(1, len(schedules[0])) if schedules[0][k] != schedules[0][k - 1]]
    assert schedules[0][0] == (16384, 32768)
    assert set(changes) <= {4, 7, 10, 13}
    assert len(changes) >= 2  # the grid's first points differ from the start
    events = [json.loads(x) for x in (tmp_path / "first" / "trials.jsonl").read_text().splitlines()]
    trials = [e for e in events if e["event"] == "trial"]
    assert len(trials) == 4
    assert events[-1]["event"] == "finish"
    best = Configuration.from_json(events[-1]["best"]["config"])
    assert schedules[0][-1] == (best.partition_bytes, best.credit_bytes)
    for t in trials[1:]:
        assert 4096 <= t["config"]["partition_bytes"] <= 32768
    # Re-partitioning mid-training changes nothing in the sums.
    want = one_process_reference()
    for r in got:
        for k, v in want.items():
            assert torch.allclose(r["state"][k], v, rtol=0, atol=1e-10), k

    # A second run of the same job applies the stored best at the first step, untuned.
    again = tuned_job(tmp_path, tmp_path / "again", optimizer)
    assert again[0]["schedules"] == again[1]["schedules"]
    assert set(again[0]["schedules"]) == {(best.partition_bytes, best.credit_bytes)}
    events = [json.loads(x) for x in (tmp_path / "again" / "trials.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "reuse"]


def test_the_fusion_threshold_is_tuned_with_the_other_knobs(tmp_path: Path) -> None:
    """A fusing optimizer: the grid varies the threshold too, every worker re-cuts its
    spans at the same steps, the sums stay right, and the stored best brings its
    threshold to the next run."""
    import torch

    got = tuned_job(tmp_path, tmp_path / "first", "fused")
    schedules = [r["schedules"] for r in got]
    assert schedules[0] == schedules[1]
    assert schedules[0][0] == (16384, 32768, 4096)
    # The grid's first points: the smallest partition and credit, thresholds from
    # smallest to largest (4 KiB, 11.3 KiB rounded to pages, 32 KiB).
    assert {s[2] for s in schedules[0]} >= {4096, 32768}
    events = [json.loads(x) for x in (tmp_path / "first" / "trials.jsonl").read_text().splitlines()]
    trials = [e for e in events if e["event"] == "trial"]
    assert all("fusion_bytes" in t["config"] for t in trials)
    best = Configuration.from_json(events[-1]["best"]["config"])
    assert best.fusion_bytes is not None
    assert schedules[0][-1] == (best.partition_bytes, best.credit_bytes, best.fusion_bytes)
    want = one_process_reference()
    for r in got:
        for k, v in want.items():
            assert torch.allclose(r["state"][k], v, rtol=0, atol=1e-10), k

    again = tuned_job(tmp_path, tmp_path / "again", "fused")
    assert set(again[0]["schedules"]) == {
        (best.partition_bytes, best.credit_bytes, best.fusion_bytes)
    }


def test_auto_tuning_fifo_is_refused_on_every_worker(tmp_path: Path) -> None:
    from jobs import run_worker_processes

    env = {"SUMFLOW_AUTOTUNE": "1", "SUMFLOW_SCHEDULER": "fifo"}
    outcomes = run_worker_processes(tmp_path, 2, [TUNE_WORKER, str(tmp_path), "sync"], 1, env=env)
    for o in outcomes:
        assert o.returncode != 0, f"worker {o.rank} trained"
        assert "the fifo scheduler sends whole tensors without a credit" in o.stderr, o.stderr[
            -2000:
        ]
