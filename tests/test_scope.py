"""The scope rules: contextvars, misnesting, one block per object, threads."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading

import pytest
import torch

import scopedlite as lite
from scopedlite._core.scope import open_scopes


def test_default_run_outside_launch():
    run = lite.current()
    assert (run.global_rank, run.world_size, run.is_global_zero) == (0, 1, True)
    assert run.device.type in ("cpu", "cuda", "mps")
    assert lite.current() is run


def test_launch_one_process_yields_a_run_and_restores_the_default():
    default = lite.current()
    with lite.launch(accelerator="cpu", precision="bf16-mixed") as run:
        assert lite.current() is run
        assert run.precision.name == "bf16-mixed" and run.strategy.name == "single"
        assert open_scopes()[-1].describe().startswith("lite.launch(")
    assert lite.current() is default


def test_exiting_out_of_order_names_the_scope_still_open():
    stack = contextlib.ExitStack()
    outer = lite.launch(accelerator="cpu")
    inner = lite.autocast("bf16-mixed")
    stack.enter_context(outer)
    inner.__enter__()
    with pytest.raises(lite.ScopeError, match=r"lite.launch.*exited while lite.autocast\('bf16-mixed'\) is still open"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    stack.pop_all()
    # the chain is left as it was before the misnested pair
    assert open_scopes() == ()


def test_a_scope_object_is_good_for_one_block():
    scope = lite.autocast()
    with scope:
        pass
    with pytest.raises(lite.ScopeError, match="already entered once"), scope:
        pass
    nested = lite.rank_zero_first()
    with nested, pytest.raises(lite.ScopeError):
        nested.__enter__()


def test_launch_does_not_nest():
    with (
        lite.launch(accelerator="cpu"),
        pytest.raises(lite.ScopeError, match="do not nest"),
        lite.launch(accelerator="cpu"),
    ):
        pass


def test_threads_started_in_a_launch_block_see_its_run():
    seen = {}

    def look(key):
        seen[key] = lite.current()

    with lite.launch(accelerator="cpu", precision="bf16-true") as run:
        plain = threading.Thread(target=look, args=("plain",))
        carried = threading.Thread(target=lite.carry(look), args=("carried",))
        plain.start(), carried.start()
        plain.join(), carried.join()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            seen["pool"] = pool.submit(lite.current).result()
    assert seen["plain"] is run and seen["carried"] is run and seen["pool"] is run
    after = threading.Thread(target=look, args=("after",))
    after.start(), after.join()
    assert not seen["after"].launched  # the block is closed: the default run again


def test_a_thread_outside_two_open_launch_blocks_is_refused():
    entered, release = threading.Barrier(2), threading.Event()

    def other_block():
        with lite.launch(accelerator="cpu"):
            entered.wait()
            release.wait()

    helper = threading.Thread(target=other_block)
    helper.start()
    try:
        with lite.launch(accelerator="cpu") as run:
            entered.wait()
            assert lite.current() is run  # its own context says which
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                with pytest.raises(RuntimeError, match="2 launch blocks are open in this process"):
                    pool.submit(lite.current).result()
                assert pool.submit(lite.carry(lite.current)).result() is run
    finally:
        release.set()
        helper.join()


def test_autocast_nests_innermost_wins():
    with lite.launch(accelerator="cpu", precision="bf16-mixed"):
        a = torch.ones(2, 2)
        with lite.autocast() as precision:
            assert precision.name == "bf16-mixed"
            assert (a @ a).dtype == torch.bfloat16
            with lite.autocast("32-true"):
                assert (a @ a).dtype == torch.float32
            assert (a @ a).dtype == torch.bfloat16
        assert (a @ a).dtype == torch.float32
    with pytest.raises(ValueError, match="precision='fp4'"):
        lite.autocast("fp4")


def test_exceptions_pass_through_scopes_untouched():
    with (
        pytest.raises(KeyError, match="mine"),
        lite.launch(accelerator="cpu"),
        lite.autocast(),
        lite.rank_zero_first(),
    ):
        raise KeyError("mine")
    assert open_scopes() == ()
