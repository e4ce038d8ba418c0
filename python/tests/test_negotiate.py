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


def test_a_member_without_a_row_has_joined_and_only_sums_go_on() -> None:
    # Worker 2 of 3 has joined: its row of the summed table is all zeros.
    tables = [encode(request(), r, 3, WIDTH) for r in (0, 1)]
    table = tables[0] + tables[1]
    assert decode(table, [0, 1, 2])[2] is None
    rows = check(request(), decode(table, [0, 1, 2]), [0, 1, 2])
    assert [r.rank for r in rows] == [0, 1]
    for kind in ("allgather", "broadcast", "alltoall", "reducescatter", "grouped_allgather"):
        req = request(kind=kind)
        t = encode(req, 0, 3, WIDTH) + encode(req, 2, 3, WIDTH)
        with pytest.raises(HorovodInternalError) as e:
            check(req, decode(t, [0, 1, 2]), [0, 1, 2])
        message = str(e.value)
        assert f"{kind} 'allreduce.x': worker 1 has joined" in message, message
        assert "needs every worker" in message, message
    # Every member joined (no one asked): nothing to go on with.
    with pytest.raises(HorovodInternalError, match="workers 0, 1 have joined"):
        check(request(), decode(encode(request(), 0, 2, WIDTH) * 0, [0, 1]), [0, 1])


def test_no_valid_row_is_all_zeros() -> None:
    # The first word is always 1; kind and dtype codes start at 1.
    for kind in ("allreduce", "allgather", "broadcast"):
        row = encode(request(kind=kind, shape=()), 0, 1, WIDTH)[0]
        assert row[0] == 1
        assert row[1] > 0
        assert row[2] > 0
