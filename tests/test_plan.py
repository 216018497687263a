"""The resolver: every invalid argument is refused early, naming the argument and choices."""

from __future__ import annotations

import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scopedlite as lite
from scopedlite._core.precision import PRECISIONS
from scopedlite._hardware.machine import Machine
from scopedlite._plan import ACCELERATORS, LAUNCHERS, resolve
from scopedlite._strategies.registry import STRATEGIES

CPU = Machine(cpu_count=4)
GPU4 = Machine(cuda_device_count=4, cpu_count=16)
NOTEBOOK = Machine(cpu_count=4, has_script=False)
TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "x",
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


def plan(env=None, machine=CPU, **kwargs):
    return resolve(env=env or {}, machine=machine, **kwargs)


BAD = [
    # (kwargs, machine, exception, words the message must contain)
    ({"strategy": "dpp"}, CPU, ValueError, ["strategy='dpp'", "'ddp'", "'single'"]),
    ({"strategy": 3}, CPU, TypeError, ["strategy", "int"]),
    ({"devices": 0}, CPU, ValueError, ["devices=0", "at least 1"]),
    ({"devices": -2}, CPU, ValueError, ["devices=-2"]),
    ({"devices": True}, CPU, TypeError, ["devices", "bool"]),
    ({"devices": [0, 0]}, GPU4, ValueError, ["devices=[0, 0]", "more than once"]),
    ({"devices": []}, GPU4, ValueError, ["devices=[]"]),
    ({"devices": [0, 7]}, GPU4, ValueError, ["devices=[0, 7]", "[7]"]),
    ({"devices": "two"}, CPU, ValueError, ["devices='two'"]),
    # a string is named as written, not as the value read from it
    ({"devices": "0"}, CPU, ValueError, ["devices='0'", "at least 1"]),
    ({"devices": ","}, GPU4, ValueError, ["devices=','", "at least one device index"]),
    ({"devices": "1,1"}, GPU4, ValueError, ["devices='1,1'", "more than once"]),
    ({"devices": [0, 1], "accelerator": "cpu"}, CPU, ValueError, ["devices=[0, 1]", "devices=2"]),
    ({"devices": 8, "accelerator": "cuda"}, GPU4, ValueError, ["devices=8", "4 CUDA"]),
    ({"accelerator": "cuda"}, CPU, ValueError, ["accelerator='cuda'", "no CUDA device"]),
    ({"accelerator": "mps"}, CPU, ValueError, ["accelerator='mps'"]),
    ({"accelerator": "tpu2"}, CPU, ValueError, ["accelerator='tpu2'", "'cpu'", "'cuda'"]),
    ({"precision": "fp8"}, CPU, ValueError, ["precision='fp8'", "'bf16-mixed'", "'32-true'"]),
    ({"precision": 16}, CPU, ValueError, ["precision=16 (Fabric's short name for '16-mixed')", "bf16-mixed"]),
    ({"precision": "16-mixed", "accelerator": "cpu"}, CPU, ValueError, ["precision='16-mixed'", "bf16-mixed"]),
    ({"timeout": -1}, CPU, ValueError, ["timeout=-1", "positive"]),
    ({"timeout": 0}, CPU, ValueError, ["timeout=0"]),
    ({"timeout": "10"}, CPU, TypeError, ["timeout", "str"]),
    ({"num_nodes": 0}, CPU, ValueError, ["num_nodes=0"]),
    ({"num_nodes": 2}, CPU, ValueError, ["num_nodes=2", "torchrun"]),
    ({"launcher": "mpi"}, CPU, ValueError, ["launcher='mpi'", "'fork'"]),
    ({"strategy": "single", "devices": 2}, CPU, ValueError, ["strategy='single'", "ddp"]),
    ({"strategy": "ddp", "devices": 2, "launcher": "script"}, NOTEBOOK, ValueError, ["launcher='script'", "fork"]),
    ({"strategy": "ddp", "accelerator": "mps"}, Machine(mps_available=True), ValueError, ["'ddp'", "mps"]),
    (
        {"strategy": "ddp", "devices": 2, "launcher": "fork"},
        Machine(cpu_count=2, cuda_initialized=True, cuda_device_count=2),
        ValueError,
        ["CUDA is already initialised"],
    ),
    (
        {"strategy": "ddp", "devices": 2, "launcher": "script"},
        Machine(launched_before=True),
        ValueError,
        ["second multi-process launch"],
    ),
    (
        {"strategy": lite.DDPStrategy(process_group_backend="nccl"), "accelerator": "cpu"},
        CPU,
        ValueError,
        ["nccl", "cpu"],
    ),
]


@pytest.mark.parametrize(("kwargs", "machine", "error", "words"), BAD)
def test_bad_arguments(kwargs, machine, error, words):
    with pytest.raises(error) as info:
        plan(machine=machine, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_ddp_strategy_options_are_checked_at_once():
    with pytest.raises(TypeError, match="find_unused_params"):
        lite.DDPStrategy(find_unused_params=True)
    with pytest.raises(ValueError, match="start_method='spawn'"):
        lite.DDPStrategy(start_method="spawn")
    assert lite.DDPStrategy(find_unused_parameters=True, bucket_cap_mb=25).ddp_options == {
        "find_unused_parameters": True,
        "bucket_cap_mb": 25,
    }


def test_defaults_on_cpu_are_one_process():
    p = plan()
    assert (p.accelerator, p.strategy.name, p.world_size, p.launcher, p.devices) == ("cpu", "single", 1, "none", (0,))
    assert p.timeout == datetime.timedelta(minutes=30)


def test_auto_picks_ddp_for_several_devices_and_the_script_launcher():
    p = plan(devices=2)
    assert (p.strategy.name, p.world_size, p.launcher) == ("ddp", 2, "script")


def test_notebooks_fork_and_later_blocks_fork():
    assert plan(devices=2, machine=NOTEBOOK).launcher == "fork"
    assert plan(devices=2, machine=Machine(launched_before=True)).launcher == "fork"
    assert plan(strategy="ddp_notebook", devices=2).launcher == "fork"


def test_cuda_auto_takes_every_gpu():
    p = plan(machine=GPU4)
    assert (p.accelerator, p.devices, p.world_size) == ("cuda", (0, 1, 2, 3), 4)
    assert plan(machine=GPU4, devices=[2, 3]).devices == (2, 3)
    assert plan(machine=GPU4, devices="1,3").devices == (1, 3)


def test_torchrun_world_is_joined():
    p = plan(env=TORCHRUN, devices=2)
    assert p.launcher == "join" and p.world_size == 4 and p.num_nodes == 2
    assert p.world is not None and (p.world.global_rank, p.world.local_rank, p.world.node_rank) == (3, 1, 1)
    assert p.world.main_address == "10.0.0.1"
    assert plan(env=TORCHRUN).devices == (0, 1)


def test_torchrun_world_mismatch_is_an_error():
    with pytest.raises(ValueError, match="world has 2 per node and 4 in all"):
        plan(env=TORCHRUN, devices=3)
    with pytest.raises(
        ValueError, match="launcher='fork' cannot be used inside an existing world \\(made by torchelastic\\)"
    ):
        plan(env=TORCHRUN, launcher="fork")
    broken = {k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}
    with pytest.raises(ValueError, match="MASTER_PORT"):
        plan(env=broken)


def test_plan_is_frozen():
    p = plan()
    with pytest.raises(AttributeError):
        p.world_size = 3  # type: ignore[misc]


# the arguments whose valid values are a closed set, which a refusal of another value lists
CHOICES = {
    "accelerator": ACCELERATORS,
    "launcher": LAUNCHERS,
    "precision": tuple(PRECISIONS),
    "strategy": ("auto", *STRATEGIES),
}


def _assert_names_the_argument_value_and_choices(message: str, args: dict) -> None:
    """A clear error names the argument and the value it got (``precision='16'``), and, for a
    value outside a closed set, every valid choice."""
    named = [name for name, value in args.items() if f"{name}={value!r}" in message]
    assert named, f"the error names no argument with the value it got: {message}"
    for name in named:
        if name in CHOICES and args[name] not in CHOICES[name]:
            missing = [choice for choice in CHOICES[name] if repr(choice) not in message]
            assert not missing, f"{name}={args[name]!r} refused without the valid choices {missing}: {message}"


def test_the_clear_error_check_can_fail():
    args = {"precision": "16", "devices": 2}
    _assert_names_the_argument_value_and_choices(
        f"precision='16' is not supported. Valid choices: {', '.join(map(repr, PRECISIONS))}", args
    )
    for unclear in ("precision must be one of the supported ones", "precision='16' is not supported", "devices = 2"):
        with pytest.raises(AssertionError):
            _assert_names_the_argument_value_and_choices(unclear, args)


@settings(max_examples=200, deadline=None)
@given(
    accelerator=st.one_of(st.sampled_from(ACCELERATORS), st.text(max_size=5)),
    devices=st.one_of(
        st.integers(-3, 6), st.lists(st.integers(-1, 5), max_size=4), st.just("auto"), st.text(max_size=3)
    ),
    precision=st.one_of(
        st.sampled_from(["32-true", "bf16-mixed", "16-mixed", "64-true", "16-true"]), st.text(max_size=5)
    ),
    launcher=st.one_of(st.sampled_from(LAUNCHERS), st.text(max_size=4)),
    timeout=st.one_of(st.none(), st.floats(-5, 5, allow_nan=False), st.integers(-5, 5)),
    strategy=st.sampled_from(["auto", "single", "ddp", "ddp_fork", "nope"]),
    gpus=st.integers(0, 4),
)
def test_resolve_either_plans_consistently_or_raises_a_clear_error(
    accelerator, devices, precision, launcher, timeout, strategy, gpus
):
    machine = Machine(cuda_device_count=gpus, cpu_count=4)
    try:
        p = resolve(
            accelerator=accelerator,
            devices=devices,
            precision=precision,
            launcher=launcher,
            timeout=timeout,
            strategy=strategy,
            env={},
            machine=machine,
        )
    except (ValueError, TypeError) as e:
        args = {
            "accelerator": accelerator,
            "devices": devices,
            "precision": precision,
            "launcher": launcher,
            "timeout": timeout,
            "strategy": strategy,
        }
        _assert_names_the_argument_value_and_choices(str(e), args)
        return
    assert p.world_size == len(p.devices) * p.num_nodes
    assert len(set(p.devices)) == len(p.devices)
    assert p.timeout.total_seconds() > 0
    assert p.launcher in ("none", "script", "fork")
    assert (p.launcher == "none") == (not p.strategy.multi_process)
    if p.accelerator == "cuda":
        assert all(0 <= d < gpus for d in p.devices)


# -- python -m scopedlite run --accelerator/--strategy/--devices/--num-nodes/--precision -------
CLI = {"SCOPEDLITE_CLI_STRATEGY": "ddp", "SCOPEDLITE_CLI_DEVICES": "2", "SCOPEDLITE_CLI_PRECISION": "bf16-mixed"}


def test_arguments_left_at_their_default_take_the_command_lines_values():
    p = plan(env={**TORCHRUN, **CLI, "SCOPEDLITE_CLI_ACCELERATOR": "cpu", "SCOPEDLITE_CLI_NUM_NODES": "2"})
    assert (p.strategy.name, p.devices, p.precision.name, p.accelerator, p.num_nodes) == (
        "ddp",
        (0, 1),
        "bf16-mixed",
        "cpu",
        2,
    )
    # written out at the default value counts as the default
    assert plan(env={**TORCHRUN, **CLI}, precision="32-true", strategy="auto").precision.name == "bf16-mixed"
    # the command line's strategy, not "auto"'s choice: fsdp rather than ddp
    assert plan(env={**TORCHRUN, "SCOPEDLITE_CLI_STRATEGY": "fsdp"}).strategy.name == "fsdp"


def test_arguments_that_agree_with_the_command_line_are_kept():
    instance = lite.DDPStrategy(find_unused_parameters=True)
    p = plan(env={**TORCHRUN, **CLI}, strategy=instance, devices="2", precision="bf16-mixed")
    assert p.strategy.name == "ddp" and p.strategy.fresh().describe() == instance.fresh().describe()
    assert plan(env={**TORCHRUN, "SCOPEDLITE_CLI_STRATEGY": "ddp_fork"}, strategy="ddp_notebook").strategy.name == "ddp"
    assert plan(env={**TORCHRUN, **CLI}, machine=GPU4, devices=[2, 3]).devices == (2, 3)


@pytest.mark.parametrize(
    ("kwargs", "env", "words"),
    [
        ({"strategy": "fsdp"}, CLI, ["launch(strategy='fsdp')", "--strategy ddp", "Remove strategy="]),
        ({"strategy": lite.FSDPStrategy()}, CLI, ["--strategy ddp", "FSDP"]),
        ({"devices": 4}, CLI, ["launch(devices=4)", "--devices 2"]),
        ({"devices": [0, 1, 2]}, CLI, ["launch(devices=[0, 1, 2])", "--devices 2"]),
        ({"precision": "64-true"}, CLI, ["launch(precision='64-true')", "--precision bf16-mixed"]),
        (
            {"accelerator": "cuda"},
            {"SCOPEDLITE_CLI_ACCELERATOR": "cpu"},
            ["launch(accelerator='cuda')", "--accelerator cpu"],
        ),
        ({"num_nodes": 1}, {"SCOPEDLITE_CLI_NUM_NODES": "2"}, ["launch(num_nodes=1)", "--num-nodes 2"]),
        ({}, {"SCOPEDLITE_CLI_PRECISION": "fp8"}, ["SCOPEDLITE_CLI_PRECISION='fp8'", "--precision", "'bf16-mixed'"]),
    ],
)
def test_an_explicit_argument_contradicting_the_command_line_names_both(kwargs, env, words):
    with pytest.raises(ValueError) as info:
        plan(env={**TORCHRUN, **env}, machine=GPU4, **kwargs)
    for word in words:
        assert word in str(info.value), str(info.value)
