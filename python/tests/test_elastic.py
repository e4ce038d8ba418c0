"""Elastic jobs (docs/elastic.md): ``sumflow-run --min-np`` keeps training when a worker
dies, takes in workers that a discovery script makes room for, and stops with a reason
when too few are left; its rendezvous refuses what is not a request of the job."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from jobs import launcher_free_env, script

from sumflow.jobenv import elastic as wire
from sumflow.launcher.cli import build_parser
from sumflow.launcher.elastic import Rendezvous
from sumflow.launcher.errors import ConfigError
from sumflow.launcher.plan import make_plan

WORKER = str(Path(__file__).with_name("elastic_worker.py"))
LAUNCHER = [sys.executable, "-m", "sumflow.launcher"]
#: Every elastic job of these tests ends within this many seconds, or the test fails.
TIMEOUT = 120
STEPS = 40
LR = 0.125


def run_job(args: list[str], **env: str) -> tuple[int, str, list[dict[str, Any]]]:
    """Runs ``sumflow-run ARGS python elastic_worker.py``; (status, output, results)."""
    forwarded = [a for name in env for a in ("-x", name)]
    done = subprocess.run(
        [*LAUNCHER, *args, *forwarded, sys.executable, WORKER],
        env=launcher_free_env(**env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    out = done.stdout + done.stderr
    results = [
        json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line
    ]
    return done.returncode, out, results


def discovery_script(path: Path, lines_by_mark: list[tuple[Path | None, str]]) -> Path:
    """A discovery script at `path` printing the text of the first (marker, text) pair
    whose marker file exists (None: always), so a test moves it on by creating files."""
    body = ["#!/bin/sh"]
    for mark, text in lines_by_mark:
        out = f"printf '%s\\n' {' '.join(text.split())}; exit 0"
        body.append(out if mark is None else f"if [ -e {mark} ]; then {out}; fi")
    path.write_text("\n".join(body) + "\n")
    path.chmod(0o755)
    return path


def check_consistent(results: list[dict[str, Any]], steps: int = STEPS) -> None:
    """Every worker ends with the weight of exactly `steps` steps and the same history."""
    for r in results:
        assert r["weight"] == [-LR * steps] * 4, r
        assert len(r["sizes"]) == steps, r
    assert len({json.dumps(r["sizes"]) for r in results}) == 1, results
    assert sorted(r["rank"] for r in results) == list(range(len(results)))


def test_a_killed_worker_leaves_the_others_training_on_three() -> None:
    code, out, results = run_job(
        ["-np", "4", "--min-np", "2"],
        ELASTIC_TEST_VICTIM="w2",
        ELASTIC_TEST_KILL_AT="12",
        ELASTIC_TEST_STEPS=str(STEPS),
    )
    assert code == 0, out
    assert sorted(r["worker"] for r in results) == ["w0", "w1", "w3"], out
    check_consistent(results)
    # Steps 0-11 ran on 4 workers; the killed step was done again by the 3 survivors.
    assert results[0]["sizes"] == [4] * 12 + [3] * (STEPS - 12), results[0]
    assert all(r["resets"] == [3] for r in results)
    # Every recovery is logged with its reason, by the launcher and by each survivor.
    assert "was killed by SIGKILL" in out, out
    assert "epoch 0 ended: worker w2" in out, out
    assert "epoch 1: 3 workers (localhost: 3)" in out, out
    assert out.count("sumflow elastic: leaving epoch 0: NodeFailedError") == 3, out
    assert out.count("sumflow elastic: resumed in epoch 1") == 3, out


def test_a_worker_joins_where_discovery_makes_room(tmp_path: Path) -> None:
    grow = tmp_path / "grow"
    discover = discovery_script(
        tmp_path / "discover.sh", [(grow, "localhost:4"), (None, "localhost:3")]
    )
    steps = 60
    code, out, results = run_job(
        ["-np", "3", "--min-np", "2", "--host-discovery-script", str(discover)],
        ELASTIC_TEST_MARKS=f"5:{grow}",
        ELASTIC_TEST_STEPS=str(steps),
    )
    assert code == 0, out
    assert sorted(r["worker"] for r in results) == ["w0", "w1", "w2", "w3"], out
    check_consistent(results, steps)
    sizes = results[0]["sizes"]
    joined = sizes.index(4)
    # It joins at a commit after discovery saw the room: the history before it is the
    # old membership's, which the new worker received, and nothing was done twice.
    assert 5 < joined < steps, sizes
    assert sizes == [3] * joined + [4] * (steps - joined), sizes
    newcomer = next(r for r in results if r["worker"] == "w3")
    assert newcomer["rank"] == 3
    assert newcomer["resets"] == []
    assert "discovery: host localhost listed with 4 slots (was 3)" in out, out
    assert "leaving epoch 0: the membership changes at this commit" in out, out


def test_a_worker_whose_slot_is_no_longer_listed_leaves_and_the_others_go_on(
    tmp_path: Path,
) -> None:
    shrink = tmp_path / "shrink"
    discover = discovery_script(
        tmp_path / "discover.sh", [(shrink, "localhost:2"), (None, "localhost:3")]
    )
    steps = 60
    code, out, results = run_job(
        ["-np", "3", "--min-np", "2", "--host-discovery-script", str(discover)],
        ELASTIC_TEST_MARKS=f"5:{shrink}",
        ELASTIC_TEST_STEPS=str(steps),
    )
    assert code == 0, out
    assert sorted(r["worker"] for r in results) == ["w0", "w1"], out
    check_consistent(results, steps)
    assert "sumflow: leaving the elastic job: host localhost slot 2 is no longer listed" in out
    assert "left the job: host localhost slot 2 is no longer listed" in out, out
    assert "epoch 1: 2 workers (localhost: 2)" in out, out


def test_too_few_workers_stop_the_job_after_the_elastic_timeout() -> None:
    code, out, results = run_job(
        ["-np", "2", "--min-np", "2", "--elastic-timeout", "2"],
        ELASTIC_TEST_VICTIM="w1",
        ELASTIC_TEST_KILL_AT="3",
    )
    assert code != 0, out
    assert not results, out
    assert "1 worker left, fewer than --min-np 2; waiting up to 2 s" in out, out
    assert "fewer than --min-np 2 for 2 s (--elastic-timeout); stopping" in out, out


def test_cpu_servers_added_and_removed_take_effect_at_a_commit(tmp_path: Path) -> None:
    grow, shrink = tmp_path / "grow", tmp_path / "shrink"
    discover = discovery_script(
        tmp_path / "servers.sh",
        [(shrink, "localhost:2"), (grow, "localhost:3"), (None, "localhost")],
    )
    steps = 80
    code, out, results = run_job(
        ["-np", "3", "--min-np", "2", "--server-discovery-script", str(discover)],
        ELASTIC_TEST_MARKS=f"10:{grow},40:{shrink}",
        ELASTIC_TEST_STEPS=str(steps),
    )
    assert code == 0, out
    check_consistent(results, steps)
    # One membership per set of servers, each with the Eq. 1/2 placement of its k; the
    # workers stay, so every step still sums over 3.
    assert "epoch 0: 3 workers (localhost: 3), 1 CPU server" in out, out
    assert "epoch 1: 3 workers (localhost: 3), 3 CPU servers" in out, out
    assert "epoch 2: 3 workers (localhost: 3), 2 CPU servers" in out, out
    assert results[0]["sizes"] == [3] * steps
    assert out.count("the membership changes at this commit") == 6, out


def test_a_cpu_server_killed_mid_round_costs_the_steps_since_the_last_commit_only(
    tmp_path: Path,
) -> None:
    mark, ack = tmp_path / "held", tmp_path / "go-on"
    steps = 60
    proc = subprocess.Popen(
        [
            *(*LAUNCHER, "-np", "3", "--min-np", "2", "--servers", "1", "--no-colocated"),
            *("-x", "ELASTIC_TEST_HOLD", "-x", "ELASTIC_TEST_STEPS", "-x", "ELASTIC_TEST_PAUSE"),
            *(sys.executable, WORKER),
        ],
        env=launcher_free_env(
            ELASTIC_TEST_HOLD=f"20:{mark}:{ack}",
            ELASTIC_TEST_STEPS=str(steps),
            ELASTIC_TEST_PAUSE="0.01",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def kill_the_server() -> None:
        # Step 20 of 60: worker 0 holds its push back, the other two have pushed theirs,
        # so the only summation server holds a round half summed. SIGKILL it (a child of
        # the launcher), then let worker 0 go on.
        while not mark.exists() and proc.poll() is None:
            time.sleep(0.02)
        time.sleep(0.5)
        subprocess.run(["pkill", "-KILL", "-P", str(proc.pid), "-f", "host-id cpu-0"], check=True)
        ack.touch()

    killer = threading.Thread(target=kill_the_server, daemon=True)
    killer.start()
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    results = [
        json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line
    ]
    assert proc.returncode == 0, out
    assert "epoch 0 ended: cpu-server 0 e0" in out, out
    assert "was killed by SIGKILL" in out, out
    assert "epoch 1: 3 workers (localhost: 3), 1 CPU server" in out, out
    assert len(results) == 3, out
    # Every gradient counted once: the steps after the last commit were done again on the
    # new servers, and the weight is exactly that of 60 steps.
    check_consistent(results, steps)


def run_with_hand_server(
    tmp_path: Path, steps: int, retire_at: int, **env: str
) -> tuple[str, str, list[dict[str, Any]]]:
    """A job of 3 workers and one CPU server that a server started by hand joins at step 10
    and leaves (SIGTERM) at `retire_at`; the job's output, the server's, the results."""
    token = tmp_path / "token"
    token.write_text("s" * 32 + "\n")
    token.chmod(0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    joined, retire = tmp_path / "joined", tmp_path / "retire"
    env = {
        "ELASTIC_TEST_MARKS": f"10:{joined},{retire_at}:{retire}",
        "ELASTIC_TEST_STEPS": str(steps),
        **env,
    }
    job = subprocess.Popen(
        [
            *(*LAUNCHER, "-np", "3", "--min-np", "2", "--token-file", str(token)),
            *("--rendezvous-port", str(port)),
            # One machine's workers sum in shared memory, or on its colocated server when
            # there is one (BytePS's placement at n = 1): CPU servers only, without it.
            *("--no-colocated", "--servers", "1", "-x", "SUMFLOW_SHARED_MEMORY=off"),
            *(a for name in env for a in ("-x", name)),
            *(sys.executable, WORKER),
        ],
        env=launcher_free_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + TIMEOUT
        while not joined.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        # A CPU machine lends its cores: no launcher, only the rendezvous and the token.
        server = subprocess.Popen(
            [
                *(script("sumflow-server"), "--elastic", f"127.0.0.1:{port}"),
                *("--token-file", str(token), "--name", "lender"),
            ],
            env={**launcher_free_env(), "RUST_LOG": "info"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        while not retire.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        server.send_signal(signal.SIGTERM)  # retire at the next commit
        server_out, _ = server.communicate(timeout=TIMEOUT)
        out, _ = job.communicate(timeout=TIMEOUT)
    finally:
        for p in (job, server):
            if p is not None and p.poll() is None:
                p.kill()
    assert server.returncode == 0, server_out
    assert job.returncode == 0, out
    assert f"elastic rendezvous at 127.0.0.1:{port}" in out, out
    results = [
        json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line
    ]
    return out, server_out, results


def test_a_server_started_by_hand_joins_and_retires(tmp_path: Path) -> None:
    steps = 80
    out, server_out, results = run_with_hand_server(tmp_path, steps, retire_at=40)
    assert "serving epoch 1" in server_out, server_out
    assert "leaving the elastic job: it retired" in server_out, server_out
    # It summed its share of the keys.
    held = re.search(r"at most (\d+) at once", server_out)
    assert held is not None, server_out
    assert int(held.group(1)) > 0, server_out
    assert "epoch 1: 3 workers (localhost: 3), 2 CPU servers (1 started by hand)" in out, out
    assert "epoch 2: 3 workers (localhost: 3), 1 CPU server\n" in out, out
    check_consistent(results, steps)


def test_a_server_started_by_hand_stays_through_a_workers_failure(tmp_path: Path) -> None:
    steps = 80
    out, server_out, results = run_with_hand_server(
        tmp_path, steps, retire_at=50, ELASTIC_TEST_VICTIM="w2", ELASTIC_TEST_KILL_AT="30"
    )
    # The next membership takes it in again once it has left the last one (no settling
    # wait, no membership without it).
    assert "serving epoch 1" in server_out, server_out
    assert "serving epoch 2" in server_out, server_out
    assert "epoch 2: 2 workers (localhost: 2), 2 CPU servers (1 started by hand)" in out, out
    assert "epoch 3: 2 workers (localhost: 2), 1 CPU server\n" in out, out
    check_consistent(results, steps)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-np", "4", "--min-np", "5", "true"], "-np 4 is below --min-np 5"),
        (["-np", "4", "--min-np", "2", "--max-np", "3", "true"], "-np 4 is above --max-np 3"),
        (["-np", "4", "--max-np", "2", "true"], "--max-np 2 is below --min-np 4"),
        (["-np", "4", "--min-np", "2", "--local-size", "2", "true"], "--local-size is not for"),
        (["--min-np", "2", "true"], "-np N is required"),
        (["-np", "2", "--min-np", "1", "--blacklist-after", "0", "true"], "--blacklist-after"),
        (
            ["-np", "2", "--host-discovery-script", "/nonexistent/discover", "true"],
            "/nonexistent/discover",
        ),
        (
            ["-np", "2", "--server-discovery-script", "/nonexistent/servers", "true"],
            "/nonexistent/servers",
        ),
        (["-np", "2", "--server-discovery-script", "", "true"], "is empty"),
    ],
)
def test_elastic_flags_are_checked(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("-", r"\-")):
        make_plan(build_parser().parse_args(argv))


def test_an_elastic_job_grown_by_discovery_listens_where_it_is_told() -> None:
    args = ["-np", "2", "--host-discovery-script", "true", "--coordinator-bind", "10.1.2.3:0"]
    plan = make_plan(build_parser().parse_args([*args, "true"]))
    assert plan.coordinator_bind == "10.1.2.3:0"
    assert plan.elastic is not None
    assert plan.elastic.max_np == 1 << 16


def test_the_plan_of_an_elastic_job_on_one_machine() -> None:
    plan = make_plan(
        build_parser().parse_args(["-np", "3", "--min-np", "2", "--servers", "1", "true"])
    )
    assert plan.elastic is not None
    assert (plan.elastic.initial, plan.elastic.min_np, plan.elastic.max_np) == (3, 2, 3)
    assert plan.machines == [("localhost", None, 3)]
    assert plan.cpu_servers == 1
    assert plan.coordinator_bind == "127.0.0.1:0"


# -- the rendezvous against hostile and broken clients ------------------------------------

TOKEN = "t" * 32


@pytest.fixture
def rendezvous() -> Any:
    asked: list[tuple[str, str, int]] = []
    replies = [
        {"wait": True},
        {
            "epoch": 3,
            "coordinator": "h:1",
            "rank": 1,
            "size": 2,
            "local_rank": 0,
            "local_size": 1,
            "host_id": "b",
        },
    ]

    def answer(worker: str, op: str, after: int) -> dict[str, Any]:
        asked.append((worker, op, after))
        if worker == "gone":
            return {"leave": "host b is blacklisted"}
        if op == "updates":
            return {"pending": True}
        return dict(replies.pop(0)) if replies else {"wait": True}

    server = Rendezvous(("127.0.0.1", 0), TOKEN, answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.address
    yield f"{host}:{port}", asked
    server.shutdown()
    server.server_close()


def raw(address: str, data: bytes) -> dict[str, Any]:
    host, port = wire.split_address(address)
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        reply = s.makefile("rb").readline()
    return json.loads(reply)


def test_the_rendezvous_refuses_bad_requests_and_changes_nothing(rendezvous: Any) -> None:
    address, asked = rendezvous
    request = {"worker": "w0", "op": "updates", "epoch": 0}
    good = wire.sign(request, TOKEN)
    stale = wire.sign(request, TOKEN)
    stale["time"] -= 2 * int(wire.MAX_CLOCK_SKEW)
    cases = [
        (b"not json\n", "malformed request"),
        (b"[1, 2]\n", "a request is a JSON object"),
        (b'{"op": "updates"', "malformed request"),  # no end of line
        (b"x" * (wire.MAX_LINE + 10) + b"\n", "at most"),
        (wire.encode(request), "unsigned request"),
        (wire.encode({**request, "token": TOKEN}), "unsigned request"),  # no plain tokens
        (wire.encode(wire.sign(request, "w" * 32)), "wrong job token"),
        (wire.encode({**good, "epoch": 1}), "wrong job token"),  # altered after signing
        (wire.encode(stale), "wrong job token"),  # its time is signed too
        (wire.encode(wire.sign({**request, "worker": None}, TOKEN)), "names its worker"),
        (wire.encode(wire.sign({**request, "epoch": "1"}, TOKEN)), "integers"),
        (wire.encode(wire.sign({**request, "epoch": True}, TOKEN)), "integers"),
    ]
    for data, why in cases:
        reply = raw(address, data)
        assert why in reply.get("error", ""), (data[:40], reply)
    assert asked == []
    assert raw(address, wire.encode(good)) == {"pending": True}
    assert asked == [("w0", "updates", 0)]
    # The same signed request again is a replay.
    assert "replay" in raw(address, wire.encode(good))["error"]
    assert asked == [("w0", "updates", 0)]
    # A server started by hand asks for its place after an epoch, as a worker does.
    raw(address, wire.encode(wire.sign({"worker": "lender", "op": "serve", "after": 2}, TOKEN)))
    assert asked[-1] == ("lender", "serve", 2)


def test_a_request_signed_too_long_ago_is_refused() -> None:
    message = wire.sign({"worker": "w0", "op": "updates", "epoch": 0}, TOKEN)
    assert wire.verify(message, TOKEN) is None
    later = message["time"] + wire.MAX_CLOCK_SKEW + 5
    assert "off this machine's clock" in (wire.verify(message, TOKEN, now=later) or "")


def test_the_client_waits_for_its_place_and_is_told_to_leave(rendezvous: Any) -> None:
    address, asked = rendezvous
    place = wire.Client(address, TOKEN, "w1").assignment(after=2, timeout=10)
    assert place == wire.Assignment(3, "h:1", 1, 2, 0, 1, "b")
    assert asked == [("w1", "assignment", 2)] * 2
    with pytest.raises(wire.Removed, match="host b is blacklisted"):
        wire.Client(address, TOKEN, "gone").assignment(after=3, timeout=10)
    with pytest.raises(wire.RendezvousError, match="wrong job token"):
        wire.Client(address, "x" * 32, "w1").updates_pending(3)
    assert wire.Client(address, TOKEN, "w1").updates_pending(3) is True


def test_a_client_names_the_rendezvous_it_cannot_reach() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = wire.Client(f"127.0.0.1:{port}", TOKEN, "w0")
    with pytest.raises(
        wire.RendezvousError, match=f"127.0.0.1:{port} while waiting for its first epoch"
    ):
        client.assignment(after=-1, timeout=0.3)


def test_worker_environment_is_not_inherited_from_an_enclosing_elastic_job() -> None:
    # A stale rendezvous address in the launcher's own environment must not reach the job.
    env = launcher_free_env(SUMFLOW_ELASTIC_ADDR="127.0.0.1:1", SUMFLOW_ELASTIC_WORKER="w9")
    done = subprocess.run(
        [
            *LAUNCHER,
            "-np",
            "1",
            sys.executable,
            "-c",
            "import os; print('addr', os.environ.get('SUMFLOW_ELASTIC_ADDR'))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    assert "addr None" in done.stdout


# -- the digits example through a failure and a join --------------------------------------

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "train_digits_elastic.py"


def run_digits(
    launcher_args: list[str],
    json_path: Path,
    *example_args: str,
    on_line: Callable[[str], None] = lambda line: None,
) -> str:
    """Runs the example to its end (``on_line`` sees each line of its output as it comes);
    its whole output."""
    argv = [*LAUNCHER, *launcher_args, sys.executable, str(DIGITS), "--epochs", "10"]
    argv += ["--min-accuracy", "0.93", "--json", str(json_path), *example_args]
    proc = subprocess.Popen(
        argv,
        env=launcher_free_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    killer = threading.Timer(TIMEOUT, proc.kill)
    killer.start()
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            on_line(line)
        code = proc.wait()
    finally:
        killer.cancel()
    out = "".join(lines)
    assert code == 0, out
    return out


def test_digits_finishes_its_epochs_on_three_after_a_worker_is_killed(tmp_path: Path) -> None:
    result = tmp_path / "digits.json"
    out = run_digits(
        ["-np", "4", "--min-np", "2"], result, "--kill-worker", "w2", "--kill-at-step", "70"
    )
    metrics = json.loads(result.read_text())
    assert metrics["workers"] == 3, out
    assert metrics["accuracy"] >= 0.93, out
    [change] = metrics["changes"]
    killed_at = float(out.split("killing w2 at step 70 at ")[1].split()[0])
    assert change["workers"] == 3
    assert change["first_step_at"] > killed_at, out
    assert "epoch  10/10  3 workers" in out, out


def test_digits_takes_in_a_worker_that_joins_mid_job(tmp_path: Path) -> None:
    grow = tmp_path / "grow"
    # Room for a fourth worker once the job has run a while.
    discover = discovery_script(
        tmp_path / "discover.sh", [(grow, "localhost:4"), (None, "localhost:3")]
    )
    result = tmp_path / "digits.json"

    def grow_after_epoch_2(line: str) -> None:
        if "epoch   2/" in line:
            grow.touch()

    out = run_digits(
        ["-np", "3", "--min-np", "2", "--host-discovery-script", str(discover)],
        result,
        *("--epochs", "20", "--pause", "0.03"),
        on_line=grow_after_epoch_2,
    )
    metrics = json.loads(result.read_text())
    assert metrics["workers"] == 4, out
    assert [c["workers"] for c in metrics["changes"]] == [4], out
    assert metrics["accuracy"] >= 0.93, out


def test_what_is_not_elastic_yet_says_so() -> None:
    script_text = (
        "import torch, sumflow.torch as hvd\n"
        "hvd.init()\n"
        "m = torch.nn.Linear(2, 1)\n"
        "try:\n"
        "    hvd.AsyncOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))\n"
        "except NotImplementedError as e:\n"
        "    print('refused:', e)\n"
        "hvd.shutdown()\n"
    )
    done = subprocess.run(
        [*LAUNCHER, "-np", "1", "--min-np", "1", sys.executable, "-c", script_text],
        env=launcher_free_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "refused: AsyncOptimizer in an elastic job" in done.stdout, done.stdout
