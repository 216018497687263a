"""Readable output: workers' lines carry their rank, and rank 0 draws one progress bar."""

from __future__ import annotations

import io

import pytest

import scopedlite as lite
from scopedlite._api.progress import format_progress
from scopedlite._launch.output import RankPrefixed, prefix_enabled

PRINTS = """
import sys, scopedlite as lite
print("before the block")
with lite.launch(strategy="ddp", devices=3, accelerator="cpu", launcher={launcher!r}, timeout=60) as run:
    lite.barrier()
    print(f"hello from {{run.global_rank}}\\nsecond line {{run.global_rank}}")
    print("partial ", end="")
    print(f"end {{run.global_rank}}")
    print(f"to stderr {{run.global_rank}}", file=sys.stderr)
    lite.print("only rank zero")
    for _ in lite.progress(range(20), desc="epoch"):
        pass
    lite.barrier()
print("after the block")
"""


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_prefix_goes_at_the_start_of_every_line_only():
    out = io.StringIO()
    stream = RankPrefixed(out, "[rank 2] ")
    stream.write("a\nb")
    stream.write("c\n\n")
    stream.write("")
    stream.writelines(["d\n", "e"])
    assert out.getvalue() == "[rank 2] a\n[rank 2] bc\n\n[rank 2] d\n"  # "e" waits for its line
    stream.flush()
    stream.write("f\ng\n")  # the flushed partial line goes on unprefixed
    assert out.getvalue() == "[rank 2] a\n[rank 2] bc\n\n[rank 2] d\n[rank 2] ef\n[rank 2] g\n"
    assert stream.getvalue() == out.getvalue()  # everything else is the wrapped stream's


@pytest.mark.parametrize(
    ("value", "enabled"), [(None, True), ("1", True), ("0", False), ("off", False), ("False", False)]
)
def test_prefix_opt_out(value, enabled):
    assert prefix_enabled({} if value is None else {"SCOPEDLITE_RANK_PREFIX": value}) is enabled


@pytest.mark.timeout(90)
@pytest.mark.parametrize("launcher", ["script", "fork"])
def test_workers_lines_are_prefixed_and_rank_zero_is_not(run_python, launcher):
    # Unbuffered, rank 0's print() is two writes (text, then "\n"): inside the block they are
    # held until the line is whole (test_epochs.py checks concurrent prints).
    result = run_python("-c", PRINTS.format(launcher=launcher))
    assert result.returncode == 0, result.explain()
    out, err = _lines(result.stdout), _lines(result.stderr)
    for rank in (0, 1, 2):
        tag = "" if rank == 0 else f"[rank {rank}] "
        for line in (f"hello from {rank}", f"second line {rank}", f"partial end {rank}"):
            assert f"{tag}{line}" in out, (line, result.stdout)
        assert f"{tag}to stderr {rank}" in err, result.stderr
    assert out.count("only rank zero") == 1 and out.count("after the block") == 1
    assert out.count("before the block") == (3 if launcher == "script" else 1)  # re-executed: runs again
    # the progress bar: rank 0 only, unprefixed, plain lines when not a terminal
    bars = [line for line in err if "epoch:" in line]
    assert bars and all(line.startswith("epoch:") for line in bars), result.stderr
    assert bars[-1].startswith("epoch: 100% 20/20")


@pytest.mark.timeout(90)
def test_prefix_can_be_turned_off(run_python):
    result = run_python("-c", PRINTS.format(launcher="script"), env={"SCOPEDLITE_RANK_PREFIX": "0"})
    assert result.returncode == 0, result.explain()
    assert "[rank" not in result.stdout + result.stderr
    out = _lines(result.stdout)  # unprefixed, the lines still arrive whole
    for rank in (0, 1, 2):
        assert f"hello from {rank}" in out and f"partial end {rank}" in out, result.stdout


def test_progress_plain_text_at_each_tenth_when_not_a_terminal():
    out = io.StringIO()
    assert list(lite.progress(range(25), desc="train", file=out)) == list(range(25))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split()[2] for line in lines] == [f"{n}/25" for n in (3, 5, 8, 10, 13, 15, 18, 20, 23, 25)]
    assert lines[-1].startswith("train: 100% 25/25 [")


def test_progress_redraws_in_place_on_a_terminal():
    out = _Tty()
    assert list(lite.progress(iter("abc"), total=3, file=out)) == ["a", "b", "c"]
    text = out.getvalue()
    assert text.startswith("\r  0% |") and text.endswith("| 3/3 [" + text.rsplit("[", 1)[1])
    assert text.count("\n") == 1 and f"|{'#' * 24}| 3/3" in text


def test_progress_without_a_length_counts():
    out = io.StringIO()
    list(lite.progress((i for i in range(4)), desc="eval", file=out))
    assert out.getvalue().startswith("eval: 4 [00:00, ")


def test_progress_rejects_a_bad_total():
    with pytest.raises(ValueError, match=r"total=-1 is not valid"):
        lite.progress([], total=-1)  # at the call, not at the first item


def test_format_progress():
    assert format_progress("x", 4, 10, 2.0, bar=False) == "x:  40% 4/10 [00:02<00:03, 2.0 it/s]"
    assert format_progress("", 5, None, 3725.0, bar=False) == "5 [1:02:05, 0.0 it/s]"
    assert format_progress("", 10, 10, 1.0, bar=True).startswith(f"100% |{'#' * 24}| 10/10")
