"""``python -m scopedlite run``: torchrun's command line built from ours, and real runs."""

from __future__ import annotations

import json
import textwrap

import pytest

from conftest import SCRIPTS
from scopedlite._cli import build_parser, main, torchrun_argv

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
    return torchrun_argv(build_parser().parse_args(["run", *args]))


def test_one_node_is_standalone_and_passes_script_arguments_through():
    assert _argv("--devices", "2", "train.py", "--lr", "0.1", "--devices", "9") == [
        "--nproc-per-node", "2", "--standalone", "train.py", "--lr", "0.1", "--devices", "9",
    ]  # fmt: skip


def test_several_nodes_use_static_rendezvous_at_node_0():
    assert _argv("--devices", "4", "--num-nodes", "2", "--node-rank", "1", "--main-address", "n0", "--main-port", "1234", "-m", "pkg.train", "x") == [
        "--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "n0", "--master-port", "1234",
        "--module", "pkg.train", "x",
    ]  # fmt: skip
    assert _argv("--main-port", "1234", "t.py")[-3:] == ["--master-port", "1234", "t.py"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices", "0", "t.py"], "argument --devices: '0' must be at least 1"),
        (["--devices", "two", "t.py"], "argument --devices: 'two' is not an integer"),
        (["--num-nodes", "2", "t.py"], "--num-nodes 2 needs --main-address"),
        (["--num-nodes", "2", "--node-rank", "2", "--main-address", "a", "t.py"], "--node-rank 2 is not valid with --num-nodes 2: use 0..1"),
        (["--main-port", "70000", "t.py"], "'70000' is not a port number"),
        ([], "the following arguments are required: target"),
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
        out = json.loads(open(f"{result._out}.rank{rank}").read())
        assert out == {"sum": 3.0, "world": 2, "argv": ["--lr", "3"]}


@pytest.mark.timeout(90)
def test_runs_a_module(run_python, tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "plain.py").write_text(PLAIN)
    result = run_python("-m", "scopedlite", "run", "--devices", "2", "-m", "pkg.plain", "a", cwd=tmp_path)
    assert result.returncode == 0, result.explain()
    assert json.loads(open(f"{result._out}.rank1").read())["argv"] == ["a"]


@pytest.mark.timeout(90)
def test_a_scopedlite_script_joins_the_world_instead_of_spawning(run_python):
    result = run_python("-m", "scopedlite", "run", "--devices", "2", str(SCRIPTS / "world.py"))
    assert result.returncode == 0, result.explain()
    out = result.json()
    assert out["source"] == "torchelastic" and out["world_size"] == 2 and out["sum"] == 3
    assert [r["children"] for r in out["ranks"]] == [0, 0]  # launch started nobody


@pytest.mark.timeout(90)
def test_a_failing_rank_gives_exit_1_and_names_the_rank(run_python, tmp_path):
    path = tmp_path / "fail.py"
    path.write_text(textwrap.dedent("""
        import os
        if os.environ["RANK"] == "1":
            raise KeyError("boom on one")
    """))
    result = run_python("-m", "scopedlite", "run", "--devices", "2", str(path))
    assert result.returncode == 1, result.explain()
    assert "KeyError: 'boom on one'" in result.stderr
    assert "rank      : 1 (local_rank: 1)" in result.stderr
