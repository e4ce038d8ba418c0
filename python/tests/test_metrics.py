"""Operators' metrics under sumflow-run (issue 24): --metrics-port gives the coordinator
and every summation server a Prometheus endpoint, which follows the job."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from sumflow.launcher.cli import build_parser
from sumflow.launcher.errors import ConfigError
from sumflow.launcher.plan import build_processes, make_plan

#: Scrapes the coordinator (port P) and server 0 (P + 1) after a sum, from worker 0.
WORKER = textwrap.dedent(
    """
    import sys, urllib.request
    import torch
    import sumflow.torch as hvd

    hvd.init()
    for _ in range(3):
        hvd.allreduce(torch.ones(1024), name="x")
    if hvd.rank() == 0:
        port = int(sys.argv[1])
        for p in (port, port + 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=10) as r:
                print(r.read().decode())
    hvd.barrier()
    """
)


def _free_base(count: int) -> int:
    """A port with the `count` after it free when asked (a race, but a narrow one)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            held = []
            for p in range(base, base + count):
                t = socket.socket()
                held.append(t)
                t.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for t in held:
                t.close()
        return base
    pytest.skip("no run of free ports")


def test_metrics_ports_follow_the_coordinators_and_each_servers_host() -> None:
    parser = build_parser()
    plan = make_plan(
        parser.parse_args(
            ["-np", "4", "--local-size", "2", "--servers", "1", "--metrics-port", "9464", "true"]
        )
    )
    assert plan.coordinator_args[-2:] == ["--metrics-bind", "127.0.0.1:9464"]
    binds = [
        s.argv[s.argv.index("--metrics-bind") + 1]
        for s in build_processes(plan, "127.0.0.1:1")
        if s.kind == "server"
    ]
    assert binds == ["127.0.0.1:9465", "127.0.0.1:9466", "127.0.0.1:9467"]
    plan = make_plan(
        parser.parse_args(
            [
                "-H",
                "a:1,b:1",
                "--coordinator-bind",
                "10.0.0.1:29400",
                "--metrics-port",
                "9464",
                "true",
            ]
        )
    )
    assert plan.coordinator_args[-1] == "10.0.0.1:9464"
    servers = [s for s in build_processes(plan, "10.0.0.1:29400") if s.kind == "server"]
    assert [s.argv[s.argv.index("--metrics-bind") + 1] for s in servers] == [
        "0.0.0.0:9465",
        "0.0.0.0:9466",
    ]
    with pytest.raises(ConfigError, match="65535 to 65536"):
        make_plan(parser.parse_args(["-np", "2", "--metrics-port", "65535", "true"]))


def test_a_jobs_coordinator_and_servers_serve_metrics_under_sumflow_run() -> None:
    base = _free_base(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "sumflow.launcher",
            "-np",
            "2",
            "--machine-per-worker",
            "--metrics-port",
            str(base),
            sys.executable,
            "-c",
            WORKER,
            str(base),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    log = run.stdout[-4000:] + run.stderr[-3000:]
    assert run.returncode == 0, log

    def value(series: str) -> float:
        m = re.search(rf"^\[worker 0\] {re.escape(series)} (\S+)$", run.stdout, re.M)
        assert m, f"no {series}: {log}"
        return float(m.group(1))

    assert value('sumflow_coordinator_nodes{role="worker",status="live"}') == 2
    assert value('sumflow_coordinator_nodes{role="server",status="live"}') == 2
    assert value("sumflow_coordinator_running") == 1
    assert value("sumflow_server_up") == 1
    assert value('sumflow_server_workers{state="connected"}') == 2
    # Three sums (and the agreements before them) went through the servers.
    assert value("sumflow_server_rounds_total") >= 1
    assert value("sumflow_server_received_bytes_total") > 0
