"""The extension module ``sumflow._core``, its console scripts and its exceptions."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from importlib import metadata
from pathlib import Path

import pytest
from jobs import script

import sumflow
from sumflow import _core

REPO = Path(__file__).resolve().parents[2]
TOKEN = "python-test-token-0123456789"
SIMD_LEVELS = {"avx512", "avx2+f16c", "portable"}


def cargo_version() -> str:
    """The version in the root Cargo.toml's [workspace.package] table."""
    text = (REPO / "Cargo.toml").read_text()
    table = re.search(r"^\[workspace\.package\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert table, "no [workspace.package] in Cargo.toml"
    version = re.search(r'^version\s*=\s*"([^"]+)"', table.group(1), re.M)
    assert version, "no version in [workspace.package]"
    return version.group(1)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any SUMFLOW_ setting, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUMFLOW_")}
    env["RUST_LOG"] = "info"
    env.update(extra)
    return env


def test_import_exposes_the_core() -> None:
    for name in sumflow.__all__:
        assert getattr(sumflow, name) is getattr(_core, name), name
    # One abi3 wheel for every CPython >= 3.10: the module is built for the stable ABI.
    assert Path(_core.__file__).name.startswith("_core.abi3."), _core.__file__


def test_version_is_cargos() -> None:
    assert sumflow.__version__ == _core.__version__ == cargo_version()
    assert metadata.version("sumflow") == cargo_version()


def test_simd_level_is_a_known_kernel_set() -> None:
    assert sumflow.simd_level() in SIMD_LEVELS


def test_exception_hierarchy() -> None:
    assert issubclass(sumflow.SumflowError, RuntimeError)
    for cls in (
        sumflow.SumflowTimeoutError,
        sumflow.NodeFailedError,
        sumflow.DeclarationMismatchError,
        sumflow.ProtocolError,
    ):
        assert issubclass(cls, sumflow.SumflowError), cls
        assert cls.__module__ == "sumflow", cls
        assert cls.__doc__, cls
    assert issubclass(sumflow.SumflowTimeoutError, TimeoutError)
    assert not issubclass(sumflow.NodeFailedError, TimeoutError)
    with pytest.raises(TimeoutError, match="pull of key 3"):
        raise sumflow.SumflowTimeoutError("pull of key 3 timed out after 5 s")
    with pytest.raises(sumflow.SumflowError):
        raise sumflow.SumflowTimeoutError("timed out")


def test_in_process_help_and_errors_return_codes(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Returned, not sys.exit()ed from inside Rust: the interpreter carries on.
    assert sumflow.run_server(["--help"]) == 0
    assert "--coordinator" in capfd.readouterr().out
    assert sumflow.run_coordinator(["--no-such-flag"]) == 2
    assert "--no-such-flag" in capfd.readouterr().err
    monkeypatch.setenv("SUMFLOW_JOB_TOKEN", TOKEN)
    monkeypatch.delenv("SUMFLOW_NUM_WORKERS", raising=False)
    assert sumflow.run_coordinator(["--workers", "0"]) == 2
    assert "at least 1 worker" in capfd.readouterr().err
    with pytest.raises(TypeError):
        sumflow.run_server("--help")  # type: ignore[arg-type]


def test_server_script_help() -> None:
    out = subprocess.run(
        [script("sumflow-server"), "--help"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "--coordinator" in out.stdout
    assert "SUMFLOW_" in out.stdout


def test_coordinator_script_configuration_error_exits_2_with_the_reason() -> None:
    out = subprocess.run(
        [script("sumflow-coordinator"), "--workers", "0"],
        env=clean_env(SUMFLOW_JOB_TOKEN=TOKEN),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out
    assert "at least 1 worker" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_standalone_server_script_serves_then_stops_on_signal(
    tmp_path: Path, sig: signal.Signals
) -> None:
    addr_file = tmp_path / "addr"
    proc = subprocess.Popen(
        [script("sumflow-server"), "--workers", "1", "--addr-file", str(addr_file)],
        env=clean_env(SUMFLOW_JOB_TOKEN=TOKEN),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (addr_file.exists() and addr_file.read_text().strip()):
            assert proc.poll() is None, f"server exited early: {proc.communicate()[1]}"
            assert time.monotonic() < deadline, "server did not write its address"
            time.sleep(0.02)
        host, port = addr_file.read_text().strip().rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5):
            pass
        proc.send_signal(sig)
        _, log = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log
    assert "summation server stopped" in log
    assert "Traceback" not in log
    assert "KeyboardInterrupt" not in log
