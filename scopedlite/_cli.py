"""``python -m scopedlite``: command-line entry points.

One subcommand per job, each a pair of functions (add its arguments, run it) registered in
:data:`SUBCOMMANDS`, so adding one (``consolidate``, ...) touches nothing else.

``run`` starts a script on one or several nodes by handing it to ``torch.distributed.run``
(torchrun), which already does rendezvous, restarts and failure reporting well: this module
only translates our flag names into torchrun's. ``lite.launch`` inside the script then finds
torchrun's world and joins it, and a plain ``torch.distributed`` script runs unchanged.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["SUBCOMMANDS", "Subcommand", "main", "torchrun_argv"]

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
        "--devices",
        type=_devices,
        default="1",
        help="processes on this node: a number, 'gpu' (one per GPU), 'cpu' or 'auto' (default 1)",
    )
    parser.add_argument("--num-nodes", type=_positive_int, default=1, help="number of nodes (default 1)")
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
    nodes, node_rank = options.num_nodes, options.node_rank
    if not 0 <= node_rank < nodes:
        raise ValueError(f"--node-rank {node_rank} is not valid with --num-nodes {nodes}: use 0..{nodes - 1}.")
    if nodes > 1 and options.main_address is None:
        raise ValueError(
            f"--num-nodes {nodes} needs --main-address: the address of node 0 (the node started "
            "with --node-rank 0), the same on every node, e.g. --main-address node01."
        )
    argv = ["--nproc-per-node", options.devices]
    if nodes == 1 and options.main_address is None and options.main_port is None:
        argv.append("--standalone")
    else:
        argv += [
            "--nnodes", str(nodes),
            "--node-rank", str(node_rank),
            "--master-addr", options.main_address or "127.0.0.1",
            "--master-port", str(options.main_port or DEFAULT_PORT),
        ]  # fmt: skip
    if options.module:
        argv.append("--module")
    return [*argv, options.target, *options.args]


def _run(options: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        argv = torchrun_argv(options)
    except ValueError as e:
        parser.error(str(e))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except ChildFailedError as e:
        # torchrun's own report (ranks, exit codes, error files) is the message to show; its
        # Python traceback adds nothing a user can act on.
        print(e, file=sys.stderr)
        return 1
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
        sub = commands.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(_subcommand=command, _parser=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the subcommand; return its exit code."""
    options = build_parser().parse_args(argv)
    return options._subcommand.run(options, options._parser)
