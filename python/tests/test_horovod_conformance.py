"""Horovod's own PyTorch test suite against sumflow.torch (../shared/conformance/
horovod-torch/run.sh, only its import line changed): every test that passes today must
keep passing. The tests that pass are listed in horovod_conformance_passing.txt (today
every one that does not skip itself, the three join tests included; docs/torch.md says
which skip and why). The whole suite runs in one job, as under horovodrun: on one
machine of two workers, and on two machines of two workers each (their sums aggregated
inside each machine first)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = REPO.parent / "shared" / "conformance" / "horovod-torch" / "run.sh"
PASSING = Path(__file__).with_name("horovod_conformance_passing.txt")


@pytest.mark.skipif(not RUN.exists(), reason=f"Horovod's suite is not at {RUN}")
@pytest.mark.parametrize(
    "shape",
    [
        ["--launcher-flags", "--timeout 60"],
        ["-np", "4", "--launcher-flags", "--local-size 2 --timeout 60"],
    ],
    ids=["1x2", "2x2"],
)
def test_no_horovod_test_that_passed_fails_now(shape: list[str]) -> None:
    # run.sh takes python and sumflow-run from PATH: this interpreter's own, so the suite runs
    # under the torch and the sumflow of whichever environment runs this test.
    here = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": os.pathsep.join([here, os.environ.get("PATH", "")])}
    done = subprocess.run(
        ["bash", str(RUN), *shape],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    out = done.stdout + done.stderr
    passed = set(re.findall(r"^PASSED test_torch\.py::TorchTests::(\w+)", out, re.M))
    expected = {line.strip() for line in PASSING.read_text().splitlines() if line.strip()}
    regressed = sorted(expected - passed)
    assert not regressed, f"Horovod tests that passed before fail now: {regressed}\n{out[-4000:]}"
    summary = re.search(r"horovod-conformance: .*", out)
    print(summary.group(0) if summary else out[-2000:])
