"""What the library's wheel carries: maturin packs ``python/sumflow`` (pyproject.toml's
``python-source``), so the benchmark harness must live outside it, in ``bench/`` (its own
distribution, sumflow-bench), and nothing in the library may import it. Also the one
import direction inside the library that keeps the torch plugin from loading the launcher.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "sumflow"

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the development environment runs 3.11
    tomllib = pytest.importorskip("tomli")


def imported_modules(path: Path) -> Iterator[str]:
    """Every module `path` imports, absolute, wherever the import statement is."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_the_wheel_is_built_from_the_library_folder_only() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["maturin"]["python-source"] == "python"
    packages = sorted(p.parent.name for p in (ROOT / "python").glob("*/__init__.py"))
    assert packages == ["sumflow"]


@pytest.mark.parametrize("lab_only", ["bench", "sim/calibrate.py", "tune/compare.py"])
def test_the_library_holds_no_benchmark_harness(lab_only: str) -> None:
    assert not (PACKAGE / lab_only).exists(), (
        f"python/sumflow/{lab_only} would ship in the library's wheel: it belongs in "
        "bench/sumflow_bench"
    )


def test_the_library_imports_nothing_from_the_benchmarks() -> None:
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for module in imported_modules(path)
        if module.split(".")[0] == "sumflow_bench"
    ]
    assert not offenders, "the library must not need sumflow-bench: " + "; ".join(offenders)


def test_the_torch_runtime_does_not_import_the_launcher() -> None:
    runtime = PACKAGE / "torch" / "_runtime.py"
    launcher = [m for m in imported_modules(runtime) if m.startswith("sumflow.launcher")]
    assert not launcher, launcher


def test_the_benchmark_package_is_a_distribution_of_its_own() -> None:
    config = tomllib.loads((ROOT / "bench" / "pyproject.toml").read_text())
    project = config["project"]
    assert project["name"] == "sumflow-bench"
    assert any(dep.split("[")[0] == "sumflow" for dep in project["dependencies"])
    assert config["tool"]["setuptools"]["packages"] == ["sumflow_bench"]


def test_the_scripts_oldest_python_is_requires_python() -> None:
    """scripts/lib.sh builds CI's oldest environment on `min_python` and refuses an older
    python3: it must be the floor pyproject.toml declares."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    floor = config["project"]["requires-python"]
    (line,) = [
        x
        for x in (ROOT / "scripts" / "lib.sh").read_text().splitlines()
        if x.startswith("min_python=")
    ]
    assert floor == ">=" + line.split("=", 1)[1], (floor, line)
