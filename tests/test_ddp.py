"""DDP on real gloo processes trains to the same parameters as one process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from _common import (
    assert_close,
    check_save_on_some_ranks,
    check_scheduler_on_some_ranks,
    make_model,
    reference_training,
    torch_join_batch,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("devices", [2, 3])
def test_ddp_matches_single_process_over_the_global_batch(script, devices):
    n, batch = 12 * devices, 4
    result = script("train", "ddp", devices, n, batch)
    assert result.returncode == 0, result.explain()
    out = result.json()
    reference = reference_training(n, devices, batch)
    expected = [p.detach().flatten().tolist() for p in reference.parameters()]
    assert_close(out["params"], expected, 1e-5, "parameters")
    # parameters identical on every rank
    first = out["first_param_on_each_rank"]
    assert all(row == first[0] for row in first)
    _check_threads(out, devices)


def _check_threads(out, devices):
    """SPEC 4: with N local processes on C cores, each uses max(1, C // N) torch threads unless
    OMP_NUM_THREADS is set; the main process gets its own count back after the block."""
    if out["omp_num_threads"] is None:
        assert out["threads"] == [max(1, out["cores"] // devices)] * devices, (out["threads"], out["cores"])
    else:
        assert out["threads"][0] == out["threads_before"], "OMP_NUM_THREADS is the user's: left as it was"
    assert out["threads_after"] == out["threads_before"]


def test_single_strategy_gives_the_single_process_result(script):
    n, batch = 24, 8
    result = script("train", "single", 1, n, batch)
    assert result.returncode == 0, result.explain()
    reference = reference_training(n, 1, batch)
    expected = [p.detach().flatten().tolist() for p in reference.parameters()]
    assert_close(result.json()["params"], expected, 1e-5, "parameters")


def test_accumulation_clipping_checkpoint_and_rank_zero_first(script, tmp_path):
    result = script("ddp_features", tmp_path / "ckpt.pt")
    assert result.returncode == 0, result.explain()
    out = result.json()

    # one process: the mean-loss gradient over all 16 rows, one SGD step
    from _common import make_data, make_model

    model = make_model()
    x, y = make_data(16).tensors
    torch.nn.functional.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    expected = [p.detach().flatten().tolist() for p in model.parameters()]
    assert_close(out["params"], expected, 1e-5, "parameters")
    assert out["norm"] == pytest.approx(norm.item(), rel=1e-5)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])  # of the update above, before it
    assert out["norm_inf"] == pytest.approx(grads.abs().max().item(), rel=1e-5)
    assert out["norm_1"] == pytest.approx(grads.abs().sum().item(), rel=1e-5)
    assert out["dtype"] == "torch.bfloat16"
    assert out["restored"] and out["restored_all"] == 1 and out["rest"] == {"step": 1}
    for rank, error in enumerate(out["unused_errors"]):  # on every rank, in its second forward
        assert error is not None, f"rank {rank} raised nothing"
        message = error["message"]
        # torch's indices 4 5 (the frozen layer is not counted), as names in the user's module
        assert (
            f"parameters unused.weight, unused.bias received no gradient in the last backward on rank {rank}" in message
        )
        assert "`lite.launch(strategy=lite.DDPStrategy(find_unused_parameters=True), ...)`" in message
        assert "`model.unused.requires_grad_(False)`" in message
        assert f"Parameter indices which did not receive grad for rank {rank}: 4 5" in error["cause"]
    # rank 0 entered first and found nothing; rank 1 entered after it left, and found its file
    assert out["rank_zero_first"] == [{"first": True, "found": False}, {"first": False, "found": True}]


def test_lite_save_or_load_on_rank_zero_alone_is_refused_at_once(script):
    """`if run.is_global_zero: lite.save(path, state)` (and lite.load), a torchrun habit: every
    rank checks the path together, so rank 0's check met rank 1's next backward, and gloo
    aborted the process on the mismatched sizes (under NCCL: a hang). Now rank 0 is refused at
    once, before any collective, naming the fix; it catches it and the ranks stay in step
    (training equals plain torch's), and a save and load on every rank round-trip."""
    result = script("save_on_some_ranks", "ddp", timeout=100)
    assert result.returncode == 0, result.explain()
    check_save_on_some_ranks(result.json())


@pytest.mark.parametrize("asymmetry", ["scheduler", "step", "clip"])
def test_a_scheduler_or_step_on_one_rank_is_refused_at_the_next_backward(script, asymmetry):
    """`if rank == 0: scheduler.step()` (as after an evaluation on rank 0), one more
    `optimizer.step()` on rank 1, or `lite.clip_gradients` on rank 0 alone (each rank clips its
    own replica's gradients: no collective to miss): each rank would step its replica its own
    way and the replicas would part without a word. The all-reduce that compares the forward counts carries a digest
    of the optimizers that stepped since the last backward (how often, and their
    hyperparameters as they are now): the next backward raises on every rank, naming what its
    optimizer did and the fix; the next collective pairs. Before it, a correct script (a model
    dropped while rank 1 still holds it, a join block over uneven batches, the scheduler on
    every rank) is not refused and equals plain torch."""
    result = script("scheduler_on_some_ranks", "ddp", asymmetry, timeout=100)
    assert result.returncode == 0, result.explain()
    check_scheduler_on_some_ranks(result.json(), asymmetry)


def test_a_step_skipped_on_one_rank_is_refused_on_every_rank_at_once(script):
    """Outside lite.join, rank 1 skips a step (`if not torch.isfinite(loss): continue`): both
    ranks raise at the next backward each runs (rank 0's 4th, rank 1's 5th), before any
    optimizer step averages gradients of different steps (before: silently averaged, then
    gloo aborted the process). A user's communication hook still reduces the buckets, with
    the values of plain torch; rank 0 evaluating alone under no_grad and an uneven join block
    refuse nothing. A join block that every rank leaves by a refusal (caught) restarts the
    counts too (before: the check stayed off, and the skip went unrefused)."""
    result = script("skipped_step")
    assert result.returncode == 0, result.explain()
    seen = result.json()
    for rank, out in enumerate(seen):
        assert out["hook_calls"] >= 4, out["hook_calls"]  # the user's hook reduced every step
        assert_close(out["hooked"], out["reference"], 1e-5, f"rank {rank} params")
        assert out["after_join"]
        # refused inside a join block on every rank, caught: the check of outside it goes on
        assert "announced different steps" in out["join_refused"], out["join_refused"]
        assert "different numbers of training forwards" in out["error"], out["error"]
        assert "lite.all_reduce(float(not torch.isfinite(loss))" in out["error"], out["error"]
        assert out["after"] == 3.0  # the next collective pairs
    assert [out["at"] for out in seen] == [3, 4]


def test_torchs_own_join_around_a_set_up_model_trains_as_plain_torch(script):
    """torch's ``Join([model])`` (a torchrun script that keeps it) over uneven batches: rank 1
    shadows rank 0's last two backwards. Before, the ranks' comparison of their forwards
    refused rank 1's shadow all-reduce; now it pauses inside the block. The parameters equal
    plain torch's (each step's gradient summed over the ranks that had a batch, divided by 2,
    as torch's Join divides by the initial world size), on both ranks, after the block and
    after an even step; a step skipped on one rank after the block is still refused."""
    result = script("torch_join")
    assert result.returncode == 0, result.explain()
    seen = result.json()
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(batches):
        opt.zero_grad()
        for x in batches:
            (net(x).pow(2).mean() / 2).backward()
        opt.step()

    for i in range(3):
        step([torch_join_batch(r, i) for r in range(2) if i < (3, 1)[r]])
    after_join = [p.detach().flatten().tolist() for p in net.parameters()]
    step([torch_join_batch(r, 5) for r in range(2)])
    after_even = [p.detach().flatten().tolist() for p in net.parameters()]
    for rank, out in enumerate(seen):
        assert_close(out["after_join"], after_join, 1e-6, f"rank {rank} after the block")
        assert_close(out["after_even"], after_even, 1e-6, f"rank {rank} after an even step")
        assert "different numbers of training forwards" in out["error"], out["error"]
