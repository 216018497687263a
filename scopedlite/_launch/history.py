"""What this interpreter has done with launch blocks so far.

Process state by nature: it describes this interpreter's history, not a scope, so it lives
in module globals, written only here.
"""

from __future__ import annotations

__all__ = ["blocks_entered", "describe_identity", "enter", "launched_before", "mark_launched"]

# Whether this process already started a multi-process block (script or fork). A worker
# re-executing the script would run that block again, so a later block must fork.
_launched = [False]

# How many launch blocks this process entered at each file:line. A launch is identified by
# its site *and* this count ("x.py:3#2"), so a helper holding one `with lite.launch(...)`
# called twice (`run(1); run(2)`) gives two launches a worker can tell apart.
_entered_at: dict[str, int] = {}


def launched_before() -> bool:
    return _launched[0]


def mark_launched() -> None:
    _launched[0] = True


def enter(site: str) -> str:
    """Count one more entry of the launch at ``site``; return its identity (``site#n``)."""
    _entered_at[site] = _entered_at.get(site, 0) + 1
    return f"{site}#{_entered_at[site]}"


def blocks_entered() -> int:
    """How many launch blocks this process has entered: what separates one use of the
    default run (outside every block) from the next."""
    return sum(_entered_at.values())


def describe_identity(identity: str) -> str:
    """``x.py:3#2`` -> ``x.py:3 (launch block number 2 entered there)``."""
    site, _, count = identity.rpartition("#")
    if not site or count == "1":
        return site or identity
    return f"{site} (launch block number {count} entered there)"
