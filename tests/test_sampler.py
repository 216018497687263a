"""The scope-aware sampler: padding outside join, every sample once inside, seeded shuffle."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler, SubsetRandomSampler

import scopedlite as lite
from scopedlite import ShardedBatchSampler, ShardedSampler


def _all(world, sampler_factory, inside_join, epoch=0):
    out = []
    for rank in range(world):
        s = ShardedSampler(sampler_factory(), rank, world, seed=3)
        s.set_epoch(epoch)
        if inside_join:
            with lite.join():
                out.append((list(s), len(s)))
        else:
            out.append((list(s), len(s)))
    return out


def test_ten_items_on_three_ranks():
    outside = _all(3, lambda: SequentialSampler(range(10)), False)
    assert [o[0] for o in outside] == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    assert {o[1] for o in outside} == {4}
    inside = _all(3, lambda: SequentialSampler(range(10)), True)
    assert [o[0] for o in inside] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [o[1] for o in inside] == [4, 3, 3]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 7, 10])
def test_every_sample_exactly_once_inside_join_with_shuffle(world, n):
    for epoch in (0, 1):
        shards = _all(world, lambda: RandomSampler(range(n)), True, epoch)
        seen = sorted(i for indices, _ in shards for i in indices)
        assert seen == list(range(n))
        assert [len(i) for i, _ in shards] == [c for _, c in shards]


def test_shuffle_is_shared_across_ranks_and_differs_per_epoch():
    e0 = _all(2, lambda: RandomSampler(range(20)), True, 0)
    e1 = _all(2, lambda: RandomSampler(range(20)), True, 1)
    assert e0 != e1
    assert sorted(e0[0][0] + e0[1][0]) == list(range(20))
    assert _all(2, lambda: RandomSampler(range(20)), True, 0) == e0


def test_users_own_sampler_is_sharded_not_replaced():
    subset = [10, 11, 12, 13, 14]
    shards = _all(2, lambda: SubsetRandomSampler(subset), True)
    assert sorted(shards[0][0] + shards[1][0]) == subset


def test_the_users_global_rng_is_untouched():
    torch.manual_seed(123)
    expected = torch.rand(2)
    torch.manual_seed(123)
    list(ShardedSampler(RandomSampler(range(5)), 0, 2))
    assert torch.equal(torch.rand(2), expected)


def test_batch_sampler_deals_whole_batches():
    make = lambda: BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=False)  # noqa: E731
    inside = []
    for rank in range(2):
        s = ShardedBatchSampler(make(), rank, 2)
        with lite.join():
            inside.append(list(s))
    assert inside == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9]]]
    outside = [list(ShardedBatchSampler(make(), r, 2)) for r in range(2)]
    assert [len(o) for o in outside] == [2, 2]
