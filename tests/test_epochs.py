"""Epochs per loader, as torch's recipe and Fabric count them, and whole output lines (issue 24).

One launched script (tests/scripts/epochs.py) holds two launch blocks, 2 ranks then 3, and
serves every multi-process check: each rank's order is compared with what plain torch's
``DistributedSampler`` gives that rank with ``set_epoch(epoch)``, computed here. The default
run and the epoch book are checked in this process.
"""

from __future__ import annotations

import contextvars
import io
import json
import re
import subprocess
import sys

import pytest
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler

import scopedlite as lite
from conftest import SCRIPTS, _env
from scopedlite import ShardedBatchSampler, ShardedSampler
from scopedlite._launch.output import HeldLines, RankPrefixed

SEED, LINES = 11, 300  # as in the script
WORLDS = (2, 3)  # the script's two launch blocks


def torch_order(n, world, rank, epoch, seed, shuffle=True):
    """What a torchrun script's ``DistributedSampler`` hands rank ``rank`` in ``epoch``."""
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Both blocks' records and the process's output, from one run of the script."""
    out = tmp_path_factory.mktemp("epochs") / "out.json"
    # Buffered, as Python's output is into a pipe by default: rank 0's 8 KiB blocks used to
    # end mid-line, and another rank's line then joined it.
    env = dict(_env(), OUT=str(out), PYTHONUNBUFFERED="")
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "epochs.py")],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=str(out.parent),
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.timeout(180)
def test_train_and_validation_in_turn_read_what_torchs_distributed_sampler_gives(launched):
    blocks, _ = launched
    for world, ranks in zip(WORLDS, blocks, strict=True):  # the second block counts from 0 again
        assert len(ranks) == world
        for rank, record in enumerate(ranks):
            assert record["train"] == [torch_order(13, world, rank, e, SEED) for e in range(3)], (world, rank)
            assert record["val"] == [torch_order(7, world, rank, e, 3) for e in range(3)], (world, rank)


@pytest.mark.timeout(180)
def test_loaders_set_up_after_others_start_at_epoch_zero(launched):
    blocks, _ = launched
    for world, ranks in zip(WORLDS, blocks, strict=True):
        for rank, record in enumerate(ranks):
            assert record["late"] == [torch_order(9, world, rank, e, 1) for e in range(2)], (world, rank)
            assert record["aware_epochs"] == [0, 1]  # once per pass, as Fabric calls it
            rotated = [[(i + e) % 6 for i in range(6)] for e in range(2)]
            assert record["aware"] == [order[rank::world] for order in rotated]


@pytest.mark.timeout(180)
def test_a_loader_rebuilt_over_the_same_dataset_continues_until_a_reseed(launched):
    blocks, _ = launched
    for world, ranks in zip(WORLDS, blocks, strict=True):
        for rank, record in enumerate(ranks):
            # the training loader made passes 0-2: rebuilt ones go on with 3, 4; re-seeded: 0
            assert record["rebuilt"] == [torch_order(13, world, rank, e, SEED) for e in (3, 4, 0)], (world, rank)


_LINE = re.compile(r"^(?:\[rank (\d)\] )?line (\d) (\d+) (x*) end$")


@pytest.mark.timeout(180)
def test_every_rank_prints_whole_lines_rank_zero_included(launched):
    _, stdout = launched
    seen: dict[tuple[int, int], int] = {}
    for line in stdout.splitlines():
        match = _LINE.match(line)
        assert match, f"a line not printed whole by one rank: {line!r}"
        prefix, rank, i, xs = match.group(1), int(match.group(2)), int(match.group(3)), match.group(4)
        assert prefix == (None if rank == 0 else str(rank)), line
        assert len(xs) == i * 37 % 200, line
        seen[(rank, i)] = seen.get((rank, i), 0) + 1
    # ranks 0 and 1 print in both blocks, rank 2 in the second only
    assert seen == {(rank, i): 2 if rank < 2 else 1 for rank in range(3) for i in range(LINES)}


# -- in this process -------------------------------------------------------------------------


class _Rows(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return i


class _Epochs(Sampler):
    def __init__(self):
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(4))

    def __len__(self):
        return 4


def test_set_epoch_is_passed_on_by_the_sharded_samplers():
    inner = _Epochs()
    ShardedSampler(inner, 0, 2).set_epoch(5)
    batches = BatchSampler(_Epochs(), 2, False)

    class Mine(BatchSampler):
        pass

    custom = Mine(batches.sampler, 2, False)
    ShardedBatchSampler(custom, 0, 2).set_epoch(6)
    assert inner.epochs == [5] and batches.sampler.epochs == [6]


def _isolated(fn):
    """Run ``fn`` in a copy of this context: the seed and the epoch book it sets stay there."""
    return contextvars.copy_context().run(fn)


def _two_passes(dataset):
    epochs = _Epochs()
    loader = lite.setup_dataloader(DataLoader(dataset, sampler=epochs))
    list(loader)
    list(loader)
    return epochs.epochs


def test_the_default_run_used_twice_counts_afresh_each_use():
    def uses():
        data = _Rows()
        assert _two_passes(data) == [0, 1]  # a first use of the default run
        assert _two_passes(data) == [2, 3]  # rebuilt over the same dataset: continues
        with lite.launch(strategy="single", accelerator="cpu"):
            assert _two_passes(data) == [0, 1]  # nothing carries into a launch block
        assert _two_passes(data) == [0, 1]  # nor out of it, into the next use of the default run
        assert _two_passes(_Rows()) == [0, 1]  # another dataset: its own count
        lite.seed_everything(0)
        assert _two_passes(data) == [0, 1]  # a re-seed starts afresh, even with the same seed

    _isolated(uses)


def test_each_loader_counts_its_own_passes_and_the_scripts_epoch_wins():
    def run():
        with lite.launch(strategy="single", accelerator="cpu"):
            first, later = _Epochs(), _Epochs()
            kept = lite.setup_dataloader(DataLoader(range(4), sampler=first, batch_size=2))
            list(kept)
            list(kept)
            other = lite.setup_dataloader(DataLoader(range(4), sampler=later, batch_size=2))  # after kept's passes
            list(other)
            list(kept)
            list(other)
            kept.set_epoch(10)
            list(kept)
            sampler = DistributedSampler(range(8), num_replicas=1, rank=0, shuffle=True)
            resumed = lite.setup_dataloader(DataLoader(range(8), sampler=sampler))
            got = []
            for epoch in (5, 6, None):  # resumed at 5, as a torchrun script does; then held
                if epoch is not None:
                    sampler.set_epoch(epoch)
                got.append([int(i) for i in resumed])
            resumed.set_epoch(1)  # the loader's own: the next pass, then counted again
            got += [[int(i) for i in resumed] for _ in range(2)]
        assert first.epochs == [0, 1, 2, 10] and later.epochs == [0, 1]  # through batch_sampler.sampler
        assert got == [torch_order(8, 1, 0, e, 0) for e in (5, 6, 6, 1, 2)]

    _isolated(run)


def test_datasets_without_weak_references_are_told_apart_and_not_all_kept():
    def run():
        with lite.launch(strategy="single", accelerator="cpu"):
            data = [0, 1, 2, 3]  # a list: held by the book to keep its identity
            assert _two_passes(data) == [0, 1]
            assert _two_passes(data) == [2, 3]
            assert _two_passes([0, 1, 2, 3]) == [0, 1]  # equal, not the same: its own count
            for _ in range(8):  # eight more lists: the first is forgotten, not kept alive
                _two_passes(list(range(4)))
            assert _two_passes(data) == [0, 1]

    _isolated(run)


# -- output ----------------------------------------------------------------------------------


class _Writes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


def test_lines_go_out_whole_in_pieces_of_at_most_pipe_buf_bytes():
    out = _Writes()
    stream = RankPrefixed(out, "")
    stream.write("a" * 3000 + "\n" + "b" * 3000 + "\n" + "c" * 5000 + "\nd")
    assert [len(w) for w in out.writes] == [3001, 3001, 5001]  # "d" waits for its line
    print("x", file=stream)  # print's two writes: one line out
    assert out.writes[-1] == "dx\n"


def test_rank_zero_streams_are_put_back_with_what_they_held(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    held = HeldLines("")
    print("whole", end="")
    assert out.getvalue() == ""
    held.restore()
    assert sys.stdout is out and out.getvalue() == "whole"
