"""Every module of the package imports, in a fresh interpreter of the Python running the
tests. What an older Python cannot load (3.11's syntax, or a type alias written with a
newer release's features, which is evaluated at import) fails here: scripts/test.sh runs
this under the oldest Python supported (pyproject.toml's requires-python) as well.

A module may need one of the package's optional extras (pyproject.toml's
``optional-dependencies``); where that is not installed, its import must fail naming it,
and nothing else.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "sumflow"

#: The top-level modules of the optional extras' dependencies (optuna and scipy for
#: ``tune``; scikit-learn, tqdm and matplotlib for ``examples``).
EXTRAS = {"optuna", "scipy", "sklearn", "tqdm", "matplotlib"}

_IMPORT_ALL = """
import importlib, json, sys, traceback
results = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        results[name] = None
    except ModuleNotFoundError as e:
        results[name] = ["missing", e.name or ""]
    except Exception:
        results[name] = ["error", traceback.format_exc()]
print(json.dumps(results))
"""


def package_modules() -> list[str]:
    """Every module of the source tree, by dotted name (``__main__`` modules run when
    imported, so they are left out; what they call is in the others)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def test_the_package_has_the_modules_this_test_walks() -> None:
    names = package_modules()
    assert {"sumflow", "sumflow.torch", "sumflow.torch.ops", "sumflow.launcher.cli"} <= set(names)


def test_every_module_imports_on_this_python() -> None:
    names = package_modules()
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, *names],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    results = json.loads(out.strip().splitlines()[-1])
    failed = {}
    for name, outcome in results.items():
        if outcome is None:
            continue
        kind, detail = outcome
        if kind == "missing" and detail.split(".")[0] in EXTRAS:
            continue
        failed[name] = detail
    version = ".".join(map(str, sys.version_info[:3]))
    assert not failed, f"modules that do not import on Python {version}:\n" + "\n".join(
        f"{name}: {detail}" for name, detail in failed.items()
    )
