"""The simulator (sumflow.sim) against the papers' analyses and examples.

- BytePS Table 1 and Eq. 6: on a uniform network the busiest link carries exactly the
  communication time the formulas give, and an iteration of pure communication takes
  that time plus the pipeline's fill and drain (exactly that time for ring all-reduce);
  Eq. 7's acceleration ratios at n = 32, k = 16.
- ByteScheduler Theorem 1: priority scheduling with small partitions beats every other
  priority order and every non-preemptive order, by brute force on random chains.
- ByteScheduler Fig. 2's three-layer example (44.4%) and the order of Prophet Fig. 5.
- Folding identical worker machines into one changes nothing.
- Bad configurations fail with the field named; the timeline is a Chrome trace; the CLI.

Times are simulated, never wall-clock: nothing here depends on this machine's speed.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest

from sumflow import profiles
from sumflow.profiles import LayerProfile, ModelProfile, ParamSpec
from sumflow.sim import Cluster, Config, Network, Scheduling, cli, simulate

#: 1 GB/s in each direction: a megabyte takes a millisecond.
B = 1e9
GBPS = B * 8 / 1e9
#: Nothing but bandwidth: no latency, no per-message cost, no headers.
IDEAL = Network(gbps=GBPS, latency_us=0, message_overhead_us=0, segment_bytes=4096, header_bytes=0)


def model(
    tensor_bytes: list[int], forward_ms: float = 0.0, backward_ms: float = 0.0
) -> ModelProfile:
    """One layer holding the given float32 tensors."""
    return ModelProfile(
        name="set",
        source="test",
        device="none",
        batch_size=1,
        sample="none",
        layers=(
            LayerProfile(
                "set",
                tuple(ParamSpec(f"t{i}", (b // 4,)) for i, b in enumerate(tensor_bytes)),
                forward_ms,
                backward_ms,
            ),
        ),
    )


def chain(forward_ms: list[float], backward_ms: list[float], elements: list[int]) -> ModelProfile:
    """Layers in forward order, one tensor each."""
    return ModelProfile(
        name="chain",
        source="test",
        device="none",
        batch_size=1,
        sample="none",
        layers=tuple(
            LayerProfile(f"L{i}", (ParamSpec(f"w{i}", (e,)),), f, b)
            for i, (f, b, e) in enumerate(zip(forward_ms, backward_ms, elements, strict=True))
        ),
    )


def communication(profile: ModelProfile, arch: str, n: int, k: int = 0, **kw) -> object:
    """One iteration of pure communication: every gradient ready at once, nothing hidden."""
    cfg = Config(
        profile=profile,
        cluster=Cluster(machines=n, cpu_machines=k),
        network=kw.pop("network", IDEAL),
        architecture=arch,
        scheduling=kw.pop("scheduling", Scheduling(partition_bytes=1 << 18)),
        cross_barrier=False,
        warmup_iterations=0,
        iterations=1,
        **kw,
    )
    return simulate(cfg)


# ---- BytePS Table 1, Eq. 6 and Eq. 7 ---------------------------------------------------


def allreduce_time(n: int, m: float) -> float:
    return 2 * (n - 1) * m / (n * B)


def ps_time(n: int, k: int, m: float) -> float:
    return max(m / B, n * m / (k * B))


def optimal_time(n: int, k: int, m: float) -> float:
    return 2 * n * (n - 1) * m / ((n * n + k * n - 2 * k) * B)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_allreduce_takes_table_1_time_exactly(n: int) -> None:
    m = 24 * (1 << 20)
    # Partitions of 24 x 8 KiB: every ring's chunk is a whole number of bytes.
    sched = Scheduling(partition_bytes=24 * 8192)
    r = communication(model([m // 8] * 8), "ring", n, scheduling=sched)
    assert r.iteration_s == pytest.approx(allreduce_time(n, m), rel=1e-9)
    assert r.network_s == pytest.approx(allreduce_time(n, m), rel=1e-9)
    # The ring crosses every NIC in both directions equally.
    assert {round(link.utilisation, 9) for link in r.links} == {1.0}


@pytest.mark.parametrize(("n", "k"), [(4, 4), (4, 2), (4, 1), (8, 2)])
def test_noncolocated_ps_moves_table_1_bytes_and_only_the_pipeline_adds(n: int, k: int) -> None:
    m = 64 * (1 << 18)
    gaps = []
    for partition in (1 << 18, 1 << 16):
        r = communication(
            model([1 << 18] * 64), "ps", n, k, scheduling=Scheduling(partition_bytes=partition)
        )
        assert r.network_s == pytest.approx(ps_time(n, k, m), rel=1e-9)
        assert r.iteration_s >= ps_time(n, k, m)
        # Fill and drain: a partition's sums leave only once every worker's push is in,
        # a few partitions' time at each end.
        gap = r.iteration_s - ps_time(n, k, m)
        assert gap <= 8 * n * partition / (k * B), (partition, gap)
        gaps.append(gap)
    assert gaps[1] < gaps[0] / 2, "smaller partitions pipeline better"


@pytest.mark.parametrize("n", [2, 4, 5])
def test_colocated_ps_moves_as_many_bytes_as_the_ring(n: int) -> None:
    m = 40 * n * (1 << 16)
    r = communication(model([1 << 16] * (40 * n)), "colocated-ps", n)
    assert r.network_s == pytest.approx(allreduce_time(n, m), rel=1e-9)
    assert r.iteration_s == pytest.approx(allreduce_time(n, m), rel=0.05)


@pytest.mark.parametrize(("n", "k"), [(4, 1), (4, 2), (4, 3), (6, 2)])
def test_byteps_eq_1_and_2_shares_give_eq_6_time(n: int, k: int) -> None:
    # n^2 + kn - 2k equal partitions: Eq. 1 and 2 give every server a whole number. Large
    # enough to be cut into a piece per lane (none under 128 KiB), and a set large against
    # a round's last pieces, which return alone.
    units = n * n + k * n - 2 * k
    part = 1 << 20
    r = communication(
        model([part] * units * 8), "byteps", n, k, scheduling=Scheduling(partition_bytes=part)
    )
    m = units * 8 * part
    assert r.network_s == pytest.approx(optimal_time(n, k, m), rel=1e-9)
    assert optimal_time(n, k, m) <= r.iteration_s <= optimal_time(n, k, m) * 1.1
    for line in r.placement:
        # "server 3 (colocated): 0.3 MB, 6.7% of the model, target 6.7%"
        share, target = re.search(r"([\d.]+)% of the model, target ([\d.]+)%", line).groups()
        assert share == target, line
    # Worker machines and CPU machines are equally busy: the point of Eq. 1 and 2.
    busiest = max(link.busy_s_per_iteration for link in r.links)
    cpu = [link for link in r.links if link.name.startswith("CPU")]
    assert all(link.busy_s_per_iteration == pytest.approx(busiest, rel=1e-9) for link in cpu)


def test_eq_7_acceleration_ratios_at_32_workers_and_16_cpu_machines() -> None:
    n, k = 32, 16
    units = n * n + k * n - 2 * k  # 1504
    part = 1 << 12
    profile = model([part] * units)
    sched = Scheduling(partition_bytes=part)
    ring = communication(profile, "ring", n, scheduling=sched).network_s
    ps = communication(profile, "ps", n, k, scheduling=sched).network_s
    byteps = communication(profile, "byteps", n, k, scheduling=sched).network_s
    gamma_a, gamma_p = ring / byteps, ps / byteps
    assert gamma_a == pytest.approx(units / n**2, rel=1e-9)
    assert gamma_p == pytest.approx(units / (2 * k * (n - 1)), rel=1e-9)
    # The paper prints 1.46 (1.46875 cut to two places) and 1.52.
    assert math.floor(gamma_a * 100) / 100 == 1.46
    assert round(gamma_p, 2) == 1.52


# ---- ByteScheduler Theorem 1, Fig. 2; Prophet Fig. 5 --------------------------------------

#: 1 MB/s: 1,000 bytes take a millisecond, the time unit of the examples below.
UNIT = 1000
SLOW = Network(gbps=8e-3, latency_us=0, message_overhead_us=0, segment_bytes=8, header_bytes=0)


def one_worker(profile: ModelProfile, scheduling: Scheduling, network: Network = SLOW) -> float:
    """Milliseconds per iteration of one worker and one CPU server (the setting of the
    scheduling papers' examples: push on the worker's uplink, pull on its downlink),
    crossing the global barrier, in steady state."""
    cfg = Config(
        profile=profile,
        cluster=Cluster(machines=1, cpu_machines=1),
        network=network,
        architecture="ps",
        scheduling=scheduling,
        warmup_iterations=4,
        iterations=3,
    )
    return simulate(cfg).iteration_s * 1e3


def test_theorem_1_priority_order_beats_every_other_order_on_random_chains() -> None:
    rng = random.Random(8)
    strictly_better = 0
    for _ in range(12):
        layers = rng.choice((3, 4))
        f = [round(rng.uniform(0.2, 2.0), 2) for _ in range(layers)]
        b = [round(rng.uniform(0.2, 2.0), 2) for _ in range(layers)]
        elements = [rng.randint(100, 750) for _ in range(layers)]  # 0.4 to 3 time units
        p = chain(f, b, elements)
        tiny = 20  # bytes: Theorem 1's small partitions (1/50 of a time unit)

        def run(order: tuple[int, ...] | None, partition: int, p: ModelProfile = p) -> float:
            return one_worker(
                p,
                Scheduling(
                    partition_bytes=partition,
                    credit_bytes=partition,
                    window_bytes=0,
                    priorities=order,
                ),
            )

        natural = run(None, tiny)
        others = [
            run(order, partition)
            for order in itertools.permutations(range(layers))
            # Preemptive priority orders, and whole tensors without preemption.
            for partition in (tiny, 1 << 20)
            if (order, partition) != (tuple(range(layers)), tiny)
        ]
        # Within a partition's transmission time of the best other schedule, or better.
        assert natural <= min(others) + tiny / UNIT, (f, b, elements)
        strictly_better += natural < max(others) - 0.1
    assert strictly_better >= 6, "the order must matter on most chains for this to test anything"


def test_bytescheduler_fig_2_three_layers_44_percent() -> None:
    """Three layers of different sizes, forward and backward times differing. Times in
    units of 1 ms, sizes in units of 1 ms of transmission each way (push and pull).

    FIFO, whole tensors: backward ends b2 at 4, b1 at 5, b0 at 7; pushes 2 (4-7), 1 (7-8),
    0 (8-10); pulls 2 (7-10), 1 (10-11), 0 (11-13); the next forward starts at 13.
    Priority with small partitions: push 2 from 4 until 1 preempts it (5-6), 2 again
    (6-7), 0 preempts (7-9), 2 ends (9-10); each partition's pull follows its push, so
    layer 0 is back at 9, 1 at 6, 2 at 10, and forward 0-1-2 runs 9-12 unhindered: the next
    forward starts at 9. 13 / 9 = 1.444.
    """
    p = chain([1.0, 1.0, 1.0], [2.0, 1.0, 1.0], [2 * UNIT // 4, UNIT // 4, 3 * UNIT // 4])
    fifo = one_worker(p, Scheduling(scheduler="fifo", window_bytes=0))
    better = one_worker(p, Scheduling(partition_bytes=20, credit_bytes=20, window_bytes=0))
    assert fifo == pytest.approx(13.0, abs=1e-6)
    # 9 units, plus the last partition's pull after its push.
    assert 9.0 <= better <= 9.0 + 2 * 20 / UNIT
    assert fifo / better - 1 == pytest.approx(4 / 9, abs=0.005)


def test_prophet_fig_5_order_prophet_bytescheduler_p3_fifo() -> None:
    """Gradient 1 (4 partitions) is ready; gradient 0 (1 partition) follows 3 ms later;
    latency 0.1 ms, per-message cost 0.05 ms. FIFO sends gradient 1 whole ahead of gradient 0;
    P3 sends half-size partitions one at a time and pays their cost twice over;
    ByteScheduler lets 3 partitions of gradient 1 ahead of gradient 0 (the figure's
    credit); Prophet, on P3's one-partition credit, sends what fits in the gap as a block:
    two partitions, as in the figure."""
    p = chain([1.0, 1.0], [3.0, 1.0], [UNIT // 4, 4 * UNIT // 4])
    net = Network(
        gbps=8e-3, latency_us=100, message_overhead_us=50, segment_bytes=50, header_bytes=0
    )

    def run(sched: Scheduling, trace: bool = False) -> object:
        cfg = Config(
            profile=p,
            cluster=Cluster(machines=1, cpu_machines=1),
            network=net,
            architecture="ps",
            scheduling=sched,
            warmup_iterations=4,
            iterations=3,
            trace=trace,
        )
        return simulate(cfg)

    t = {
        "fifo": run(Scheduling(scheduler="fifo")).iteration_s,
        "p3": run(Scheduling(scheduler="p3", partition_bytes=UNIT // 2)).iteration_s,
        "bytescheduler": run(Scheduling(partition_bytes=UNIT, credit_bytes=3 * UNIT)).iteration_s,
    }
    prophet = run(
        Scheduling(scheduler="prophet", partition_bytes=UNIT, credit_bytes=UNIT), trace=True
    )
    t["prophet"] = prophet.iteration_s
    assert t["prophet"] < t["bytescheduler"] < t["p3"] < t["fifo"], t
    blocks = {
        e["args"]["block"]
        for e in prophet.trace_events
        if e["track"] == "scheduler" and e["name"] == "w1" and "block" in e["args"]
    }
    assert blocks == {2}, blocks
    # The block is what wins: without it (the same one-partition credit) Prophet is slower.
    plain = run(Scheduling(partition_bytes=UNIT, credit_bytes=UNIT)).iteration_s
    assert t["prophet"] < plain


# ---- folding identical machines ---------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "k", "scheduler"),
    [("ps", 2, "bytescheduler"), ("ps", 3, "p3"), ("byteps", 4, "prophet"), ("ps", 2, "fifo")],
)
def test_folding_worker_machines_changes_nothing(arch: str, k: int, scheduler: str) -> None:
    p = profiles.scale(profiles.builtin("resnet50"), size_scale=0.1, time_scale=0.2)
    cfg = Config(
        profile=p,
        cluster=Cluster(machines=4, gpus_per_machine=2, cpu_machines=k),
        # Fine segments: unfolded, identical pushes arriving together are forwarded in
        # worker order, which stop-and-wait (p3) amplifies at coarser ones. No per-message
        # cost: with one, servers serve the machines one after the other (no folding).
        network=Network(gbps=10, segment_bytes=1024, message_overhead_us=0),
        architecture=arch,
        scheduling=Scheduling(scheduler=scheduler, partition_bytes=1 << 18),
        warmup_iterations=2,
        iterations=2,
    )
    folded = simulate(cfg)
    full = simulate(cfg.with_(exploit_symmetry=False))
    assert "simulated as one" in folded.reduction
    assert len(full.machines) == 4 + k
    assert len(folded.machines) == 1 + k
    assert folded.iteration_s == pytest.approx(full.iteration_s, rel=0.005)
    assert folded.network_s == pytest.approx(full.network_s, rel=0.005)


def test_machines_that_differ_are_all_simulated() -> None:
    cfg = Config(
        profile=model([1 << 20] * 8, 1.0, 2.0),
        cluster=Cluster(machines=4, cpu_machines=2),
        network=Network(gbps=10, message_overhead_us=0),
    )
    r = simulate(cfg)
    assert len(r.machines) == 6
    assert "each hosts a summation server with its own share" in r.reduction
    # A non-colocated PS whose servers take time per message serves the machines in turn.
    r = simulate(cfg.with_(architecture="ps", network=Network(gbps=10, message_overhead_us=5)))
    assert len(r.machines) == 6
    assert "one after the other" in r.reduction


def test_gpus_without_intra_machine_aggregation_push_their_own_copies() -> None:
    p = model([1 << 20] * 8)
    base = Config(
        profile=p,
        cluster=Cluster(machines=4, gpus_per_machine=4, cpu_machines=4),
        network=IDEAL,
        architecture="ps",
        cross_barrier=False,
        warmup_iterations=0,
        iterations=1,
    )
    aggregated = simulate(base)
    separate = simulate(base.with_(intra_aggregation=False))
    assert separate.network_s == pytest.approx(4 * aggregated.network_s, rel=1e-9)


# ---- validation, outputs, the command ----------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"architecture": "ring", "cluster": Cluster(2, cpu_machines=1)}, "cannot use CPU"),
        ({"architecture": "ps", "cluster": Cluster(2)}, "cpu_machines is 0"),
        ({"architecture": "mesh"}, "Config.architecture"),
        ({"iterations": 0}, "Config.iterations"),
        ({"compute_jitter": 1.5}, "Config.compute_jitter"),
        ({"compute_jitter": -0.1}, "Config.compute_jitter"),
        ({"compute_jitter": "0.1"}, "Config.compute_jitter"),
        ({"seed": -1}, "Config.seed"),
        ({"seed": 2**64}, "Config.seed"),
        ({"scheduling": Scheduling(priorities=(0, 1, 2))}, "one per tensor"),
    ],
)
def test_impossible_configurations_say_what_is_wrong(kwargs: dict, words: str) -> None:
    base = {"profile": model([4096, 4096]), "cluster": Cluster(2)}
    with pytest.raises(ValueError, match=words):
        Config(**{**base, **kwargs})


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Cluster(0), "Cluster.machines"),
        (lambda: Network(gbps=0), "Network.gbps"),
        (lambda: Network(latency_us=-1), "Network.latency_us"),
        (lambda: Network(gbps=float("nan")), "Network.gbps"),
        (lambda: Network(nic_queue_spread=1.5), "Network.nic_queue_spread"),
        (lambda: Network(nic_queue_spread=-0.1), "Network.nic_queue_spread"),
        (lambda: Network(fair_downlinks=1), "Network.fair_downlinks"),
        (lambda: Scheduling(scheduler="lifo"), "fifo, p3, bytescheduler, prophet"),
        (lambda: Scheduling(partition_bytes=2), "Scheduling.partition_bytes"),
    ],
)
def test_bad_values_name_the_field(make, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        make()


def test_uneven_connections_and_jitter_draw_from_the_seed() -> None:
    # Connections sharing NICs unevenly: one configuration, one answer; another seed,
    # another answer; no spread, no randomness at all.
    cfg = Config(
        profile=profiles.scale(profiles.builtin("resnet50"), size_scale=0.05, time_scale=0.5),
        cluster=Cluster(machines=4, cpu_machines=2),
        network=Network(gbps=1, nic_queue_bytes=256 << 10, nic_queue_spread=0.9),
        iterations=5,
    )
    assert json.loads(cfg.to_json())["seed"] == 0
    first = simulate(cfg).iterations_s
    assert simulate(cfg).iterations_s == first
    assert simulate(replace(cfg, seed=1)).iterations_s != first
    even = replace(cfg, network=replace(cfg.network, nic_queue_spread=0.0))
    assert simulate(replace(even, seed=1)).iterations_s == simulate(even).iterations_s


def test_the_core_refuses_what_python_let_through() -> None:
    from sumflow import _core

    cfg = json.loads(Config(profile=model([4096]), cluster=Cluster(2)).to_json())
    cfg["network"]["bandwidth"] = -1
    with pytest.raises(ValueError, match=r"network\.bandwidth"):
        _core.simulate(json.dumps(cfg))
    cfg["network"]["bandwidth"] = 1e9
    cfg["extra"] = 1
    with pytest.raises(ValueError, match="extra"):
        _core.simulate(json.dumps(cfg))


def test_result_reports_idle_throughput_and_links() -> None:
    p = profiles.builtin("resnet50")
    cfg = Config(
        profile=p,
        cluster=Cluster(machines=4, gpus_per_machine=8, cpu_machines=2),
        network=Network(gbps=25),
        scheduling=Scheduling(partition_bytes=1 << 20),
    )
    r = simulate(cfg)
    assert r.iteration_s >= r.compute_s == pytest.approx(p.compute_ms / 1e3)
    assert r.gpu_idle_s == pytest.approx(r.iteration_s - r.compute_s)
    assert r.throughput == pytest.approx(32 * 32 / r.iteration_s)
    assert len(r.links) == 2 * len(r.machines)
    assert all(0 <= link.utilisation <= 1 for link in r.links)
    assert r.network_s == max(link.busy_s_per_iteration for link in r.links)
    assert r.push_pulls == p.num_tensors
    assert "iteration" in r.summary()
    assert "GPU idle" in r.summary()


def test_timeline_is_a_chrome_trace_with_the_runtime_tracks(tmp_path: Path) -> None:
    cfg = Config(
        profile=profiles.scale(profiles.builtin("vgg16"), size_scale=0.01, time_scale=0.1),
        cluster=Cluster(machines=2, cpu_machines=1),
        network=Network(gbps=10),
        trace=True,
    )
    r = simulate(cfg)
    path = r.save_trace(tmp_path / "sim.json")
    trace = json.loads(path.read_text())
    assert trace["otherData"]["sumflow_trace"] == 1
    assert trace["otherData"]["simulated"] is True
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"steps", "compute", "scheduler"} <= names
    assert any(n.startswith("push → server") for n in names)
    assert any(n.startswith("receive ← server") for n in names)
    procs = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert "CPU machine 0" in procs
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert slices
    assert all(e["dur"] >= 0 for e in slices)
    untraced = simulate(cfg.with_(trace=False))
    with pytest.raises(ValueError, match="trace=True"):
        untraced.save_trace(tmp_path / "none.json")


def test_cli_runs_sweeps_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    trace = tmp_path / "t.json"
    assert (
        cli.main(
            [
                "run",
                "--profile",
                "resnet50",
                "--machines",
                "4",
                "--gpus",
                "2",
                "--cpu-machines",
                "2",
                "--gbps",
                "10",
                "--json",
                str(out),
                "--trace",
                str(trace),
            ]
        )
        == 0
    )
    assert "iteration" in capsys.readouterr().out
    assert json.loads(out.read_text())["iteration_s"] > 0
    assert json.loads(trace.read_text())["traceEvents"]
    png = tmp_path / "cpu.png"
    assert (
        cli.main(
            [
                "cpu-sweep",
                "--profile",
                "resnet50",
                "--machines",
                "4",
                "--cpu-machines",
                "0,2,4",
                "--gbps",
                "10",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    assert png.stat().st_size > 0
    assert "speedup" in capsys.readouterr().out
    png = tmp_path / "sched.png"
    assert (
        cli.main(
            [
                "schedulers",
                "--profile",
                "vgg16",
                "--machines",
                "2",
                "--gbps-list",
                "1,10",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    assert png.stat().st_size > 0
    with pytest.raises(SystemExit):
        cli.main(["run", "--profile", "resnet50", "--machines", "0"])
    # A recorded profile is a JSON file in the profiles' format.
    recorded = profiles.scale(profiles.builtin("transformer"), size_scale=0.1, time_scale=0.5)
    path = recorded.save(tmp_path / "recorded.json")
    assert cli.main(["run", "--profile", str(path), "--machines", "2", "--quiet"]) == 0
    assert "transformer on 2 x 1 GPUs" in capsys.readouterr().out
    # Stragglers: every machine simulated, on its own pace.
    jitter = ["run", "--profile", "resnet50", "--machines", "4", "--cpu-machines", "4", "--quiet"]
    assert cli.main([*jitter, "--compute-jitter", "0.2", "--seed", "3", "--iterations", "5"]) == 0
    assert "compute jitter gives each its own pace" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main([*jitter, "--compute-jitter", "1.5"])
    assert "Config.compute_jitter" in capsys.readouterr().err


def test_sumflow_console_script_runs_sim(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sumflow import _cli

    monkeypatch.setattr(
        "sys.argv", ["sumflow", "sim", "run", "--profile", "resnet50", "--machines", "2"]
    )
    with pytest.raises(SystemExit) as done:
        _cli.main()
    assert done.value.code == 0
    assert "resnet50 on 2 x 1 GPUs" in capsys.readouterr().out
    monkeypatch.setattr("sys.argv", ["sumflow", "train"])
    with pytest.raises(SystemExit) as done:
        _cli.main()
    assert done.value.code == 2
    assert "sim" in capsys.readouterr().err


def test_sumflow_sim_calibrate_says_where_the_calibration_went(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["calibrate", "bench/results/cluster"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "python -m sumflow_bench.calibrate" in err
