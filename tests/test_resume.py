"""A preempted run resumes exactly where it stopped (issue 17).

The multi-process tests run tests/scripts/resume.py (dropout in the model, ``shuffle=True``,
the loader in the checkpoint) in chains of launches: a launch may finish the previous
launch's interrupted job, run the next job's uninterrupted reference, then be stopped by a
real SIGTERM in that job (or killed with SIGKILL while it writes a checkpoint), and the next
launch restarts from the checkpoint. Final parameters must equal the reference's exactly;
across a change of world size, the interrupted epoch must read every sample exactly once.
The rest (what is saved, bad input) runs in this process.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler, TensorDataset

import scopedlite as lite
from conftest import SCRIPTS, _env
from scopedlite import ShardedSampler
from scopedlite._api.loader_state import Interrupted

sys.path.insert(0, str(SCRIPTS))
from _common import max_diff

pytestmark = pytest.mark.timeout(240)

N, EPOCHS = 33, 3


def _launch(script, strategy, devices, *jobs):
    result = script("resume", strategy, devices, *jobs, timeout=120)
    assert result.returncode == 0, result.explain()
    return result.json()


def _same(resumed_job, reference_job):
    assert len(resumed_job) == len(reference_job), "a rank's result is missing"
    for rank, (resumed, reference) in enumerate(zip(resumed_job, reference_job)):
        assert resumed["params"] is not None, f"rank {rank} did not finish"
        assert max_diff(resumed["params"], reference["params"], f"rank {rank}'s parameters") == 0.0, (
            f"rank {rank}: parameters differ from the uninterrupted run"
        )


def _reads(*jobs):
    """Sample indices read per epoch, over all ranks of the given (partial) runs."""
    per_epoch: dict[str, list[int]] = {}
    for job in jobs:
        for rank in job:
            for epoch, indices in rank["read"].items():
                per_epoch.setdefault(epoch, []).extend(indices)
    return per_epoch


def test_ddp_resumes_exactly_at_the_same_world_size_and_once_across_others(script):
    # a: outside lite.join, 2 workers per rank, stopped in the middle of epoch 1
    first = _launch(script, "ddp", 2, "a,ref,nojoin,2,0", "a,run,nojoin,2,8")
    assert all(rank["params"] is None for rank in first[1])  # it did stop
    # b: inside lite.join, stopped on rank 0's last batch of epoch 0, after rank 1 ran out
    second = _launch(script, "ddp", 2, "a,run,nojoin,2,0", "b,ref,join,0,0", "b,run,join,0,5")
    _same(second[0], first[0])
    # r: inside lite.join, 2 ranks -> 3 -> 2 within epoch 0
    third = _launch(script, "ddp", 2, "b,run,join,0,0", "r,run,join,0,2")
    _same(third[0], second[1])
    fourth = _launch(script, "ddp", 3, "r,run,join,0,3")
    fifth = _launch(script, "ddp", 2, "r,run,join,0,0", "q,run,join,0,3")
    sixth = _launch(script, "single", 1, "q,run,join,0,0")  # 2 ranks -> 1 process

    # every sample of the resumed runs read once: before the stop, and in what was left
    a = _reads(first[1], second[0])
    b = _reads(second[2], third[0])
    for reads in (a, b):
        assert sorted(reads) == ["0", "1", "2"]
    assert all(sorted(b[e]) == list(range(N)) for e in b)  # inside join: each sample once
    r = _reads(third[1], fourth[0], fifth[0])
    assert [len(rank["read"]["0"]) for rank in fourth[0]] == [4, 4, 4]  # 3 ranks took part
    q = _reads(fifth[1], sixth[0])
    assert len(sixth[0][0]["read"]["0"]) == N - 2 * 3 * 4  # what the 2 ranks left, in 1 process
    for reads in (r, q):
        for epoch in ("0", "1", "2"):
            assert sorted(reads[epoch]) == list(range(N)), f"epoch {epoch}: {sorted(reads[epoch])}"


def test_fsdp_resumes_exactly(script):
    first = _launch(script, "fsdp", 2, "f,ref,nojoin,0,0", "f,run,nojoin,0,12")
    assert all(rank["params"] is None for rank in first[1])
    second = _launch(script, "fsdp", 2, "f,run,nojoin,0,0")
    _same(second[0], first[0])


def _order(epoch, seed=7):
    """The shuffled order of an epoch on several ranks: DistributedSampler's (seed + epoch)."""
    return torch.randperm(N, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def _one_then_two_reference(first_epoch):
    """Plain torch: resume.py's model without dropout trained one epoch in one process over
    ``first_epoch`` (its order), then epochs 1 and 2 as 2 ranks in lite.join compute them: per
    step, the running ranks' mean-loss gradients summed and divided by 2."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Identity(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def grads(idx):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        return [p.grad.clone() for p in model.parameters()]

    for i in range(0, N, 4):
        opt.zero_grad()
        grads(first_epoch[i : i + 4])
        opt.step()
    for epoch in (1, 2):
        shares = [_order(epoch)[r::2] for r in range(2)]
        per_rank = [[share[i : i + 4] for i in range(0, len(share), 4)] for share in shares]
        for step in range(max(map(len, per_rank))):
            total = [torch.zeros_like(p) for p in model.parameters()]
            for batches in per_rank:
                if step < len(batches):
                    total = [t + g for t, g in zip(total, grads(batches[step]))]
            for p, t in zip(model.parameters(), total):
                p.grad = t / 2
            opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def test_one_process_resumes_on_two_ranks_from_an_epoch_boundary_and_refuses_mid_epoch(script):
    # o: one process saves at the end of epoch 0; m: one process stopped by SIGTERM after step 3
    single = _launch(script, "single", 1, "o,epoch,join,0,1,nodrop", "m,run,join,0,3,nodrop")
    assert single[0][0]["params"] is None and single[1][0]["params"] is None  # both stopped
    first = single[0][0]["read"]
    assert sorted(first) == ["0"] and sorted(first["0"]) == list(range(N))
    assert len(single[1][0]["read"]["0"]) == 3 * 4
    expected = _one_then_two_reference(first["0"])
    with_deepspeed = ("deepspeed_stage_3",) if importlib.util.find_spec("deepspeed") is not None else ()
    for strategy in ("ddp", "fsdp", *with_deepspeed):
        refused, resumed = _launch(script, strategy, 2, "m,tryload,join,0,0,nodrop", "o,run,join,0,0,nodrop")
        assert len(refused) == len(resumed) == 2
        for rank in refused:  # every rank refuses the 1-process mid-epoch cursor, naming it
            assert rank["params"].startswith(
                "ValueError: This loader was saved in the middle of epoch 0 by a run of 1 process(es) "
                "and is loaded by one of 2"
            ), (strategy, rank["params"])
            assert "save at the end of an epoch" in rank["params"]
        for r, rank in enumerate(resumed):
            # the next epochs on 2 ranks: their shuffled order, every sample once (inside join)
            assert sorted(rank["read"]) == ["1", "2"], (strategy, r)
            for epoch in (1, 2):
                assert rank["read"][str(epoch)] == _order(epoch)[r::2], (strategy, r, epoch)
            worst = max_diff(rank["params"], expected, f"{strategy} rank {r}'s parameters")
            assert worst <= 1e-5, (
                f"{strategy} rank {r}: parameters differ from the one-process reference by {worst:.3g}"
            )


def test_single_resumes_from_the_last_complete_checkpoint_after_sigkill_mid_save(tmp_path, script):
    # k saves after every step, with 16 MB in each checkpoint; it is killed while writing one
    env = _env()
    env["OUT"] = str(tmp_path / "killed.json")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "resume.py"), "single", "1", "k,every,nojoin,0,0"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    checkpoint, partial = tmp_path / "k.ckpt", []
    deadline = time.monotonic() + 60
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if checkpoint.exists():  # one complete checkpoint, then catch the next one mid-write
                partial = [p for p in tmp_path.iterdir() if p.name.startswith(".k.ckpt.")]
                if partial:
                    os.kill(proc.pid, signal.SIGSTOP)  # frozen where it is
                    if partial[0].exists():
                        break  # in the middle of writing it
                    os.kill(proc.pid, signal.SIGCONT)  # it had just finished that one: the next
                    partial = []
            time.sleep(0.001)
    finally:
        proc.kill()
        _, stderr = proc.communicate(timeout=30)
    assert partial, f"the run ended (exit {proc.returncode}) before it could be killed mid-save:\n{stderr}"
    assert partial[0].exists()  # killed in the middle: the temporary file stays, the checkpoint is whole
    # s: one process, 2 workers, SIGTERM in the middle of epoch 0
    second = _launch(script, "single", 1, "k,run,nojoin,0,0", "k,ref,nojoin,0,0", "s,run,nojoin,2,3")
    _same(second[0], second[1])
    third = _launch(script, "single", 1, "s,run,nojoin,2,0")
    _same(third[0], second[1])
    reads = _reads(second[2], third[0])
    assert all(sorted(reads[e]) == list(range(N)) for e in ("0", "1", "2"))


# --- in this process ---------------------------------------------------------------------


def test_interrupted_remaining_deals_out_exactly_the_untaken_positions():
    # 2 ranks, padded: rank 0 read positions 0, 2, 4; rank 1 read 1, 3 of 7 (padded to 8)
    assert Interrupted(2, (3, 2), padded=True, drop_last=False).remaining(7) == [5, 6]
    # padding wraps around: 5 items on 4 ranks pad to 8 (positions 5..7 are items 0..2)
    assert Interrupted(4, (2, 2, 2, 2), padded=True, drop_last=False).remaining(5) == []
    assert Interrupted(4, (1, 1, 1, 1), padded=True, drop_last=False).remaining(5) == [4]
    # inside join ranks may have taken different counts
    assert Interrupted(3, (2, 0, 1), padded=False, drop_last=False).remaining(7) == [1, 4, 5, 6]
    # a resumed pass interrupted again: positions are those of the earlier remainder
    first = Interrupted(2, (1, 1), padded=False, drop_last=False)
    assert Interrupted(3, (1, 0, 0), padded=False, drop_last=False, before=first).remaining(6) == [3, 4, 5]
    state = Interrupted(3, (1, 0, 0), False, False, before=first).to_state()
    assert Interrupted.from_state(state) == Interrupted(3, (1, 0, 0), False, False, before=first)


def _loader(**kwargs):
    data = TensorDataset(torch.arange(10).float())
    return DataLoader(data, batch_size=3, **kwargs)


def test_a_plain_dataloader_in_the_state_is_refused_at_save(tmp_path):
    with pytest.raises(TypeError, match="lite.setup_dataloader"):
        lite.save(tmp_path / "c.pt", {"loader": _loader()})
    assert not (tmp_path / "c.pt").exists()


def test_an_entry_that_is_not_a_loader_state_is_refused_at_load(tmp_path):
    lite.save(tmp_path / "c.pt", {"loader": 3})
    with pytest.raises(ValueError, match="not a loader state"):
        lite.load(tmp_path / "c.pt", {"loader": lite.setup_dataloader(_loader())})


def _values(batches):
    return [batch[0].tolist() for batch in batches]


@pytest.mark.parametrize(
    "workers", [{}, {"num_workers": 2, "persistent_workers": True}], ids=["plain", "persistent_workers"]
)
def test_a_loader_saved_mid_pass_continues_with_the_next_batch_and_random_state(tmp_path, workers):
    # persistent workers draw their base seed once per process: the restart must not draw it again
    lite.seed_everything(1)
    loader = lite.setup_dataloader(_loader(shuffle=True, **workers))
    batches = iter(loader)
    seen = _values([next(batches), next(batches)])
    lite.save(tmp_path / "c.pt", {"loader": loader})
    expected = _values([next(batches)])
    draw = torch.rand(3)  # dropout, say, after the save
    expected += _values(batches) + _values(loader)  # the rest of the pass, then the next pass
    later = torch.rand(3)

    lite.seed_everything(1)
    restarted = lite.setup_dataloader(_loader(shuffle=True, **workers))
    torch.rand(100)  # a restarted process has drawn something else meanwhile
    lite.load(tmp_path / "c.pt", {"loader": restarted})
    batches = iter(restarted)
    resumed = _values([next(batches)])
    assert torch.equal(torch.rand(3), draw)  # the random state of the save, before the next batch
    resumed += _values(batches) + _values(restarted)
    assert resumed == expected
    assert torch.equal(torch.rand(3), later)  # the next pass drew what the uninterrupted one drew
    assert sorted(itertools.chain(*seen, *resumed[:2])) == [float(i) for i in range(10)]  # the pass: each once


@pytest.mark.parametrize("mid_pass", [False, True], ids=["between_passes", "mid_pass"])
def test_an_epoch_the_script_set_still_holds_after_a_load(tmp_path, mid_pass):
    def made():
        sampler = DistributedSampler(range(8), num_replicas=1, rank=0, shuffle=True, seed=3)
        return sampler, lite.setup_dataloader(DataLoader(range(8), batch_size=2, sampler=sampler))

    def order(epoch):  # torch's own, computed here
        sampler = DistributedSampler(range(8), num_replicas=1, rank=0, shuffle=True, seed=3)
        sampler.set_epoch(epoch)
        return list(sampler)

    sampler, loader = made()
    sampler.set_epoch(4)  # once: torch reads epoch 4 in every pass after it
    list(loader)
    batches = iter(loader)
    if mid_pass:
        next(batches)
    lite.save(tmp_path / "c.pt", {"loader": loader})
    _, restarted = made()
    lite.load(tmp_path / "c.pt", {"loader": restarted})
    got = [[int(i) for batch in restarted for i in batch] for _ in range(2)]  # no set_epoch after the load
    assert got == [order(4)[2:] if mid_pass else order(4), order(4)]


def test_a_loader_over_an_iterable_dataset_is_refused_mid_pass_at_save(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(6))

    loader = lite.setup_dataloader(DataLoader(Stream(), batch_size=2))
    lite.save(tmp_path / "between.pt", {"loader": loader})  # between passes: fine
    next(iter(loader))
    with pytest.raises(TypeError, match="IterableDataset"):
        lite.save(tmp_path / "c.pt", {"loader": loader})


def test_a_run_stopped_again_before_its_first_batch_saves_the_loaded_position(tmp_path):
    lite.seed_everything(1)
    loader = lite.setup_dataloader(_loader(shuffle=True))
    batches = iter(loader)
    next(batches)
    lite.save(tmp_path / "c.pt", {"loader": loader})
    expected = _values(batches)

    for _ in range(2):  # restarted, loaded, and stopped again at once
        lite.seed_everything(1)
        restarted = lite.setup_dataloader(_loader(shuffle=True))
        lite.load(tmp_path / "c.pt", {"loader": restarted})
        lite.save(tmp_path / "c.pt", {"loader": restarted})
    lite.seed_everything(1)
    restarted = lite.setup_dataloader(_loader(shuffle=True))
    lite.load(tmp_path / "c.pt", {"loader": restarted})
    assert _values(restarted) == expected


def test_the_rest_of_a_pass_on_another_world_size_is_padded_outside_join_only():
    # 9 items on 2 ranks, padded to 10: each rank took 2, so positions 0..3 are read
    interrupted = Interrupted(2, (2, 2), padded=True, drop_last=False)
    samplers = [ShardedSampler(SequentialSampler(range(9)), rank, 3) for rank in range(3)]
    for sampler in samplers:
        sampler.resumed = interrupted
    shares = [(list(s), len(s)) for s in samplers]
    # what is left, 4..8, padded to 6 by repeating its first item, as DistributedSampler pads
    assert shares == [([4, 7], 2), ([5, 8], 2), ([6, 4], 2)]
    with lite.join():  # inside join: each once
        assert [list(s) for s in samplers] == [[4, 7], [5, 8], [6]]
        assert [len(s) for s in samplers] == [2, 2, 1]
