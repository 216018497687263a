"""SCOPEDLITE_DEBUG=1: mismatched collectives raise on every rank, naming each rank's call."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize(
    ("case", "rank0", "rank1"),
    [
        ("shape", "all_reduce(op='sum', shape=(2,)", "all_reduce(op='sum', shape=(3,)"),
        ("op", "all_reduce(op='sum'", "all_reduce(op='max'"),
        ("kind", "all_reduce(op='sum'", "broadcast(src=0)"),
        ("join", "all_gather(shape=(1,)", "all_gather(shape=(2,)"),
    ],
)
def test_mismatch_is_reported_on_every_rank(script, case, rank0, rank1):
    result = script("desync", case, env={"SCOPEDLITE_DEBUG": "1"})
    assert result.returncode == 0, result.explain()
    for message in result.json():
        assert f"rank 0: {rank0}" in message and f"rank 1: {rank1}" in message
        assert "desync.py:" in message  # the user's call site, not ours


def test_matching_collectives_pass_in_debug_mode(script):
    result = script("desync", "same", env={"SCOPEDLITE_DEBUG": "1"})
    assert result.returncode == 0, result.explain()
    assert result.json() == ["no error", "no error"]


def test_a_call_site_is_named_alike_wherever_each_node_keeps_the_script():
    """The line that calls a collective is compared between ranks (``_comm/signature.py``,
    and lite.join's rounds): one node may run ``python train.py``, another
    ``python /home/x/train.py``; the same line must compare equal, another line not."""
    from scopedlite._comm.debug import site_id, site_name

    here = site_id("/home/x/project/train.py:57")
    assert here == site_id("train.py:57") == site_id("/scratch/job-12/train.py:57")
    assert here != site_id("train.py:58") and here != site_id("/home/x/project/eval.py:57")
    assert site_name(here) == "/home/x/project/train.py:57"  # shown as this process saw it first


def test_a_call_site_names_the_users_callers_up_to_the_first_library_frame():
    """A helper called on some ranks only runs the same line as the others' next call of it;
    the user's lines that called it tell the two apart. The callers are the user's own frames
    around the call (this file's), up to the first frame of an installed library (pytest
    here, runpy or a launcher in a script: they differ between a launching rank and the ranks
    it started), and they compare equal wherever each node keeps the files."""
    from scopedlite._comm.debug import call_site, site_id

    def helper():
        return call_site()

    def first():
        return helper()

    def second():
        return helper()

    here = Path(__file__).name
    inner, _, callers = first().partition(" (from ")
    assert inner.startswith(str(Path(__file__))) and inner.endswith(f":{helper.__code__.co_firstlineno + 1}")
    named = callers.rstrip(")").split(", ")
    assert named[0] == f"{here}:{first.__code__.co_firstlineno + 1}"  # its caller, then this test
    assert len(named) == 2 and named[1].startswith(f"{here}:"), named  # pytest's frames end it
    assert first() == first() and site_id(first()) == site_id(first())
    assert first().partition(" (from ")[0] == second().partition(" (from ")[0]  # the same line...
    assert site_id(first()) != site_id(second())  # ...through another caller
    seen = first()
    assert site_id(seen.replace(str(Path(__file__).parent), "/elsewhere/tests")) == site_id(seen)
