"""Horovod-style agreement on one operation (sumflow.torch.negotiate), without a job: the
workers' request tables are summed here as the servers would."""

from __future__ import annotations

import pytest
import torch

from sumflow.torch.negotiate import WIDTH, HorovodInternalError, Request, check, decode, encode


def agree(requests: list[Request], ranks: list[int] | None = None) -> list:
    """Every worker's table summed, decoded and checked as each worker does."""
    n = len(requests)
    width = WIDTH + max(len(r.extra) for r in requests)
    table = sum(encode(r, i, n, width) for i, r in enumerate(requests))
    assert isinstance(table, torch.Tensor)
    return check(requests[0], decode(table, ranks or list(range(n))))


def request(**changes: object) -> Request:
    base: dict[str, object] = {
        "kind": "allreduce",
        "name": "allreduce.x",
        "dtype": torch.float32,
        "shape": (3, 4),
        "op": 1,
    }
    base.update(changes)
    return Request(**base)  # type: ignore[arg-type]


def test_agreeing_requests_give_every_row_with_its_extra_words() -> None:
    rows = agree([request(extra=(5,)), request(extra=(0,)), request(extra=(7,))])
    assert [r.rank for r in rows] == [0, 1, 2]
    assert [r.extra for r in rows] == [(5,), (0,), (7,)]
    assert all(r.shape == (3, 4) and r.dtype == torch.float32 for r in rows)


def test_rows_are_named_by_the_members_ranks() -> None:
    rows = agree([request(), request()], ranks=[1, 3])
    assert [r.rank for r in rows] == [1, 3]


@pytest.mark.parametrize(
    ("other", "words"),
    [
        (request(shape=(3, 5)), ["shape", "[3, 4] on workers 0, 2", "[3, 5] on worker 1"]),
        (request(dtype=torch.int32), ["dtype", "torch.int32 on worker 1"]),
        (request(op=0), ["op"]),
        (request(root=1), ["root"]),
        (request(kind="allgather"), ["kind"]),
        (request(facts="scaled"), ["settings"]),
        (request(shape=(1,) * 9), ["shape"]),
    ],
)
def test_a_disagreement_names_what_differs_and_the_workers(
    other: Request, words: list[str]
) -> None:
    with pytest.raises(HorovodInternalError) as e:
        agree([request(), other, request()])
    assert isinstance(e.value, RuntimeError)
    assert "allreduce 'allreduce.x'" in str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_gathers_may_differ_in_the_first_dimension_only() -> None:
    gather: dict[str, object] = {"kind": "allgather", "any_first_dim": True}
    agree([request(shape=(2, 4), **gather), request(shape=(0, 4), **gather)])
    with pytest.raises(HorovodInternalError, match="shape after the first dimension"):
        agree([request(shape=(2, 4), **gather), request(shape=(2, 5), **gather)])


def test_more_dimensions_than_a_row_shows_are_compared_by_their_hash() -> None:
    big = (2,) * 10
    agree([request(shape=big), request(shape=big)])
    with pytest.raises(HorovodInternalError):
        agree([request(shape=big), request(shape=(2,) * 9 + (3,))])


def test_a_member_that_sent_nothing_is_named() -> None:
    table = encode(request(), 0, 2, WIDTH)
    with pytest.raises(HorovodInternalError, match="positions \\[1\\]"):
        check(request(), decode(table, [0, 1]))
