"""Figures that depend on the layout of the job, worked out by hand for two nodes: the rank,
world size and processes per node read from torchrun's and SLURM's variables; each process's
share of the cores it may run on (torchrun's processes share their launcher's cores, bound srun
tasks have their own), hence its threads and loader workers; and the doctor's per-node report.
In-process, with the variables, the core affinity and the gathered facts made up."""
import os

import pytest
import torch

import tools.doctor as doctor
from conftest import LAUNCHER_VARIABLES
from multi_train_utils.options import config_of  # noqa: E402
from multi_train_utils import distributed_utils
from multi_train_utils.distributed_utils import (count_sharing, cores_per_process, default_workers,
                                                 processes_sharing_cores, read_dist_env)


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher's variables; afterwards the environment as it was (read_dist_env sets RANK,
    MASTER_ADDR ... itself, as srun's processes need)."""
    saved = dict(os.environ)
    for name in list(os.environ):
        if name in LAUNCHER_VARIABLES or name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    yield monkeypatch
    monkeypatch.undo()
    os.environ.clear()
    os.environ.update(saved)


def test_torchrun_on_the_second_of_two_nodes(clean_env):
    """torchrun --nnodes 2 --nproc_per_node 2: the last rank of the job is local rank 1 of 2."""
    for name, value in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                            TORCHELASTIC_RUN_ID="x").items():
        clean_env.setenv(name, value)
    env = read_dist_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (3, 4, 1, 2, "torchrun")
    assert processes_sharing_cores(env) == 2  # the processes of this node, not of the job


def test_srun_step_on_two_nodes_takes_the_steps_tasks_not_the_jobs(clean_env):
    """A job of 8 tasks (SLURM_NTASKS) running a step of 4 (2 per node): the step is the world."""
    for name, value in dict(SLURM_PROCID="3", SLURM_STEP_NUM_TASKS="4", SLURM_NTASKS="8", SLURM_LOCALID="1",
                            SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_TASKS_PER_NODE="4(x2)",
                            SLURM_STEP_NODELIST="gpu[07-08]", SLURM_NODELIST="gpu[07-10]", SLURM_JOB_ID="42").items():
        clean_env.setenv(name, value)
    env = read_dist_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (3, 4, 1, 2, "slurm")
    assert os.environ["MASTER_ADDR"] == "gpu07"  # the step's first node
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_WORLD_SIZE"]) == ("3", "4", "2")


@pytest.mark.parametrize("cores, sharing, per_process, workers", [(8, 2, 4, 4), (3, 2, 1, 1), (1, 4, 1, 1),
                                                                   (40, 2, 20, 16), (64, 1, 64, 16)])
def test_each_process_gets_its_share_of_the_cores_it_may_run_on(monkeypatch, cores, sharing, per_process, workers):
    """The cores of the affinity mask (taskset, cgroups, srun's binding), never the machine's."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(100, 100 + cores)))
    monkeypatch.setattr(os, "cpu_count", lambda: 256)
    assert distributed_utils.cpu_cores_available() == cores
    assert cores_per_process(sharing) == per_process
    assert default_workers(sharing) == workers


def test_bound_srun_tasks_share_no_cores_and_torchruns_processes_share_the_launchers():
    torchrun = [[0, 1, 2, 3], [0, 1, 2, 3]]
    srun_bound = [[0, 1], [2, 3], [4, 5]]
    assert [count_sharing(c, torchrun) for c in torchrun] == [2, 2]
    assert [count_sharing(c, srun_bound) for c in srun_bound] == [1, 1, 1]
    assert count_sharing([1, 2], srun_bound) == 2  # overlapping two tasks' cores


def facts(rank, local_rank, host, cpus):
    return {"rank": rank, "local_rank": local_rank, "host": host, "pid": 1000 + rank, "device": "cpu", "gpu": None,
            "torch": "2.x", "cores": len(cpus), "cores_per_process": len(cpus), "cpus": cpus, "shm_total": 2**30,
            "shm_free": 2**29, "output_dir": "/out", "disk_free": 5e9, "interfaces": ["eth0"], "variables": {}}


def test_the_doctor_reports_each_node_with_its_own_cores_per_process():
    """Node a: torchrun's 2 ranks on the same 8 cores: 4 each. Node b: 2 srun tasks bound to 3
    cores each: 3 each. Node b's ranks are the last ones (2, 3)."""
    gathered = {0: facts(0, 0, "a", list(range(8))), 1: facts(1, 1, "a", list(range(8))),
                2: facts(2, 0, "b", [0, 1, 2]), 3: facts(3, 1, "b", [3, 4, 5])}
    gathered = doctor.with_shared_cores(gathered, "gloo")
    assert {rank: f["cores_per_process"] for rank, f in gathered.items()} == {0: 4, 1: 4, 2: 3, 3: 3}
    report = doctor.format_report(gathered, {}, [], world_size=4, backend="gloo", rendezvous="a:29500", timeout=5)
    lines = report.splitlines()
    assert lines[0].startswith("doctor: 4 of 4 ranks joined, on 2 node(s); backend gloo")
    node_b = lines.index("node b: ranks 2-3") if "node b: ranks 2-3" in lines else \
        next(i for i, line in enumerate(lines) if line.startswith("node b: "))
    node_a = next(i for i, line in enumerate(lines) if line.startswith("node a: "))
    assert "  CPU cores per process: 4 (of 8 this process may use)" in lines[node_a:node_b]
    assert "  CPU cores per process: 3 (of 3 this process may use)" in lines[node_b:]
    assert [line for line in lines[node_b:] if line.startswith("  rank ")] == [
        "  rank 2: cpu (local rank 0, pid 1002)", "  rank 3: cpu (local rank 1, pid 1003)"]


@pytest.mark.parametrize("rank, local_rank, printed", [("0", "0", True), ("2", "0", True), ("3", "1", False)])
def test_bad_input_is_printed_once_per_node(clean_env, capsys, rank, local_rank, printed):
    """Two nodes of two processes: local rank 0 of each node prints the line (rank 2 is the
    second node's first), the others stay silent; an error of one rank's own is printed by it."""
    from multi_train_utils.errors import RankError, UserError, report_error

    for name, value in dict(RANK=rank, WORLD_SIZE="4", LOCAL_RANK=local_rank, LOCAL_WORLD_SIZE="2").items():
        clean_env.setenv(name, value)
    report_error(UserError("--data-path x: no such folder"))
    assert capsys.readouterr().err == ("error: --data-path x: no such folder\n" if printed else "")
    report_error(RankError("cannot decode image y.jpg"))
    assert capsys.readouterr().err == f"[rank {rank}] error: cannot decode image y.jpg\n"


def test_a_batch_larger_than_a_ranks_share_is_refused_on_two_nodes_of_one_process(tmp_path, monkeypatch):
    """Two nodes, one process each: 24 training images give each rank 12, whatever the node's
    own count of processes (1): --batch-size 13 is refused with the job's world size."""
    from multi_train_utils import run_files as inputs
    from multi_train_utils.distributed_utils import DistEnv
    from multi_train_utils.errors import UserError
    from multi_train_utils.options import get_args_parser, parse_args
    from my_dataset import build_datasets

    for name in ("a", "b"):
        os.makedirs(tmp_path / "data" / name)
        for i in range(15):
            (tmp_path / "data" / name / f"{i}.jpg").write_bytes(b"")
    monkeypatch.setattr(inputs, "current_job", lambda: DistEnv(1, 2, 0, 1, "torchrun"))
    monkeypatch.setattr(inputs, "get_world_size", lambda: 2)
    monkeypatch.setattr(inputs, "get_rank", lambda: 1)
    args = parse_args(get_args_parser(distributed=True), ["--data-path", str(tmp_path / "data"), "--batch-size", "13",
                                                          "--output-dir", str(tmp_path / "out")])
    with pytest.raises(UserError) as e:
        inputs.read_inputs(config_of(args), lambda: build_datasets(args), torch.device("cpu"))
    assert str(e.value) == ("--batch-size 13: each of the 2 process(es) gets only 12 of the 24 training images; "
                            "use --batch-size 12 or less")
    args.batch_size = 12
    assert len(inputs.read_inputs(config_of(args), lambda: build_datasets(args), torch.device("cpu")).data.train) == 24


@pytest.mark.parametrize("local_rank, writes", [(0, True), (1, False)])
def test_the_first_process_of_every_node_makes_the_demo_data(tmp_path, monkeypatch, local_rank, writes):
    """On the second of two nodes (global ranks 2 and 3: nodes need not share a file system),
    local rank 0 writes data/demo and local rank 1 waits for it."""
    from multi_train_utils import run_files as inputs
    from multi_train_utils.options import get_args_parser, parse_args

    class Built(Exception):
        """The datasets are built next: who made the data is decided by then."""

    def build_datasets(args):
        raise Built

    waited = []
    monkeypatch.setattr(inputs, "get_rank", lambda: 2 + local_rank)
    monkeypatch.setattr(inputs, "get_world_size", lambda: 4)
    monkeypatch.setattr(inputs, "make_demo_dataset", lambda path: os.makedirs(os.path.join(path, "written")))
    monkeypatch.setattr(inputs, "wait_for_folder", lambda path, **kw: waited.append(path))
    args = parse_args(get_args_parser(distributed=True), ["--demo", "--data-path", str(tmp_path / "demo")])
    with pytest.raises(Built):
        inputs.load_data(config_of(args), lambda: build_datasets(args), local_rank=local_rank, world_size=4)
    assert (tmp_path / "demo" / "written").is_dir() is writes
    assert waited == ([] if writes else [str(tmp_path / "demo")])


@pytest.mark.parametrize("sharing, threads, workers", [(1, 8, 8), (2, 4, 4), (3, 2, 2), (16, 1, 1)])
def test_a_process_takes_its_share_of_threads_and_workers_not_the_machines(monkeypatch, sharing, threads, workers):
    """configure_cpu_threads, as both scripts call it: 8 cores shared by ``sharing`` processes."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    before = torch.get_num_threads()
    try:
        got = distributed_utils.configure_cpu_threads(torch.device("cpu"), sharing=sharing)
        assert (torch.get_num_threads(), got) == (threads, workers)
        # --threads 3 and --workers 0 win
        assert distributed_utils.configure_cpu_threads(torch.device("cpu"), 3, 0, sharing=sharing) == 0
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_without_a_process_group_a_process_is_rank_0_of_1_whatever_the_variables(clean_env):
    """train_single.py started inside a torchrun or srun task (RANK set) is still the one
    process that prints and writes."""
    from multi_train_utils.distributed_utils import get_rank, get_world_size, is_main_process

    for name, value in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", SLURM_PROCID="3").items():
        clean_env.setenv(name, value)
    assert (get_rank(), get_world_size(), is_main_process()) == (0, 1, True)


def test_torchruns_local_rank_wins_over_a_local_rank_flag(clean_env):
    """A --local-rank left in a command line does not override the launcher's LOCAL_RANK."""
    for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2").items():
        clean_env.setenv(name, value)
    assert read_dist_env(local_rank_arg=0).local_rank == 1
    clean_env.delenv("LOCAL_RANK")
    assert read_dist_env(local_rank_arg=1).local_rank == 1  # torch.distributed.launch's --local-rank=K


@pytest.mark.parametrize("hosts, hinted", [(["node0", "node1"], False), (["node0", "node0"], True),
                                           (["node0", "node0", "node1"], True)])
def test_the_consumer_gpu_hint_counts_the_gpus_of_each_node_not_of_the_job(monkeypatch, hosts, hinted):
    """docs/multi-gpu.md: consumer GPUs several to a node (P2P between them) get the hint; one a
    node, on any number of nodes, does not."""
    from test_readme_promises import node_facts

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    geforce = {"name": "NVIDIA GeForce RTX 4090", "uuid": "GPU-1"}
    facts = {rank: node_facts(rank=rank, host=host, gpu=dict(geforce, uuid=f"GPU-{rank}"), device="cuda:0",
                              cpus=list(range(8 * rank, 8 * rank + 8)))
             for rank, host in enumerate(hosts)}
    facts = doctor.with_shared_cores(facts, "nccl")
    hinted_ranks = [rank for rank, f in facts.items() if any("consumer GPUs" in x["what"] for x in f["findings"])]
    assert hinted_ranks == ([r for r, h in enumerate(hosts) if hosts.count(h) > 1] if hinted else [])
