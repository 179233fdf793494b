"""What breaks on GPU clusters, reproduced on a CPU: mocked GPU counts and SLURM layouts,
SyncBatchNorm's default, and the clean-up of a process group whose peers are gone (in a
real process: tests/test_fault_tolerance.py's hanging rank).

The GPU side of these (and what cannot be mocked) is in tests/test_gpu.py.
"""
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from multi_train_utils import distributed_utils
from multi_train_utils.distributed_utils import DistEnv
from multi_train_utils.errors import UserError


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this process sees the GPUs whose UUIDs the test sets in ``visible``; records
    the devices made current."""
    state = SimpleNamespace(visible=[], current=[])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(state.visible))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(state.visible))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=state.visible[i]))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: state.current.append(torch.device(device)))
    return state


def meet(store, local_world_size, visible_by_rank, monkeypatch):
    """Every local rank of one node runs meet_node_peers at once (threads, one store), each
    seeing its own GPUs (and core); returns each rank's view of the node."""
    views, lock = {}, threading.Lock()

    by_thread = {}
    monkeypatch.setattr(distributed_utils, "visible_gpus", lambda: by_thread[threading.get_ident()][0])
    monkeypatch.setattr(distributed_utils, "cpu_affinity", lambda: by_thread[threading.get_ident()][1])

    def run(local_rank):
        with lock:
            by_thread[threading.get_ident()] = (visible_by_rank[local_rank], {local_rank})
        env = DistEnv(rank=local_rank, world_size=local_world_size, local_rank=local_rank,
                      local_world_size=local_world_size, launcher="slurm")
        views[local_rank] = distributed_utils.meet_node_peers(store, env)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(local_world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return views


def outcome(call):
    """What ``call()`` returns, or its UserError's message (so that a test asserts on either)."""
    try:
        return call()
    except UserError as e:
        return f"error: {e}"


def test_one_gpu_per_task_takes_its_own_gpu(gpus, monkeypatch):
    """srun --gpus-per-task=1: 4 tasks on a node, each sees one GPU as cuda:0, all different."""
    store = dist.HashStore()
    gpus.visible = ["GPU-2"]  # what local rank 2 sees (one GPU: each compares)
    views = meet(store, 4, [[f"GPU-{r}"] for r in range(4)], monkeypatch)
    device = outcome(lambda: distributed_utils.select_device("auto", local_rank=2, local_world_size=4,
                                                             node_peers=views[2]))
    assert device == torch.device("cuda", 0)
    assert gpus.current == [torch.device("cuda", 0)]  # made the current device
    assert [p["gpus"] for p in views[0]] == [["GPU-0"], ["GPU-1"], ["GPU-2"], ["GPU-3"]]  # every rank sees all


def test_processes_sharing_one_gpu_are_refused_unless_gloo(gpus, monkeypatch):
    store = dist.HashStore()
    gpus.visible = ["GPU-a"]
    views = meet(store, 2, [["GPU-a"], ["GPU-a"]], monkeypatch)
    with pytest.raises(UserError, match=r"local ranks 0, 1 of this node share GPU\(s\).*--dist-backend gloo"):
        distributed_utils.select_device("cuda", local_rank=1, local_world_size=2, node_peers=views[1])
    assert distributed_utils.select_device("cuda", 1, 2, views[1], shared_gpu_ok=True) == torch.device("cuda", 0)


def test_uuids_are_read_only_where_a_process_sees_fewer_gpus_than_its_node_has_processes(gpus, monkeypatch):
    """Reading a GPU's UUID initialises CUDA in the process: with a GPU for every process
    (the usual torchrun node) nothing is read before each takes its own."""
    gpus.visible = ["GPU-0", "GPU-1"]
    views = meet(dist.HashStore(), 2, [["GPU-0", "GPU-1"]] * 2, monkeypatch)
    assert [p["gpus"] for p in views[0]] == [[], []]


def test_gpus_of_the_local_rank_and_cuda_n_become_current(gpus):
    gpus.visible = ["GPU-0", "GPU-1"]
    assert distributed_utils.select_device("auto", local_rank=1, local_world_size=2) == torch.device("cuda", 1)
    assert distributed_utils.select_device("cuda:1") == torch.device("cuda", 1)
    assert gpus.current == [torch.device("cuda", 1)] * 2
    with pytest.raises(UserError, match="4 processes per node but only 2 GPU"):  # no store to compare through
        distributed_utils.select_device("auto", local_rank=3, local_world_size=4)


def test_loader_workers_divide_the_cores_among_the_processes_sharing_them(monkeypatch):
    """srun torchrun: one task with 64 cores (SLURM_CPUS_PER_TASK=64) and 8 workers sharing
    them: 8 each. Plain srun with per-task binding: each task its own 8 cores: 8 each, not 1.
    A big machine: at most MAX_WORKERS."""
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "64")
    node = [{"local_rank": r, "cpus": list(range(64)), "gpus": []} for r in range(8)]
    monkeypatch.setattr(distributed_utils, "cpu_affinity", lambda: set(range(64)))
    env = DistEnv(rank=3, world_size=16, local_rank=3, local_world_size=8, launcher="torchrun")
    sharing = distributed_utils.processes_sharing_cores(env, node)
    assert (sharing, distributed_utils.default_workers(sharing), distributed_utils.cores_per_process(sharing)) == (8, 8, 8)

    bound = [{"local_rank": r, "cpus": list(range(8 * r, 8 * r + 8)), "gpus": []} for r in range(8)]
    monkeypatch.setattr(distributed_utils, "cpu_affinity", lambda: set(range(24, 32)))
    slurm_env = DistEnv(rank=3, world_size=8, local_rank=3, local_world_size=8, launcher="slurm")
    sharing = distributed_utils.processes_sharing_cores(slurm_env, bound)
    assert (sharing, distributed_utils.default_workers(sharing)) == (1, 8)
    assert distributed_utils.processes_sharing_cores(slurm_env, None) == 8  # no store: all of the node's processes

    monkeypatch.setattr(distributed_utils, "cpu_affinity", lambda: set(range(256)))
    assert distributed_utils.default_workers(1) == distributed_utils.MAX_WORKERS == 16


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # no worker is started here
def test_validation_loader_has_at_most_two_workers_started_per_pass():
    from multi_train_utils.loaders import MAX_VAL_WORKERS, make_loader

    data = [torch.zeros(3, 4, 4, dtype=torch.uint8)] * 4
    train = make_loader(data, [[0, 1]], 6, torch.device("cpu"))
    val = make_loader(data, [[0, 1]], 6, torch.device("cpu"), validation=True)
    assert (train.num_workers, train.persistent_workers) == (6, True)
    assert (val.num_workers, val.persistent_workers) == (MAX_VAL_WORKERS, False) == (2, False)
    val = make_loader(data, [[0]], 1, torch.device("cpu"), validation=True)
    assert val.num_workers == 1


def test_sync_bn_is_opt_in_and_warns_with_compile(capsys):
    from multi_train_utils.model_setup import use_sync_bn

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert use_sync_bn(None, gpu, distributed=True) is False  # the default
    assert use_sync_bn(True, gpu, distributed=False) is False  # one process: nothing to sync
    assert capsys.readouterr().out == ""
    assert use_sync_bn(True, gpu, distributed=True, compiled=True) is True
    assert "--sync-bn with --compile: the compiled graph breaks at every SyncBatchNorm" in capsys.readouterr().out
    assert use_sync_bn(True, cpu, distributed=True) is False
    assert "--sync-bn needs GPUs" in capsys.readouterr().out


def test_failed_cleanup_aborts_nccl_and_does_not_wait_for_a_stuck_group(monkeypatch, capsys):
    """On the error path an NCCL group is aborted, not destroyed (destroying waits for work in
    flight); whatever leaving does, the clean-up returns within its bound."""
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda: calls.append("abort") or time.sleep(60))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: calls.append("destroy"))
    start = time.monotonic()
    distributed_utils.cleanup(failed=True, seconds=1)
    assert time.monotonic() - start < 5 and calls == ["abort"]
    assert "did not shut down within 1 s" in capsys.readouterr().err
    distributed_utils.cleanup()  # success: a plain destroy
    assert calls == ["abort", "destroy"]
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")  # gloo has no abort: a bounded destroy
    distributed_utils.cleanup(failed=True, seconds=1)
    assert calls == ["abort", "destroy", "destroy"]
