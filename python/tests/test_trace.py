"""The per-worker Chrome trace: a real traced job through ``sumflow-run --trace`` (files,
Chrome JSON, the Python spans, only the chosen window), merging, and the settings' checks;
a trace of an interval on demand, and Horovod's timeline on it in a real job. The Rust
recorder's own tests are in crates/comm/src/trace.rs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import local_job

from sumflow import _core
from sumflow import trace as trace_tool
from sumflow.launcher.cli import build_parser
from sumflow.launcher.errors import ConfigError
from sumflow.launcher.plan import make_plan
from sumflow.torch import _runtime
from sumflow.torch import trace as torch_trace

WORKER = str(Path(__file__).with_name("trace_worker.py"))
TIMELINE_WORKER = str(Path(__file__).with_name("timeline_worker.py"))
TIMEOUT = 120


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}


def by_phase(trace: dict[str, Any], ph: str) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def thread_names(trace: dict[str, Any]) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in by_phase(trace, "M") if e["name"] == "thread_name"}


def run_job(out_dir: Path, steps: int, *window: str, machines: int = 2) -> str:
    """Runs trace_worker.py for ``steps`` steps as 2 workers (on ``machines`` machines: with
    one, they sum in its shared memory, not through a server) traced into ``out_dir`` with
    the launcher's ``window`` options; returns the launcher's output."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "sumflow.launcher",
            "-np",
            "2",
            *(("--machine-per-worker",) if machines == 2 else ()),
            "--trace",
            str(out_dir),
            *window,
            sys.executable,
            WORKER,
            str(steps),
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout + run.stderr


def on(trace: dict[str, Any], track: str, name: str) -> list[dict[str, Any]]:
    """The slices ``name`` on the track ``track``, in time order."""
    names = thread_names(trace)
    found = [e for e in by_phase(trace, "X") if names[e["tid"]] == track and e["name"] == name]
    return sorted(found, key=lambda e: e["ts"])


def test_a_traced_job_writes_each_workers_window_and_merges(tmp_path: Path) -> None:
    out_dir = tmp_path / "traces"
    output = run_job(out_dir, 7, "--trace-start-step", "2", "--trace-steps", "3")
    traces = {}
    for rank in range(2):
        path = out_dir / f"sumflow-trace-rank{rank}.json"
        assert f"[worker {rank}] sumflow: trace {path}: steps 2 to 4" in output
        traces[rank] = trace = json.loads(path.read_text())
        assert trace["otherData"]["recorded"] == "steps 2 to 4"
        assert trace["otherData"]["rank"] == rank
        assert {e["pid"] for e in trace["traceEvents"]} == {rank + 1}
        process = [e for e in by_phase(trace, "M") if e["name"] == "process_name"]
        assert process[0]["args"]["name"] == f"worker {rank}"
        names = thread_names(trace)
        assert {"steps", "compute", "waits", "tuner"} <= set(names.values()), names

        spans = by_phase(trace, "X")
        for e in spans:
            assert isinstance(e["ts"], float), e
            assert isinstance(e["dur"], float), e
        steps = sorted((e for e in spans if e["cat"] == "step"), key=lambda e: e["ts"])
        assert [e["name"] for e in steps] == ["step 2", "step 3", "step 4"]
        begin, end = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
        for e in spans + by_phase(trace, "i"):
            assert begin <= e["ts"] <= end, f"{e} lies outside steps 2 to 4"

        forwards = on(trace, "compute", "forward")
        assert [e["args"]["step"] for e in forwards] == [2, 3, 4]
        assert [e["args"]["step"] for e in on(trace, "waits", "allreduce")] == [2, 3, 4]
        for forward, layer in zip(forwards, on(trace, "compute", "layer"), strict=True):
            assert layer["args"] == {"index": 0, "kind": "linear"}
            assert forward["ts"] <= layer["ts"]
            assert layer["ts"] + layer["dur"] <= forward["ts"] + forward["dur"]
            assert layer["dur"] >= 2000.0, "the layer slept 2 ms"
        names = thread_names(trace)
        decisions = [e for e in by_phase(trace, "i") if names[e["tid"]] == "tuner"]
        assert [e["args"] for e in decisions] == [
            {"step": s, "better": "True", "score": 0.5} for s in (2, 3, 4)
        ]
        # The communication service's own events: the scheduler's decision for each
        # push_pull of "x", and each partition's push and sum on its lane's tracks.
        ready = [
            e
            for e in by_phase(trace, "i")
            if names[e["tid"]] == "scheduler" and e["name"] == "allreduce.x"
        ]
        assert len(ready) == 3, ready
        assert all(e["args"]["partitions"] == 1 for e in ready), ready
        pushes = [e for e in by_phase(trace, "X") if names[e["tid"]].startswith("push → server")]
        sums = [e for e in by_phase(trace, "X") if names[e["tid"]].startswith("receive ← server")]
        # Each allreduce is agreed first: a push of its request table, then the data.
        want = ["agree.allreduce.x [0]", "allreduce.x [0]"] * 3
        assert [e["name"] for e in pushes] == want, pushes
        assert [e["name"] for e in sums] == want, sums
        assert all(e["args"]["started to sum ms"] >= 0 for e in sums), sums

    # The workers' windows overlap on the common clock.
    first = [min(e["ts"] for e in by_phase(t, "X")) for t in traces.values()]
    assert abs(first[0] - first[1]) < 10e6, first

    merged_run = subprocess.run(
        [sys.executable, "-m", "sumflow.trace", "merge", str(out_dir)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert merged_run.returncode == 0, merged_run.stderr
    merged_path = out_dir / trace_tool.MERGED_NAME
    assert "merged the traces of workers 0, 1 (" in merged_run.stdout
    merged = json.loads(merged_path.read_text())
    assert len(merged["traceEvents"]) == sum(len(t["traceEvents"]) for t in traces.values())
    assert {e["pid"] for e in merged["traceEvents"]} == {1, 2}
    assert [w["rank"] for w in merged["otherData"]["sumflow_trace_merged"]] == [0, 1]


def test_workers_of_one_machine_trace_their_shared_memory_stage(tmp_path: Path) -> None:
    run_job(tmp_path, 5, "--trace-start-step", "2", "--trace-steps", "2", machines=1)
    for rank in range(2):
        trace = json.loads((tmp_path / f"sumflow-trace-rank{rank}.json").read_text())
        names = thread_names(trace)
        assert not [n for n in names.values() if n.startswith(("push →", "receive ←"))], names
        # Each allreduce of "x" (and its agreement) on the shared-memory track, its
        # phases inside it. An operation is recorded when it ends and a phase when it
        # does, so at the window's edges an operation may lack its first phases, or a
        # phase its operation.
        ops = on(trace, "shared memory", "allreduce.x")
        assert 1 <= len(ops) <= 3, ops
        assert all(e["args"]["mode"] == "two phases" for e in ops), ops
        assert all(e["args"]["members"] == 2 for e in ops), ops
        assert on(trace, "shared memory", "agree.allreduce.x")
        complete = 0
        for op in ops:
            phases = [
                e["name"]
                for e in sorted(by_phase(trace, "X"), key=lambda e: e["ts"])
                if names[e["tid"]] == "shared memory"
                and e["name"] in ("copy in", "reduce slice", "take")
                and op["ts"] - 1 <= e["ts"]
                and end(e) <= end(op) + 1
            ]
            assert phases[-1:] == ["take"], (op, phases)
            complete += phases == ["copy in", "reduce slice", "take"]
        assert complete >= 1, ops


def test_a_job_ending_inside_the_window_writes_what_it_recorded(tmp_path: Path) -> None:
    output = run_job(tmp_path, 3, "--trace-start-step", "1", "--trace-steps", "10")
    recorded = "steps 1 to 3: the job stopped before the window's last step 10"
    for rank in range(2):
        path = tmp_path / f"sumflow-trace-rank{rank}.json"
        assert f"[worker {rank}] sumflow: trace {path}: {recorded}" in output
        trace = json.loads(path.read_text())
        assert trace["otherData"]["recorded"] == recorded
        assert [e["args"]["step"] for e in on(trace, "compute", "forward")] == [1, 2]


def write_trace(path: Path, rank: int, events: int = 1) -> None:
    """A minimal worker trace as the core writes it."""
    meta = {"ph": "M", "pid": rank + 1, "tid": 0, "name": "process_name", "args": {"name": "w"}}
    span = {"ph": "X", "name": "s", "pid": rank + 1, "tid": 1, "ts": 1.0, "dur": 1.0}
    path.write_text(
        json.dumps(
            {
                "traceEvents": [meta] + [span] * events,
                "otherData": {"sumflow_trace": 1, "rank": rank},
            }
        )
    )


def test_merge_refuses_two_files_of_one_worker_and_non_traces(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_trace(a / "sumflow-trace-rank0.json", 0)
    write_trace(a / "sumflow-trace-rank10.json", 10, events=2)
    write_trace(a / "sumflow-trace-rank2.json", 2)
    write_trace(b / "sumflow-trace-rank0.json", 0)
    merged = trace_tool.merge([a], tmp_path / "out.json")
    assert (merged.workers, merged.events) == ([0, 2, 10], 4)
    with pytest.raises(ValueError, match=r"both hold worker 0: traces of different jobs"):
        trace_tool.merge([a, b], tmp_path / "out2.json")
    assert not (tmp_path / "out2.json").exists()
    assert not (tmp_path / "out2.json.partial").exists()
    (b / "other.json").write_text('{"traceEvents": []}')
    with pytest.raises(ValueError, match="not a sumflow worker trace"):
        trace_tool.merge([b / "other.json"], tmp_path / "out3.json")
    with pytest.raises(ValueError, match="no sumflow-trace-rank"):
        trace_tool.merge([tmp_path / "out.json", tmp_path], tmp_path / "out4.json")
    assert trace_tool.main(["merge", str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SUMFLOW_TRACE_STEPS": "3"}, "SUMFLOW_TRACE_STEPS set without SUMFLOW_TRACE_DIR"),
        ({"SUMFLOW_TRACE_DIR": "d", "SUMFLOW_TRACE_STEPS": "0"}, "STEPS='0': expected an int"),
        ({"SUMFLOW_TRACE_DIR": "d", "SUMFLOW_TRACE_START_STEP": "-1"}, "an integer >= 0"),
        ({"SUMFLOW_TRACE_DIR": "d", "SUMFLOW_TRACE_MAX_EVENTS": "x"}, "EVENTS='x': expected"),
    ],
)
def test_bad_trace_variables_are_named(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        _runtime._trace_settings()


def test_trace_variables_become_the_services_keywords(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUMFLOW_TRACE_DIR", "/tmp/t")
    monkeypatch.setenv("SUMFLOW_TRACE_STEPS", "7")
    assert _runtime._trace_settings() == {"trace_dir": "/tmp/t", "trace_steps": 7}
    monkeypatch.delenv("SUMFLOW_TRACE_DIR")
    monkeypatch.delenv("SUMFLOW_TRACE_STEPS")
    assert _runtime._trace_settings() == {}


def test_the_service_refuses_bad_trace_keywords(tmp_path: Path) -> None:
    # Checked before joining, so no coordinator is needed to see the error.
    with pytest.raises(ValueError, match="need trace_dir"):
        _core.CommunicationService("127.0.0.1:1", "t" * 32, host_id="h", trace_steps=3)
    with pytest.raises(ValueError, match="traced steps must be at least 1"):
        _core.CommunicationService(
            "127.0.0.1:1", "t" * 32, host_id="h", trace_dir=tmp_path, trace_steps=0
        )
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match="cannot create the trace directory") as refused:
        _core.CommunicationService(
            "127.0.0.1:1", "t" * 32, host_id="h", trace_dir=tmp_path / "file" / "sub"
        )
    assert not isinstance(refused.value, ValueError), "an I/O failure is not a bad argument"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace-steps", "2"], "--trace-steps needs --trace DIR"),
        (["--trace", "d", "--trace-steps", "0"], "--trace-steps must be at least 1"),
        (["--trace", "d", "--trace-start-step", "-1"], "--trace-start-step must be at least 0"),
    ],
)
def test_launcher_checks_the_trace_window(args: list[str], message: str) -> None:
    parser = build_parser()
    with pytest.raises(ConfigError, match=message):
        make_plan(parser.parse_args(["-np", "2", *args, "true"]))


def test_launcher_help_documents_the_trace_options() -> None:
    text = build_parser().format_help()
    for flag in ("--trace DIR", "--trace-start-step N", "--trace-steps N"):
        assert flag in text, flag


def test_launcher_gives_every_worker_the_trace_variables(tmp_path: Path) -> None:
    parser = build_parser()
    plan = make_plan(
        parser.parse_args(["-np", "2", "--trace", "rel", "--trace-start-step", "0", "true"])
    )
    assert plan.worker_env["SUMFLOW_TRACE_DIR"] == str(Path("rel").absolute())
    assert plan.worker_env["SUMFLOW_TRACE_START_STEP"] == "0"
    assert "SUMFLOW_TRACE_STEPS" not in plan.worker_env


def test_spans_are_no_ops_without_a_service() -> None:
    assert not torch_trace.recording()
    with torch_trace.span("compute", "forward", step=1):
        pass
    torch_trace.instant("tuner", "decision")
    with pytest.raises(ValueError, match="not initialised"):
        torch_trace.mark_step()


def test_the_service_records_an_interval_on_demand(tmp_path: Path) -> None:
    with local_job(tmp_path, 1) as job:
        svc = job.service(0)
        try:
            assert not svc.tracing
            assert svc.trace_interval_stop() is None, "none was being recorded"
            with pytest.raises(OSError, match=r"nowhere does not exist"):
                svc.trace_interval_start(tmp_path / "nowhere" / "t.json")
            with pytest.raises(ValueError, match="at least 1"):
                svc.trace_interval_start(tmp_path / "t.json", max_events=0)
            assert not svc.tracing
            path = tmp_path / "interval.json"
            svc.trace_interval_start(path, max_events=100)
            assert svc.tracing
            with pytest.raises(ValueError, match=f"being recorded already, into {path}"):
                svc.trace_interval_start(tmp_path / "other.json")
            begin = svc.trace_now()
            svc.trace_span("script", "work", begin, svc.trace_now(), {"i": 1})
            svc.mark_step()
            written = svc.trace_interval_stop()
            assert written is not None
            assert written[0] == str(path)
            assert written[1].endswith("recorded on demand, during steps 0 to 1"), written
            assert not svc.tracing
            trace = json.loads(path.read_text())
            assert [(e["name"], e["args"]) for e in on(trace, "script", "work")] == [
                ("work", {"i": 1})
            ]
            assert [e["name"] for e in by_phase(trace, "X") if e["cat"] == "step"] == ["step 0"]
            assert trace["otherData"]["max_events"] == 100
            # Shutdown writes an interval still being recorded.
            svc.trace_interval_start(tmp_path / "at-shutdown.json")
        finally:
            svc.shutdown("test done")
    assert json.loads((tmp_path / "at-shutdown.json").read_text())["otherData"]["rank"] == 0


def partitions(trace: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The slices of partition ``name`` on every lane's push and receive tracks."""
    names = thread_names(trace)
    lanes = ("push → server", "receive ← server")
    return [
        e for e in by_phase(trace, "X") if names[e["tid"]].startswith(lanes) and e["name"] == name
    ]


def test_a_timeline_shows_each_operation_above_the_partitions_it_caused(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            *(sys.executable, "-m", "sumflow.launcher", "-np", "2", "--machine-per-worker"),
            *("--timeout", "60", sys.executable, TIMELINE_WORKER, str(tmp_path)),
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    operations = {
        "allreduce.x": "ALLREDUCE",
        "allgather.g": "ALLGATHER",
        "broadcast.b": "BROADCAST",
    }
    files = []
    for rank in range(2):
        path = tmp_path / f"timeline-rank{rank}.json"
        files.append(path)
        trace = json.loads(path.read_text())
        meta = trace["otherData"]
        assert meta["rank"] == rank
        assert meta["truncated_at_step"] is None
        assert {e["pid"] for e in trace["traceEvents"]} == {rank + 1}
        names = thread_names(trace)
        tid = {name: t for t, name in names.items()}
        lanes = [t for t, name in names.items() if name.startswith(("push →", "receive ←"))]
        assert lanes, names
        # Each operation's track, named by its tensor, is drawn above every lane's.
        assert max(tid[name] for name in operations) < min(lanes), names
        assert tid["scheduler"] < min(lanes)
        slices = by_phase(trace, "X")
        start = meta["start_time_since_epoch_in_micros"]
        assert all(e["ts"] >= start - 1 for e in slices + by_phase(trace, "i"))
        # Only the interval: the operations before and after it left nothing.
        assert not [e for e in slices if "before" in e["name"] or "after" in e["name"]]
        (script,) = on(trace, "script", "operations")
        data_starts = []
        for tensor, kind in operations.items():
            (agree,) = on(trace, tensor, f"NEGOTIATE_{kind}")
            (data,) = on(trace, tensor, kind)
            assert agree["args"] == data["args"] == {"tensor": tensor}
            assert end(agree) <= data["ts"] + 1, "the data stage follows the agreement"
            data_starts.append(data["ts"])
            for phase in (agree, data):
                assert script["ts"] - 1 <= phase["ts"]
                assert end(phase) <= end(script) + 1
            # The agreement's push and sum lie within NEGOTIATE_<KIND>, the data's within
            # <KIND> (±1 µs: epoch microseconds read as floats keep a quarter of one). An
            # allgather's rows are one region per worker: a worker pushes its own and
            # takes the other's (an empty push, then the receive); a broadcast's root only
            # pushes.
            data_parts = {
                "ALLREDUCE": (partitions(trace, f"{tensor} [0]"), 2),
                "ALLGATHER": (
                    partitions(trace, f"{tensor}#0 [0]") + partitions(trace, f"{tensor}#1 [0]"),
                    3,
                ),
                "BROADCAST": (partitions(trace, f"{tensor} [0]"), 1 if rank == 0 else 2),
            }[kind]
            for phase, (pushed_and_summed, count) in (
                (agree, (partitions(trace, f"agree.{tensor} [0]"), 2)),
                (data, data_parts),
            ):
                assert len(pushed_and_summed) == count, (tensor, pushed_and_summed)
                for e in pushed_and_summed:
                    assert phase["ts"] - 1 <= e["ts"], (phase, e)
                    assert end(e) <= end(phase) + 1, (phase, e)
        # DistributedOptimizer's gradients, agreed in advance: one ALLREDUCE phase each.
        gradients = {
            names[e["tid"]]: e
            for e in slices
            if e["name"] == "ALLREDUCE" and names[e["tid"]] not in operations
        }
        assert sorted(gradients) == [
            "DistributedOptimizer.grad.bias",
            "DistributedOptimizer.grad.weight",
        ]
        for tensor, phase in gradients.items():
            data_starts.append(phase["ts"])
            pushed_and_summed = partitions(trace, f"{tensor} [0]")
            assert len(pushed_and_summed) == 2, (tensor, pushed_and_summed)
            for e in pushed_and_summed:
                assert phase["ts"] - 1 <= e["ts"], (phase, e)
                assert end(e) <= end(phase) + 1, (phase, e)
        cycles = [e for e in by_phase(trace, "i") if names[e["tid"]] == "horovod cycles"]
        assert [e["name"] for e in cycles] == ["CYCLE_START"] * 5
        assert [e["ts"] for e in cycles] == pytest.approx(sorted(data_starts), abs=1)
    # The workers' timelines merge like their window traces.
    merged = trace_tool.merge(files, tmp_path / "merged.json")
    assert merged.workers == [0, 1]


def end(e: dict[str, Any]) -> float:
    return float(e["ts"] + e["dur"])
