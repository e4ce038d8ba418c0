"""The docs' relative links lead somewhere, and bench/results stays a few fixtures.

Every relative link (and image) in README.md, BENCHMARKS.md, CHANGELOG.md and docs/*.md
must name a file git tracks, and its anchor, if any, a heading of that file (GitHub's
slugs). bench/results holds only what tests and docs read; a benchmark run's raw output
is ignored there (bench/results/.gitignore), and the count below keeps it so.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path, PurePosixPath

import pytest

REPO = Path(__file__).resolve().parents[2]

#: At most this many tracked files under bench/results (34 when this test was written).
BENCH_RESULTS_LIMIT = 60

#: `[text](target)` and `![alt](target "title")`; the target has no spaces.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _tracked() -> set[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (or no git): the links are checked against git's files")
    files = {f for f in out.decode().split("\0") if f}
    if not files:
        pytest.skip("git tracks nothing here")
    return files


@cache
def tracked() -> frozenset[str]:
    return frozenset(_tracked())


def documents() -> list[str]:
    names = ["README.md", "BENCHMARKS.md", "CHANGELOG.md"]
    names += sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))
    return [n for n in names if (REPO / n).is_file()]


def prose(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1; inline code spans blanked."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, re.sub(r"`[^`]*`", "``", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, without punctuation but
    hyphens and underscores, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[*`]|<[^>]*>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose((REPO / path).read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: str) -> list[tuple[int, str]]:
    text = (REPO / path).read_text(encoding="utf-8")
    return [(n, m.group(1)) for n, line in prose(text) for m in LINK.finditer(line)]


def resolve(doc: str, target: str) -> tuple[str, str]:
    """The repository path a relative link names (the document itself for `#anchor`), and
    its anchor."""
    path, _, anchor = target.partition("#")
    if not path:
        return doc, anchor
    parts: list[str] = []
    for part in (PurePosixPath(doc).parent / path).parts:
        if part == "..":
            if parts:
                parts.pop()
            else:
                parts.append(part)  # above the repository: reported as missing
        elif part != ".":
            parts.append(part)
    return "/".join(parts), anchor


def is_external(target: str) -> bool:
    return bool(re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith("//")


@pytest.mark.parametrize("doc", documents())
def test_every_relative_link_names_a_tracked_file_and_heading(doc: str) -> None:
    files = tracked()
    folders = {str(PurePosixPath(f).parent) for f in files} | {
        str(p) for f in files for p in PurePosixPath(f).parents
    }
    broken = []
    for n, target in links(doc):
        if is_external(target):
            continue
        path, anchor = resolve(doc, target)
        path = path.rstrip("/")
        if path not in files and path not in folders:
            broken.append(f"{doc}:{n}: {target} -> {path} is not tracked")
        elif anchor and path in files and path.endswith(".md") and anchor not in anchors(path):
            broken.append(f"{doc}:{n}: {target} -> no heading #{anchor} in {path}")
    assert not broken, "\n".join(broken)


def test_bench_results_holds_only_a_few_fixtures() -> None:
    kept = sorted(f for f in tracked() if f.startswith("bench/results/"))
    assert len(kept) <= BENCH_RESULTS_LIMIT, (
        f"{len(kept)} files tracked under bench/results (limit {BENCH_RESULTS_LIMIT}): keep "
        "what tests and docs read, re-run the benchmark for the rest"
    )
    # Nothing raw: the logs, trial logs and traces of a run stay out of git.
    raw = [f for f in kept if re.search(r"/(logs|tuned|traces)/|\.(log|lock|jsonl|gz)$", f)]
    assert not raw, raw


def test_the_slugs_are_githubs() -> None:
    assert slug("Emulated cluster: goodput against BytePS Eq. 6") == (
        "emulated-cluster-goodput-against-byteps-eq-6"
    )
    assert slug("push_pull against gloo all_reduce: ResNet-50 gradients") == (
        "push_pull-against-gloo-all_reduce-resnet-50-gradients"
    )
    assert slug("What bench/results keeps") == "what-benchresults-keeps"
    assert slug("Training: digits (examples/train_digits.py)") == (
        "training-digits-examplestrain_digitspy"
    )
    assert slug("`fifo` and **p3**") == "fifo-and-p3"
    assert resolve("docs/a.md", "../BENCHMARKS.md#simulator") == ("BENCHMARKS.md", "simulator")
    assert resolve("docs/a.md", "#x") == ("docs/a.md", "x")
    assert resolve("README.md", "docs/b.md") == ("docs/b.md", "")
