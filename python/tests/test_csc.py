"""Coarse-grained sparse communication (sumflow.torch.csc): its pure parts alone, then two
worker processes against the numpy reference of GradientFlow's Algorithm 1 and chunk
selection (csc_reference.py): the same chunks chosen on every worker, the same weights,
a state_dict that resumes exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from csc_reference import CONFIG, STEPS, WORKERS, reference
from jobs import run_worker_processes

from sumflow.torch.csc import (
    CoarseSparseSGD,
    chunk_l1_norms,
    chunks_sent,
    density_at,
    select_chunks,
)

WORKER = str(Path(__file__).with_name("csc_worker.py"))


def test_density_ramps_linearly_from_dense_over_the_warm_up() -> None:
    assert [density_at(s, 0.2, 4) for s in range(6)] == pytest.approx(
        [1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    )
    assert density_at(0, 0.2, 0) == 0.2


def test_chunks_sent_rounds_up_and_sends_at_least_one() -> None:
    assert chunks_sent(20, 0.15) == 3
    assert chunks_sent(7, 0.3) == 3
    assert chunks_sent(10, 0.01) == 1
    assert chunks_sent(10, 1.0) == 10


def test_selection_takes_the_largest_norms_and_breaks_ties_by_index() -> None:
    norms = torch.tensor([1.0, 5.0, 3.0, 5.0, 0.0, 3.0])
    assert select_chunks(norms, 3).tolist() == [1, 2, 3]
    assert select_chunks(norms, 1).tolist() == [1]


def test_norms_of_sent_chunks_are_divided_by_the_workers() -> None:
    rows = torch.tensor([[1.0, -2.0], [4.0, -4.0], [0.5, 0.0]])
    norms = chunk_l1_norms(rows, torch.tensor([1]), 4)
    assert norms.tolist() == [3.0, 2.0, 0.5]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"density": 0.0}, "density"),
        ({"density": 1.5}, "density"),
        ({"momentum": 1.0}, "momentum"),
        ({"chunk_elements": 0}, "chunk_elements"),
        ({"warmup_steps": -1}, "warmup_steps"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CoarseSparseSGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1, **kwargs)


def test_parameters_it_cannot_pool_are_refused() -> None:
    mixed = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3).double())]
    with pytest.raises(ValueError, match="one floating dtype"):
        CoarseSparseSGD(mixed, lr=0.1)
    groups = [{"params": [mixed[0]]}, {"params": [torch.nn.Parameter(torch.zeros(2))]}]
    with pytest.raises(ValueError, match="one parameter group"):
        CoarseSparseSGD(groups, lr=0.1)


def test_a_state_dict_of_another_optimizer_is_refused() -> None:
    opt = CoarseSparseSGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1).state_dict()
    with pytest.raises(ValueError, match="no 'csc' entry"):
        opt.load_state_dict(plain)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp_path = tmp_path_factory.mktemp("csc")
    outcomes = run_worker_processes(tmp_path, WORKERS, [WORKER, str(tmp_path)])
    for o in outcomes:
        assert o.returncode == 0, f"worker {o.rank} exited {o.returncode}:\n{o.stderr[-3000:]}"
    return [torch.load(tmp_path / f"rank{o.rank}.pt", weights_only=False) for o in outcomes]


def test_every_worker_sends_the_chunks_the_reference_selects(ranks: list[dict[str, Any]]) -> None:
    want, _ = reference()
    chunks = 7
    # Dense through the warm-up's first step, then sparser, down to 3 of 7 chunks.
    assert [len(s) for s in want] == [7, 6, 5, 4, 3, 3, 3, 3, 3, 3]
    assert any(s != want[-1] for s in want[4:]), "the selection should move with the norms"
    for r in ranks:
        assert r["sent"] == want
        assert all(0 <= c < chunks for s in r["sent"] for c in s)


def test_weights_equal_the_reference_of_algorithm_1(ranks: list[dict[str, Any]]) -> None:
    _, want = reference()
    for rank, r in enumerate(ranks):
        assert len(r["weights"]) == STEPS
        for step, (got, ref) in enumerate(zip(r["weights"], want, strict=True)):
            for g, w in zip(got, ref, strict=True):
                np.testing.assert_allclose(
                    g.numpy(), w, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank} step {step}"
                )


def test_weights_of_unsent_chunks_do_not_move(ranks: list[dict[str, Any]]) -> None:
    c = CONFIG["chunk_elements"]
    for r in ranks:
        for step in range(1, STEPS):
            before = torch.cat([w.reshape(-1) for w in r["weights"][step - 1]])
            after = torch.cat([w.reshape(-1) for w in r["weights"][step]])
            moved = {int(i) // c for i in torch.nonzero(before != after)}
            assert moved <= set(r["sent"][step]), f"step {step}"


def test_a_restored_state_dict_continues_exactly(ranks: list[dict[str, Any]]) -> None:
    half = STEPS // 2
    for r in ranks:
        assert r["restored_sent"] == r["sent"][half:]
        for got, want in zip(r["restored_weights"], r["weights"][half:], strict=True):
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w)


def test_the_wire_carries_the_sent_chunks_and_the_norms(ranks: list[dict[str, Any]]) -> None:
    """Counted at the sockets: payload of the chunks sent and of the norm exchanges, plus
    frame headers of at most 100 bytes per push (push, pull, acknowledgement, reply)."""
    c = CONFIG["chunk_elements"]
    half = STEPS // 2
    for r in ranks:
        wire = r["wire"]
        sent_chunks = sum(len(s) for s in r["sent"]) + sum(len(s) for s in r["restored_sent"])
        chunk_bytes = sent_chunks * c * 4
        chunk_tensors = [k for k in wire if ".group" in k or ".tail" in k]
        # allreduce_ names them "allreduce.<name>".
        assert {k.split(".")[1] for k in chunk_tensors} == {"CoarseSparseSGD", "restored"}
        sent = sum(wire[k][0] for k in chunk_tensors)
        received = sum(wire[k][1] for k in chunk_tensors)
        assert chunk_bytes < sent < chunk_bytes * 1.2 + 100 * 2 * STEPS
        assert chunk_bytes < received < chunk_bytes * 1.2 + 100 * 2 * STEPS
        # Norms go out after every step whose successor is sparse, which is every step
        # here: ten of the first optimizer, five of the restored one.
        norm_pushes = STEPS + (STEPS - half)
        norm_bytes = norm_pushes * 7 * 4
        names = ("allreduce.CoarseSparseSGD.norms", "allreduce.restored.norms")
        sent_norms = sum(wire[name][0] for name in names)
        assert norm_bytes < sent_norms < norm_bytes + 100 * norm_pushes
        total = r["wire_total"]
        assert (total.sent, total.received) == tuple(map(sum, zip(*wire.values(), strict=True)))
