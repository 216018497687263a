"""``python -m scopedlite``: command-line entry points.

One subcommand per job, each a pair of functions (add its arguments, run it) registered in
:data:`SUBCOMMANDS`, so adding one (``consolidate``, ...) touches nothing else.

``run`` starts a script on one or several nodes by handing it to ``torch.distributed.run``
(torchrun), which already does rendezvous, restarts and failure reporting well: this module
only translates our flag names into torchrun's. ``lite.launch`` inside the script then finds
torchrun's world and joins it, and a plain ``torch.distributed`` script runs unchanged.
``--accelerator``, ``--strategy``, ``--devices``, ``--num-nodes`` and ``--precision`` also reach
the script's ``lite.launch()`` through environment variables (:data:`COMMAND_LINE`), where an
argument the script leaves at its default takes the command line's value.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from scopedlite._core.precision import FABRIC_SHORT_NAMES, PRECISIONS
from scopedlite._plan import ACCELERATORS, COMMAND_LINE
from scopedlite._strategies.registry import STRATEGIES

__all__ = ["SUBCOMMANDS", "Subcommand", "main", "parse_args", "script_environment", "torchrun_argv"]

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Subcommand:
    """A subcommand: its one-line help, how to add its arguments, and what runs it."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _devices(text: str) -> str:
    if text in ("auto", "cpu", "gpu"):
        return text
    return str(_positive_int(text))


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1..65535)")
    return value


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--accelerator",
        choices=ACCELERATORS,
        default=None,
        help="launch(accelerator=) for the script's lite.launch() (default: the script's own)",
    )
    parser.add_argument(
        "--strategy",
        choices=["auto", *STRATEGIES],
        default=None,
        metavar="STRATEGY",
        help=f"launch(strategy=) for the script's lite.launch(): one of {', '.join(['auto', *STRATEGIES])}",
    )
    parser.add_argument(
        "--devices",
        type=_devices,
        default=None,
        help="processes on this node: a number, 'gpu' (one per GPU), 'cpu' or 'auto' (default 1); "
        "a number also becomes the script's launch(devices=)",
    )
    parser.add_argument(
        "--precision",
        choices=[*PRECISIONS, *FABRIC_SHORT_NAMES],
        default=None,
        help="launch(precision=) for the script's lite.launch() (default: the script's own)",
    )
    parser.add_argument("--num-nodes", type=_positive_int, default=None, help="number of nodes (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0..num-nodes-1 (default 0)")
    parser.add_argument("--main-address", default=None, help="address of node 0, which hosts the rendezvous")
    parser.add_argument("--main-port", type=_port, default=None, help=f"port on node 0 (default {DEFAULT_PORT})")
    parser.add_argument("-m", dest="module", action="store_true", help="run the target as a module, like python -m")
    parser.add_argument("target", help="the script (or module, with -m) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed on to the script")


def torchrun_argv(options: argparse.Namespace) -> list[str]:
    """Translate ``run``'s options into torchrun's command line (without the program name).

    One node without an address: ``--standalone`` (torchrun picks a free port). Otherwise
    torchrun's static rendezvous, which keeps the node ranks given on the command line, so
    rank 0 runs on node 0, at ``--main-address``.

    Raises:
        ValueError: The options contradict each other (a node rank out of range, several
            nodes without the address of node 0).
    """
    nodes, node_rank = options.num_nodes or 1, options.node_rank
    if not 0 <= node_rank < nodes:
        raise ValueError(f"--node-rank {node_rank} is not valid with --num-nodes {nodes}: use 0..{nodes - 1}.")
    if nodes > 1 and options.main_address is None:
        raise ValueError(
            f"--num-nodes {nodes} needs --main-address: the address of node 0 (the node started "
            "with --node-rank 0), the same on every node, e.g. --main-address node01."
        )
    argv = ["--nproc-per-node", options.devices or "1"]
    if nodes == 1 and options.main_address is None and options.main_port is None:
        argv.append("--standalone")
    else:
        argv += [
            "--nnodes", str(nodes),
            "--node-rank", str(node_rank),
            "--master-addr", options.main_address or "127.0.0.1",
            "--master-port", str(options.main_port or DEFAULT_PORT),
        ]  # fmt: skip
    argv += _torchrun_options(getattr(options, "torchrun_options", []))
    if options.module:
        argv.append("--module")
    return [*argv, options.target, *options.args]


# torchrun options that ``run`` sets from its own; given directly they would contradict them.
_OURS = {
    "--nproc-per-node": "--devices",
    "--nnodes": "--num-nodes",
    "--node-rank": "--node-rank",
    "--master-addr": "--main-address",
    "--master-port": "--main-port",
    "--standalone": "--main-address/--main-port (none given: standalone)",
    "--module": "-m",
}


def _torchrun_options(extra: Sequence[str]) -> list[str]:
    """Options ``run`` does not know, written before the script: handed to torchrun as they are.

    They must be written ``--name=value``: ``--max-restarts 3 train.py`` cannot be told apart
    from a script named ``3``.
    """
    for option in extra:
        name = option.split("=", 1)[0]
        normalized = name.replace("_", "-")
        if normalized in _OURS:
            raise ValueError(f"{option!r}: run sets torchrun's {normalized} itself; use {_OURS[normalized]} instead.")
        if not option.startswith("--") or "=" not in option:
            raise ValueError(
                f"{option!r} is not an option of run. Options for torchrun go before the script, "
                f"written --name=value (e.g. --max-restarts=3); see python -m torch.distributed.run --help."
            )
    return list(extra)


def script_environment(options: argparse.Namespace) -> dict[str, str]:
    """The variables that carry ``run``'s launch options to the script's ``lite.launch()``.

    Only options given on the command line are set, so the script's own arguments stay in
    force for the rest. ``--devices gpu|cpu|auto`` tells torchrun how many processes to
    start, and ``launch(devices="auto")`` already takes that count from torchrun's world, so
    only a number is passed on.
    """
    values = {
        "accelerator": options.accelerator,
        "strategy": options.strategy,
        "devices": options.devices if options.devices and options.devices.isdigit() else None,
        "num_nodes": None if options.num_nodes is None else str(options.num_nodes),
        "precision": options.precision,
    }
    return {COMMAND_LINE[name]: value for name, value in values.items() if value is not None}


def _run(options: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        argv = torchrun_argv(options)
    except ValueError as e:
        parser.error(str(e))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # torchrun's workers inherit this process's environment.
    added = script_environment(options)
    before = {name: os.environ.get(name) for name in added}
    os.environ.update(added)
    try:
        torchrun(argv)
    except ChildFailedError as e:
        # torchrun's own report (ranks, exit codes, error files) is the message to show; its
        # Python traceback adds nothing a user can act on.
        print(e, file=sys.stderr)
        return 1
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0


SUBCOMMANDS: dict[str, Subcommand] = {
    "run": Subcommand(
        help="run a script on one or several nodes (through torchrun); lite.launch joins its world",
        add_arguments=_add_run_arguments,
        run=_run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scopedlite", description="scopedlite command-line tools.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in SUBCOMMANDS.items():
        # no abbreviations: an unknown option is torchrun's, not a prefix of one of ours
        sub = commands.add_parser(name, help=command.help, description=command.help, allow_abbrev=False)
        command.add_arguments(sub)
        sub.set_defaults(_subcommand=command, _parser=sub)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; options ``run`` does not know, before the script, become
    ``torchrun_options`` (checked when torchrun's command line is built)."""
    options, extra = build_parser().parse_known_args(argv)
    options.torchrun_options = extra
    return options


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the subcommand; return its exit code."""
    options = parse_args(argv)
    return options._subcommand.run(options, options._parser)
