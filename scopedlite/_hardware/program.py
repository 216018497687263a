"""The command line that started this program, and how to start it again.

A re-executed worker must run exactly what the user typed: ``sys.orig_argv``, read by the
interpreter's own option grammar, never by the length of ``sys.argv``, which the script may
have edited (``sys.argv.pop()``, a config system consuming its arguments). Only the script's
path changes, made absolute, because a worker starts in the directory this program started
in, whatever ``os.chdir`` the script did since.

The command line is checked against what Python actually runs as ``__main__``: a program
started through a runner (``python -m pdb x.py``, ``runpy`` from another script) or by an
embedding host has a command line that would not start the same program, and saying so
beats starting workers on a guess.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Program", "parse_command_line", "this_program"]

# CPython's own grammar (Python/getopt.c, 3.10-3.13): one-letter flags may be combined
# (``-uB``); -c, -m, -W and -X take a value, attached (``-Xdev``) or as the next argument;
# -c and -m end the options; ``--`` ends them too, and the next argument is the script.
_FLAGS = frozenset("bBdEhiIJOPqRsStuvVx?")
_WITH_VALUE = frozenset("cmWX")
_LONG_FLAGS = frozenset({"--help", "--help-all", "--help-env", "--help-xoptions", "--version"})
_LONG_WITH_VALUE = frozenset({"--check-hash-based-pycs"})

FORMS = ("script", "module", "command", "stdin", "interactive")

WAY_OUT = (
    "Use launcher='fork' (the workers are forked from this process instead), or start the "
    "ranks yourself with torchrun (torchrun --nproc-per-node N script.py), which launch joins."
)


@dataclass(frozen=True)
class Typed:
    """What a command line asks the interpreter to run.

    Attributes:
        form: One of :data:`FORMS`: a script file (or a directory or zip with
            ``__main__.py``), ``-m`` module, ``-c`` command, ``-`` (stdin), or none
            (a bare ``python``: the REPL).
        value: The script's path, the module's name or the command's code as typed.
        index: Where the script's path stands in the command line (-1 for other forms).
    """

    form: str
    value: str = ""
    index: int = -1


def parse_command_line(argv: Sequence[str]) -> Typed:
    """Read ``argv`` (``sys.orig_argv``) as the interpreter did.

    Raises:
        ValueError: An option this grammar does not know: the target cannot be found.
    """
    i = 1
    while i < len(argv):
        token = argv[i]
        if token == "--":
            i += 1
            break
        if not token.startswith("-") or token == "-":
            break
        if token.startswith("--"):
            if token in _LONG_WITH_VALUE:
                i += 2
                continue
            if token in _LONG_FLAGS:
                i += 1
                continue
            raise ValueError(f"the interpreter option {token!r} is not one this parser knows")
        i += 1
        for position, letter in enumerate(token[1:], start=1):
            if letter in _FLAGS:
                continue
            if letter not in _WITH_VALUE:
                raise ValueError(f"the interpreter option -{letter} (in {token!r}) is not one this parser knows")
            attached = token[position + 1 :]
            if not attached:
                if i >= len(argv):
                    raise ValueError(f"the interpreter option -{letter} has no value")
                attached = argv[i]
                i += 1
            if letter == "c":
                return Typed("command", attached)
            if letter == "m":
                return Typed("module", attached)
            break  # -W / -X: the value was the rest of this token or the next argument
    if i >= len(argv):
        return Typed("interactive")
    if argv[i] == "-":
        return Typed("stdin")
    return Typed("script", argv[i], i)


@dataclass(frozen=True)
class Program:
    """How to start this program again.

    Attributes:
        form: The command line's form (:data:`FORMS`), or "" where it could not be read.
        command: The command line to run a worker with, or None.
        directory: Where to run it: the directory this program started in, as near as it
            can be known (exact for a relative script path and for ``-m``), or None.
        problem: Why the command line cannot start this program again, with the way out;
            None when it can (or when there is no command line at all: a REPL, stdin).
    """

    form: str
    command: tuple[str, ...] | None = None
    directory: str | None = None
    problem: str | None = None


def rebuild(
    *,
    orig_argv: Sequence[str],
    executable: str,
    main_file: str | None,
    main_spec: str | None,
    path0: str | None,
    imported_in: str | None,
) -> Program:
    """The pure part of :func:`this_program`, given what it reads from ``sys`` and ``__main__``.

    ``main_file``/``main_spec``: ``__main__.__file__`` and ``__main__.__spec__.name``;
    ``path0``: the directory Python put first on ``sys.path`` (None under ``-P``/``-I``);
    ``imported_in``: the working directory when scopedlite was imported.
    """
    if not orig_argv or not executable:
        what = "sys.orig_argv is empty" if not orig_argv else "sys.executable is empty"
        return Program(
            "", problem=f"this interpreter was not started from a command line ({what}: an embedding host). {WAY_OUT}"
        )
    try:
        typed = parse_command_line(orig_argv)
    except ValueError as e:
        return Program("", problem=f"the command line {list(orig_argv)!r} cannot be read: {e}. {WAY_OUT}")
    command = [executable, *orig_argv[1:]]
    if typed.form == "command":
        if main_file is not None:
            return _runner(typed, orig_argv, main_file)
        return Program("command", tuple(command), imported_in)
    if typed.form == "module":
        if main_spec not in (typed.value, typed.value + ".__main__"):
            return _runner(typed, orig_argv, main_file or main_spec or "an unknown module")
        directory = path0 if path0 and os.path.isabs(path0) and os.path.isdir(path0) else imported_in
        return Program("module", tuple(command), directory)
    if typed.form != "script":
        return Program(typed.form)  # stdin or a REPL: nothing to re-execute
    start = _script_directory(typed.value, main_file)
    if start is None:
        return _runner(typed, orig_argv, main_file or "no file")
    command[typed.index] = os.path.join(start, typed.value)  # as typed when it is absolute
    return Program("script", tuple(command), start or imported_in)


def _script_directory(typed: str, main_file: str | None) -> str | None:
    """The directory the typed script path was relative to, found from ``__main__.__file__``
    (absolute since Python 3.9: the start directory joined with the path as typed); "" for an
    absolute path; None when ``__main__`` is not that script."""
    if main_file is None or not os.path.isabs(main_file):
        return None
    package = typed.rstrip(os.sep)  # `python dir/` or `python app.zip`: __main__ is inside
    for suffix in (typed, package + os.sep + "__main__.py"):
        if os.path.isabs(typed):
            if main_file == suffix:
                return ""
        elif main_file.endswith(os.sep + suffix):
            return main_file[: -len(suffix) - 1] or os.sep
    return None


def _runner(typed: Typed, orig_argv: Sequence[str], main: str) -> Program:
    shown = {"command": "-c", "module": f"-m {typed.value}", "script": typed.value}[typed.form]
    return Program(
        typed.form,
        problem=(
            f"the command line {list(orig_argv)!r} runs {shown}, but the program Python runs "
            f"as __main__ is {main}: it was started through a runner (pdb, runpy, a profiler, "
            f"an embedding host), so re-executing the command line may not start this program "
            f"again. {WAY_OUT}"
        ),
    )


def this_program() -> Program:
    """How this process was started, read from ``sys.orig_argv`` and ``__main__``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    safe_path = getattr(sys.flags, "safe_path", False) or sys.flags.isolated  # no sys.path[0] entry
    package = sys.modules.get("scopedlite")
    return rebuild(
        orig_argv=list(getattr(sys, "orig_argv", None) or []),
        executable=sys.executable,
        main_file=getattr(main, "__file__", None),
        main_spec=getattr(spec, "name", None),
        path0=None if safe_path or not sys.path else sys.path[0],
        imported_in=getattr(package, "_START_DIRECTORY", None),
    )
