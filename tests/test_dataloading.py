"""Data loading loses, repeats and reorders nothing (issue 15).

One launched script per world size (tests/scripts/data_order.py) reads every everyday kind of
loader for two passes outside ``lite.join`` and two inside; the test checks each sample is
read exactly once per pass inside join, the padded count outside, and ``DistributedSampler``'s
exact order where the contract promises it. The rest runs in this process.
"""

from __future__ import annotations

import math
import pickle
import random

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

import scopedlite as lite
from conftest import SCRIPTS, run_warm
from scopedlite import ShardedBatchSampler, ShardedSampler
from scopedlite._api.seed import SeedWorker, seeded_generators
from scopedlite._private.torch_internals import held_by_python_only

pytestmark = pytest.mark.timeout(150)

N = 11
# the order of CASES in the script; each case's loader counts its own passes from 0, though it
# is set up after the previous cases' passes (see docs/api.md)
CASES = ["plain", "shuffle", "distributed", "batch_sampler", "custom_batches", "subset", "by_epoch", "workers"]
EXPECTED_SETS = {"subset": sorted(set(range(N)) - {4})}
BATCH = {"batch_sampler": 3, "custom_batches": 3, "by_epoch": 1}


def distributed_order(world, rank, epoch, shuffle, seed, n=N):
    """What torch's own DistributedSampler gives rank `rank` (padded, drop_last=False)."""
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def unpadded(world, rank, epoch, shuffle, seed, n=N):
    """The same permutation inside join: strided, without the padding."""
    return distributed_order(1, 0, epoch, shuffle, seed, n)[rank::world]


def batch_count(items, batch):
    return math.ceil(items / batch)


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def ranks(request, tmp_path_factory):
    """Every rank's record from one launch: one launch per world size serves every check
    below, since real processes are the expensive part."""
    folder = tmp_path_factory.mktemp("data")
    result = run_warm(SCRIPTS / "data_order.py", request.param, tmp_path=folder, timeout=120)
    assert result.returncode == 0, result.explain()
    return result.json()


@pytest.mark.parametrize("case", CASES + ["rebuilt", "resumed"])
def test_each_sample_once_inside_join_padded_count_outside(ranks, case):
    world = len(ranks)
    expected = EXPECTED_SETS.get(case, list(range(N)))
    batch = BATCH.get(case, 2)
    for p in range(4):
        passes = [r[case][p] for r in ranks]
        seen = [i for one in passes for i in one["idx"]]
        if passes[0]["join"]:
            assert sorted(seen) == expected, (case, p, [one["idx"] for one in passes])
            assert [one["len"] for one in passes] == [batch_count(len(one["idx"]), batch) for one in passes]
        elif case == "custom_batches":  # whole batches dealt out, padded with whole batches
            assert set(seen) == set(expected)
            assert [one["len"] for one in passes] == [math.ceil(batch_count(N, 3) / world)] * world
        else:
            per_rank = math.ceil(len(expected) / world)
            assert [len(one["idx"]) for one in passes] == [per_rank] * world, (case, p)
            assert set(seen) == set(expected)
            assert {one["len"] for one in passes} == {batch_count(per_rank, batch)}


@pytest.mark.parametrize(
    ("case", "shuffle", "seed"),
    [
        ("plain", False, 0),
        ("shuffle", True, 0),
        ("distributed", True, 5),
        ("workers", True, 0),
    ],
)
def test_distributed_sampler_order_outside_join_and_unpadded_inside(ranks, case, shuffle, seed):
    world = len(ranks)
    for p in range(4):
        for rank, r in enumerate(ranks):
            one = r[case][p]
            reference = unpadded if one["join"] else distributed_order
            assert one["idx"] == reference(world, rank, p, shuffle, seed), (case, p, rank)


def test_a_loader_rebuilt_every_epoch_reshuffles_like_distributed_sampler(ranks):
    world = len(ranks)
    orders = []
    for p in range(4):
        for rank, r in enumerate(ranks):
            one = r["rebuilt"][p]
            reference = unpadded if one["join"] else distributed_order
            assert one["idx"] == reference(world, rank, p, True, 0)
        orders.append(ranks[0]["rebuilt"][p]["idx"])
    assert orders[0] != orders[1] and orders[2] != orders[3]


def test_an_epoch_the_script_sets_on_its_own_sampler_wins(ranks):
    world = len(ranks)
    for p in range(4):
        for rank, r in enumerate(ranks):
            one = r["resumed"][p]
            reference = unpadded if one["join"] else distributed_order
            assert one["idx"] == reference(world, rank, 20 + p, True, 5), (p, rank)


@pytest.mark.parametrize(("case", "seed"), [("users", 5), ("users_via_loader", 5), ("ours", 0), ("ours_early", 0)])
def test_the_ddp_tutorials_peek_then_set_epoch_reads_torchs_order(ranks, case, seed):
    """pytorch/examples' DDP tutorial peeks at a batch, then sets the epoch each epoch: every
    pass reads what torch's DistributedSampler gives, and the epoch set last holds."""
    world = len(ranks)
    for rank, r in enumerate(ranks):
        got = r["tutorial"][case]
        assert got["peek"] == distributed_order(world, rank, 0, True, seed)[:2], (case, rank)
        expected = [distributed_order(world, rank, epoch, True, seed) for epoch in (0, 1, 2, 2)]
        assert got["passes"] == expected, (case, rank)


def test_our_collectives_tensors_are_freed_by_our_thread_not_gloos(ranks):
    """A C++ thread that frees a Python tensor takes the GIL and makes a thread state under
    CPython's runtime lock: a DataLoader fork at that moment hangs its worker on CPython
    <= 3.11.9 (gh-112275; _comm/payloads.py)."""
    for rank, r in enumerate(ranks):
        ours_main, ours_python, ours_native = r["freed_by"]["ours"]
        raw_main, raw_python, raw_native = r["freed_by"]["raw"]
        # Without keep() 23-58% are gloo's; with it none alone, and 1 of ~600 was seen once in
        # the full suite under load (gloo's thread still held the tensor when it was let go).
        assert ours_main + ours_python > 300 and ours_native <= (ours_main + ours_python) // 100, (rank, r["freed_by"])
        # the control: gloo's thread frees some of the script's own (measured: 23-58% of 100;
        # once, under load in the full suite, none of 100: the script tries up to 5 times 100)
        assert raw_native > 0 and (raw_main + raw_python + raw_native) % 100 == 0, (rank, r["freed_by"])


def test_set_epoch_reaches_the_users_sampler(ranks):
    world = len(ranks)
    for p in range(4):
        order = [(i + p) % N for i in range(N)]
        for rank, r in enumerate(ranks):
            one = r["by_epoch"][p]
            if one["join"]:
                assert one["idx"] == order[rank::world]


def test_shuffling_samplers_change_order_per_pass(ranks):
    for case in ("shuffle", "distributed", "batch_sampler", "custom_batches", "subset", "workers"):
        # two passes outside join, two inside: each in another order than the pass before it
        # (not all four distinct: custom_batches shuffles 4 batches, and its epochs 1 and 3 draw the same)
        orders = [tuple(i for r in ranks for i in r[case][p]["idx"]) for p in range(4)]
        assert all(orders[p] != orders[p + 1] for p in range(3)), (case, orders)


def test_ranks_seeded_differently_still_share_one_order(ranks):
    world = len(ranks)
    seen = [r["reseeded"][0]["idx"] for r in ranks]
    assert sorted({i for s in seen for i in s}) == list(range(N))
    # the loader's first pass: DistributedSampler's epoch 0 under rank 0's seed (100), not rank 1's (101)
    assert seen == [distributed_order(world, rank, 0, True, 100) for rank in range(world)]
    assert seen != [distributed_order(world, rank, 0, True, 101) for rank in range(world)]


def test_an_endless_sampler_is_refused_at_setup(ranks):
    for r in ranks:
        assert "Endless has no __len__" in r["endless"]
        assert "use_distributed_sampler=False" in r["endless"]


def test_worker_seeds_differ_per_rank_worker_and_pass(ranks):
    draws = [r["draws"] for r in ranks]
    values = [v for rank in draws for one_pass in rank for item in one_pass for v in item]
    assert len(set(values)) == len(values), "two workers (or ranks, or passes) drew the same numbers"


def test_setup_dataloader_inside_rank_zero_first_is_an_error_not_a_hang(run_python):
    code = (
        "import torch, scopedlite as lite\n"
        "with lite.launch(strategy='ddp', devices=2, accelerator='cpu', timeout=300):\n"
        "    with lite.rank_zero_first():\n"
        "        lite.setup_dataloader(torch.utils.data.DataLoader(range(4)))\n"
    )
    result = run_python("-c", code, timeout=60)
    assert result.returncode == 1, result.explain()
    # before launch(timeout=300) could end it: a hang is killed at 60 s and fails above
    assert "setup_dataloader was called inside lite.rank_zero_first()" in result.stderr


# -- in this process -------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 7, 10])
@pytest.mark.parametrize("shuffle", [False, True])
def test_sharded_sampler_equals_distributed_sampler(world, n, shuffle):
    base = RandomSampler(range(n)) if shuffle else SequentialSampler(range(n))
    for epoch in (0, 3):
        for rank in range(world):
            ours = ShardedSampler(base, rank, world, seed=11)
            ours.set_epoch(epoch)
            assert list(ours) == distributed_order(world, rank, epoch, shuffle, 11, n)
            assert len(ours) == len(list(ours))
            with lite.join():
                assert list(ours) == unpadded(world, rank, epoch, shuffle, 11, n)
                assert len(ours) == len(list(ours))


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_users_distributed_sampler_is_taken_over_not_sharded_twice(drop_last):
    for rank in range(3):
        users = DistributedSampler(range(10), num_replicas=3, rank=rank, shuffle=True, seed=4, drop_last=drop_last)
        ours = ShardedSampler(users, rank, 3, seed=99)  # the sampler's own seed wins
        ours.set_epoch(2)
        assert users.epoch == 2
        assert list(ours) == list(users) and len(ours) == len(users)
        with lite.join():
            assert list(ours) == unpadded(3, rank, 2, True, 4, 10)


def test_a_distributed_sampler_for_another_world_is_refused():
    with pytest.raises(ValueError, match="num_replicas=2, rank=1, but this process is rank 0 of 3"):
        ShardedSampler(DistributedSampler(range(10), num_replicas=2, rank=1), 0, 3)

    class Mine(DistributedSampler):
        pass

    with pytest.raises(TypeError, match="already shards"):
        ShardedSampler(Mine(range(10), num_replicas=3, rank=0), 0, 3)


class _NoLength(Sampler):
    def __iter__(self):
        while True:
            yield 0


def test_a_sampler_without_len_is_refused_not_drained():
    with pytest.raises(TypeError, match="sampler=_NoLength has no __len__.*use_distributed_sampler=False"):
        ShardedSampler(_NoLength(), 0, 2)
    with pytest.raises(TypeError, match="batch_sampler=BatchSampler has no __len__"):
        ShardedBatchSampler(BatchSampler(_NoLength(), 2, False), 0, 2)


def test_drawing_an_order_leaves_the_users_generators_alone():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), np.random.rand(), torch.rand(()).item())
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    with seeded_generators(123):
        inside = (random.random(), np.random.rand(), torch.rand(()).item())
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == expected
    with seeded_generators(123):
        assert (random.random(), np.random.rand(), torch.rand(()).item()) == inside


def test_worker_init_composes_with_the_users_and_pickles():
    called = []
    pickle.dumps(SeedWorker(3, None))

    def draw(rank, worker=1, base=41):
        torch.manual_seed(base + worker)  # what torch does in worker `worker` before init
        SeedWorker(rank, called.append)(worker)
        return (torch.rand(()).item(), random.random(), np.random.rand())

    with seeded_generators(0):
        assert draw(3) == draw(3)  # deterministic per (base seed, worker, rank)
        assert len({draw(3), draw(4), draw(3, worker=2), draw(3, base=42)}) == 4
    assert called == [1, 1, 1, 1, 2, 1]


def test_a_tensor_counts_as_held_by_python_only_while_nothing_else_holds_it():
    tensor = torch.ones(3)
    assert held_by_python_only(tensor)
    view = tensor[:2]  # a view holds its base, as a collective in flight holds its tensors
    assert not held_by_python_only(tensor)
    del view
    assert held_by_python_only(tensor)
