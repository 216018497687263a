"""``python -m scopedlite run``: torchrun's command line built from ours, and real runs."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from _common import assert_close
from scopedlite._cli import build_parser, main, parse_args, script_environment, torchrun_argv

PLAIN = """
import json, os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
with open(os.environ["OUT"] + f".rank{dist.get_rank()}", "w") as f:
    json.dump({"sum": t.item(), "world": dist.get_world_size(), "argv": sys.argv[1:]}, f)
dist.destroy_process_group()
"""


def _argv(*args: str) -> list[str]:
    return torchrun_argv(parse_args(["run", *args]))


def test_one_node_is_standalone_and_passes_script_arguments_through():
    assert _argv("--devices", "2", "train.py", "--lr", "0.1", "--devices", "9") == [
        "--nproc-per-node", "2", "--standalone", "train.py", "--lr", "0.1", "--devices", "9",
    ]  # fmt: skip


def test_several_nodes_use_static_rendezvous_at_node_0():
    assert _argv(
        "--devices", "4", "--num-nodes", "2", "--node-rank", "1", "--main-address", "n0", "--main-port", "1234",
        "-m", "pkg.train", "x",
    ) == [
        "--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "n0", "--master-port", "1234",
        "--module", "pkg.train", "x",
    ]  # fmt: skip
    assert _argv("--main-port", "1234", "t.py")[-3:] == ["--master-port", "1234", "t.py"]


def test_torchrun_options_before_the_script_are_passed_on():
    assert _argv("--devices", "2", "--max-restarts=3", "--rdzv-conf=timeout=60", "t.py", "--x=1") == [
        "--nproc-per-node", "2", "--standalone", "--max-restarts=3", "--rdzv-conf=timeout=60", "t.py", "--x=1",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices", "0", "t.py"], "argument --devices: '0' must be at least 1"),
        (["--devices", "two", "t.py"], "argument --devices: 'two' is not an integer"),
        (["--num-nodes", "2", "t.py"], "--num-nodes 2 needs --main-address"),
        (
            ["--num-nodes", "2", "--node-rank", "2", "--main-address", "a", "t.py"],
            "--node-rank 2 is not valid with --num-nodes 2: use 0..1",
        ),
        (["--main-port", "70000", "t.py"], "'70000' is not a port number"),
        ([], "the following arguments are required: target"),
        (["--max-restarts", "3", "t.py"], "'--max-restarts' is not an option of run"),
        (["--nproc_per_node=4", "t.py"], "run sets torchrun's --nproc-per-node itself; use --devices"),
    ],
)
def test_bad_arguments_are_clear_errors(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_subcommand_lists_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        main(["walk"])
    err = capsys.readouterr().err
    assert "invalid choice: 'walk'" in err and "run" in err.split("choose from")[1]


@pytest.mark.timeout(90)
def test_runs_an_unmodified_torch_distributed_script(run_python, tmp_path):
    path = tmp_path / "plain.py"
    path.write_text(PLAIN)
    result = run_python("-m", "scopedlite", "run", "--devices", "2", str(path), "--lr", "3")
    assert result.returncode == 0, result.explain()
    for rank in (0, 1):
        out = json.loads(Path(f"{result._out}.rank{rank}").read_text())
        assert out == {"sum": 3.0, "world": 2, "argv": ["--lr", "3"]}


@pytest.mark.timeout(90)
def test_runs_a_module(run_python, tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "plain.py").write_text(PLAIN)
    result = run_python("-m", "scopedlite", "run", "--devices", "2", "-m", "pkg.plain", "a", cwd=tmp_path)
    assert result.returncode == 0, result.explain()
    assert json.loads(Path(f"{result._out}.rank1").read_text())["argv"] == ["a"]


@pytest.mark.timeout(90)
def test_a_scopedlite_script_joins_the_world_instead_of_spawning(run_python):
    result = run_python("-m", "scopedlite", "run", "--devices", "2", str(SCRIPTS / "world.py"))
    assert result.returncode == 0, result.explain()
    out = result.json()
    assert out["source"] == "torchelastic" and out["world_size"] == 2 and out["sum"] == 3
    assert [r["children"] for r in out["ranks"]] == [0, 0]  # launch started nobody
    # At its exit the process lets go of its run's gloo groups while Python still runs (their
    # worker threads end here): freed by the interpreter's teardown, a worker aborted at times.
    assert out["threads_let_go"] > 0


@pytest.mark.timeout(90)
def test_a_failing_rank_gives_exit_1_and_names_the_rank(run_python, tmp_path):
    path = tmp_path / "fail.py"
    path.write_text(
        textwrap.dedent("""
        import os
        if os.environ["RANK"] == "1":
            raise KeyError("boom on one")
    """)
    )
    result = run_python("-m", "scopedlite", "run", "--devices", "2", str(path))
    assert result.returncode == 1, result.explain()
    assert "KeyError: 'boom on one'" in result.stderr
    assert "rank      : 1 (local_rank: 1)" in result.stderr


def test_launch_options_reach_the_script_only_when_given():
    options = build_parser().parse_args(
        ["run", "--accelerator", "cpu", "--strategy", "fsdp", "--devices", "3", "--precision", "bf16-true", "t.py"]
    )
    assert script_environment(options) == {
        "SCOPEDLITE_CLI_ACCELERATOR": "cpu",
        "SCOPEDLITE_CLI_STRATEGY": "fsdp",
        "SCOPEDLITE_CLI_DEVICES": "3",
        "SCOPEDLITE_CLI_PRECISION": "bf16-true",
    }
    assert torchrun_argv(options)[:2] == ["--nproc-per-node", "3"]
    assert script_environment(build_parser().parse_args(["run", "--devices", "gpu", "t.py"])) == {}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "dpp", "t.py"], "argument --strategy: invalid choice: 'dpp'"),
        (["--precision", "fp8", "t.py"], "argument --precision: invalid choice: 'fp8'"),
        (["--accelerator", "tpu2", "t.py"], "argument --accelerator: invalid choice: 'tpu2'"),
    ],
)
def test_bad_launch_options_fail_before_anything_starts(args, message, capsys):
    with pytest.raises(SystemExit):
        main(["run", *args])
    assert message in capsys.readouterr().err


FABRIC_STYLE = """
import json, os, torch, scopedlite as lite

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
with lite.launch() as run:          # configured by the command line alone
    model, opt = lite.setup(lin := torch.nn.Linear(4, 1), torch.optim.SGD(lin.parameters(), lr=0.1))
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(data, batch_size=8))
    losses = []
    for x, y in loader:
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, y.to(out.dtype))  # float64 under 64-true
        lite.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(lite.all_reduce(loss.detach(), op="mean").item())
    with open(os.environ["OUT"] + f".rank{run.global_rank}", "w") as f:
        json.dump({"world": run.world_size, "strategy": run.strategy.name, "accelerator": run.accelerator,
                   "batches": len(losses), "losses": losses, "dtype": str(lin.weight.dtype),
                   "weight": lin.weight.detach().flatten().tolist() + lin.bias.detach().tolist()}, f)
"""


def _fabric_style_reference() -> tuple[list[float], list[float]]:
    """One process, plain torch, float64: per step the mean loss over both ranks' batches of 8
    (rank r reads rows r, r+2, ...: the sampler's order without shuffle), one SGD step."""
    import torch

    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    lin = torch.nn.Linear(4, 1).double()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    shares = [list(range(64))[r::2] for r in range(2)]
    losses = []
    for step in range(4):
        rows = [share[8 * step : 8 * step + 8] for share in shares]
        per_rank = [torch.nn.functional.mse_loss(lin(x[r].double()), y[r].double()) for r in rows]
        (sum(per_rank) / 2).backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(sum(per_rank).detach()) / 2)
    return losses, lin.weight.detach().flatten().tolist() + lin.bias.detach().tolist()


@pytest.mark.timeout(120)
def test_a_bare_launch_is_configured_by_the_command_line_and_trains_on_two_ranks(run_python, tmp_path):
    path = tmp_path / "train.py"
    path.write_text(FABRIC_STYLE)
    result = run_python(
        "-m",
        "scopedlite",
        "run",
        "--accelerator",
        "cpu",
        "--strategy",
        "ddp",
        "--devices",
        "2",
        "--precision",
        "64-true",
        str(path),
    )
    assert result.returncode == 0, result.explain()
    ranks = [json.loads(Path(f"{result._out}.rank{rank}").read_text()) for rank in (0, 1)]
    losses, weight = _fabric_style_reference()
    for out in ranks:
        assert (out["world"], out["strategy"], out["accelerator"], out["batches"]) == (2, "ddp", "cpu", 4)
        assert out["dtype"] == "torch.float64"  # --precision 64-true reached the bare launch()
        assert_close(out["losses"], losses, 1e-10, "all_reduce(mean) of the losses")
        assert_close(out["weight"], weight, 1e-10, "trained weights")


@pytest.mark.timeout(90)
def test_a_launch_argument_contradicting_the_command_line_stops_the_script_naming_both(run_python, tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import scopedlite as lite\nwith lite.launch(accelerator='cpu', precision='64-true'):\n    pass\n")
    result = run_python("-m", "scopedlite", "run", "--precision", "bf16-true", str(path))
    assert result.returncode == 1, result.explain()
    assert (
        "launch(precision='64-true') in the script contradicts `python -m scopedlite run --precision bf16-true`"
        in result.stderr
    )
