"""Detecting existing worlds (SLURM, MPI, LSF, Kubeflow, a process group made before launch)
from plain environment mappings.

The variable sets below are what each tool really exports (SLURM 22.05, Open MPI 4.1 and
jsrun/PyTorchJob as documented); the real SLURM and mpirun runs are in test_worlds.py.
"""

from __future__ import annotations

import pytest

from scopedlite._cluster.environments import World, detect_world, existing_group_world
from scopedlite._cluster.hostlist import expand_hostlist, expand_tasks_per_node
from scopedlite._hardware.machine import Machine
from scopedlite._plan import resolve

# What `srun -N3 -n7` sets for task 4 (node 1 of "node[01-03]"), abridged to what matters.
SRUN = {
    "SLURM_JOB_ID": "4321",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "7",
    "SLURM_STEP_NUM_TASKS": "7",
    "SLURM_STEP_TASKS_PER_NODE": "3(x2),1",
    "SLURM_STEP_NODELIST": "node[01-03]",
    "SLURM_JOB_NODELIST": "node[01-03]",
}

# Inside an sbatch script before any srun: PROCID and NTASKS exist, no step.
SBATCH = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")} | {
    "SLURM_PROCID": "0",
    "SLURM_NODEID": "0",
    "SLURM_LOCALID": "0",
}

MPIRUN = {  # `mpirun -n 2`, rank 1, both on this node
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1",  # a rank on the node, not the node's index
    "OMPI_MCA_ess_base_jobid": "1460076545",
    "PMIX_NAMESPACE": "1460076545",
}

HYDRA = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_JOBID": "kvs_77_0"}

JSRUN = {
    "LSB_JOBID": "98765",
    "JSM_NAMESPACE_RANK": "5",
    "JSM_NAMESPACE_SIZE": "8",
    "JSM_NAMESPACE_LOCAL_RANK": "1",
    "LSB_MCPU_HOSTS": "batch3 1 h41n01 42 h41n02 42",
}

# The port derived from a job id (docs/launching.md), written out here rather than computed with
# the code under test: a numeric id gives 15000 + id % 20000; any other id 15000 + CRC-32 of its
# UTF-8 bytes % 20000 (zlib.crc32, the same in every process, unlike hash()).
PORT_OF = {
    "4321": 19321,  # SLURM job 4321 without a step id
    "4321.0": 27899,  # its step 0: crc32(b"4321.0") = 2600312899
    "4321.1": 16269,  # crc32(b"4321.1") = 3992621269
    "4322.0": 34770,  # crc32(b"4322.0") = 2562399770
    "1460076545": 31545,  # Open MPI's job id: 1460076545 % 20000 = 16545
    "kvs_77_0": 23186,  # crc32(b"kvs_77_0") = 130868186
    "kvs_78_0": 20991,  # crc32(b"kvs_78_0") = 210805991
    "98765": 33765,  # LSF
}

PYTORCHJOB = {
    "KUBERNETES_PORT": "tcp://10.0.0.1:443",
    "MASTER_ADDR": "job-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "3",
    "RANK": "2",
}


# -- host lists ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
        ("a[8-11]", ["a8", "a9", "a10", "a11"]),
        ("a[098-101]", ["a098", "a099", "a100", "a101"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("x1,y[2-3],z", ["x1", "y2", "y3", "z"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_hostlist_expands(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-03", "node01]", "node[a-b]", "node[5-3]", "node[1-]"])
def test_malformed_hostlist_is_an_error(text):
    with pytest.raises(ValueError, match="Malformed SLURM host list"):
        expand_hostlist(text)


@pytest.mark.parametrize(("text", "counts"), [("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("1,4(x2)", [1, 4, 4])])
def test_tasks_per_node_expand(text, counts):
    assert expand_tasks_per_node(text) == counts


def test_malformed_tasks_per_node_is_an_error():
    with pytest.raises(ValueError, match=r"'2\(3\)'"):
        expand_tasks_per_node("2(3)")


# -- SLURM -------------------------------------------------------------------------------------
def test_slurm_step_is_a_world():
    world = detect_world(SRUN)
    assert world == World(
        source="slurm",
        global_rank=4,
        local_rank=1,
        node_rank=1,
        world_size=7,
        local_world_size=3,
        main_address="node01",
        main_port=PORT_OF["4321.0"],
        num_nodes=3,
    )


def test_sbatch_script_before_srun_is_not_a_world():
    assert "SLURM_PROCID" in SBATCH and "SLURM_NTASKS" in SBATCH
    assert detect_world(SBATCH) is None


def test_slurm_port_is_deterministic_per_step_and_overridable():
    a, b = detect_world(SRUN), detect_world(SRUN | {"SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0"})
    assert a.main_port == b.main_port == PORT_OF["4321.0"]
    assert detect_world(SRUN | {"SLURM_STEP_ID": "1"}).main_port == PORT_OF["4321.1"]
    assert detect_world(SRUN | {"SLURM_JOB_ID": "4322"}).main_port == PORT_OF["4322.0"]
    no_step = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    assert detect_world(no_step).main_port == PORT_OF["4321"]
    assert detect_world(SRUN | {"MASTER_PORT": "29511", "MASTER_ADDR": "login2"}).main_port == 29511
    assert detect_world(SRUN | {"MASTER_ADDR": "login2"}).main_address == "login2"


def test_slurm_step_nodelist_wins_over_the_job_nodelist():
    world = detect_world(SRUN | {"SLURM_STEP_NODELIST": "gpu[7-9]", "SLURM_JOB_NODELIST": "gpu[1-9]"})
    assert world.main_address == "gpu7"


def test_slurm_single_task_step_is_not_a_world():
    one = SRUN | {
        "SLURM_STEP_NUM_TASKS": "1",
        "SLURM_STEP_TASKS_PER_NODE": "1",
        "SLURM_PROCID": "0",
        "SLURM_NODEID": "0",
        "SLURM_LOCALID": "0",
    }
    assert detect_world(one) is None


def test_inconsistent_slurm_environment_is_a_clear_error():
    with pytest.raises(ValueError, match=r"SLURM_STEP_TASKS_PER_NODE='2\(x2\)'"):
        detect_world(SRUN | {"SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
    with pytest.raises(ValueError, match="SLURM_NODEID"):
        detect_world({k: v for k, v in SRUN.items() if k != "SLURM_NODEID"})


def test_torchrun_started_by_srun_is_torchruns_world():
    env = SRUN | {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1234"}
    assert detect_world(env).source == "torchelastic"


# -- MPI ---------------------------------------------------------------------------------------
def test_open_mpi_on_one_node():
    world = detect_world(MPIRUN)
    assert world == World("openmpi", 1, 1, 0, 2, 2, "127.0.0.1", PORT_OF["1460076545"])


def test_open_mpi_node_rank_is_the_node_index_not_ompis_node_rank():
    env = MPIRUN | {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "6",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "n1",
    }
    assert detect_world(env).node_rank == 2


def test_mpi_across_nodes_without_an_address_says_what_to_export():
    env = MPIRUN | {"OMPI_COMM_WORLD_SIZE": "4"}
    with pytest.raises(ValueError, match="MASTER_ADDR") as info:
        detect_world(env)
    assert "4 ranks, 2 on this node" in str(info.value)
    world = detect_world(env | {"MASTER_ADDR": "head", "MASTER_PORT": "2999"})
    assert (world.main_address, world.main_port, world.world_size) == ("head", 2999, 4)


def test_mpi_without_port_or_job_id_says_what_to_export():
    env = {k: v for k, v in MPIRUN.items() if k not in ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")}
    with pytest.raises(ValueError, match="MASTER_PORT"):
        detect_world(env)


def test_mpirun_inside_an_allocation_is_mpis_world_not_the_daemons_step():
    # mpirun in an sbatch script starts one daemon per node through srun: its ranks inherit
    # that step's variables, where SLURM_PROCID is the node index.
    env = SRUN | MPIRUN | {"MASTER_ADDR": "node01"}
    world = detect_world(env)
    assert world.source == "openmpi" and world.world_size == 2
    assert world.main_port == PORT_OF["1460076545"]


def test_mpich_and_intel_mpi():
    world = detect_world(HYDRA | {"MASTER_ADDR": "n0"})
    assert world == World("mpich", 3, 1, 1, 4, 2, "n0", PORT_OF["kvs_77_0"])
    assert detect_world(HYDRA | {"MASTER_ADDR": "n0", "PMI_JOBID": "kvs_78_0"}).main_port == PORT_OF["kvs_78_0"]


def test_srun_pmi2_without_hydras_local_variables_is_slurms_world():
    env = SRUN | {"PMI_RANK": "4", "PMI_SIZE": "7"}
    assert detect_world(env).source == "slurm"


def test_inconsistent_mpi_ranks_are_a_clear_error():
    with pytest.raises(ValueError, match="global rank 2 is outside 0..1"):
        detect_world(MPIRUN | {"OMPI_COMM_WORLD_RANK": "2"})
    with pytest.raises(ValueError, match="not an integer"):
        detect_world(MPIRUN | {"OMPI_COMM_WORLD_SIZE": "two"})


# -- LSF and Kubeflow ---------------------------------------------------------------------------
def test_lsf_jsrun_skips_the_launch_node():
    world = detect_world(JSRUN)
    assert world == World("lsf", 5, 1, 1, 8, 4, "h41n01", PORT_OF["98765"])


def test_lsf_local_size_from_jsm_when_given():
    world = detect_world(
        JSRUN | {"JSM_NAMESPACE_LOCAL_SIZE": "2", "JSM_NAMESPACE_RANK": "6", "JSM_NAMESPACE_LOCAL_RANK": "0"}
    )
    assert (world.local_world_size, world.node_rank) == (2, 3)


def test_lsf_uneven_hosts_is_a_clear_error():
    with pytest.raises(ValueError, match="JSM_NAMESPACE_LOCAL_SIZE"):
        detect_world(JSRUN | {"JSM_NAMESPACE_SIZE": "7", "JSM_NAMESPACE_RANK": "1"})


def test_kubeflow_pytorchjob_pod():
    world = detect_world(PYTORCHJOB)
    assert world == World("kubeflow", 2, 0, 2, 3, 1, "job-master-0", 23456)


def test_plain_kubernetes_pod_is_not_a_world():
    assert detect_world({"KUBERNETES_PORT": "tcp://10.0.0.1:443", "MASTER_ADDR": "x"}) is None


@pytest.mark.parametrize("env", [MPIRUN, HYDRA, JSRUN, SRUN, PYTORCHJOB])
def test_one_process_worlds_are_not_joined(env):
    one = dict(env)
    for name in (
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "PMI_SIZE",
        "MPI_LOCALNRANKS",
        "JSM_NAMESPACE_SIZE",
        "SLURM_STEP_NUM_TASKS",
        "WORLD_SIZE",
    ):
        if name in one:
            one[name] = "1"
    for name in (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "PMI_RANK",
        "MPI_LOCALRANKID",
        "JSM_NAMESPACE_RANK",
        "JSM_NAMESPACE_LOCAL_RANK",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "RANK",
    ):
        if name in one:
            one[name] = "0"
    one.update({"SLURM_STEP_TASKS_PER_NODE": "1"} if "SLURM_PROCID" in one else {})
    one.update({"LSB_MCPU_HOSTS": "h1 1"} if "LSB_JOBID" in one else {})
    assert detect_world(one) is None


# -- the resolver with these worlds -------------------------------------------------------------
def _resolve(env, **kwargs):
    return resolve(accelerator="cpu", env=env, machine=Machine(cpu_count=2), **kwargs)


@pytest.mark.parametrize(
    ("env", "world_size", "per_node", "nodes"),
    [(MPIRUN, 2, 2, 1), (HYDRA | {"MASTER_ADDR": "n0"}, 4, 2, 2), (JSRUN, 8, 4, 2), (PYTORCHJOB, 3, 1, 3)],
)
def test_resolver_joins_external_worlds(env, world_size, per_node, nodes):
    plan = _resolve(env)
    assert (plan.launcher, plan.world_size, plan.local_world_size, plan.num_nodes) == (
        "join",
        world_size,
        per_node,
        nodes,
    )
    assert plan.strategy.name == "ddp"
    assert _resolve(env, devices=per_node, num_nodes=nodes).world_size == world_size


def test_resolver_joins_a_slurm_step_with_uneven_nodes():
    plan = _resolve(SRUN)
    assert (plan.launcher, plan.world_size, plan.local_world_size, plan.num_nodes) == ("join", 7, 3, 3)
    last_node = SRUN | {"SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "2"}
    assert _resolve(last_node, devices=1, num_nodes=3).local_world_size == 1


@pytest.mark.parametrize(
    ("env", "kwargs", "source"),
    [
        (MPIRUN, {"devices": 3}, "openmpi"),
        (MPIRUN, {"devices": 2, "num_nodes": 2}, "openmpi"),
        (SRUN, {"devices": 3, "num_nodes": 2}, "slurm"),
        (SRUN, {"devices": 2}, "slurm"),
        (JSRUN, {"devices": 8}, "lsf"),
        (PYTORCHJOB, {"devices": 2}, "kubeflow"),
    ],
)
def test_resolver_refuses_a_mismatch_with_the_world(env, kwargs, source):
    with pytest.raises(ValueError, match=f"but the {source} world has") as info:
        _resolve(env, **kwargs)
    assert "devices='auto'" in str(info.value)


def test_resolver_refuses_a_launcher_inside_an_external_world():
    with pytest.raises(
        ValueError, match=r"launcher='fork' cannot be used inside an existing world \(made by openmpi\)"
    ):
        _resolve(MPIRUN, launcher="fork")


def test_resolver_in_an_sbatch_script_starts_its_own_ranks():
    plan = resolve(accelerator="cpu", devices=2, env=SBATCH, machine=Machine(cpu_count=2))
    assert plan.launcher == "script" and plan.world is None


# -- a default process group that exists before launch (Ray Train, a framework, the script) --
# What Ray Train 2.60 sets in the worker of rank 3 of 4, two per node (no TORCHELASTIC_RUN_ID).
RAY_WORKER = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "NODE_RANK": "1",
    "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "41999",
}


@pytest.mark.parametrize(
    ("env", "group", "place"),
    [
        (RAY_WORKER, (3, 4), (3, 1, 1, 4, 2)),
        (
            RAY_WORKER | {"KUBERNETES_PORT": "tcp://10.0.0.1:443"},
            (3, 4),
            (3, 1, 1, 4, 2),
        ),  # KubeRay: LOCAL_RANK, not Kubeflow's 0
        ({}, (1, 3), (1, 1, 0, 3, 3)),  # made by hand, no variables: every rank on this node
        (MPIRUN, (1, 2), (1, 1, 0, 2, 2)),  # the launcher's local facts, though it gave no port
        (HYDRA, (3, 4), (3, 1, 1, 4, 2)),
        ({}, (0, 1), (0, 0, 0, 1, 1)),  # a group of one is joined too: launch may not make another
    ],
)
def test_an_existing_group_is_a_world_with_its_ranks_and_the_environments_local_facts(env, group, place):
    world = existing_group_world(env, *group)
    assert world.source == "process_group"
    assert (world.global_rank, world.local_rank, world.node_rank, world.world_size, world.local_world_size) == place


def test_an_environment_that_disagrees_with_the_existing_group_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"rank 2 of 4\), but the environment says RANK=3 WORLD_SIZE=4"):
        existing_group_world(RAY_WORKER, 2, 4)


def _resolve_in_group(env, group, **kwargs):
    return resolve(accelerator="cpu", env=env, machine=Machine(cpu_count=2, process_group=group), **kwargs)


def test_resolver_joins_an_existing_group_before_any_launcher_environment():
    plan = _resolve_in_group(RAY_WORKER, (3, 4))
    assert (plan.launcher, plan.world_size, plan.local_world_size, plan.num_nodes, plan.world.source) == (
        "join",
        4,
        2,
        2,
        "process_group",
    )
    assert plan.strategy.name == "ddp"
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "1"}
    assert _resolve_in_group(torchrun, (0, 1)).world.source == "process_group"  # never a second group
    assert _resolve_in_group({}, (0, 1), strategy="single").launcher == "join"


@pytest.mark.parametrize(
    ("kwargs", "asked"),
    [
        ({"devices": 3}, "3 process(es) per node on 1 node(s)"),
        ({"num_nodes": 2}, "2 process(es) per node on 2 node(s)"),
    ],
)
def test_resolver_refuses_a_size_that_disagrees_with_the_existing_group_naming_both(kwargs, asked):
    with pytest.raises(ValueError) as info:
        _resolve_in_group({}, (0, 2), **kwargs)
    assert asked in str(info.value) and "the process_group world has 2 per node and 2 in all" in str(info.value)


def test_resolver_refuses_a_timeout_for_a_group_it_did_not_make():
    with pytest.raises(ValueError, match=r"launch\(timeout=30\).*TorchConfig\(timeout_s=...\)"):
        _resolve_in_group(RAY_WORKER, (3, 4), timeout=30)
