"""Everything a one-process run does, with real tensors and files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import scopedlite as lite


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_collectives_return_their_input_without_torch_distributed():
    import torch.distributed as dist

    t = torch.tensor([1.0, 2.0])
    assert lite.all_reduce(t, op="mean") is t
    assert lite.all_reduce({"a": 3}) == {"a": 3}
    assert lite.all_gather(t).shape == (1, 2)
    assert lite.all_gather(5).tolist() == [5]
    assert lite.broadcast("x") == "x"
    lite.barrier()
    rows = torch.arange(6.0).view(3, 2)
    nest = lite.gather_for_metrics({"rows": rows, "n": 3, "loss": torch.tensor(0.5)})
    assert nest["rows"] is rows  # concatenating one rank's rows: its rows
    assert nest["n"].tolist() == [3] and nest["loss"].tolist() == [0.5]  # one value per rank
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="op='avg'"):
        lite.all_reduce(t, op="avg")
    with pytest.raises(ValueError, match="src=1"):
        lite.broadcast(t, src=1)


def test_setup_returns_model_and_optimizers():
    model = _model()
    opt1 = torch.optim.SGD(model.parameters(), lr=0.1)
    opt2 = torch.optim.Adam(model.parameters())
    assert lite.setup(model) is model
    m, o1, o2 = lite.setup(model, opt1, opt2)
    assert m is model and o1 is opt1 and o2 is opt2
    with pytest.raises(TypeError, match="torch.nn.Module"):
        lite.setup("model")


def test_training_step_matches_plain_torch():
    model, reference = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model, opt = lite.setup(model, opt)
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    for _ in range(3):
        lite.backward(torch.nn.functional.cross_entropy(model(x), y))
        norm = lite.clip_gradients(model, opt, max_norm=0.5)
        opt.step(), opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step(), ref_opt.zero_grad()
        assert torch.allclose(norm, ref_norm)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="exactly one of max_norm or clip_val"):
        lite.clip_gradients(model, opt)
    with pytest.raises(ValueError, match="max_norm=-1"):
        lite.clip_gradients(model, opt, max_norm=-1)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3, float("inf"), "inf"])
def test_clip_gradients_by_any_p_norm_matches_torch(norm_type):
    torch.manual_seed(0)
    model, reference = _model(), _model()
    reference.load_state_dict(model.state_dict())
    model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    lite.backward(torch.nn.functional.cross_entropy(model(x), y))
    norm = lite.clip_gradients(model, opt, max_norm=0.01, norm_type=norm_type)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    p = float(norm_type)
    grads = torch.cat([q.grad.flatten() for q in reference.parameters()])
    assert norm.item() == pytest.approx(
        grads.abs().max().item() if p == float("inf") else grads.abs().pow(p).sum().pow(1 / p).item(), rel=1e-6
    )
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01, norm_type=p)
    assert torch.equal(norm, ref_norm) and norm > 0.01  # it did clip
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_clip_gradients_by_value_with_no_gradient_yet_clips_nothing():
    """Before the first backward (or after `zero_grad()`): nothing to clip, as by norm (torch's
    own clip_grad_value_ raises "Expected !nested_tensorlist[0].empty()" on no gradient), then
    the next gradients are clamped."""
    net, reference = _model(), _model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert lite.clip_gradients(model, opt, clip_val=0.1) is None
    assert all(p.grad is None for p in model.parameters())
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    lite.backward(model(x).pow(2).sum())
    lite.clip_gradients(model, opt, clip_val=0.1)
    reference(x).pow(2).sum().backward()
    torch.nn.utils.clip_grad_value_(reference.parameters(), 0.1)
    grads = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b.grad) for a, b in zip(grads, reference.parameters()))
    values = torch.cat([g.flatten() for g in grads]).abs()
    assert values.max() == torch.tensor(0.1) and values.min() < 0.1  # some clamped, some not


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_norm": 1.0, "norm_type": 0}, ["norm_type=0", "float('inf')"]),
        ({"max_norm": 1.0, "norm_type": "max"}, ["norm_type='max'"]),
        ({"clip_val": 1.0, "norm_type": 1.0}, ["norm_type=1.0", "max_norm="]),
    ],
)
def test_clip_gradients_refuses_a_bad_norm_type(kwargs, words):
    model = _model()
    model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError) as info:
        lite.clip_gradients(model, opt, **kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16-true", torch.bfloat16), ("64-true", torch.float64), ("16-true", torch.float16)]
)
def test_true_precisions_convert_module_and_inputs(precision, dtype):
    with lite.launch(accelerator="cpu", precision=precision):
        model = lite.setup(torch.nn.Linear(3, 1))
        assert model.weight.dtype == dtype
        out = model(torch.randn(2, 3))  # float32 input is cast by the module's hook
        assert out.dtype == dtype
        with lite.sharded_init():
            built = torch.nn.Linear(3, 1)
        assert built.weight.dtype == dtype


def test_sharded_init_empty_skips_initialisation():
    """Initialising a Linear draws from torch's generator; ``empty=True`` draws nothing (and
    leaves real, uninitialised memory), where the default build draws as a plain one does."""
    with lite.launch(accelerator="cpu"):
        torch.manual_seed(0)
        untouched = torch.get_rng_state()
        with lite.sharded_init(empty=True):
            layer = torch.nn.Linear(64, 64)
        assert torch.equal(torch.get_rng_state(), untouched)  # no initialiser ran
        assert layer.weight.device.type == "cpu" and layer.weight.shape == (64, 64)
        with lite.sharded_init():
            initialised = torch.nn.Linear(64, 64)
        assert not torch.equal(torch.get_rng_state(), untouched)  # ... which the check would see
        torch.manual_seed(0)
        normal = torch.nn.Linear(64, 64)
    assert torch.equal(initialised.weight, normal.weight)
    assert not torch.equal(layer.weight, normal.weight)


def test_no_backward_sync_is_a_no_op_on_one_device():
    model = lite.setup(_model())
    with lite.no_backward_sync(model):
        lite.backward(model(torch.randn(2, 4)).sum())
    assert all(p.grad is not None for p in model.parameters())


def test_save_load_round_trip_and_remaining_state(tmp_path):
    model, opt = lite.setup(_model(), torch.optim.Adam(_model().parameters()))
    opt = torch.optim.Adam(model.parameters())
    lite.backward(model(torch.randn(3, 4)).sum())
    opt.step()
    path = tmp_path / "ckpt.pt"
    lite.save(path, {"model": model, "opt": opt, "step": 7, "extra": [1, 2]})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left

    fresh = _model()
    fresh_opt = torch.optim.Adam(fresh.parameters())
    state = {"model": fresh, "opt": fresh_opt, "step": 0}
    rest = lite.load(path, state)
    assert rest == {"extra": [1, 2]} and state["step"] == 7
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert lite.load(path)["step"] == 7
    with pytest.raises(KeyError, match="missing"):
        lite.load(path, {"missing": 1})


class Custom:
    """A class torch's weights_only unpickler refuses."""


def test_load_rejects_truncated_foreign_and_unsafe_files(tmp_path):
    good = tmp_path / "good.pt"
    lite.save(good, {"w": torch.ones(100)})
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:200])
    with pytest.raises(lite.CheckpointError, match="not a complete torch checkpoint"):
        lite.load(truncated)
    foreign = tmp_path / "foreign.pt"
    foreign.write_text("hello, not a checkpoint")
    with pytest.raises(lite.CheckpointError):
        lite.load(foreign)
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"obj": Custom()}, unsafe)
    with pytest.raises(lite.CheckpointError, match="weights_only=False"):
        lite.load(unsafe)
    assert isinstance(lite.load(unsafe, weights_only=False)["obj"], Custom)


def test_a_crash_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    lite.save(path, {"version": 1, "w": torch.zeros(10)})
    code = (
        "import os, signal, torch, scopedlite as lite\n"
        "class Bomb:\n"
        "    def __reduce__(self):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        f"lite.save({str(path)!r}, {{'version': 2, 'w': torch.ones(10), 'bomb': Bomb()}})\n"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)
    assert proc.returncode == -9
    assert lite.load(path)["version"] == 1


def test_ctrl_c_in_the_middle_of_a_save_shows_the_interrupt_and_keeps_the_previous_checkpoint(tmp_path):
    """A real SIGINT to the process while it writes 200 MB (sent by a thread once the
    temporary file holds 1 MB): torch's zip writer would turn the KeyboardInterrupt raised in
    its write into ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``."""
    path = tmp_path / "ckpt.pt"
    code = textwrap.dedent(
        f"""
        import os, signal, threading, time, torch, scopedlite as lite
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (CI may ignore SIGINT)
        folder = {str(tmp_path)!r}
        lite.save(os.path.join(folder, "ckpt.pt"), {{"version": 1, "w": torch.zeros(10)}})

        def interrupt():
            while True:
                partial = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".tmp")]
                if partial and os.path.getsize(partial[0]) >= 2**20:
                    os.kill(os.getpid(), signal.SIGINT)
                    return
                time.sleep(0.001)

        threading.Thread(target=interrupt, daemon=True).start()
        lite.save(os.path.join(folder, "ckpt.pt"), {{"version": 2, "w": torch.empty(50_000_000)}})
        print("the save finished before the interrupt")
        """
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "the save finished" not in proc.stdout, "the interrupt came too late to test anything"
    assert proc.returncode != 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "KeyboardInterrupt", proc.stderr
    assert "inline_container" not in proc.stderr and "write_atomically" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no temporary file left
    assert lite.load(path)["version"] == 1


def test_seed_everything_and_validation():
    assert lite.seed_everything(5) == 5
    a = torch.rand(3)
    lite.seed_everything(5)
    assert torch.equal(a, torch.rand(3))
    with pytest.raises(ValueError, match="seed=-1"):
        lite.seed_everything(-1)
    lite.seed_everything(0)


def test_setup_dataloader_moves_batches_and_keeps_the_loader_on_one_process():
    data = TensorDataset(torch.arange(10.0).unsqueeze(1))
    loader = lite.setup_dataloader(DataLoader(data, batch_size=4))
    assert len(loader) == 3 and loader.batch_size == 4
    assert [b[0].flatten().tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    a, b = lite.setup_dataloader(DataLoader(data), DataLoader(data))
    assert len(a) == len(b) == 10
    with pytest.raises(TypeError, match="at least one"):
        lite.setup_dataloader()


def test_print_prints_its_arguments_on_one_process(capsys):
    """(Rank 0 only among several: test_launch.py's "printed once", test_output.py.)"""
    lite.print("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"


def test_to_device():
    # The run's device is the CPU here (a move between devices needs a GPU: not tested here);
    # checked are the structure, the values and what is not a tensor, at every level.
    x = torch.arange(3.0)
    out = lite.to_device({"a": [x, (x * 2,)], "b": 2, "c": "text"})
    device = lite.current().device
    assert sorted(out) == ["a", "b", "c"] and len(out["a"]) == 2 and isinstance(out["a"][1], tuple)
    assert out["a"][0].device == device and out["a"][1][0].device == device
    assert out["a"][0].tolist() == [0.0, 1.0, 2.0] and out["a"][1][0].tolist() == [0.0, 2.0, 4.0]
    assert out["b"] == 2 and out["c"] == "text"
    assert next(lite.to_device(torch.nn.Linear(2, 1)).parameters()).device == device


def test_join_is_a_no_op_on_one_device():
    model = lite.setup(_model())
    with lite.join(model):
        assert lite.all_reduce(2.0, op="mean") == 2.0
    with pytest.raises(TypeError, match="divide_by_initial_world_size"):
        lite.join(model, divide_by_initial_world_size="yes")
    with lite.join(), pytest.raises(lite.ScopeError, match="do not nest"), lite.join():
        pass


def test_a_second_setup_of_the_same_module_in_one_run_is_refused():
    model = _model()
    with lite.launch(devices=1, accelerator="cpu"):
        prepared = lite.setup(model)
        with pytest.raises(
            RuntimeError, match=r"already set up in this run \(at .*test_single.py:\d+\).*model = lite.setup\(model\)"
        ):
            lite.setup(model)
        with pytest.raises(RuntimeError, match="already set up in this run"):
            lite.setup(prepared, torch.optim.SGD(model.parameters(), lr=0.1))
    with lite.launch(devices=1, accelerator="cpu"):  # a new run may set it up again
        lite.setup(model)
    lite.setup(model)  # outside any launch (a notebook cell run twice): harmless, allowed
    lite.setup(model)


def test_a_background_save_holds_the_state_at_the_call(tmp_path):
    """``lite.save(path, state, blocking=False)`` on one process, then two Adam steps, a new
    learning rate and an entry changed in place before anything waits: the checkpoint holds
    the state at the call (plain torch's values, copied then). The next save and a load wait
    for the write; the write itself is atomic (only the checkpoint is left in the folder)."""
    model, opt = lite.setup(_model(), torch.optim.Adam(_model().parameters(), lr=0.01))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step() -> None:
        lite.backward(model(torch.randn(3, 4)).square().mean())
        opt.step()
        opt.zero_grad()

    step()
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    counts = torch.arange(3.0)
    path = tmp_path / "ckpt.pt"
    handle = lite.save(path, {"model": model, "opt": opt, "counts": counts}, blocking=False)
    assert isinstance(handle, lite.SaveHandle) and handle.path == path
    step()
    step()
    opt.param_groups[0]["lr"] = 0.5
    counts += 10
    fresh = _model()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    state = {"model": fresh, "opt": fresh_opt, "counts": None}
    assert lite.load(path, state) == {}  # waits for the write first
    assert handle.done() and repr(handle) == f"<lite.SaveHandle {str(path)!r} written>"
    handle.wait()  # waited already: returns at once
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected_model[key]), key
    for p, moment in zip(fresh.parameters(), expected_moments):
        assert torch.equal(fresh_opt.state[p]["exp_avg"], moment)
        assert fresh_opt.state[p]["step"].item() == 1
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    assert state["counts"].tolist() == [0.0, 1.0, 2.0]
    second = lite.save(path, {"model": model}, blocking=False)
    lite.save(tmp_path / "other.pt", {"step": 1})  # waits for the one in flight
    assert second.done()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "other.pt"]
    with pytest.raises(TypeError, match="blocking must be True or False"):
        lite.save(path, {}, blocking=0)


def test_a_background_write_that_fails_is_raised_at_wait_at_the_next_save_and_at_the_block_end(tmp_path):
    """torch.save fails in the writing thread (an entry it cannot pickle): the error is raised,
    as a CheckpointError naming the path, rank 0 and torch's error, at ``handle.wait()``, at
    the next save (which then writes nothing), and by the launch block's ``with`` statement;
    the previous checkpoint stays, and no temporary file is left."""
    path = tmp_path / "ckpt.pt"
    lite.save(path, {"version": 1})
    failing = {"version": 2, "hook": lambda: None}
    handle = lite.save(path, failing, blocking=False)
    with pytest.raises(lite.CheckpointError, match="failed in the background on rank 0") as raised:
        handle.wait()
    assert "Can't pickle" in str(raised.value) and str(path) in str(raised.value)
    assert raised.value.__cause__ is not None
    with pytest.raises(lite.CheckpointError):
        handle.wait()  # the same outcome again
    with lite.launch(strategy="single"):
        lite.save(path, failing, blocking=False)
        with pytest.raises(lite.CheckpointError, match="failed in the background"):
            lite.save(tmp_path / "next.pt", {"version": 3})
    with pytest.raises(lite.CheckpointError, match="failed in the background"), lite.launch(strategy="single"):
        lite.save(path, failing, blocking=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert lite.load(path)["version"] == 1


@pytest.mark.parametrize("mode", ["kill", "interrupt"])
def test_a_process_ended_during_a_background_write_keeps_the_previous_checkpoint(tmp_path, mode):
    """The writing process killed (SIGKILL while it trains on), or Ctrl-C while it waits for
    the handle, once the temporary file holds 1 MB of the 128 MB: the path still holds the
    previous checkpoint; after Ctrl-C the KeyboardInterrupt is raised and the abandoned write
    removed its temporary file."""
    from conftest import SCRIPTS, run_warm

    result = run_warm(SCRIPTS / "background_save.py", tmp_path, mode, tmp_path=tmp_path, timeout=120)
    assert "the save finished first" not in result.stdout, "the signal came too late to test anything"
    assert lite.load(tmp_path / "ckpt.pt")["version"] == 1
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("out-"))
    if mode == "kill":
        assert result.returncode == -9, result.stderr
        assert "ckpt.pt" in names and all(n.endswith(".tmp") for n in names if n != "ckpt.pt"), names
    else:
        assert result.returncode != 0 and result.stderr.strip().splitlines()[-1] == "KeyboardInterrupt", result.stderr
        assert names == ["ckpt.pt"]
