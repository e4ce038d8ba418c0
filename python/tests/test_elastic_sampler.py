"""ElasticSampler: sharding an epoch, and re-sharding its rest when the workers change.

The workers are played in one process: the sampler's rank, size and object collectives are
module-level helpers, replaced here by a mutable `World`.
"""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from sumflow.torch.elastic import sampler as elastic_sampler
from sumflow.torch.elastic.sampler import ElasticSampler


@dataclass
class World:
    rank: int = 0
    size: int = 1


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    w = World()
    monkeypatch.setattr(elastic_sampler, "_rank", lambda: w.rank)
    monkeypatch.setattr(elastic_sampler, "_size", lambda: w.size)
    return w


def order(n: int, seed: int, epoch: int) -> list[int]:
    """The epoch order the sampler must use when shuffling, computed independently."""
    result: list[int] = torch.randperm(
        n, generator=torch.Generator().manual_seed(seed + epoch)
    ).tolist()
    return result


def samplers(world: World, size: int, dataset: Sized, **kwargs: Any) -> list[ElasticSampler]:
    """One sampler per rank of `size` workers."""
    world.size = size
    out = []
    for rank in range(size):
        world.rank = rank
        out.append(ElasticSampler(dataset, **kwargs))
    return out


def sync_all(
    world: World,
    monkeypatch: pytest.MonkeyPatch,
    survivors: list[ElasticSampler],
    gathered: list[list[int]],
) -> None:
    """Sync `survivors` as ranks 0.. of a job of len(survivors) workers, with the
    allgather answering `gathered` (each worker's sorted processed indices)."""
    monkeypatch.setattr(elastic_sampler, "_allgather_object", lambda obj: gathered)
    monkeypatch.setattr(elastic_sampler, "_broadcast_object", lambda obj, root_rank: obj)
    world.size = len(survivors)
    for rank, s in enumerate(survivors):
        world.rank = rank
        s.sync()


def test_shards_of_an_epoch_are_disjoint_and_cover_the_dataset(world: World) -> None:
    dataset = list(range(12))
    shards = [list(s) for s in samplers(world, 4, dataset, seed=3)]
    assert [len(shard) for shard in shards] == [3, 3, 3, 3]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not set(shards[a]) & set(shards[b])
    assert sorted(i for shard in shards for i in shard) == list(range(12))
    epoch_order = order(12, seed=3, epoch=0)
    assert shards == [epoch_order[rank::4] for rank in range(4)]


def test_shards_pad_from_the_start_when_not_divisible(world: World) -> None:
    dataset = list(range(10))
    ordered = samplers(world, 4, dataset, shuffle=False)
    assert [list(s) for s in ordered] == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert [len(s) for s in ordered] == [3, 3, 3, 3]

    shuffled = samplers(world, 4, dataset, seed=7)
    epoch_order = order(10, seed=7, epoch=0)
    padded = epoch_order + epoch_order[:2]
    assert [list(s) for s in shuffled] == [padded[rank::4] for rank in range(4)]
    assert {i for s in shuffled for i in s} == set(range(10))


def test_padding_repeats_when_fewer_remain_than_workers(world: World) -> None:
    dataset = list(range(5))
    s = samplers(world, 4, dataset, shuffle=False)[0]
    s.record_indices([0, 1, 2, 3])
    shards = []
    for rank in range(4):
        world.rank = rank
        s.reset()
        shards.append(list(s))
    assert shards == [[4], [4], [4], [4]]


def test_after_a_worker_leaves_the_rest_of_the_epoch_is_resharded(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    n, batch, k = 50, 3, 2
    dataset = list(range(n))
    four = samplers(world, 4, dataset, seed=11)
    for s in four:
        for b in range(k):
            s.record_batch(b, batch)
    processed = {i for s in four for b in range(k) for i in s.get_indices(b, batch)}
    assert len(processed) == 4 * k * batch

    gathered = [sorted(s.processed_indices) for s in four]
    three = four[:3]
    sync_all(world, monkeypatch, three, gathered)

    remaining = [i for i in order(n, seed=11, epoch=0) if i not in processed]
    assert len(remaining) == 26
    padded = remaining + remaining[:1]
    assert [list(s) for s in three] == [padded[rank::3] for rank in range(3)]
    assert [len(s) for s in three] == [9, 9, 9]
    assert {i for s in three for i in s} == set(range(n)) - processed
    for s in three:
        assert s.processed_indices == processed
        assert not set(s) & processed

    # The three finish the epoch: with their batches synced, nothing is left.
    for s in three:
        for b in range(3):
            s.record_batch(b, batch)
    sync_all(world, monkeypatch, three, [sorted(s.processed_indices) for s in three])
    for s in three:
        assert s.processed_indices == set(range(n))
        assert list(s) == []
        assert len(s) == 0


def test_sync_takes_the_epoch_from_rank_0(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    s = ElasticSampler(list(range(8)), seed=1)
    s.set_epoch(2)
    s.record_indices([5])
    roots = []

    def broadcast(obj: Any, root_rank: int) -> Any:
        roots.append(root_rank)
        return 4

    monkeypatch.setattr(elastic_sampler, "_broadcast_object", broadcast)
    monkeypatch.setattr(elastic_sampler, "_allgather_object", lambda obj: [obj, [1]])
    s.sync()
    assert roots == [0]
    assert s.epoch == 4
    assert s.processed_indices == {1, 5}
    assert list(s) == [i for i in order(8, seed=1, epoch=4) if i not in {1, 5}]


def test_set_epoch_changes_the_order_and_clears_processed(world: World) -> None:
    s = ElasticSampler(list(range(20)), seed=5)
    assert list(s) == order(20, seed=5, epoch=0)
    s.record_batch(0, 4)
    assert s.processed_indices == set(order(20, seed=5, epoch=0)[:4])
    s.set_epoch(1)
    assert s.epoch == 1
    assert s.processed_indices == set()
    assert list(s) == order(20, seed=5, epoch=1)
    assert list(s) != order(20, seed=5, epoch=0)
    assert len(s) == 20


def test_shuffle_false_gives_index_order(world: World) -> None:
    s = ElasticSampler(list(range(9)), shuffle=False, seed=123)
    assert list(s) == list(range(9))
    s.set_epoch(3)
    assert list(s) == list(range(9))
    s.record_indices([0, 4])
    s.reset()
    assert list(s) == [1, 2, 3, 5, 6, 7, 8]


def test_get_indices_slices_the_shard_and_clips_at_its_end(world: World) -> None:
    s = ElasticSampler(list(range(10)), shuffle=False)
    assert s.get_indices(0, 4) == [0, 1, 2, 3]
    assert s.get_indices(2, 4) == [8, 9]
    assert s.get_indices(3, 4) == []
    s.record_batch(2, 4)
    assert s.processed_indices == {8, 9}


def test_state_dict_round_trip(world: World) -> None:
    s = ElasticSampler(list(range(16)), seed=2)
    s.set_epoch(3)
    s.record_batch(1, 5)
    state = s.state_dict()
    assert state == {"epoch": 3, "processed_indices": sorted(order(16, seed=2, epoch=3)[5:10])}

    restored = ElasticSampler(list(range(16)), seed=2)
    restored.load_state_dict(state)
    assert restored.epoch == 3
    assert restored.processed_indices == set(state["processed_indices"])
    assert list(restored) == [
        i for i in order(16, seed=2, epoch=3) if i not in state["processed_indices"]
    ]
    assert restored.state_dict() == state


@pytest.mark.parametrize(
    ("state", "name"),
    [
        ({"processed_indices": []}, "epoch"),
        ({"epoch": 0}, "processed_indices"),
        ({"epoch": 0, "processed_indices": [3, 10]}, "10"),
        ({"epoch": 0, "processed_indices": [-1]}, "-1"),
        ({"epoch": 0, "processed_indices": ["2"]}, "'2'"),
        ({"epoch": -1, "processed_indices": []}, "epoch"),
        ({"epoch": "1", "processed_indices": []}, "epoch"),
    ],
)
def test_load_state_dict_rejects_bad_states(world: World, state: dict[str, Any], name: str) -> None:
    s = ElasticSampler(list(range(10)))
    s.record_indices([1])
    with pytest.raises(ValueError, match=name):
        s.load_state_dict(state)
    assert s.state_dict() == {"epoch": 0, "processed_indices": [1]}


def test_bad_batches_and_indices_raise(world: World) -> None:
    s = ElasticSampler(list(range(10)))
    with pytest.raises(ValueError, match="batch_size"):
        s.record_batch(0, 0)
    with pytest.raises(ValueError, match="batch_idx"):
        s.get_indices(-1, 2)
    with pytest.raises(ValueError, match="99"):
        s.record_indices([2, 99])
    assert s.processed_indices == set()
    world.rank, world.size = 3, 3
    with pytest.raises(ValueError, match="rank 3"):
        s.reset()


def test_everything_processed_gives_an_empty_shard(world: World) -> None:
    s = samplers(world, 2, list(range(6)), seed=4)[1]
    s.record_indices(range(6))
    s.reset()
    assert list(s) == []
    assert len(s) == 0
    assert s.get_indices(0, 2) == []


def test_drives_a_dataloader(world: World) -> None:
    dataset = TensorDataset(torch.arange(100, 110))
    s = samplers(world, 2, dataset, shuffle=False)[1]
    batches = [b.tolist() for (b,) in DataLoader(dataset, batch_size=2, sampler=s)]
    assert batches == [[101, 103], [105, 107], [109]]
