"""Launching from a script, -m and -c (whatever the script did to sys.argv); code after the block
runs once; failures end fast."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import textwrap
from pathlib import Path

import psutil
import pytest
import torch

pytestmark = pytest.mark.timeout(90)

# Each form of command line, with sys.argv edited before launch and a chdir before it too: a
# worker must be started with the command line the user typed, from the directory it was typed
# in. timeout=0.5 bounds the collective, not the start-up.
BODY = """
import json, os, sys
original = list(sys.argv)
edit = os.environ["EDIT"]
if edit == "pop":
    sys.argv.pop()  # a script consuming its own last argument
elif edit == "replace":
    sys.argv[:] = ["replaced", "--lr", "9"]
elif edit == "empty":
    sys.argv.clear()
elif edit == "rebind":
    sys.argv = sys.argv[:1]
import scopedlite as lite
os.makedirs("out", exist_ok=True)
os.chdir("out")  # before launch: a worker re-runs this line from the directory we started in
with lite.launch(strategy="ddp", devices=2, accelerator="cpu", timeout=0.5) as run:
    total = lite.all_reduce(run.global_rank + 1)
    facts = {"argv": original, "file": globals().get("__file__"), "cwd": os.getcwd(), "sum": total,
             "dev_mode": sys.flags.dev_mode, "orig_argv": sys.orig_argv}
    json.dump(facts, open(os.environ["OUT"] + f".rank{run.global_rank}", "w"))
with open(os.environ["OUT"] + ".after", "a") as f:
    f.write(f"{os.getpid()}\\n")
"""

FORMS = {
    # name: (command line after `python`, directory it is typed in, arguments, edit)
    "options and a relative script": (["-u", "-X", "dev", "pkg/train_argv.py"], "", ["first", "second", "fast"], "pop"),
    "module": (["-m", "pkg.train_argv"], "", ["a", "--flag=1"], "replace"),
    "command": (["-c", BODY], "", ["first", "config.py"], "empty"),
    "symlink by a relative path with ..": (["-Wignore", "--", "../link.py"], "sub", ["only"], "rebind"),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_workers_get_the_command_line_as_typed_whatever_the_script_did_to_sys_argv(run_python, tmp_path, form):
    """Every rank starts with rank 0's original sys.argv (the script's path made absolute), its
    interpreter options, the same __file__, and the directory the command was typed in."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train_argv.py").write_text(BODY)
    (tmp_path / "link.py").symlink_to("pkg/train_argv.py")
    (tmp_path / "sub").mkdir()
    before, where, args, edit = FORMS[form]
    start = tmp_path / where
    result = run_python(*before, *args, cwd=start, env={"EDIT": edit})
    assert result.returncode == 0, result.explain()
    outs = [json.loads(Path(f"{result._out}.rank{r}").read_text()) for r in (0, 1)]
    for out in outs:
        assert out["argv"][1:] == args
        assert os.path.join(start, out["argv"][0]) == os.path.join(start, outs[0]["argv"][0])
        assert out["file"] == outs[0]["file"]
        assert out["cwd"] == str(start / "out")  # not out/out on rank 1
        assert out["sum"] == 3
        assert out["dev_mode"] == ("dev" in before)
    typed, started = outs[0]["orig_argv"][1:], outs[1]["orig_argv"][1:]
    assert typed == [*before, *args]
    assert len(started) == len(typed) and all(a == b or os.path.join(start, a) == b for a, b in zip(typed, started))
    if form.startswith("symlink"):
        assert outs[1]["argv"][0] == str(tmp_path / "sub" / ".." / "link.py")
    with open(f"{result._out}.after") as f:
        assert len(f.read().split()) == 1, "code after the block ran more than once"


RUNNER = """
import runpy, sys
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

RUN_BY_A_RUNNER = """
import scopedlite as lite
try:
    with lite.launch(strategy="ddp", devices=2, accelerator="cpu"):
        pass
except ValueError as e:
    print("REFUSED", e)
with lite.launch(strategy="ddp", devices=2, accelerator="cpu", launcher="fork") as run:
    print("FORKED", lite.all_reduce(run.global_rank + 1))
"""


def test_a_program_started_through_a_runner_is_refused_and_fork_is_the_way_out(run_python, tmp_path):
    (tmp_path / "runner.py").write_text(RUNNER)
    (tmp_path / "train.py").write_text(RUN_BY_A_RUNNER)
    result = run_python("runner.py", "train.py", cwd=tmp_path)
    assert result.returncode == 0, result.explain()
    refusal = next(line for line in result.stdout.splitlines() if line.startswith("REFUSED"))
    assert "runs runner.py, but the program Python runs as __main__ is train.py" in refusal
    assert "launcher='fork'" in refusal and "torchrun" in refusal
    assert result.stdout.count("FORKED 3") == 2


@pytest.mark.parametrize(
    ("argv", "form", "value", "index"),
    [
        (["py", "x.py", "a"], "script", "x.py", 1),
        (["py", "-u", "-X", "dev", "x.py", "-m"], "script", "x.py", 4),
        (["py", "-uX", "dev", "-Wd", "x.py"], "script", "x.py", 4),
        (["py", "-Xdev", "-W", "ignore", "-OO", "--", "-x.py", "-c"], "script", "-x.py", 6),
        (["py", "--check-hash-based-pycs", "never", "x.py"], "script", "x.py", 3),
        (["py", "-m", "pkg.mod", "x.py"], "module", "pkg.mod", -1),
        (["py", "-Bmpkg", "-c"], "module", "pkg", -1),
        (["py", "-uc", "print(1)", "x.py"], "command", "print(1)", -1),
        (["py", "-", "-c"], "stdin", "", -1),
        (["py", "-u"], "interactive", "", -1),
    ],
)
def test_the_command_line_is_read_by_the_interpreters_grammar(argv, form, value, index):
    from scopedlite._hardware.program import Typed, parse_command_line

    assert parse_command_line(argv) == Typed(form, value, index)


def _rebuild(**overrides):
    from scopedlite._hardware.program import rebuild

    facts = {
        "orig_argv": ["py", "x.py"],
        "executable": "/bin/python",
        "main_file": "/w/x.py",
        "main_spec": None,
        "path0": "/w",
        "imported_in": "/w",
    }
    return rebuild(**{**facts, **overrides})


def test_a_command_line_that_cannot_start_the_program_again_is_refused_naming_why():
    assert _rebuild().command == ("/bin/python", "/w/x.py")
    assert _rebuild(orig_argv=["py", "-u", "../x.py"], main_file="/w/sub/../x.py").directory == "/w/sub"
    for facts, why in [
        ({"orig_argv": []}, "sys.orig_argv is empty"),
        ({"executable": ""}, "sys.executable is empty"),
        ({"orig_argv": ["py", "-Z", "x.py"]}, "-Z"),
        ({"orig_argv": ["py", "runner.py", "x.py"]}, "runs runner.py"),
        ({"orig_argv": ["py", "-m", "pdb", "x.py"]}, "runs -m pdb"),
        ({"orig_argv": ["py", "-c", "import runpy"]}, "runs -c"),
        ({"main_file": None}, "runs x.py"),
    ]:
        program = _rebuild(**facts)
        assert program.command is None and why in program.problem, (facts, program)
        assert "launcher='fork'" in program.problem and "torchrun" in program.problem


@pytest.mark.parametrize(("devices", "strategy"), [(2, "ddp"), (3, "ddp"), (2, "fsdp")])
def test_collectives(script, devices, strategy):
    result = script("collectives", devices, strategy)
    assert result.returncode == 0, result.explain()
    assert result.stdout.count("printed once") == 1
    ranks = list(range(devices))
    total = sum(r + 1 for r in ranks)
    for out in result.json():
        assert out["sum"] == [total, -total]
        assert out["mean"] == pytest.approx([total / devices, -total / devices])
        assert out["max"] == [devices, -1] and out["min"] == [1, -devices]
        assert out["int_sum"] == total and isinstance(out["int_sum"], int)
        assert out["int_mean"] == pytest.approx(total / devices)
        assert out["float_max"] == (devices - 1) / 2
        assert out["bool_max"] is True
        assert out["nested"] == {"a": [sum(ranks), float(sum(ranks))], "b": [devices, 2.5 * devices]}
        assert out["gather"] == [[r, 10 * r] for r in ranks]
        assert out["gather_number"] == ranks
        assert out["broadcast_tensor"] == [0, 7, 14]
        assert out["broadcast_obj"] == {"from": devices - 1, "list": [devices - 1] * 2}
        assert out["world"] == [devices, devices, 0]
    # rank_zero_first: rank 0 had left its block before any other rank entered
    assert [out["rank0_done_before"] for out in result.json()] == [r != 0 for r in ranks]
    assert [out["input_unchanged"] for out in result.json()] == [[r + 1.0, -(r + 1.0)] for r in ranks]
    _assert_mismatches_refused_on_every_rank([out["mismatches"] for out in result.json()], devices)
    _assert_gathered_for_metrics([out["metrics"] for out in result.json()], devices)
    _assert_gathered_over_a_loader([out["loader"] for out in result.json()], devices)
    _assert_padded_passes_gathered_once([out["padded_passes"] for out in result.json()], devices)


def _assert_mismatches_refused_on_every_rank(seen, devices):
    """Each case raised on every rank, naming every rank's shape (and the run went on)."""
    ranks = range(devices)
    shown = {
        "all_gather": ("ShapeMismatchError", [f"rank {r}: lite.all_gather of float32[{5 - 2 * r}, 4]" for r in ranks]),
        "all_reduce": (
            "ShapeMismatchError",
            [f"rank {r}: lite.all_reduce(op='max') of float32[{5 - 2 * r}, 4]" for r in ranks],
        ),
        "nest": (
            "ShapeMismatchError",
            [
                f"rank {r}: lite.all_reduce(op='sum') of {{'loss': float32[], 'rows': [float32[{5 - 2 * r}, 4]]}}"
                for r in ranks
            ],
        ),
        "dtype": (
            "ShapeMismatchError",
            [f"rank {r}: lite.all_reduce(op='sum') of {'float64' if r == 0 else 'int64'}[2]" for r in ranks],
        ),
        "number": (
            "ShapeMismatchError",
            [f"rank {r}: lite.all_gather of {'int64' if r == 0 else 'float64'}[]" for r in ranks],
        ),
        "keys": (
            "ShapeMismatchError",
            [
                "rank 0: lite.all_reduce(op='sum') of {'a': float32[2], 'b': float32[2]}",
                "rank 1: lite.all_reduce(op='sum') of {'b': float32[2], 'a': float32[2]}",
            ],
        ),
        "op": (
            "CollectiveMismatchError",
            ["rank 0: lite.all_reduce(op='sum') of float32[2]", "rank 1: lite.all_reduce(op='max') of float32[2]"],
        ),
        "trailing": (
            "ShapeMismatchError",
            [f"rank {r}: lite.gather_for_metrics of float32[2, {3 + r}]" for r in ranks],
        ),
        "metrics_dtype": (
            "ShapeMismatchError",
            [f"rank {r}: lite.gather_for_metrics of {'int64' if r == 0 else 'float32'}[2]" for r in ranks],
        ),
    }
    fixes = {
        "all_gather": "lite.gather_for_metrics(x)",
        "dtype": "x.float()",
        "keys": "same keys",
        "trailing": "first dimension",
    }
    for rank, cases in enumerate(seen):
        assert sorted(cases) == sorted([*shown, "after"])
        for case, (kind, lines) in shown.items():
            assert cases[case] is not None, f"rank {rank}: {case} raised nothing"
            name, message, is_mismatch, is_value_error = cases[case]
            assert name == kind and is_mismatch, (rank, case, message)
            assert is_value_error == (kind == "ShapeMismatchError"), (rank, case)
            for line in lines:
                assert line in message, (rank, case, line, message)
            assert fixes.get(case, "") in message, (rank, case, message)
        assert cases["after"] == [sum(r + 1.0 for r in ranks)]  # no abort: the group still works


def _rows(r):
    i = torch.arange(5 - 2 * r, dtype=torch.float64)
    return torch.stack([10 * r + i, -i, i / 2], dim=1)


def _assert_gathered_for_metrics(seen, devices):
    """Per-rank rows of 5, 3, 1 (and nests, numbers, empty ones) are concatenated in rank order."""
    ranks = range(devices)
    rows = torch.cat([_rows(r) for r in ranks])
    expected = {
        "rows": [rows.tolist(), "torch.float64", list(rows.shape)],
        "nest": {
            "rows": [rows.tolist(), "torch.float64", list(rows.shape)],
            "ids": [rows[:, 0].long().tolist(), "torch.int64", [len(rows)]],
            "count": [[5 - 2 * r for r in ranks], "torch.int64", [devices]],
        },
        "scalar": [[r / 2 for r in ranks], "torch.float64", [devices]],
        "zero_d": [list(ranks), "torch.int32", [devices]],
        "empty_on_last": [
            rows[: -len(_rows(devices - 1))].tolist(),
            "torch.float64",
            [len(rows) - len(_rows(devices - 1)), 3],
        ],
        "none_anywhere": [[], "torch.float64", [0, 3]],
        "big": [(rows[:, :2] + 19).tolist(), "torch.float64", [len(rows), 2]],
    }
    for out in seen:
        assert out == expected


def _assert_gathered_over_a_loader(seen, devices):
    """Over a set-up loader of N samples, batch 2: outside lite.join the pass is padded as
    torch's DistributedSampler pads, and the per-batch gathers leave the repeats out; inside
    it every sample is gathered exactly once, in rank order, the ranks out of data
    contributing nothing."""
    from torch.utils.data import DistributedSampler

    n = 21 if devices == 2 else 20
    ids = (torch.randperm(n, generator=torch.Generator().manual_seed(5)) * 10).tolist()
    padded = [list(DistributedSampler(range(n), devices, r, shuffle=False)) for r in range(devices)]
    shares = [p[: len(range(r, n, devices))] for r, p in enumerate(padded)]  # without the repeat
    assert sorted(i for share in shares for i in share) == list(range(n))

    def per_step(parts):
        steps = (max(map(len, parts)) + 1) // 2
        return [[ids[i] for part in parts for i in part[2 * k : 2 * k + 2]] for k in range(steps)]

    inside = per_step(shares)
    counts = [[len(part[2 * k : 2 * k + 2]) for part in shares if part[2 * k : 2 * k + 2]] for k in range(len(inside))]
    assert sum(map(len, inside)) == n and len(counts[-1]) < devices  # in the last step, a rank has none
    for rank, out in enumerate(seen):
        assert out["ids"] == ids
        assert per_step(padded) != inside  # the pass repeats: rank order, the repeats in
        assert out["padded"] == inside  # ... and each rank's repeated row is left out
        own_steps = (len(shares[rank]) + 1) // 2
        assert [step[:-1] for step in out["steps"]] == inside[:own_steps]
        assert all(step[-1] is True for step in out["steps"])  # the x rows came with their ids
        assert out["counts"] == counts[:own_steps]
        assert out["after"] == [ids[i] for share in shares for i in share]


def _assert_padded_passes_gathered_once(seen, devices):
    """Padded passes (batch 3) outside lite.join: per-batch gathers and the gather of the
    whole pass after it hold every sample once, over torch's DistributedSampler shares and
    over a user's batch sampler dealt batch by batch (where a whole batch repeats); a
    per-batch sum holds the repeat unless that batch is the repeat alone, and the rank whose
    share repeats is warned, once per pass, where it could not be left out."""
    from torch.utils.data import DistributedSampler

    n = 21 if devices == 2 else 20
    ids = (torch.randperm(n, generator=torch.Generator().manual_seed(5)) * 10).tolist()
    ranks = range(devices)
    shares = [list(DistributedSampler(range(n), devices, r, shuffle=False)) for r in ranks]
    whole = [list(range(i, min(i + 3, n))) for i in range(0, n, 3)]  # the user's batches
    dealt = -(-len(whole) // devices) * devices  # padded by repeating the first batches
    kinds = {
        # rank -> (its batches in the padded pass, how many of its last items repeat)
        "sampled": [
            ([s[k : k + 3] for k in range(0, len(s), 3)], len(s) - len(range(r, n, devices)))
            for r, s in enumerate(shares)
        ],
        "batched": [((whole * 2)[r:dealt:devices], 0 if r + dealt - devices < len(whole) else None) for r in ranks],
    }
    for name, per_rank in kinds.items():
        kept, repeat_alone = [], []
        for batches, repeats in per_rank:
            repeats = len(batches[-1]) if repeats is None else repeats  # a whole batch repeats
            kept.append(batches[:-1] + [batches[-1][: len(batches[-1]) - repeats]])
            repeat_alone.append(repeats > 0 and len(batches[-1]) == 1)
        steps = len(per_rank[0][0])
        assert all(len(batches) == steps for batches, _ in per_rank)  # padded: the same count
        assert sorted(i for rank in kept for batch in rank for i in batch) == list(range(n))
        per_batch = [[ids[i] for rank in kept for i in rank[k]] for k in range(steps)]
        after = [ids[i] for rank in kept for batch in rank for i in batch]
        sums = [
            [sum(ids[i] for i in per_rank[r][0][k]) for r in ranks if not (k == steps - 1 and repeat_alone[r])]
            for k in range(steps)
        ]
        for rank, out in enumerate(seen):
            got = out[name]
            assert got["per_batch"] == per_batch, name
            assert got["after"] == after, name
            assert got["sums"] == sums, name
            repeats = len(sum(per_rank[rank][0], [])) > len(sum(kept[rank], []))
            warned = 1 if repeats and not repeat_alone[rank] else 0  # the sums hold the repeat
            assert len(got["warned"]) == warned, (name, rank, got["warned"])
            for w in got["warned"]:  # at the user's line, with the ways out
                assert w.startswith("collectives.py: ") and "lite.join" in w and "Gather each batch" in w, w


FAILURES = [
    ("raise", 1, "ValueError: boom on rank 1"),
    ("raise", 2, "ValueError: boom on rank 2"),
    ("kill", 1, "killed by SIGKILL"),
    ("abort", 2, "aborted (SIGABRT)"),
    ("busy", 1, "ValueError: boom on rank 1"),
    ("exit", 1, "raised SystemExit: 3"),
]


def _assert_no_survivors(pids):
    for pid in pids:
        try:
            proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        assert proc.status() == psutil.STATUS_ZOMBIE, f"process {pid} survived the run"


@pytest.mark.parametrize(("mode", "rank", "expected"), FAILURES)
def test_worker_failure_ends_the_run(script, mode, rank, expected):
    result = script("fail", mode, rank)
    out = result.json()
    assert out["error"] == "WorkerFailedError", result.explain()
    assert expected in out["message"]
    assert out["ranks"] == [rank]
    # found, not timed out: the others' collectives would have waited for launch(timeout=60)
    assert out["latency"] < 60, f"took {out['latency']:.2f} s from the fault to the error"
    if mode in ("raise", "busy"):
        assert "--- traceback of rank" in out["message"] and "fail.py" in out["message"]
    if mode == "abort":  # where the aborting rank's threads were, beside torch's one line
        assert "Fatal Python error: Aborted" in result.stderr, result.explain()
        assert 'fail.py", line' in result.stderr.split("Fatal Python error: Aborted")[1], result.explain()
    _assert_no_survivors(out["pids"])


@pytest.mark.parametrize("mode", ["raise", "busy"])
def test_rank_zero_failure_stops_the_workers(script, mode):
    result = script("fail", mode, 0)
    out = result.json()
    assert out["error"] == "ValueError", result.explain()
    assert "boom on rank 0" in out["message"]
    assert any("raised on rank 0" in n for n in out["notes"])
    _assert_no_survivors(out["pids"])


def test_collective_timeout_shows_where_every_rank_was(script):
    result = script("fail", "timeout", 1, 2)
    out = result.json()
    assert out["error"] == "CollectiveTimeoutError", result.explain()
    message = out["message"]
    assert "--- rank 0 ---" in message and "--- rank 1 ---" in message
    rank1 = message.split("--- rank 1 ---")[1]
    from conftest import SCRIPTS

    sleep_line = (
        1 + [i for i, ln in enumerate((SCRIPTS / "fail.py").read_text().splitlines()) if "time.sleep(30)" in ln][0]
    )
    assert f'fail.py", line {sleep_line}' in rank1  # rank 1 sits in its sleep, not in the collective
    _assert_no_survivors(out["pids"])


def test_parent_killed_leaves_no_orphans(run_python, tmp_path):
    code = textwrap.dedent(
        """
        import os, signal, time, scopedlite as lite
        with lite.launch(strategy="ddp", devices=2, accelerator="cpu") as run:
            with open(os.environ["OUT"] + f".pid{run.global_rank}", "w") as f:
                f.write(str(os.getpid()))
            lite.barrier()
            if run.global_rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(30)
        """
    )
    result = run_python("-c", code)
    assert result.returncode == -9
    worker = int(Path(f"{result._out}.pid1").read_text())
    psutil.wait_procs([psutil.Process(worker)] if psutil.pid_exists(worker) else [], timeout=3)
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE


TWO_BLOCKS = """
import os, json, scopedlite as lite
out = os.environ["OUT"]
for block in ("first", "second"):
    with lite.launch(strategy="ddp", devices=2, accelerator="cpu", timeout=60) as run:
        total = lite.all_reduce(run.global_rank + 1)
        with open(f"{out}.{block}.rank{run.global_rank}", "w") as f:
            json.dump({"sum": total, "pid": os.getpid()}, f)
    with open(f"{out}.after", "a") as f:
        f.write(block + "\\n")
"""


def test_later_blocks_fork_and_code_after_each_block_runs_once(run_python, tmp_path):
    path = tmp_path / "two_blocks.py"
    path.write_text(TWO_BLOCKS)
    result = run_python(str(path))
    assert result.returncode == 0, result.explain()
    base = result._out.as_posix()
    pids = {}
    for block in ("first", "second"):
        for rank in (0, 1):
            data = json.loads(Path(f"{base}.{block}.rank{rank}").read_text())
            assert data["sum"] == 3
            pids[block, rank] = data["pid"]
    assert Path(f"{base}.after").read_text().split() == ["first", "second"]
    assert pids["first", 0] == pids["second", 0]  # rank 0 is the main process both times
    assert pids["first", 1] != pids["second", 1]  # a new worker (forked) for the second


def test_fork_launcher_reports_a_failing_worker(run_python):
    code = textwrap.dedent(
        """
        import scopedlite as lite
        try:
            with lite.launch(strategy="ddp", devices=2, accelerator="cpu", launcher="fork") as run:
                lite.barrier()
                if run.global_rank == 1:
                    raise KeyError("forked worker failed")
                lite.barrier()
        except lite.WorkerFailedError as e:
            print("CAUGHT", e.ranks, "KeyError" in str(e))
        """
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.explain()
    assert "CAUGHT (1,) True" in result.stdout


def test_torchrun_world_is_joined_not_spawned(run_python, tmp_path):
    path = tmp_path / "under_torchrun.py"
    path.write_text(
        textwrap.dedent(
            """
            import os, json, scopedlite as lite
            with lite.launch(accelerator="cpu", timeout=60) as run:
                total = lite.all_reduce(run.global_rank + 1)
                info = {"sum": total, "world": run.world_size, "strategy": run.strategy.name,
                        "ppid": os.getppid(), "children": len(__import__("psutil").Process().children())}
            with open(os.environ["OUT"] + f".rank{run.global_rank}", "w") as f:
                json.dump(info, f)
            """
        )
    )
    result = run_python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(path), timeout=120)
    assert result.returncode == 0, result.explain()
    infos = [json.loads(Path(f"{result._out}.rank{r}").read_text()) for r in (0, 1)]
    for info in infos:
        assert info["sum"] == 3 and info["world"] == 2 and info["strategy"] == "ddp"
        assert info["children"] == 0  # launch spawned nothing
    assert infos[0]["ppid"] == infos[1]["ppid"]  # both are torchrun's children


def test_ctrl_c_in_the_main_process_stops_every_worker(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import _env

    marks = tmp_path / "marks"
    marks.mkdir()
    code = textwrap.dedent(
        f"""
        import os, signal, time, torch, scopedlite as lite
        # Ctrl-C as in a terminal: Python raises KeyboardInterrupt on SIGINT unless it started
        # with SIGINT ignored (a background job of a shell, nohup), as CI may start this.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with lite.launch(strategy="ddp", devices=2, accelerator="cpu") as run:
            open(os.path.join({str(marks)!r}, f"pid{{run.global_rank}}"), "w").write(str(os.getpid()))
            lite.barrier()
            if run.global_rank == 0:
                lite.all_reduce(torch.ones(1))  # blocks: rank 1 never joins this collective
            time.sleep(60)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while len(list(marks.glob("pid*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # rank 0 is now blocked inside the all-reduce
    os.kill(proc.pid, signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=15)
    finally:  # not stopped: leave no process behind the failure
        for pid in [proc.pid, *(int(p.read_text()) for p in marks.glob("pid*") if p.read_text())]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in stderr or "WorkerFailedError" in stderr, stderr
    _assert_no_survivors([int(p.read_text()) for p in marks.glob("pid*")])


def test_worker_failing_before_it_reaches_launch_is_reported_before_the_timeout(run_python):
    code = textwrap.dedent(
        """
        import os, sys, time, scopedlite as lite
        if os.environ.get("SCOPEDLITE_LAUNCH_TOKEN"):
            sys.exit(5)  # only the re-executed worker fails, before reaching launch
        start = time.time()
        try:
            with lite.launch(strategy="ddp", devices=2, accelerator="cpu", timeout=60):
                pass
        except lite.WorkerFailedError as e:
            print("CAUGHT", e.ranks, "code 5" in str(e), round(time.time() - start, 1))
        """
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.explain()
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("CAUGHT"))
    assert line.startswith("CAUGHT (1,) True")
    assert float(line.split()[-1]) < 60  # found, not waited out: rank 0's wait for its group ends at 60 s


def test_a_forked_block_then_an_auto_block_forks_again(run_python):
    code = textwrap.dedent(
        """
        import os, scopedlite as lite
        for launcher in ("fork", "auto"):
            with lite.launch(strategy="ddp", devices=2, accelerator="cpu", launcher=launcher) as run:
                total = lite.all_reduce(1)
            print("block", launcher, total, os.getpid())
        """
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.explain()
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("block")]
    assert [ln.split()[:3] for ln in lines] == [["block", "fork", "2"], ["block", "auto", "2"]]
    assert len({ln.split()[3] for ln in lines}) == 1  # both printed by the main process only


def _start_and_wait_ready(script_path, out, tmp_path):
    import os
    import subprocess
    import sys
    import time

    from conftest import _env

    env = _env()
    env["OUT"] = str(out)
    proc = subprocess.Popen(
        [sys.executable, str(script_path)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 40
    while not os.path.exists(f"{out}.ready") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    return proc


def test_sigterm_lets_the_loop_save_and_stop_on_every_rank(tmp_path):
    import os
    import signal

    from conftest import SCRIPTS

    out = tmp_path / "preempt.json"
    proc = _start_and_wait_ready(SCRIPTS / "preempt.py", out, tmp_path)
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    result = json.loads(out.read_text())
    assert result["saved"]
    assert result["steps"][0] == result["steps"][1] >= 5  # both ranks left at the same step
    _assert_no_survivors([int(Path(f"{out}.pid{r}").read_text()) for r in (0, 1)])


def test_a_second_sigterm_stops_at_once(tmp_path):
    import os
    import signal

    path = tmp_path / "ignore_stop.py"
    path.write_text(
        textwrap.dedent(
            """
            import os, time, scopedlite as lite
            out = os.environ["OUT"]
            with lite.launch(strategy="ddp", devices=2, accelerator="cpu") as run:
                open(f"{out}.pid{run.global_rank}", "w").write(str(os.getpid()))
                lite.barrier()
                if run.is_global_zero:
                    open(f"{out}.ready", "w").close()
                time.sleep(60)  # never checks should_stop
            """
        )
    )
    out = tmp_path / "second.json"
    proc = _start_and_wait_ready(path, out, tmp_path)
    os.kill(proc.pid, signal.SIGTERM)
    import time

    time.sleep(0.5)
    assert proc.poll() is None  # the first SIGTERM only requests a stop
    os.kill(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=15)
    assert proc.returncode == 128 + signal.SIGTERM
    _assert_no_survivors([int(Path(f"{out}.pid{r}").read_text()) for r in (0, 1)])


LISTENING = """
import json, os, psutil, scopedlite as lite
with lite.launch(strategy="ddp", devices=2, accelerator="cpu", timeout=60) as run:
    lite.barrier()  # every rank's store connection and gloo pairs are up
    if run.is_global_zero:
        procs = [psutil.Process()] + psutil.Process().children(recursive=True)
        seen = [
            [p.pid, c.laddr.ip, c.laddr.port]
            for p in procs
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        json.dump({"listening": seen, "pids": [p.pid for p in procs]}, open(os.environ["OUT"], "w"))
    lite.barrier()
"""


def test_a_local_run_listens_on_the_loopback_address_only(run_python):
    result = run_python("-c", LISTENING)
    assert result.returncode == 0, result.explain()
    out = result.json()
    assert len(out["pids"]) == 2
    assert out["listening"], "the store should be listening"
    exposed = [s for s in out["listening"] if s[1] not in ("127.0.0.1", "::1")]
    assert not exposed, f"listening on more than the loopback address: {exposed}"


def test_summary_is_the_exception_line_and_rank_zero_tracebacks_are_unprefixed(run_python):
    code = textwrap.dedent(
        """
        import scopedlite as lite
        try:
            with lite.launch(strategy="ddp", devices=2, accelerator="cpu", timeout=60) as run:
                lite.barrier()
                if run.global_rank == 1:  # a pytest assertion: its message goes on for lines
                    raise AssertionError("assert 1 == 2.\\n +  where 1 = Run(global_rank=1)")
                lite.barrier()
        except lite.WorkerFailedError as e:
            print("SUMMARY", str(e).splitlines()[0])
        raise ValueError("uncaught on rank 0")
        """
    )
    result = run_python("-c", code)
    assert result.returncode == 1
    summary = next(ln for ln in result.stdout.splitlines() if ln.startswith("SUMMARY"))
    assert summary == "SUMMARY rank 1 raised AssertionError: assert 1 == 2. The other ranks were stopped."
    assert "ValueError: uncaught on rank 0" in result.stderr
    assert "[rank0]" not in result.stderr, result.stderr


def test_a_worker_that_exits_with_code_0_before_launch_is_reported_at_once(run_python):
    code = textwrap.dedent(
        """
        import os, sys, time, scopedlite as lite
        if os.environ.get("SCOPEDLITE_LAUNCH_TOKEN"):
            print("worker took another path")
            open(os.environ["OUT"] + ".exited", "w").write(repr(time.time()))
            sys.exit(0)  # the re-executed worker never reaches launch
        try:
            with lite.launch(strategy="ddp", devices=2, accelerator="cpu", timeout=60):
                pass
        except lite.WorkerFailedError as e:
            exited = float(open(os.environ["OUT"] + ".exited").read())
            print("CAUGHT", e.ranks, e.failures[0].exitcode, round(time.time() - exited, 2))
            print(str(e).splitlines()[0])
        """
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.explain()
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("CAUGHT"))
    assert line.startswith("CAUGHT (1,) 0"), result.stdout
    assert float(line.split()[-1]) < 60  # found, not waited out: rank 0's wait for its group ends at 60 s
    assert "rank 1 exited with code 0 before it reached lite.launch(" in result.stdout
    assert "worker took another path" in result.stdout


def test_a_script_read_from_stdin_with_its_own_dash_c_forks(tmp_path):
    import subprocess
    import sys

    from conftest import _env

    code = (
        "import sys, scopedlite as lite\n"
        "with lite.launch(strategy='ddp', devices=2, accelerator='cpu', timeout=60) as run:\n"
        "    print('sum', lite.all_reduce(1), sys.argv)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-", "-c"], input=code, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "sum 2 ['-', '-c']" in proc.stdout


def test_two_launches_from_one_line_are_told_apart(run_python, tmp_path):
    path = tmp_path / "helper.py"
    path.write_text(
        textwrap.dedent(
            """
            import os, scopedlite as lite

            def run(n):
                with lite.launch(devices=n, accelerator="cpu", timeout=60) as r:
                    asked = lite.all_gather(n).tolist()  # the devices= each rank's block was given
                return asked

            print("RESULTS", run(1), run(2), os.getpid())
            """
        )
    )
    result = run_python(str(path))
    assert result.returncode == 0, result.explain()
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULTS")]
    assert len(lines) == 1 and lines[0].startswith("RESULTS [1] [2, 2]"), result.stdout


def test_a_script_started_by_rank_1_launches_a_run_of_its_own(run_python, tmp_path):
    child = tmp_path / "child.py"
    child.write_text(
        textwrap.dedent(
            """
            import os, scopedlite as lite
            inherited = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "SCOPEDLITE_LAUNCH_TOKEN")}
            with lite.launch(strategy="ddp", devices=2, accelerator="cpu", timeout=60) as run:
                total = lite.all_reduce(run.global_rank + 10)
            print("CHILD", total, run.world_size, inherited)
            """
        )
    )
    parent = tmp_path / "parent.py"
    parent.write_text(
        textwrap.dedent(
            f"""
            import os, subprocess, sys, scopedlite as lite
            with lite.launch(strategy="ddp", devices=2, accelerator="cpu", timeout=60) as run:
                env_rank = os.environ.get("RANK")
                if run.global_rank == 1:
                    out = subprocess.run([sys.executable, {str(child)!r}], capture_output=True, text=True)
                    open(os.environ["OUT"] + ".child", "w").write(out.stdout + out.stderr)
                lite.barrier()
                # one write: rank 0's own lines are not protected against the workers' lines
                print("RANK in the environment of rank %d : %s" % (run.global_rank, env_rank))
            """
        )
    )
    result = run_python(str(parent))
    assert result.returncode == 0, result.explain()
    child_out = Path(f"{result._out}.child").read_text()
    assert "CHILD 21 2 {'RANK': None, 'WORLD_SIZE': None, 'SCOPEDLITE_LAUNCH_TOKEN': None}" in child_out, child_out
    assert "RANK in the environment of rank 0 : None" in result.stdout
    assert "RANK in the environment of rank 1 : None" in result.stdout  # as on rank 0


@pytest.mark.timeout(120)
def test_a_second_forked_block_after_an_fsdp_block_starts_and_runs(run_python):
    # The first block's gather ledger kept rank 0's store alive past the block, and the
    # workers forked for the next block hung before reaching it.
    code = (
        "import torch, scopedlite as lite\n"
        "for name in ('fsdp', 'fsdp', 'ddp'):\n"
        "    with lite.launch(strategy=name, devices=2, accelerator='cpu', launcher='fork', timeout=300) as run:\n"
        "        total = lite.all_reduce(torch.tensor([run.global_rank + 1.0])).item()\n"
        "        lite.print(name, total)\n"
    )
    result = run_python("-c", code, timeout=90)
    assert result.returncode == 0, result.explain()
    assert result.stdout.split() == ["fsdp", "3.0", "fsdp", "3.0", "ddp", "3.0"], result.explain()


@pytest.mark.parametrize(
    "strategy",
    [
        "ddp",
        pytest.param(
            "deepspeed_stage_2",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("deepspeed") is None,
                reason="deepspeed is not installed (pip install scopedlite[deepspeed])",
            ),
        ),
    ],
)
def test_later_forked_blocks_whose_workers_drop_an_earlier_blocks_model_finish(script, strategy):
    """A notebook's second cell assigns `model` again inside its launch block: every forked
    worker drops its copy of the model rank 0 kept from the first block (a DDP reducer, a
    DeepSpeed engine), and with it that run's gloo groups, whose destructor waited on threads a
    forked child does not have (the worker hung at the assignment, until launch's timeout)."""
    result = script("later_block_drops_model", strategy, timeout=80)
    assert result.returncode == 0, result.explain()
    assert result.json() == [3.0, 3.0, 3.0]  # each block's all_reduce of ranks 1 + 2
