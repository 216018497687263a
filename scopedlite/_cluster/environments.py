"""Cluster environments: worlds that already exist when ``launch`` is called.

When a process was started by torchrun, srun (SLURM), mpirun (Open MPI, MPICH, Intel MPI),
jsrun (LSF), a Kubeflow PyTorchJob, or is a worker that our own launcher re-executed, the
world is already there: ``launch`` spawns nothing and joins it. Each environment is one
small detector that reads a mapping of environment variables and returns a :class:`World`
or None. Detection is pure (it reads the mapping it is given, never ``os.environ``), so the
resolver stays a pure function and tests pass plain dicts.

A default process group that exists already (Ray Train makes one in each worker; so may a
framework or the script itself) is a world too, joined like torchrun's:
:func:`existing_group_world` takes its rank and size from the group and the local facts from
the environment.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Mapping

from scopedlite._cluster.hostlist import expand_hostlist, expand_tasks_per_node

__all__ = [
    "DETECTORS",
    "ENV",
    "EXISTING_GROUP",
    "OURS",
    "TORCHELASTIC",
    "World",
    "derived_port",
    "detect_world",
    "existing_group_world",
]


class ENV:
    """Names of the variables our launcher hands to the workers it starts."""

    TOKEN = "SCOPEDLITE_LAUNCH_TOKEN"  # identifies the launch that started this worker
    SITE = "SCOPEDLITE_LAUNCH_SITE"  # file:line of that launch, checked by the worker
    ERROR_FILE = "SCOPEDLITE_ERROR_FILE"  # where a failing worker writes its traceback
    PARENT_PID = "SCOPEDLITE_PARENT_PID"


# The makers of a world that launch treats in a way of its own (World.is_ours, ...).
OURS = "scopedlite"  # a worker our launcher started
TORCHELASTIC = "torchelastic"  # torchrun
EXISTING_GROUP = "process_group"  # a default process group made before launch


@dataclass(frozen=True)
class World:
    """An existing world this process is a member of.

    Attributes:
        source: Who made it: ``"scopedlite"`` (:data:`OURS`: a worker of ours),
            ``"torchelastic"`` (:data:`TORCHELASTIC`), ``"slurm"``, ``"openmpi"``,
            ``"mpich"``, ``"lsf"``, ``"kubeflow"``, or ``"process_group"``
            (:data:`EXISTING_GROUP`: a default process group made before ``launch``, by Ray
            Train, a framework or the script; launch never destroys it). Code that treats one
            of them apart asks :attr:`is_ours`, :attr:`is_torchelastic` or
            :attr:`is_existing_group`; the name itself is for messages.
        global_rank, local_rank, node_rank, world_size, local_world_size: As in torchrun.
        main_address, main_port: Where rank 0's rendezvous store listens.
        num_nodes: Number of nodes when the environment says so (SLURM may place different
            numbers of tasks on different nodes); 0 when it is world_size // local_world_size.
    """

    source: str
    global_rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    main_address: str
    main_port: int
    num_nodes: int = 0

    @property
    def is_ours(self) -> bool:
        """A worker our launcher started: rank 0 (the user's process) hosts the store."""
        return self.source == OURS

    @property
    def is_torchelastic(self) -> bool:
        """Started by torchrun, whose agent hosts the store (``env://``)."""
        return self.source == TORCHELASTIC

    @property
    def is_existing_group(self) -> bool:
        """A default process group made before launch: joined as it is, never destroyed."""
        return self.source == EXISTING_GROUP


def _int(env: Mapping[str, str], name: str, source: str) -> int:
    raw = env.get(name)
    if raw is None:
        raise ValueError(
            f"The {source} environment is incomplete: the variable {name} is not set. "
            f"Variables present: {sorted(k for k in env if k.isupper())[:40]}."
        )
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"The {source} environment has {name}={raw!r}, not an integer.") from e


def _standard_world(env: Mapping[str, str], source: str) -> World:
    world_size = _int(env, "WORLD_SIZE", source)
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
    return World(
        source=source,
        global_rank=_int(env, "RANK", source),
        local_rank=_int(env, "LOCAL_RANK", source),
        node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", "0"))),
        world_size=world_size,
        local_world_size=local_world_size,
        main_address=env.get("MASTER_ADDR", "127.0.0.1"),
        main_port=_int(env, "MASTER_PORT", source),
    )


def _ours(env: Mapping[str, str]) -> World | None:
    if ENV.TOKEN not in env:
        return None
    return _standard_world(env, OURS)


def _torchelastic(env: Mapping[str, str]) -> World | None:
    # torchrun always sets TORCHELASTIC_RUN_ID; RANK alone could be anything.
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    return _standard_world(env, TORCHELASTIC)


def derived_port(job_id: str) -> int:
    """A port every rank of one job computes alike, from an id they all share.

    Numeric ids map to 15000 + id mod 20000 (consecutive jobs get different ports); other
    ids are hashed with CRC-32, which, unlike ``hash()``, is the same in every process.
    """
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return 15000 + number % 20000


def _port(env: Mapping[str, str], source: str, job_ids: tuple[str, ...]) -> int:
    if "MASTER_PORT" in env:
        return _int(env, "MASTER_PORT", source)
    for name in job_ids:
        if env.get(name):
            return derived_port(env[name])
    raise ValueError(
        f"The {source} world gives no port for rank 0's rendezvous and no job id to derive "
        f"one from (looked for {', '.join(job_ids)}). Export one before starting the job, "
        "e.g. `export MASTER_PORT=29500`."
    )


def _mpi_address(env: Mapping[str, str], source: str, world_size: int, local_world_size: int) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if local_world_size == world_size:
        return "127.0.0.1"  # every rank is on this node
    raise ValueError(
        f"The {source} world spans several nodes ({world_size} ranks, {local_world_size} on "
        "this node) but does not say where rank 0 runs. Export the address of rank 0's node "
        "and a free port to every rank, e.g. `mpirun -x MASTER_ADDR=$(hostname) -x "
        "MASTER_PORT=29500 ...`."
    )


def _check_ranks(world: World) -> World:
    problems = []
    if not 0 <= world.global_rank < world.world_size:
        problems.append(f"global rank {world.global_rank} is outside 0..{world.world_size - 1}")
    if not 0 <= world.local_rank < world.local_world_size:
        problems.append(f"local rank {world.local_rank} is outside 0..{world.local_world_size - 1}")
    if world.local_world_size > world.world_size:
        problems.append(f"{world.local_world_size} ranks on this node but {world.world_size} in all")
    if problems:
        raise ValueError(f"The {world.source} environment is inconsistent: {'; '.join(problems)}.")
    return world


# Several MPI implementations also export a job id; SLURM's and LSF's cover mpirun inside
# an allocation. Used only to derive a port when MASTER_PORT is not set.
_MPI_JOB_IDS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMI_JOBID", "SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID")


def _mpi_world(env: Mapping[str, str], source: str, names: tuple[str, str, str, str]) -> World | None:
    rank_name, size_name, local_rank_name, local_size_name = names
    if not all(name in env for name in names):
        return None
    world_size, local_world_size = _int(env, size_name, source), _int(env, local_size_name, source)
    global_rank = _int(env, rank_name, source)
    return _check_ranks(
        World(
            source=source,
            global_rank=global_rank,
            local_rank=_int(env, local_rank_name, source),
            # Open MPI's OMPI_COMM_WORLD_NODE_RANK is a rank *on* the node across jobs, not
            # the node's index: derive it from mpirun's default by-slot placement instead.
            node_rank=global_rank // max(1, local_world_size),
            world_size=world_size,
            local_world_size=local_world_size,
            main_address=_mpi_address(env, source, world_size, local_world_size),
            main_port=_port(env, source, _MPI_JOB_IDS),
        )
    )


def _openmpi(env: Mapping[str, str]) -> World | None:
    names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    return _mpi_world(env, "openmpi", names)


def _mpich(env: Mapping[str, str]) -> World | None:
    # MPICH's and Intel MPI's Hydra. srun's PMI-2 also sets PMI_RANK/PMI_SIZE, but not the
    # local pair: such a process is left to the SLURM detector.
    return _mpi_world(env, "mpich", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))


def _slurm(env: Mapping[str, str]) -> World | None:
    # Only a job *step* (srun) is a world. Inside an sbatch script before srun, SLURM_PROCID
    # and SLURM_NTASKS are already set, but no process but this one exists: joining would
    # wait forever for the others. SLURM_STEP_NUM_TASKS is set by srun only.
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return None
    source = "slurm"
    world_size = _int(env, "SLURM_STEP_NUM_TASKS", source)
    node_rank = _int(env, "SLURM_NODEID", source)
    per_node_text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node_text is None:
        raise ValueError("The slurm environment is incomplete: SLURM_STEP_TASKS_PER_NODE is not set.")
    per_node = expand_tasks_per_node(per_node_text)
    if not 0 <= node_rank < len(per_node) or sum(per_node) != world_size:
        raise ValueError(
            f"The slurm environment is inconsistent: SLURM_STEP_TASKS_PER_NODE={per_node_text!r} "
            f"does not describe {world_size} tasks with this one on node {node_rank}."
        )
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if env.get("MASTER_ADDR"):
        address = env["MASTER_ADDR"]
    elif nodelist:
        address = expand_hostlist(nodelist)[0]
    else:
        raise ValueError("The slurm environment is incomplete: SLURM_STEP_NODELIST is not set.")
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT", source)
    else:
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job:
            raise ValueError("The slurm environment is incomplete: SLURM_JOB_ID is not set.")
        # Steps of one job may run at the same time: each gets its own port.
        step = env.get("SLURM_STEP_ID", "")
        port = derived_port(job if not step else f"{job}.{step}")
    return _check_ranks(
        World(
            source=source,
            global_rank=_int(env, "SLURM_PROCID", source),
            local_rank=_int(env, "SLURM_LOCALID", source),
            node_rank=node_rank,
            world_size=world_size,
            local_world_size=per_node[node_rank],
            main_address=address,
            main_port=port,
            num_nodes=len(per_node),
        )
    )


def _lsf(env: Mapping[str, str]) -> World | None:
    names = ("LSB_JOBID", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK")
    if not all(name in env for name in names):
        return None
    source = "lsf"
    world_size, global_rank = _int(env, "JSM_NAMESPACE_SIZE", source), _int(env, "JSM_NAMESPACE_RANK", source)
    # LSB_MCPU_HOSTS is "host ncpus host ncpus ...". On jsrun (CSM) systems the first host is
    # the launch node, which runs no task, so it is skipped when compute hosts follow.
    fields = env.get("LSB_MCPU_HOSTS", "").split()
    hosts = fields[0::2]
    if len(hosts) > 1:
        hosts = hosts[1:]
    if "JSM_NAMESPACE_LOCAL_SIZE" in env:
        local_world_size = _int(env, "JSM_NAMESPACE_LOCAL_SIZE", source)
    elif "OMPI_COMM_WORLD_LOCAL_SIZE" in env:
        local_world_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", source)
    elif hosts and world_size % len(hosts) == 0:
        local_world_size = world_size // len(hosts)
    else:
        raise ValueError(
            f"The lsf environment does not say how many of its {world_size} ranks run on this "
            f"node (no JSM_NAMESPACE_LOCAL_SIZE, and LSB_MCPU_HOSTS={env.get('LSB_MCPU_HOSTS')!r} "
            "does not divide them evenly). Run one jsrun resource set per node with equal "
            "task counts."
        )
    if env.get("MASTER_ADDR"):
        address = env["MASTER_ADDR"]
    elif hosts:
        address = hosts[0]
    else:
        address = _mpi_address(env, source, world_size, local_world_size)
    return _check_ranks(
        World(
            source=source,
            global_rank=global_rank,
            local_rank=_int(env, "JSM_NAMESPACE_LOCAL_RANK", source),
            node_rank=global_rank // max(1, local_world_size),
            world_size=world_size,
            local_world_size=local_world_size,
            main_address=address,
            main_port=_port(env, source, ("LSB_JOBID",)),
        )
    )


def _kubeflow(env: Mapping[str, str]) -> World | None:
    # A PyTorchJob pod: the operator sets the torch variables, one process per pod, and no
    # LOCAL_RANK. (With nprocPerNode it runs torchrun, which the torchelastic detector sees.)
    names = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
    if not all(name in env for name in names):
        return None
    source = "kubeflow"
    rank = _int(env, "RANK", source)
    return _check_ranks(
        World(
            source=source,
            global_rank=rank,
            local_rank=0,
            node_rank=rank,
            world_size=_int(env, "WORLD_SIZE", source),
            local_world_size=1,
            main_address=env["MASTER_ADDR"],
            main_port=_int(env, "MASTER_PORT", source),
        )
    )


# Checked in order; the first that recognises the environment wins. Our own marker comes
# first: a worker of ours started under torchrun is ours. torchrun comes next, so torchrun
# started by srun or mpirun is torchrun's world. MPI comes before SLURM: mpirun inside an
# allocation starts its ranks through srun, one daemon per node, and they inherit that
# step's SLURM_* variables (rank = node index), which describe the daemons, not the ranks.
DETECTORS: tuple[Callable[[Mapping[str, str]], World | None], ...] = (
    _ours,
    _torchelastic,
    _openmpi,
    _mpich,
    _lsf,
    _slurm,
    _kubeflow,
)


def detect_world(env: Mapping[str, str]) -> World | None:
    """Return the world this environment describes, or None outside any.

    Raises:
        ValueError: The environment names a world but is incomplete or inconsistent, or it
            spans nodes without saying where rank 0 is: better now than a hang later.
    """
    for detect in DETECTORS:
        world = detect(env)
        if world is not None:
            if world.world_size == 1 and world.source not in _ALWAYS_JOINED:
                return None  # `srun -n1`, `mpirun -n1`: nothing to join; launch may start ranks
            return world
    return None


_ALWAYS_JOINED = (OURS, TORCHELASTIC, EXISTING_GROUP)


def existing_group_world(env: Mapping[str, str], rank: int, size: int) -> World:
    """The world of a default process group that exists already: rank ``rank`` of ``size``.

    Rank and size are the group's. Where this process sits on its node comes from the
    environment: ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (torchrun, Ray Train), else a launcher
    that describes the same ranks (SLURM, MPI, LSF), else every rank is taken to be on this
    node (a group made by hand, e.g. ``init_process_group(init_method="tcp://...")``).

    Raises:
        ValueError: The environment's ``RANK``/``WORLD_SIZE`` disagree with the group's.
    """
    source = EXISTING_GROUP
    said = {name: env[name].strip() for name in ("RANK", "WORLD_SIZE") if name in env}
    group = {"RANK": str(rank), "WORLD_SIZE": str(size)}
    if any(said[name] != group[name] for name in said):
        shown = " ".join(f"{k}={v}" for k, v in said.items())
        raise ValueError(
            f"A default process group exists (rank {rank} of {size}), but the environment says "
            f"{shown}: launch cannot tell where this process belongs. Unset those variables, or "
            "create the group with the rank and world size they give."
        )
    local_rank, local_size, node_rank, nodes = rank, size, 0, 1
    if "LOCAL_RANK" in env:
        local_rank = _int(env, "LOCAL_RANK", source)
        local_size = _int(env, "LOCAL_WORLD_SIZE", source) if "LOCAL_WORLD_SIZE" in env else size
        node_rank = int(env.get("GROUP_RANK", env.get("NODE_RANK", rank // max(1, local_size))))
        nodes = 0
    else:
        described = _described_by_launcher(env)
        if described is not None and (described.global_rank, described.world_size) == (rank, size):
            local_rank, local_size = described.local_rank, described.local_world_size
            node_rank, nodes = described.node_rank, described.num_nodes
    return _check_ranks(
        World(
            source=source,
            global_rank=rank,
            local_rank=local_rank,
            node_rank=node_rank,
            world_size=size,
            local_world_size=local_size,
            main_address=env.get("MASTER_ADDR", "127.0.0.1"),
            main_port=int(env.get("MASTER_PORT", "0") or 0),
            num_nodes=nodes,
        )
    )


def _described_by_launcher(env: Mapping[str, str]) -> World | None:
    # Only the ranks matter here: the group needs no rendezvous, so a missing address or
    # port (which a detector would refuse) is filled in.
    filled = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", **env}
    for detect in DETECTORS:
        world = detect(filled)
        if world is not None:
            return world
    return None
