"""The one table of settings (sumflow.settings): defaults are the core's, bad values are
refused naming the variable, unset or empty means the default, what is set reaches the
service, docs/settings.md is the table's, and nothing reads a SUMFLOW_* variable past it."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest

from sumflow import _core, settings
from sumflow.settings import OptionalSetting, Setting, SettingError, Variable
from sumflow.torch import _runtime

ROOT = Path(__file__).resolve().parents[2]


# ---- defaults ----------------------------------------------------------------------------


def test_defaults_are_the_cores() -> None:
    assert "derived" in settings.PARTITION_BYTES.unset
    assert settings.SCHEDULER.default == _core.DEFAULT_SCHEDULER
    assert settings.TIMEOUT.default == _core.DEFAULT_OPERATION_TIMEOUT_S
    assert settings.JOIN_TIMEOUT.default == _core.DEFAULT_JOIN_TIMEOUT_S
    assert settings.HEARTBEAT_TIMEOUT.default == _core.DEFAULT_HEARTBEAT_TIMEOUT_S
    assert settings.TRACE_START_STEP.default == _core.DEFAULT_TRACE_START_STEP
    assert settings.TRACE_STEPS.default == _core.DEFAULT_TRACE_STEPS
    assert settings.TRACE_MAX_EVENTS.default == _core.DEFAULT_TRACE_MAX_EVENTS
    assert settings.SCHEDULER.default in settings.SCHEDULERS
    # Where the core decides (the scheduler's own credit and window), the table says how.
    assert str(_core.DEFAULT_CREDIT_PARTITIONS) in settings.CREDIT_BYTES.unset
    assert str(_core.DEFAULT_WINDOW_PARTITIONS) in settings.PUSH_WINDOW_BYTES.unset
    most = str(_core.MAX_CPU_SERVER_CONNECTIONS)
    assert settings.CPU_SERVER_CONNECTIONS.kind.allowed.endswith(f"to {most}")


@pytest.mark.parametrize("variable", settings.TABLE, ids=lambda v: v.name)
def test_unset_or_empty_means_the_default(
    monkeypatch: pytest.MonkeyPatch, variable: Variable[Any]
) -> None:
    expected = variable.default if isinstance(variable, Setting) else None
    monkeypatch.delenv(variable.name, raising=False)
    assert variable.read() == expected
    assert variable.get() is None
    for empty in ("", "  "):
        monkeypatch.setenv(variable.name, empty)
        assert variable.read() == expected


def test_values_are_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUMFLOW_PARTITION_BYTES", "65536")
    assert settings.PARTITION_BYTES.read() == 65536
    monkeypatch.setenv("SUMFLOW_PARTITION_BYTES", " 131072 ")
    assert settings.PARTITION_BYTES.read() == 131072
    monkeypatch.setenv("SUMFLOW_AUTOTUNE", "Yes")
    assert settings.AUTOTUNE.read() == "on"
    monkeypatch.setenv("SUMFLOW_AUTOTUNE_FUSION_BYTES", "4096:8192")
    assert settings.AUTOTUNE_FUSION_BYTES.read() == (4096, 8192)
    monkeypatch.setenv("SUMFLOW_CREDIT_BYTES", "0")  # 0: no limit, a value of its own
    assert settings.CREDIT_BYTES.read() == 0
    assert settings.TRACE_STEPS.read_or(None) is None


# ---- bad values --------------------------------------------------------------------------

MAX_CONNECTIONS = _core.MAX_CPU_SERVER_CONNECTIONS


@pytest.mark.parametrize(
    ("variable", "value", "allowed"),
    [
        # negative, where the core would have raised an OverflowError naming nothing
        (settings.PARTITION_BYTES, "-4", "an integer >= 2 (bytes)"),
        # zero where it is not allowed, which used to be taken silently as the default
        (settings.PARTITION_BYTES, "0", "an integer >= 2 (bytes)"),
        (settings.TRACE_STEPS, "0", "an integer >= 1"),
        (settings.TIMEOUT, "0", "a number > 0 (seconds)"),
        (settings.CPU_SERVER_CONNECTIONS, "0", f"an integer from 1 to {MAX_CONNECTIONS}"),
        # out of range above
        (
            settings.CPU_SERVER_CONNECTIONS,
            str(MAX_CONNECTIONS + 1),
            f"an integer from 1 to {MAX_CONNECTIONS}",
        ),
        # not a number
        (settings.PARTITION_BYTES, "4MiB", "an integer >= 2 (bytes)"),
        (settings.RANK, "first", "an integer >= 0"),
        (settings.HEARTBEAT_TIMEOUT, "soon", "a number > 0 (seconds)"),
        (settings.TIMEOUT, "inf", "a number > 0 (seconds)"),
        (settings.PROPHET_STAGE_FACTOR, "nan", "a number >= 0"),
        (settings.AUTOTUNE_MAX_CREDIT_PARTITIONS, "0.5", "a number >= 1 (partitions)"),
        # a bad choice
        (settings.SCHEDULER, "lifo", "one of fifo, p3, bytescheduler, prophet"),
        (settings.SCHEDULER, "FIFO", "one of fifo, p3, bytescheduler, prophet"),
        (settings.AUTOTUNE_METHOD, "sgd", "one of bo, random, grid"),
        (settings.AUTOTUNE, "maybe", "1 (tune, or reuse a stored result), retune"),
        # a bad range
        (settings.AUTOTUNE_PARTITION_BYTES, "65536", "MIN:MAX in bytes"),
        (settings.AUTOTUNE_PARTITION_BYTES, "8192:4096", "MIN:MAX in bytes with 0 < MIN <= MAX"),
        (settings.AUTOTUNE_FUSION_BYTES, "a:b", "MIN:MAX in bytes"),
    ],
    ids=lambda x: x.name if isinstance(x, Variable) else str(x),
)
def test_a_bad_value_is_refused_naming_the_variable_the_value_and_what_is_allowed(
    monkeypatch: pytest.MonkeyPatch, variable: Variable[Any], value: str, allowed: str
) -> None:
    monkeypatch.setenv(variable.name, value)
    with pytest.raises(SettingError) as refused:
        variable.read()
    message = str(refused.value)
    assert message.startswith(f"{variable.name}={value!r}: expected {allowed}"), message
    assert "unset it for " in message
    assert isinstance(refused.value, ValueError)


def test_a_components_own_refusal_names_the_variable_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sumflow.torch.compression import Compression
    from sumflow.tune import settings as tune_settings

    monkeypatch.setenv("SUMFLOW_COMPRESSION", "zip")
    with pytest.raises(SettingError, match=r"^SUMFLOW_COMPRESSION='zip': .*unset it for no comp"):
        Compression.from_env()
    # The tuner's space refuses sizes below a page; the error names the variable.
    monkeypatch.setenv("SUMFLOW_AUTOTUNE_PARTITION_BYTES", "1024:2048")
    with pytest.raises(SettingError, match=r"^SUMFLOW_AUTOTUNE_PARTITION_BYTES='1024:2048': "):
        tune_settings.from_env()


# ---- what is set reaches the service -----------------------------------------------------


class FakeService:
    """Stands in for ``_core.CommunicationService``: records what it was built with."""

    built: ClassVar[dict[str, Any]] = {}

    def __init__(self, coordinator: str, token: str, **options: Any) -> None:
        FakeService.built = {"coordinator": coordinator, "token": token, **options}

    def trace_flush(self) -> None:
        return None

    def shutdown(self, reason: str) -> None:
        return None


def test_the_environment_reaches_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in settings.TABLE:
        monkeypatch.delenv(variable.name, raising=False)
    monkeypatch.setattr(_core, "CommunicationService", FakeService)
    env = {
        "SUMFLOW_COORDINATOR": "10.0.0.1:29400",
        "SUMFLOW_JOB_TOKEN": "t" * 32,
        "SUMFLOW_HOST_ID": "gpu-7",
        "SUMFLOW_RANK": "3",
        "SUMFLOW_PARTITION_BYTES": "65536",
        "SUMFLOW_SCHEDULER": "prophet",
        "SUMFLOW_CREDIT_BYTES": "0",
        "SUMFLOW_PROPHET_STAGE_FACTOR": "1.5",
        "SUMFLOW_TIMEOUT": "12",
        "SUMFLOW_HEARTBEAT_TIMEOUT": "4",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    runtime = _runtime.init()
    try:
        built = FakeService.built
        assert runtime.timeout == 12.0
        assert (built["coordinator"], built["host_id"], built["rank"]) == (
            "10.0.0.1:29400",
            "gpu-7",
            3,
        )
        assert (built["partition_bytes"], built["scheduler"], built["credit_bytes"]) == (
            65536,
            "prophet",
            0,
        )
        assert built["prophet_stage_factor"] == 1.5
        assert built["heartbeat_timeout"] == 4.0
        # Unset: the table's defaults, the core's own where the table has none.
        assert built["join_timeout"] == _core.DEFAULT_JOIN_TIMEOUT_S
        assert built["push_window_bytes"] is None
        assert "trace_dir" not in built
    finally:
        _runtime.shutdown()


def test_a_bad_value_stops_init_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def start(name: str, args: list[str], env: dict[str, str]) -> Any:
        raise AssertionError(f"{name} started before the settings were checked")

    # A job of one starts its own coordinator and server: not with a bad setting.
    for variable in settings.TABLE:
        monkeypatch.delenv(variable.name, raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setattr(_runtime, "_start", start)
    monkeypatch.setenv("SUMFLOW_PARTITION_BYTES", "-4")
    with pytest.raises(SettingError, match="SUMFLOW_PARTITION_BYTES='-4'"):
        _runtime.init()
    assert not _runtime.is_initialized()


# ---- the table, its docs, and that nothing reads around it ---------------------------------


def test_every_name_is_a_sumflow_variable_listed_once() -> None:
    names = [v.name for v in settings.TABLE] + [v.name for v in settings.PROGRAM_VARIABLES]
    assert len(names) == len(set(names))
    assert all(name.startswith(settings.PREFIX) for name in names)
    assert all(isinstance(v, (Setting, OptionalSetting)) for v in settings.TABLE)


def test_docs_settings_md_is_the_tables() -> None:
    committed = (ROOT / "docs" / "settings.md").read_text()
    assert committed == settings.markdown(), (
        "docs/settings.md is stale: python -m sumflow.settings --markdown > docs/settings.md"
    )


def test_the_markdown_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert settings.main(["--markdown"]) == 0
    assert capsys.readouterr().out == settings.markdown()


def test_every_variable_of_the_programs_is_listed() -> None:
    """The programs' clap options that fall back on a variable (``env = "SUMFLOW_..."``)
    are all in the docs' table, and the table lists none the programs dropped."""
    in_crates = {
        name
        for path in (ROOT / "crates").rglob("*.rs")
        for name in re.findall(r'env\s*=\s*"(SUMFLOW_[A-Z0-9_]+)"', path.read_text())
    }
    program = {settings.SERVER_PROGRAM, settings.COORDINATOR_PROGRAM}
    listed = {v.name for v in settings.PROGRAM_VARIABLES} | {
        v.name for v in settings.TABLE if program & set(v.readers)
    }
    assert in_crates - listed == set(), "add these to sumflow.settings.PROGRAM_VARIABLES"
    only_programs = {v.name for v in settings.PROGRAM_VARIABLES}
    assert only_programs - in_crates == set(), "the programs no longer read these"


def _environ_reads(path: Path) -> list[str]:
    """``os.environ.get("SUMFLOW_X")``, ``os.environ["SUMFLOW_X"]`` and
    ``os.getenv("SUMFLOW_X")`` in `path`: reads that bypass the table."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        key: ast.expr | None = None
        if isinstance(node, ast.Call) and node.args:
            func = ast.unparse(node.func)
            if func in ("os.environ.get", "os.getenv", "environ.get"):
                key = node.args[0]
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and ast.unparse(node.value) == "os.environ"
        ):
            key = node.slice
        if isinstance(key, ast.Constant) and str(key.value).startswith(settings.PREFIX):
            found.append(f"{path.relative_to(ROOT)}:{key.lineno}: {key.value!r}")
    return found


def test_nothing_reads_a_sumflow_variable_around_the_table() -> None:
    sources = [
        p
        for root in (ROOT / "python" / "sumflow", ROOT / "bench" / "sumflow_bench")
        for p in sorted(root.rglob("*.py"))
        if p != ROOT / "python" / "sumflow" / "settings.py"
    ]
    reads = [read for path in sources for read in _environ_reads(path)]
    assert not reads, "read these through sumflow.settings: " + "; ".join(reads)
