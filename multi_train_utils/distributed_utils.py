"""Where this process sits in the job, and the process group for every launcher.

The process group is set up for torchrun, torch.distributed.launch, SLURM and plain python.
Rank, world size and local rank come from the environment:
- torchrun / ``python -m torch.distributed.launch`` set RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; they win whenever they are present (so
  ``srun torchrun ...`` works too);
- ``srun python train_multi_gpu.py`` sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID; the
  rendezvous address is MASTER_ADDR if set, else the first host of SLURM_NODELIST, else
  SLURM_LAUNCH_NODE_IPADDR, and the port MASTER_PORT if set, else one derived from
  SLURM_JOB_ID (so two jobs on one node do not collide);
- anything else is a single process (world size 1) and no process group is created.
"""
import functools
import json
import os
import re
import socket
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from multi_train_utils.errors import RankError, UserError, die_with_launcher, run_cli


# --- Where this process sits in the job: its rank and the world size (0 of 1 without a process group) ---

def is_dist_avail_and_initialized():
    """True inside an initialised process group."""
    return dist.is_available() and dist.is_initialized()


def get_world_size():
    """Number of processes in the job (1 without a process group)."""
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def get_rank():
    """Global rank of this process (0 without a process group)."""
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def is_main_process():
    """Only global rank 0 prints, logs and writes files."""
    return get_rank() == 0


@dataclass
class DistEnv:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "none"  # "torchrun", "slurm" or "none"

    @property
    def distributed(self):
        """True when a process group is (to be) initialised."""
        return self.launcher != "none"


def expand_slurm_hostlist(hostlist):
    """Expand a SLURM hostlist such as ``node[01-03,07],rack[1-2]-gpu[1-2]`` into host names."""
    hosts = []
    # Split on commas that are not inside brackets.
    for part in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        match = re.search(r"\[([^\]]*)\]", part)
        if not match:
            hosts.append(part)
            continue
        head, tail = part[: match.start()], part[match.end():]
        for item in match.group(1).split(","):
            lo, _, hi = item.partition("-")
            numbers = [lo] if not hi else [f"{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1)]
            for number in numbers:
                hosts += expand_slurm_hostlist(f"{head}{number}{tail}")  # later bracket groups
    return hosts


def tasks_on_node(text, node, default=1):
    """The tasks on node ``node`` (0, 1, ... in the step's node order) of a SLURM count list such
    as '2(x3),1' (3 nodes of 2 tasks, then one of 1); ``default`` where it says nothing."""
    counts = []
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", text or ""):
        counts += [int(count)] * int(repeat or 1)
    return counts[node] if node < len(counts) else (counts[-1] if counts else default)


# MASTER_PORT derived from a SLURM job id: below Linux's ephemeral ports (32768 and up), which
# the kernel hands out to outgoing connections and could already be taken.
SLURM_PORTS = range(15000, 32000)


def read_dist_env(local_rank_arg=None):
    """Read rank, world size and local rank from torchrun's or SLURM's variables.

    For SLURM it also sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT so
    that ``init_method='env://'`` finds them.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        local_rank = int(env.get("LOCAL_RANK", local_rank_arg if local_rank_arg is not None else 0))
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=local_rank,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            launcher="torchrun" if "TORCHELASTIC_RUN_ID" in env else "env",
        )
    # srun sets SLURM_STEP_NUM_TASKS for the tasks of a step; a batch script running plain
    # python has SLURM_PROCID and SLURM_NTASKS too, but is one process.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        rank, world_size = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
        local_rank = int(env.get("SLURM_LOCALID", 0))
        node = int(env["SLURM_NODEID"]) if env.get("SLURM_NODEID", "").isdigit() else 0
        local_world_size = tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE"), node)
        if "MASTER_ADDR" not in env:
            nodes = expand_slurm_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or "")
            master = nodes[0] if nodes else env.get("SLURM_LAUNCH_NODE_IPADDR")
            if not master:
                raise UserError(
                    "SLURM job without SLURM_NODELIST or SLURM_LAUNCH_NODE_IPADDR: set MASTER_ADDR "
                    "to the first node's address"
                )
            env["MASTER_ADDR"] = master
        if "MASTER_PORT" not in env:  # two steps of one job running at once get different ports
            step = int(env.get("SLURM_STEP_ID", "0")) if env.get("SLURM_STEP_ID", "").isdigit() else 0
            job = int(env.get("SLURM_JOB_ID", "0")) + 1000 * step
            env["MASTER_PORT"] = str(SLURM_PORTS[job % len(SLURM_PORTS)])
        env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                   LOCAL_WORLD_SIZE=str(local_world_size))
        return DistEnv(rank, world_size, local_rank, local_world_size, launcher="slurm")
    return DistEnv(local_rank=local_rank_arg or 0)


def select_device(requested, local_rank=0, local_world_size=1, node_peers=None, shared_gpu_ok=False,
                  make_current=True):
    """Turn ``--device`` (auto, cpu, cuda, cuda:N, mps) into a torch.device, or explain why not.

    With several processes on a node, each takes a GPU of its own:
    - at least as many GPUs visible as local processes: the GPU of its local rank;
    - fewer (SLURM's --gpus-per-task=1 or --gpu-bind, or any launcher that gives each
      process its own CUDA_VISIBLE_DEVICES): its first visible GPU, once ``node_peers``
      (see ``meet_node_peers``) shows that no other process of the node sees that GPU;
    - two processes on one GPU: an error (NCCL refuses it) unless ``shared_gpu_ok`` (gloo).
    A CUDA device becomes the current one (``torch.cuda.set_device``), so that nothing
    lands on GPU 0 by default; ``make_current=False`` leaves that to the caller (setting it
    creates this process's CUDA context).
    """
    if requested == "auto":
        if torch.cuda.is_available():
            requested = "cuda"
        elif torch.backends.mps.is_available() and local_world_size == 1:
            requested = "mps"
        else:
            requested = "cpu"
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "mps":
        if not torch.backends.mps.is_available():
            raise UserError("--device mps: no Apple GPU (MPS) is available here; use --device cpu")
        return torch.device("mps")
    if not re.fullmatch(r"cuda(:\d+)?", requested):
        raise UserError(f"--device {requested}: not a device; use auto, cpu, cuda, cuda:N or mps")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UserError(f"--device {requested}: no CUDA GPU is visible here; use --device cpu (or auto)")
    if ":" in requested and local_world_size > 1:
        raise UserError(f"--device {requested}: every process of this node would use that one GPU; "
                        "use --device cuda (each process takes the GPU of its local rank)")
    if ":" in requested:
        index = int(requested.split(":")[1])
        if index >= count:
            raise UserError(f"--device {requested}: only {count} GPU(s) visible (cuda:0 to cuda:{count - 1})")
    elif local_world_size <= count:
        index = local_rank
    else:
        index = _index_among_fewer_gpus(count, local_rank, local_world_size, node_peers, shared_gpu_ok)
    device = torch.device("cuda", index)
    if make_current:
        torch.cuda.set_device(device)
    return device


def _index_among_fewer_gpus(count, local_rank, local_world_size, node_peers, shared_gpu_ok):
    """The GPU of a process that sees fewer GPUs than there are processes on its node."""
    if node_peers is None:  # no rendezvous store to compare GPUs through (a --dist-url other than env://)
        if shared_gpu_ok:
            return local_rank % count
        raise UserError(f"{local_world_size} processes per node but only {count} GPU(s) visible: "
                        f"use --nproc_per_node={count} or fewer")
    mine = set(node_peers[local_rank]["gpus"])
    sharing = [peer["local_rank"] for peer in node_peers if peer["local_rank"] != local_rank and mine & set(peer["gpus"])]
    if not sharing:
        return 0  # the node's processes see different GPUs: each has its own
    if shared_gpu_ok:
        return local_rank % count
    ranks = ", ".join(str(r) for r in sorted([local_rank, *sharing]))
    raise UserError(
        f"local ranks {ranks} of this node share GPU(s) ({local_world_size} processes, {count} GPU(s) visible to "
        f"each); NCCL cannot run two processes on one GPU: start at most one process per GPU "
        f"(torchrun --nproc_per_node={count}, srun --ntasks-per-node=<GPUs> --gpus-per-task=1), "
        "or add --dist-backend gloo (slow, for tests)")


def visible_gpus():
    """UUIDs of the GPUs this process can see (empty without CUDA): the same GPU has the same
    UUID in every process, whatever its index under CUDA_VISIBLE_DEVICES."""
    if not torch.cuda.is_available():
        return []
    return [str(getattr(torch.cuda.get_device_properties(i), "uuid", f"index {i}"))
            for i in range(torch.cuda.device_count())]


def node_name():
    """This node's name for grouping the processes that share its GPUs and cores."""
    node_rank = os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", ""))  # containers may share host names
    return f"{socket.gethostname()}#{node_rank}"


def meet_node_peers(store, env, wants_gpus=True):
    """Tell the other processes of this node (through the rendezvous store) which cores and
    GPUs this process sees, and learn theirs: a list indexed by local rank of dicts with
    ``local_rank``, ``cpus`` and ``gpus``. None without a store (a single process, or a
    --dist-url other than env://)."""
    if store is None:
        return None
    # GPUs are compared only where a process sees fewer than its node has processes (reading
    # their UUIDs initialises CUDA in this process; there it must, to take one).
    fewer = wants_gpus and torch.cuda.is_available() and torch.cuda.device_count() < env.local_world_size
    me = {"local_rank": env.local_rank, "cpus": sorted(cpu_affinity()), "gpus": visible_gpus() if fewer else []}
    prefix = f"node-peers/{node_name()}/"
    store.set(prefix + str(env.local_rank), json.dumps(me))
    return [json.loads(store.get(prefix + str(i))) for i in range(env.local_world_size)]


def cpu_affinity():
    """The cores this process may run on (a set of core numbers)."""
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # macOS, Windows
        return set(range(os.cpu_count() or 1))


# More loader workers than this rarely feed a GPU faster; each costs memory and start-up time.
MAX_WORKERS = 16


def cpu_cores_available():
    """Cores this process may run on (respects taskset, cgroups' cpusets and SLURM's binding)."""
    return len(cpu_affinity())


def processes_sharing_cores(env=None, node_peers=None):
    """How many processes of this node (this one included) run on the cores this one may use.

    torchrun's processes share the launcher's cores (its LOCAL_WORLD_SIZE); srun's tasks,
    bound to their own cores, share them with no one; ``node_peers`` (``meet_node_peers``)
    tells which case this is. Without them, every process of the node counts."""
    if env is None:
        return 1
    if node_peers is None:
        return max(1, env.local_world_size)
    return count_sharing(node_peers[env.local_rank]["cpus"], [peer["cpus"] for peer in node_peers])


def count_sharing(cpus, cpus_of_each):
    """How many of ``cpus_of_each`` (the core lists of a node's processes) overlap ``cpus``."""
    mine = set(cpus)
    return max(1, sum(1 for other in cpus_of_each if mine & set(other)))


def cores_per_process(sharing=1):
    """This process's share of the cores it may run on (``sharing``: see processes_sharing_cores)."""
    return max(1, cpu_cores_available() // max(1, sharing))


def default_workers(sharing=1):
    """Loader workers per process: its share of the cores, at most MAX_WORKERS (on a CPU the
    workers mostly wait while the model uses the cores)."""
    return min(MAX_WORKERS, cores_per_process(sharing))


def configure_cpu_threads(device, threads=None, workers=None, sharing=1):
    """This process's share of the CPU, for ``sharing`` processes on its cores: torch's threads
    (``threads``, --threads, if given; else, on a CPU, its share of the cores, so that N ranks
    on one CPU don't fight). Returns the loader workers: ``workers`` (--workers), else
    ``default_workers``."""
    if threads:
        torch.set_num_threads(threads)
    elif device.type == "cpu":
        torch.set_num_threads(cores_per_process(sharing))
    return workers if workers is not None else default_workers(sharing)


def connect_store(distributed, env):
    """The rendezvous key-value store at MASTER_ADDR:MASTER_PORT for ``--dist-url env://``
    (every launcher here; ``distributed``: the flags' section); None for a single process or
    another --dist-url."""
    if not env.distributed or distributed.dist_url != "env://":
        return None
    return _rendezvous_store(env, timedelta(seconds=distributed.dist_timeout))


_JOB = None  # this process's DistEnv, once init_distributed_mode has it


def current_job():
    """The DistEnv given to ``init_distributed_mode``, or None (train_single.py: no job)."""
    return _JOB


def init_distributed_mode(distributed, env, device, store=None):
    """Create the default process group when launched by torchrun, launch or SLURM; return its
    backend, or None for a single process (no process group).

    NCCL for CUDA devices, gloo otherwise; ``--dist-backend`` overrides (``distributed``: the
    flags' section). ``store`` is the one from ``connect_store`` (None: ``--dist-url`` is used).
    """
    global _JOB
    _JOB = env
    if not env.distributed:
        return None
    backend = distributed.dist_backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise UserError(f"--dist-backend nccl needs CUDA GPUs, but the device is {device}; use gloo")
    if not dist.is_backend_available(backend):
        raise UserError(f"--dist-backend {backend}: not built into this torch; use gloo or nccl")
    timeout = timedelta(seconds=distributed.dist_timeout)
    dist.init_process_group(
        backend=backend,
        store=store,
        init_method=None if store is not None else distributed.dist_url,
        world_size=env.world_size,
        rank=env.rank,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    return backend


def _rendezvous_store(env, timeout):
    """The key-value store at MASTER_ADDR:MASTER_PORT, with keys prefixed by the restart count.

    After torchrun restarts a failed group (--max-restarts), the new workers reach the same
    store as the old ones and could read their stale keys (seen as "connectFullMesh failed"
    or a hang); a prefix per attempt keeps each attempt's keys apart.
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        env.world_size,
        is_master=not agent_hosts_store and env.rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


# Seconds the clean-up may wait for the process group to shut down before going on without it.
CLEANUP_SECONDS = 30


def cleanup(failed=False, seconds=None):
    """Destroy the process group if one exists (safe to call more than once).

    ``failed``: this process is leaving on an error, and its peers may be gone or stuck in a
    collective. NCCL's group is then aborted (destroying it would wait for work in flight that
    never ends); and the clean-up waits at most ``seconds`` (default CLEANUP_SECONDS), so the
    error still gets out.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if not failed:
        dist.destroy_process_group()
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.6
    leave = abort if abort is not None and dist.get_backend() == "nccl" else dist.destroy_process_group
    seconds = CLEANUP_SECONDS if seconds is None else seconds
    gpu = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    worker = threading.Thread(target=_quietly, args=(leave, gpu), daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        print(f"warning: the process group did not shut down within {seconds} s (another process is gone or "
              "stuck); leaving without it", file=sys.stderr, flush=True)


def leaves_process_group(main):
    """``main``, then ``cleanup``: the process leaves its group at the end, or, on an error,
    without waiting long for peers that may be gone (an NCCL group is aborted)."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        finally:
            cleanup(failed=sys.exc_info()[0] is not None)
    return run


def _quietly(function, gpu=None):
    try:
        if gpu is not None:
            torch.cuda.set_device(gpu)  # a new thread starts on GPU 0
        function()
    except Exception:  # a group already broken by the error being reported: nothing left to clean
        pass


def check_on_every_rank(check, device):
    """Run ``check()``; if it raises UserError on any rank, every rank raises (none is left
    waiting in a collective for a rank that quit). Returns what ``check`` returned."""
    error, result = None, None
    try:
        result = check()
    except UserError as e:
        error = e
    world_size = get_world_size()
    failed_ranks = torch.zeros(world_size, dtype=torch.int64, device=device)
    failed_ranks[dist.get_rank() if world_size > 1 else 0] = int(error is not None)
    all_reduce_sum(failed_ranks)
    failed = failed_ranks.sum()
    if error is not None and world_size > 1 and not failed_ranks[0] and not error.rank_specific:
        raise RankError(str(error))  # rank 0 found nothing: this rank prints its own line
    if error is not None:
        raise error
    if failed.item():
        raise UserError(f"{failed.item()} other process(es) found a problem with the input; see their error")
    return result


def check_same_on_every_rank(value, device, what):
    """Raise on every rank unless the integer ``value`` is the same on all of them."""
    if not is_dist_avail_and_initialized():
        return
    both = torch.tensor([value, -value], device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if int(both[0]) != -int(both[1]):
        raise UserError(f"the processes disagree about {what} (from {-int(both[1])} to {int(both[0])}); "
                        "put --output-dir on a file system that every node shares")


def all_reduce_sum(tensor):
    """Sum a tensor over all ranks in place and return it (no-op for a single process)."""
    if is_dist_avail_and_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def row_counts(rows, device):
    """The number of rows each rank holds, in rank order (one all-gather)."""
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(get_world_size())]
    dist.all_gather(counts, torch.tensor([rows], device=device))
    return [int(c) for c in torch.cat(counts).cpu()]


def all_gather_rows(rows):
    """The rows of every rank, rank 0's first, on every rank: each rank's own number of rows
    (no padding in the result; the transfer pads to the longest and trims)."""
    if not is_dist_avail_and_initialized() or dist.get_world_size() == 1:
        return rows
    counts = row_counts(len(rows), rows.device)
    padded = rows.new_zeros(max(counts), *rows.shape[1:])
    padded[:len(rows)] = rows
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded)
    return torch.cat([block[:count] for block, count in zip(gathered, counts)])


def columns_of_every_rank(blocks, bounds):
    """Every rank's rows, cut to this rank's columns ``bounds[rank]:bounds[rank + 1]``: a list
    of blocks, rank 0's rows first. ``blocks`` (this rank's rows, each rows x columns, at least
    one) is emptied once sent, so that its memory goes before the answer comes. One
    all-to-all: each rank sends every other rank that rank's columns and nothing else."""
    if not is_dist_avail_and_initialized() or dist.get_world_size() == 1:
        return [block[:, bounds[0]:bounds[1]] for block in blocks]
    rows, widths = sum(len(block) for block in blocks), [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    counts, mine = row_counts(rows, blocks[0].device), widths[get_rank()]
    send, offset = blocks[0].new_empty(rows * bounds[-1]), 0
    for lo, hi in zip(bounds, bounds[1:]):  # each rank's columns of all my rows, one after the other
        torch.cat([block[:, lo:hi] for block in blocks], out=send[offset:offset + rows * (hi - lo)].view(rows, hi - lo))
        offset += rows * (hi - lo)
    blocks.clear()
    received = send.new_empty(sum(counts) * mine)
    dist.all_to_all_single(received, send, [count * mine for count in counts], [rows * width for width in widths])
    return [part.view(count, mine) for part, count in zip(received.split([count * mine for count in counts]), counts)]


def gather_objects(obj):
    """``obj`` of every rank, in rank order (pickled)."""
    if get_world_size() < 2:
        return [obj]
    parts = [None] * get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def broadcast_buffers(module, src=0):
    """Give every rank rank ``src``'s buffers (BatchNorm's running statistics).

    DDP keeps parameters equal on every rank, but each rank's last training forward updates
    its BatchNorm statistics from its own batch; evaluation and the saved weights must use
    one set: rank 0's, which it saves.
    """
    if get_world_size() < 2:
        return
    with torch.no_grad():
        for buffer in module.buffers():
            dist.broadcast(buffer, src)


def reduce_value(value, average=True):
    """Sum (or average) a tensor over all ranks and return the result on every rank."""
    world_size = get_world_size()
    if world_size < 2:
        return value
    with torch.no_grad():
        value = value.clone()
        dist.all_reduce(value)
        if average:
            value /= world_size
    return value


def start_local_processes(main, nprocs, argv):
    """``--spawn N``: start ``nprocs`` processes on this machine, ranks 0 to N-1 of one job
    (rendezvous on a free port of 127.0.0.1), each running ``run_cli(main, argv)``; return
    torch.multiprocessing's context, not waiting for them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return mp.start_processes(_run_local_rank, args=(main, nprocs, port, argv), nprocs=nprocs, join=False)


def _run_local_rank(local_rank, main, nprocs, port, argv):
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    die_with_launcher()  # the --spawn parent, killed, takes this process with it
    run_cli(main, argv)
