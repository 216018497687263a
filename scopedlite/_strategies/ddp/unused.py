"""A parameter that received no gradient under plain DDP, named in the user's terms.

Without ``find_unused_parameters=True``, DDP's reducer waits in backward for a gradient of
every parameter that requires one; a layer the loss does not use never gives one, so the
step's all-reduce never completes, and DDP raises in the *next* forward. torch's message names
``DistributedDataParallel``'s keyword, which a script of ours never calls, and the parameters
by index ("Parameter indices which did not receive grad for rank 0: 2 3"), or by name only
under ``TORCH_DISTRIBUTED_DEBUG``. The set-up model's forward re-raises it naming our line,
``lite.DDPStrategy(find_unused_parameters=True)``, the parameters by their names in the user's
module, and the other ways out: freezing the layer, or removing it.
"""

from __future__ import annotations

import re

from torch.nn.parallel import DistributedDataParallel

from scopedlite._private.torch_internals import ddp_ignored_names

__all__ = ["forward_naming_unused", "reducer_parameter_names", "unused_parameters_error"]

_PREFIX = "Expected to have finished reduction in the prior iteration"
_NAMES = re.compile(r"Parameters which did not receive grad for rank (\d+): ([^\n]*)")
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


def is_unused_parameters_error(error: RuntimeError) -> bool:
    """Whether ``error`` is DDP's "the last backward left parameters without a gradient"."""
    return str(error).startswith(_PREFIX)


def reducer_parameter_names(ddp: DistributedDataParallel) -> list[str]:
    """The names, in the user's module, of the parameters DDP's reducer counts, in its order:
    those requiring a gradient, module by module as ``named_modules()`` lists them, without
    the ignored ones (``parameters_to_ignore``) and counting a shared parameter once, as
    ``DistributedDataParallel._build_params_for_reducer`` builds its list. torch's indices
    are positions in it."""
    ignored = ddp_ignored_names(ddp)
    seen: set[int] = set()
    names = []
    for module_name, module in ddp.module.named_modules():
        for name, parameter in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if parameter.requires_grad and full not in ignored and id(parameter) not in seen:
                seen.add(id(parameter))
                names.append(full)
    return names


def _unused_names(ddp: DistributedDataParallel, message: str) -> tuple[str | None, list[str]]:
    """(rank, names) from torch's message: its names where it printed them, else its indices
    mapped to names (or left as ``#i`` where the mapping has no such position)."""
    named = _NAMES.search(message)
    if named is not None:
        return named.group(1), [n.strip() for n in named.group(2).split(",") if n.strip()]
    indexed = _INDICES.search(message)
    if indexed is None:
        return None, []
    names = reducer_parameter_names(ddp)
    positions = [int(i) for i in indexed.group(2).split()]
    return indexed.group(1), [names[i] if i < len(names) else f"#{i}" for i in positions]


def _modules_of(names: list[str]) -> list[str]:
    """The layers holding ``names`` (``unused`` for ``unused.weight``), each once."""
    modules: dict[str, None] = {}
    for name in names:
        modules.setdefault(name.rpartition(".")[0] or name, None)
    return list(modules)


def unused_parameters_error(ddp: DistributedDataParallel, error: RuntimeError) -> RuntimeError:
    """Our message for DDP's ``error`` (see the module docstring), to raise ``from error``."""
    rank, names = _unused_names(ddp, str(error))
    on = f" on rank {rank}" if rank is not None else ""
    which = ", ".join(names) if names else "some parameters (torch did not say which)"
    freeze = " or ".join(f"`model.{m}.requires_grad_(False)`" for m in _modules_of(names)[:3]) or (
        "`layer.requires_grad_(False)`"
    )
    return RuntimeError(
        f"The model's parameters {which} received no gradient in the last backward{on}: the "
        "loss did not use them, so DDP's gradient all-reduce could not finish and this "
        "forward cannot start the next one. If some layers are meant to sit out some steps, "
        "let DDP look for them in every step (it costs a search of the graph per forward): "
        "`lite.launch(strategy=lite.DDPStrategy(find_unused_parameters=True), ...)`. If they "
        f"never train, freeze them before lite.setup ({freeze}) or remove them from the model. "
        "If they should have had a gradient, make every output of forward take part in the loss."
    )


def forward_naming_unused(ddp: DistributedDataParallel, *args: object, **kwargs: object) -> object:
    """``DistributedDataParallel.forward(ddp, ...)``, with DDP's unused-parameter error
    re-raised as :func:`unused_parameters_error` (``find_unused_parameters`` off only: with it
    on, the parameters were found, and torch's message about undetected outputs stands)."""
    try:
        return DistributedDataParallel.forward(ddp, *args, **kwargs)
    except RuntimeError as e:
        if ddp.find_unused_parameters or not is_unused_parameters_error(e):
            raise
        raise unused_parameters_error(ddp, e) from e
