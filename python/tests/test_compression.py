"""The compressors of sumflow.torch.compression: choosing them (parameters, names, the
registry, the environment), error feedback for Python compressors, and two worker
processes checked against compression_reference.py's numpy model of the core's top-k and
sign (worker and server error feedback), random-k's shared draws, dithering's bounds, a
registered Python compressor, the minimum size, 16-bit tensors, training, and the bytes
on the wire."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from compression_reference import ELEMENTS, STEPS, TOPK_RATIO, averages, gradient, sign, topk
from jobs import run_worker_processes

from sumflow.torch.compression import (
    Compression,
    Compressor,
    CoreCompressor,
    ErrorFeedback,
    core_spec,
)

WORKER = str(Path(__file__).with_name("compression_worker.py"))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Compression.topk(0.0), "ratio must be in"),
        (lambda: Compression.randomk(1.5), "ratio must be in"),
        (lambda: Compression.dithering(0), "levels must be an int from 1 to 127"),
        (lambda: Compression.dithering(128), "levels must be an int from 1 to 127"),
        (lambda: Compression.sign(min_elements=0), "min_elements"),
    ],
)
def test_core_compressors_refuse_bad_parameters(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_compressors_are_found_by_name_and_by_spec() -> None:
    assert {"none", "fp16", "bf16", "topk", "randomk", "sign", "dithering"} <= set(
        Compression.names()
    )
    assert Compression.get("fp16") is Compression.fp16
    c = Compression.parse("topk:ratio=0.05, error_feedback=False, min_elements=10")
    assert isinstance(c, CoreCompressor)
    assert (c.name, c.param, c.error_feedback, c.min_elements) == ("topk", 0.05, False, 10)
    d = Compression.parse("dithering:levels=3")
    assert repr(d) == "Compression.dithering(3, error_feedback=False, min_elements=4096)"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("zip", "no compressor named 'zip'; registered: bf16, "),
        ("topk:ratio", "not key=value"),
        ("topk:ratio=small", "not a number"),
        ("topk:k=5", "does not take"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Compression.parse(spec)


def test_a_name_is_registered_once_unless_replaced() -> None:
    Compression.register("test-twice", lambda: Compression.none)
    with pytest.raises(ValueError, match="registered already"):
        Compression.register("test-twice", lambda: Compression.fp16)
    Compression.register("test-twice", lambda: Compression.fp16, replace=True)
    assert Compression.get("test-twice") is Compression.fp16
    with pytest.raises(ValueError, match="without ':'"):
        Compression.register("a:b", lambda: Compression.none)


def test_the_environment_chooses_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SUMFLOW_COMPRESSION", raising=False)
    assert Compression.from_env() is Compression.none
    monkeypatch.setenv("SUMFLOW_COMPRESSION", "sign:error_feedback=False")
    c = Compression.from_env()
    assert isinstance(c, CoreCompressor)
    assert (c.name, c.error_feedback) == ("sign", False)
    monkeypatch.setenv("SUMFLOW_COMPRESSION", "topk:ratio=2")
    with pytest.raises(ValueError, match="SUMFLOW_COMPRESSION='topk:ratio=2'"):
        Compression.from_env()


def test_small_integer_and_16_bit_tensors_are_told_apart() -> None:
    c = Compression.topk(0.1, min_elements=100)
    wire, ctx = c.compress(torch.zeros(100, dtype=torch.float16))
    assert (wire.dtype, ctx) == (torch.float32, torch.float16)
    assert core_spec(c, wire) == ("topk", 0.1, True)
    assert core_spec(c, torch.zeros(99)) is None, "below min_elements"
    assert core_spec(c, torch.zeros(100, dtype=torch.int32)) is None, "integers"
    assert core_spec(Compression.fp16, torch.zeros(100)) is None


class _Halve(Compressor):
    """Rounds to multiples of 0.5: lossy, summable."""

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        return torch.round(tensor * 2) / 2, None

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        return tensor


def test_error_feedback_keeps_per_tensor_what_a_python_compressor_lost() -> None:
    ef = ErrorFeedback(_Halve())
    a = ef.for_tensor("a")
    assert ef.for_tensor("a") is a
    assert ef.for_tensor("b") is not a
    residual = torch.zeros(4)
    for x in ([0.3, -0.2, 1.1, 0.0], [0.3, 0.3, 0.3, 0.3], [0.0, 0.0, 0.0, 0.0]):
        x = torch.tensor(x)
        wire, ctx = a.compress(x)
        # sent + new residual = input + previous residual
        sent = a.decompress(wire.clone(), ctx)
        new = a.residual  # type: ignore[attr-defined]
        assert torch.allclose(sent + new, x + residual)
        residual = new
    # The probe of a tensor's wire form moves no residual.
    before = a.residual.clone()  # type: ignore[attr-defined]
    ef.compress(torch.ones(4))
    assert torch.equal(a.residual, before)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp_path = tmp_path_factory.mktemp("compression")
    outcomes = run_worker_processes(tmp_path, 2, [WORKER, str(tmp_path)])
    for o in outcomes:
        assert o.returncode == 0, f"worker {o.rank} exited {o.returncode}:\n{o.stderr[-3000:]}"
    return [torch.load(tmp_path / f"rank{o.rank}.pt", weights_only=False) for o in outcomes]


def _exact_average(step: int) -> np.ndarray:
    return (gradient(0, step) + gradient(1, step)) / np.float32(2)


def test_top_k_averages_equal_the_reference(ranks: list[dict[str, Any]]) -> None:
    k = int(np.ceil(TOPK_RATIO * ELEMENTS))
    want = averages(lambda x: topk(x, k))
    for r in ranks:
        for step in range(STEPS):
            got = r["topk"][step].numpy()
            np.testing.assert_array_equal(got, want[step], err_msg=f"step {step}")
            assert np.count_nonzero(got) == k


def test_sign_averages_equal_the_reference(ranks: list[dict[str, Any]]) -> None:
    want = averages(sign)
    for r in ranks:
        for step in range(STEPS):
            np.testing.assert_allclose(r["sign"][step].numpy(), want[step], rtol=1e-5)


def test_random_k_sends_the_same_elements_from_every_worker(ranks: list[dict[str, Any]]) -> None:
    drawn = []
    for step in range(STEPS):
        got = ranks[0]["randomk"][step].numpy()
        np.testing.assert_array_equal(got, ranks[1]["randomk"][step].numpy())
        kept = got != 0
        assert kept.sum() == ELEMENTS // 10
        # Where drawn, the exact average: both workers sent the same elements.
        np.testing.assert_array_equal(got[kept], _exact_average(step)[kept])
        drawn.append(kept)
    assert not np.array_equal(drawn[0], drawn[1]), "each step draws anew"


def test_dithering_stays_within_its_levels(ranks: list[dict[str, Any]]) -> None:
    levels = 3
    for step in range(STEPS):
        norms = [np.abs(gradient(r, step)).max() for r in range(2)]
        # Each worker's rounding is within a level of its norm, the server's within a
        # level of the sum's largest magnitude: at most (1 + 1/levels) times the norms.
        bound = sum(norms) / levels * (1 + (1 + 1 / levels)) / 2
        got = ranks[0]["dithering"][step].numpy()
        np.testing.assert_array_equal(got, ranks[1]["dithering"][step].numpy())
        error = np.abs(got - _exact_average(step))
        assert error.max() <= bound * 1.0001
        assert error.max() > 0, "dithering rounds"


def test_a_registered_python_compressor_with_feedback_loses_nothing(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        first, second = (t.numpy() for t in r["alternate"])
        assert not first[1::2].any()
        assert not second[::2].any()
        np.testing.assert_array_equal(first + second, _exact_average(0))


def test_tensors_below_the_minimum_size_travel_uncompressed(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        np.testing.assert_array_equal(r["small"].numpy(), _exact_average(0))


def test_16_bit_tensors_are_compressed_in_float32_and_cast_back(
    ranks: list[dict[str, Any]],
) -> None:
    halves = [torch.from_numpy(gradient(r, 0)).half().float() for r in range(2)]
    want = ((halves[0] + halves[1]) / 2).half()
    for r in ranks:
        assert r["half"].dtype == torch.float16
        assert torch.equal(r["half"], want)


def test_training_with_top_k_keeps_the_workers_identical_and_learns(
    ranks: list[dict[str, Any]],
) -> None:
    a, b = (r["trained"] for r in ranks)
    for p, q in zip(a["params"], b["params"], strict=True):
        assert torch.equal(p, q)
    assert a["losses"][-1] < 0.8 * a["losses"][0], a["losses"]


def test_the_wire_carries_the_compressed_bytes(ranks: list[dict[str, Any]]) -> None:
    """Counted at the sockets, frames whole: each compressor's pushes over its steps
    against the dense bytes of the same steps."""
    dense = STEPS * ELEMENTS * 4
    most = {"topk": 0.05, "sign": 0.06, "randomk": 0.15, "dithering": 0.16}
    for r in ranks:
        for name, fraction in most.items():
            sent = r["wire"][f"allreduce.{name}"][0]
            assert sent < fraction * dense, f"{name}: {sent} bytes of {dense}"
        assert r["wire"]["allreduce.small"][0] > ELEMENTS * 4, "small travels dense"


def test_the_ddp_hook_compresses_too(ranks: list[dict[str, Any]]) -> None:
    """Top-k keeping every element is lossless: the hooked DDP ends where it ends dense."""
    for r in ranks:
        for dense, topk_all in zip(r["ddp"], r["ddp-topk"], strict=True):
            assert torch.equal(dense, topk_all)
    for p, q in zip(ranks[0]["ddp-topk"], ranks[1]["ddp-topk"], strict=True):
        assert torch.equal(p, q)
    assert any(name.startswith("ddp-topk.grad[") for name in ranks[0]["wire"])
