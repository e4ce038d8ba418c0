"""An elastic sampler: shards a dataset over the workers there are now, not at launch.

``torch.utils.data.DistributedSampler`` fixes each worker's shard for a whole epoch from
the job's rank and size. In an elastic job workers come and go mid-epoch; re-sharding the
whole epoch over the new set would process some samples twice and, with a different
padding, skip others. :class:`ElasticSampler` instead remembers which dataset indices the
epoch has processed, and on a change of workers the survivors agree on that set
(:meth:`ElasticSampler.sync`) and shard only the rest of the epoch among themselves
(:meth:`ElasticSampler.reset`), so every sample of an epoch is processed once.

It is the counterpart of Horovod Elastic's ``horovod.torch.elastic.ElasticSampler``: record
each batch after its step (:meth:`ElasticSampler.record_batch`), and keep the sampler in
the elastic state so that its :meth:`~ElasticSampler.state_dict` is committed and restored
with the model's.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

# The rank, size and object collectives go through these module-level helpers, imported
# lazily because sumflow.torch imports its elastic package; tests replace them to play
# several workers in one process.


def _rank() -> int:
    import sumflow.torch as hvd

    return hvd.rank()


def _size() -> int:
    import sumflow.torch as hvd

    return hvd.size()


def _allgather_object(obj: Any) -> list[Any]:
    import sumflow.torch as hvd

    return hvd.allgather_object(obj)


def _broadcast_object(obj: Any, root_rank: int) -> Any:
    import sumflow.torch as hvd

    return hvd.broadcast_object(obj, root_rank=root_rank)


class ElasticSampler(Sampler[int]):
    """Yields this worker's share of the indices of `dataset` not yet processed this epoch.

    The epoch's order is a permutation seeded by ``seed + epoch`` when `shuffle` (the same on
    every worker), else ``0 .. len(dataset) - 1``. The indices not in
    :attr:`processed_indices` keep that order, are padded by repeating from their start to
    a multiple of the number of workers, and worker ``rank`` takes every ``size``-th one
    from position ``rank``, as ``DistributedSampler`` does.

    Attributes:
        epoch: The epoch the shard is drawn from.
        processed_indices: The dataset indices processed so far this epoch; after
            :meth:`sync`, by all the workers.
        indices: This worker's shard: the dataset indices it iterates, in order.
        num_samples: ``len(indices)``.
        rank: This worker's rank when the shard was computed.
        num_replicas: The number of workers when the shard was computed.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.indices: list[int] = []
        self.num_samples = 0
        self.rank = 0
        self.num_replicas = 1
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: nothing of it is processed yet; reshards."""
        self.epoch = _checked_epoch(epoch)
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch `batch_idx` (of `batch_size` samples) of this worker's shard processed.

        The batch is the slice :meth:`get_indices` returns, so call this before the next
        :meth:`reset` changes the shard.
        """
        self.processed_indices.update(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark the dataset indices `indices` processed this epoch."""
        self.processed_indices.update(self._checked_indices(indices))

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The dataset indices of batch `batch_idx` (of `batch_size` samples) of this
        worker's shard; the last batch may be short, and one past the end is empty."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if batch_idx < 0:
            raise ValueError(f"batch_idx must not be negative, got {batch_idx}")
        start = batch_idx * batch_size
        return self.indices[start : start + batch_size]

    def reset(self) -> None:
        """Recompute this worker's shard from the current rank and number of workers.

        Call it after the workers change (:meth:`sync` does) so that the remaining indices
        of the epoch are dealt out among the workers there are now.
        """
        rank, size = _rank(), _size()
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not one of {size} workers")
        remaining = [i for i in self._epoch_order() if i not in self.processed_indices]
        if remaining:
            # Every worker must yield as many samples, or the shorter ones would leave the
            # others waiting in a collective at the end of the epoch.
            padding = -len(remaining) % size
            repeats = -(-padding // len(remaining))
            remaining += (remaining * repeats)[:padding]
        self.rank = rank
        self.num_replicas = size
        self.indices = remaining[rank::size]
        self.num_samples = len(self.indices)

    def sync(self) -> None:
        """Agree with every worker on the epoch and on what it has processed, then reshard.

        A collective: every worker must call it. The epoch is rank 0's; the processed
        indices become the union of every worker's, so that a sample any worker has
        processed is in no worker's new shard.
        """
        epoch = _checked_epoch(_broadcast_object(self.epoch, root_rank=0))
        union: set[int] = set()
        for indices in _allgather_object(sorted(self.processed_indices)):
            union.update(self._checked_indices(indices))
        self.epoch = epoch
        self.processed_indices = union
        self.reset()

    def state_dict(self) -> dict[str, Any]:
        """The epoch and its processed indices (sorted), to commit or to save."""
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the epoch and processed indices of :meth:`state_dict`, then reshard.

        Raises:
            ValueError: if a key is missing, the epoch is not a non-negative int, or a
                processed index is not an index of the dataset.
        """
        for key in ("epoch", "processed_indices"):
            if key not in state_dict:
                raise ValueError(f"ElasticSampler state_dict lacks the key {key!r}")
        epoch = _checked_epoch(state_dict["epoch"])
        processed = set(self._checked_indices(state_dict["processed_indices"]))
        self.epoch = epoch
        self.processed_indices = processed
        self.reset()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples

    def _epoch_order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order: list[int] = torch.randperm(n, generator=generator).tolist()
        return order

    def _checked_indices(self, indices: Iterable[Any]) -> list[int]:
        # An index outside the dataset means a state from another dataset (or a corrupt
        # one); taking it silently would shrink the epoch by the indices it displaces.
        n = len(self.dataset)
        checked = []
        for index in indices:
            why = f"processed index {index!r} is not an index of a dataset of {n} samples"
            try:
                value = operator.index(index)
            except TypeError:
                raise ValueError(why) from None
            if not 0 <= value < n:
                raise ValueError(why)
            checked.append(value)
        return checked


def _checked_epoch(epoch: Any) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
    return epoch
