"""Preflight check of a distributed job: why it would hang, found in seconds, with the fix.

Run it under the launcher that runs training, with the same variables:

    torchrun --nproc_per_node=N -m tools.doctor
    torchrun --nnodes=2 --node_rank=R --nproc_per_node=N --master_addr=HOST0 --master_port=29500 \\
        -m tools.doctor                  # on every node
    srun --ntasks-per-node=N python -m tools.doctor
    python -m tools.doctor --spawn N     # N local processes, no launcher

Every rank joins through the key-value store at MASTER_ADDR:MASTER_PORT within --timeout
(a rank that does not is named), then the ranks start a process group, run an all-reduce
(its value checked, its bandwidth timed) and a barrier, each within --timeout. The lowest
rank that joined (rank 0 normally) prints a report per node and each problem with its fix.
Exit code 0: no problems; 1: problems found; 2: a mistake in the flags.
"""
import json
import math
import os
import re
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from multi_train_utils.distributed_utils import (cleanup, cores_per_process, count_sharing, cpu_affinity,
                                                 cpu_cores_available, read_dist_env, select_device,
                                                 start_local_processes)
from multi_train_utils.errors import UserError, die_with_launcher, one_line, run_cli
from multi_train_utils.options import HelpFormatter, OneLineErrorParser


SHM_MIN = 1 << 30  # below 1 GiB, loader workers die with "Bus error" (Docker's default is 64 MB)
DISK_MIN = 5 * 10**9  # checkpoints of a large model take gigabytes
CORES_MIN = 2  # one core cannot feed loader workers and run the model too
# Variables that change how the ranks find each other; the report lists those that are set.
VARIABLE_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL", "TORCH_DISTRIBUTED", "MASTER_", "CUDA_VISIBLE_DEVICES")
ALL_REDUCE_RUNS = 5
# What to try when a step of the collectives fails or hangs.
STEP_FIXES = {
    "start": "the ranks reached the store but not each other: NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME must name an "
             "interface that reaches the other nodes, and firewalls must let every port between the nodes through "
             "(not only MASTER_PORT); NCCL_DEBUG=INFO shows the address each rank uses",
    "all-reduce": "NCCL_DEBUG=INFO shows where it stops; on consumer GPUs (GeForce, RTX) NCCL_P2P_DISABLE=1, "
                  "without working InfiniBand NCCL_IB_DISABLE=1, between nodes NCCL_SOCKET_IFNAME set to the "
                  "interface that reaches the other nodes",
    "barrier": "a rank stopped answering after the all-reduce: see its output; TORCH_DISTRIBUTED_DEBUG=DETAIL "
               "and NCCL_DEBUG=INFO say more",
}


def get_args_parser():
    """The doctor's flags."""
    parser = OneLineErrorParser(prog="python -m tools.doctor",
                             description="Preflight check of a distributed job: run it under the launcher that runs "
                                         "training (torchrun, srun, --spawn N) to find why a job would hang.",
                             formatter_class=HelpFormatter)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda: what training will use")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                        help="process-group backend (default: nccl on cuda, gloo on cpu)")
    parser.add_argument("--timeout", type=float, default=20.0,
                        help="seconds to wait for every rank to join, and again for the collectives")
    parser.add_argument("--output-dir", default=".", help="training's --output-dir: its free disk space is checked")
    parser.add_argument("--size-mb", type=float, default=None,
                        help="size of the all-reduce whose bandwidth is timed, in MiB (default: 64 on GPU, 8 on CPU)")
    parser.add_argument("--spawn", type=int, default=0, metavar="N",
                        help="start N local processes with torch.multiprocessing instead of using a launcher")
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None,
                        help="set by torch.distributed.launch (default: none); the LOCAL_RANK variable wins")
    return parser


def check_args(args):
    """Refuse flags that cannot work, with one line."""
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UserError(f"--timeout {args.timeout}: give a positive number of seconds")
    if args.size_mb is not None and not (math.isfinite(args.size_mb) and args.size_mb > 0):
        raise UserError(f"--size-mb {args.size_mb}: give a positive size in MiB")
    if args.spawn < 0:
        raise UserError(f"--spawn {args.spawn}: give a number of processes (0: off)")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise UserError(f"--output-dir {args.output_dir}: a file, not a folder")


# ---- checks of one node, as pure functions of what was measured ----

def finding(what, fix, kind="problem"):
    """A problem (the job will hang or fail: exit code 1) or a hint (it may: printed only)."""
    return {"kind": kind, "what": what, "fix": fix}


def nccl_selected_interfaces(value, interfaces):
    """The interfaces NCCL_SOCKET_IFNAME=``value`` selects among ``interfaces``: a comma-separated
    list of name prefixes; ``=`` before the list makes the names exact, ``^`` excludes them."""
    spec = value.strip()
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    names = [name for name in spec.split(",") if name]

    def listed(interface):
        return any(interface == name if exact else interface.startswith(name) for name in names)

    return [interface for interface in interfaces if listed(interface) != exclude]


def _example_interface(interfaces):
    """The interface a fix suggests: Ethernet, InfiniBand or a bond before virtual ones and loopback."""
    for pattern in (r"(e|ib|bond)", r"(?!lo$|docker|veth|virbr|ifb|br-)"):
        found = [i for i in interfaces if re.match(pattern, i)]
        if found:
            return found[0]
    return interfaces[0] if interfaces else "eth0"


def interface_finding(variable, value, interfaces):
    """A problem if NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (``variable`` = ``value``) names no
    interface of this node, whose interfaces are ``interfaces``; else None. Gloo takes exact
    names and needs every one of them."""
    have = ", ".join(interfaces) or "none found"
    fix = f"{variable}={_example_interface(interfaces)} (this node has {have}), or unset {variable}"
    if variable.startswith("NCCL"):
        if nccl_selected_interfaces(value, interfaces):
            return None
        return finding(f"{variable}={value} selects none of this node's network interfaces ({have}): "
                       "NCCL cannot connect", fix)
    missing = [name for name in value.split(",") if name and name not in interfaces]
    if not missing:
        return None
    return finding(f"{variable}={value}: this node has no interface {', '.join(missing)} ({have}): gloo cannot "
                   "connect", fix)


def shm_finding(total_bytes):
    """A problem if /dev/shm (``total_bytes``; None where there is none) is under 1 GiB."""
    if total_bytes is None or total_bytes >= SHM_MIN:
        return None
    return finding(f"/dev/shm is only {_mib(total_bytes)}: DataLoader workers pass batches through it and die "
                   "with 'Bus error' or 'insufficient shared memory'",
                   "docker run --shm-size=8g (or --ipc=host; Kubernetes: an emptyDir with medium: Memory on "
                   "/dev/shm), or fewer --workers (0: none)")


def disk_finding(path, free_bytes):
    """A problem if under 5 GB are free in ``path``."""
    if free_bytes is None or free_bytes >= DISK_MIN:
        return None
    return finding(f"only {free_bytes / 1e9:.1f} GB free in {path}: checkpoints may not fit",
                   "free space there, or use an --output-dir on a larger disk")


def cores_finding(cores):
    """A hint if each process has fewer than 2 CPU cores (slow, not stuck)."""
    if cores >= CORES_MIN:
        return None
    return finding(f"{cores} CPU core per process: loader workers and the model share it (slow)",
                   "fewer processes per node, or more cores per task (srun --cpus-per-task, docker --cpus)", "hint")


def consumer_gpu(name):
    """Whether a GPU of this name is a consumer card (GeForce, TITAN, RTX 3090 ...), whose P2P
    transfers between GPUs often hang NCCL."""
    return bool(re.search(r"GeForce|TITAN|\bRTX \d{4}", name))


def all_reduce_finding(low, high, world_size, rank):
    """A problem unless the all-reduce of ``rank + 1`` over ``world_size`` ranks gave every element
    the sum 1 + 2 + ... + world_size (``low`` and ``high``: the smallest and largest seen)."""
    expected = world_size * (world_size + 1) / 2
    if low == expected and high == expected:
        return None
    return finding(f"rank {rank}: the all-reduce gave values from {low:g} to {high:g}, not {expected:g}: "
                   "data is corrupted between GPUs or nodes",
                   "NCCL_P2P_DISABLE=1 (broken P2P, common on consumer GPUs and in VMs), NCCL_IB_DISABLE=1; "
                   "update the GPU driver; NCCL_DEBUG=INFO shows the transport used")


# ---- what one rank measures ----

def _mib(size):
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"


def _free_disk(path):
    """Free bytes for ``path``, or its nearest existing parent (training creates the folder)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def _shm_size():
    """(total, free) bytes of /dev/shm, or (None, None) where there is none."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None, None
    return stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize


def _interfaces():
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def local_facts(args, env, device, backend):
    """What this rank sees, with the problems of its node; sent to the reporting rank as JSON."""
    shm_total, shm_free = _shm_size()
    facts = {
        "rank": env.rank, "local_rank": env.local_rank, "host": socket.gethostname(), "pid": os.getpid(),
        "device": str(device), "gpu": None, "torch": torch.__version__, "cores": cpu_cores_available(),
        # an estimate (every process of the node on these cores) until the ranks' facts are gathered
        "cores_per_process": cores_per_process(env.local_world_size), "cpus": sorted(cpu_affinity()),
        "shm_total": shm_total,
        "shm_free": shm_free, "output_dir": os.path.abspath(args.output_dir), "disk_free": _free_disk(args.output_dir),
        "interfaces": _interfaces(),
        "variables": {k: v for k, v in sorted(os.environ.items()) if k.startswith(VARIABLE_PREFIXES)},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts["gpu"] = {"name": props.name, "uuid": f"GPU-{props.uuid}"}
    facts["findings"] = node_findings(facts, backend, env.local_world_size)
    return facts


def with_shared_cores(facts, backend):
    """The gathered ``facts`` of every rank, with each rank's cores per process counted as
    training counts them (its cores divided by the processes of its node that share them:
    torchrun's processes share the launcher's cores, bound srun tasks have their own), and
    its node's findings redone with that count."""
    for rank, f in facts.items():
        node = [other for other in facts.values() if other["host"] == f["host"]]
        f["cores_per_process"] = max(1, len(f["cpus"]) // count_sharing(f["cpus"], [o["cpus"] for o in node]))
        f["findings"] = node_findings(f, backend, len(node))
    return facts


def node_findings(facts, backend, local_world_size):
    """The problems and hints that ``facts`` of one rank show about its node."""
    found = [interface_finding(variable, facts["variables"][variable], facts["interfaces"])
             for variable in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if variable in facts["variables"]]
    found += [shm_finding(facts["shm_total"]), disk_finding(facts["output_dir"], facts["disk_free"]),
              cores_finding(facts["cores_per_process"])]
    gpu, variables = facts["gpu"], facts["variables"]
    if (gpu and backend == "nccl" and consumer_gpu(gpu["name"]) and local_world_size > 1
            and "NCCL_P2P_DISABLE" not in variables):
        found.append(finding(f"{gpu['name']}: consumer GPUs often hang NCCL's first all-reduce over P2P",
                             "if the all-reduce hangs: NCCL_P2P_DISABLE=1", "hint"))
    if "SLURM_JOB_ID" in os.environ and os.environ.get("SLURM_KILL_BAD_EXIT", "0") in ("", "0"):
        found.append(finding("SLURM: a task that fails leaves the others waiting for it until the time-out",
                             "srun --kill-on-bad-exit=1 (export SLURM_KILL_BAD_EXIT=1 to let this check see it)",
                             "hint"))
    return [f for f in found if f]


# ---- joining through the store ----

class _Store:
    """The job's key-value store under a prefix of the doctor's own (torchrun's agent and the
    training's keys live beside it), with time-outs that end in a finding instead of a hang."""

    def __init__(self, store, prefix):
        self.store = dist.PrefixStore(prefix, store)

    def set(self, key, value):
        self.store.set(key, json.dumps(value))

    def get(self, key):
        return json.loads(self.store.get(key))

    def wait(self, keys, deadline):
        """Wait until ``deadline`` (time.monotonic()) for ``keys``; return those still missing."""
        missing = list(keys)
        while True:
            missing = [k for k in missing if not self.store.check([k])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.05)


def _store_prefix():
    # One prefix per torchrun restart: a new attempt must not read the last one's keys.
    return f"doctor/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def connect_store(env, timeout):
    """(the store at MASTER_ADDR:MASTER_PORT, None), or (None, finding) saying why it cannot be reached."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or not port.isdigit():
        raise UserError("RANK and WORLD_SIZE are set but MASTER_ADDR / MASTER_PORT are not: set both to rank 0's "
                        "node address and a free port there")
    port, host = int(port), socket.gethostname()
    # Under torchrun its agent hosts the store on MASTER_PORT; otherwise rank 0 does.
    is_master = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and env.rank == 0
    if is_master:
        try:
            return dist.TCPStore(addr, port, env.world_size, True, timedelta(seconds=timeout),
                                 wait_for_workers=False), None
        except dist.DistNetworkError as e:
            if "EADDRINUSE" in str(e) or "address already in use" in str(e):
                return None, finding(f"rank 0 cannot listen on MASTER_PORT {port} on node {host}: the port is in use "
                                     "(another job, or one that did not end)",
                                     "use another port: torchrun --master_port=PORT (or MASTER_PORT=PORT), the same "
                                     "on every node")
            return None, finding(f"rank 0 cannot open the store on port {port}: {one_line(e)}",
                                 "use another --master_port")
    try:
        socket.getaddrinfo(addr, port)
    except socket.gaierror:
        return None, finding(f"rank {env.rank} on node {host}: MASTER_ADDR={addr} is not a known host name here",
                             "set MASTER_ADDR (torchrun --master_addr) to rank 0's node address as this node "
                             "resolves it, or its IP address")
    # Probe with plain sockets first: a clear finding instead of the store's own retry log.
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))).close()
            break
        except OSError:
            if time.monotonic() >= deadline:
                return None, finding(
                    f"rank {env.rank} on node {host} could not reach the store at MASTER_ADDR:MASTER_PORT "
                    f"{addr}:{port} within {timeout:g} s: rank 0 is not running (not started yet, or failed), or "
                    "that address is not reachable from here",
                    f"start rank 0's node first or with the others; check from this node that {addr}:{port} is rank "
                    "0's node and reachable (nc -zv ADDR PORT), open the port in the firewall; under SLURM, "
                    "srun --kill-on-bad-exit=1")
            time.sleep(0.2)
    remaining = max(1.0, deadline - time.monotonic())
    return dist.TCPStore(addr, port, env.world_size, False, timedelta(seconds=remaining)), None


# ---- the collectives, in a thread the main thread waits for with a deadline ----

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_collectives(state, store, env, device, backend, deadline, size_mb):
    """Start the process group, time an all-reduce and pass a barrier; record each step in ``state``
    (``phase`` is the step under way, so a hang names it). The caller gives up at ``deadline``."""
    try:
        state["phase"] = "start"
        # The group's own time-out comes later than the deadline: NCCL's watchdog would end the
        # process before this rank reports.
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=deadline - time.monotonic() + 60),
                                device_id=device if backend == "nccl" else None)
        state["phase"] = "all-reduce"
        tensor = torch.ones(max(1, int(size_mb * 2**20) // 4), dtype=torch.float32, device=device)
        dist.all_reduce(tensor)  # warm-up: connections, NCCL's communicator
        _sync(device)
        low, high, seconds = math.inf, -math.inf, []
        for _ in range(ALL_REDUCE_RUNS):
            tensor.fill_(env.rank + 1)
            _sync(device)
            began = time.perf_counter()
            dist.all_reduce(tensor)
            _sync(device)
            seconds.append(time.perf_counter() - began)
            low, high = min(low, tensor.min().item()), max(high, tensor.max().item())
        state.update(low=low, high=high, seconds=sum(seconds) / len(seconds), bytes=tensor.numel() * 4)
        state["phase"] = "barrier"
        if backend == "gloo":  # names the ranks that do not arrive
            seconds_left = max(1.0, deadline - time.monotonic() - 1)
            dist.monitored_barrier(timeout=timedelta(seconds=seconds_left), wait_all_ranks=True)
        else:
            dist.barrier()
            _sync(device)
        state["phase"] = "done"
    except Exception as e:  # the reporting rank prints it as a finding
        state["error"] = one_line(e)


# ---- the report ----

def rank_list(ranks):
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    ranks, parts, i = sorted(ranks), [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts)


def ranks_text(ranks):
    """``"rank 1"`` or ``"ranks 0-2, 5"``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"


def _device_text(facts):
    gpu = facts["gpu"]
    return facts["device"] + (f" {gpu['name']} {gpu['uuid']}" if gpu else "")


def job_findings(facts, results, world_size, backend, timeout):
    """The problems found across ranks: ranks on one GPU, differing torch versions, the
    collectives' failures, hangs and wrong values. ``results``: rank -> its collectives' state."""
    found = []
    gpus = {}
    for rank, f in sorted(facts.items()):
        if f["gpu"]:
            gpus.setdefault(f["gpu"]["uuid"], []).append(rank)
    for uuid, ranks in gpus.items():
        if len(ranks) > 1 and backend == "nccl":
            found.append(finding(f"{ranks_text(ranks)} all use GPU {uuid}: NCCL needs one GPU per rank",
                                 "one process per GPU (--nproc_per_node = the GPUs of a node; srun --gpus-per-task=1); "
                                 "do not set CUDA_VISIBLE_DEVICES to the same GPU for every rank"))
    versions = {f["torch"] for f in facts.values()}
    if len(versions) > 1:
        found.append(finding(f"the ranks run different torch versions ({', '.join(sorted(versions))})",
                             "install the same torch on every node"))
    silent = [r for r in sorted(facts) if r not in results]
    if silent:
        found.append(finding(f"{ranks_text(silent)} joined but sent no result: crashed or killed (see their "
                             "output)", "fix what their error says, then run the doctor again"))
    steps = {"start": "the process group did not start", "all-reduce": "the all-reduce did not finish",
             "barrier": "the barrier did not pass"}
    for phase, what in steps.items():
        hung = [r for r, s in sorted(results.items()) if s["phase"] == phase and s.get("hung")]
        if hung:
            found.append(finding(f"{what} within {timeout:g} s on {ranks_text(hung)} (a hang)", STEP_FIXES[phase]))
        errors = {}  # the same error on many ranks: one finding
        for rank, s in sorted(results.items()):
            if s["phase"] == phase and s.get("error"):
                errors.setdefault(s["error"], []).append(rank)
        for error, ranks in errors.items():
            found.append(finding(f"{ranks_text(ranks)}: {what}: {error}", STEP_FIXES[phase]))
    for rank, s in sorted(results.items()):
        if "low" in s:
            found.append(all_reduce_finding(s["low"], s["high"], world_size, rank))
    return [f for f in found if f]


def _all_reduce_text(results, world_size):
    done = [s for s in results.values() if "low" in s]
    if len(done) < world_size:
        return "not completed on every rank (see the problems)"
    expected = world_size * (world_size + 1) / 2
    wrong = [r for r, s in sorted(results.items()) if not (s["low"] == s["high"] == expected)]
    slowest = max(s["seconds"] for s in done)
    size = done[0]["bytes"]
    bus = 2 * (world_size - 1) / world_size * size / slowest / 1e9  # nccl-tests' bus bandwidth
    bandwidth = f"bus bandwidth {bus:.2f} GB/s" if world_size > 1 else "one rank: nothing to transfer"
    values = f"every rank got {expected:g} (the sum of rank + 1 over {world_size} ranks)" if not wrong else \
        f"WRONG values on {ranks_text(wrong)}, expected {expected:g}"
    status = "ok" if not wrong else "FAILED"
    return (f"{status}: {values} in all {size / 2**20:g} MiB; {ALL_REDUCE_RUNS} runs of "
            f"{slowest * 1e3:.1f} ms, {bandwidth}")


def format_report(facts, results, findings, *, world_size, backend, rendezvous, timeout,
                  not_run="not every rank joined"):
    """The report the lowest joined rank prints: per node its ranks, devices, /dev/shm, cores, free
    disk and set variables; the all-reduce and the barrier; each finding with its fix; the verdict."""
    nodes = {}
    for rank in sorted(facts):
        nodes.setdefault(facts[rank]["host"], []).append(rank)
    lines = [f"doctor: {len(facts)} of {world_size} ranks joined, on {len(nodes)} node(s); backend {backend}; "
             f"store {rendezvous}; torch {facts[min(facts)]['torch']}"]
    for host, ranks in nodes.items():
        first = facts[ranks[0]]
        lines.append(f"node {host}: {ranks_text(ranks)}")
        for rank in ranks:
            f = facts[rank]
            lines.append(f"  rank {rank}: {_device_text(f)} (local rank {f['local_rank']}, pid {f['pid']})")
        shm = "none" if first["shm_total"] is None else f"{_mib(first['shm_total'])} ({_mib(first['shm_free'])} free)"
        lines.append(f"  /dev/shm: {shm}")
        cores = min(facts[r]["cores_per_process"] for r in ranks)
        lines.append(f"  CPU cores per process: {cores} (of {first['cores']} this process may use)")
        lines.append(f"  free disk in {first['output_dir']}: {first['disk_free'] / 1e9:.1f} GB")
        lines.append(f"  network interfaces: {', '.join(first['interfaces']) or 'none found'}")
        variables = " ".join(f"{k}={v}" for k, v in first["variables"].items())
        lines.append(f"  variables: {variables or 'none set'}")
    if results:
        lines.append(f"all-reduce: {_all_reduce_text(results, world_size)}")
        barrier = all(s["phase"] == "done" for s in results.values()) and len(results) == world_size
        lines.append(f"barrier: ok (all {world_size} ranks within {timeout:g} s)" if barrier else
                     "barrier: not passed (see the problems)")
    else:
        lines.append(f"all-reduce: not run ({not_run})")
        lines.append("barrier: not run")
    lines += format_findings(findings)
    return "\n".join(lines)


def format_findings(findings):
    """Each finding and its fix; then the verdict line."""
    lines = []
    for f in findings:
        lines.append(f"{f['kind']}: {f['what']}")
        lines.append(f"  fix: {f['fix']}")
    problems = sum(f["kind"] == "problem" for f in findings)
    lines.append("no problems found" if not problems else f"{problems} problem{'s' if problems > 1 else ''} found")
    return lines


def _unique_findings(facts):
    """The findings of every rank's node, once per node."""
    found, seen = [], set()
    for rank in sorted(facts):
        host = facts[rank]["host"]
        for f in facts[rank]["findings"]:
            if (host, f["what"]) not in seen:
                seen.add((host, f["what"]))
                found.append(dict(f, what=f"node {host}: {f['what']}"))
    return found


# ---- one rank ----

def exit_code(findings):
    """1 if any finding is a problem, else 0 (hints alone pass)."""
    return int(any(f["kind"] == "problem" for f in findings))


def check_job(args, env, device, backend):
    """Join, run the collectives, and (on the reporting rank) print the report; return the exit code."""
    facts = local_facts(args, env, device, backend)
    if not env.distributed:
        findings = _unique_findings({0: facts}) + [finding(
            "one process: no launcher's variables (RANK, WORLD_SIZE, or SLURM's under srun)",
            "run the doctor the way training runs: torchrun ..., srun ..., or --spawn N", "hint")]
        print(format_report({0: facts}, {}, findings, world_size=1, backend=backend, rendezvous="none",
                            timeout=args.timeout, not_run="one process"), flush=True)
        return exit_code(findings)
    began = time.monotonic()
    tcp_store, failure = connect_store(env, args.timeout)
    if failure:
        print("\n".join([f"doctor: rank {env.rank} of {env.world_size} could not join"] + format_findings([failure])),
              flush=True)
        return 1
    store = _Store(tcp_store, _store_prefix())
    try:
        store.set(f"joined/{env.rank}", facts)
        missing = store.wait([f"joined/{r}" for r in range(env.world_size)], began + args.timeout)
        if missing:
            return report_missing(args, env, backend, store, sorted(int(k.rsplit("/", 1)[1]) for k in missing))
        if store.store.check(["abort"]):  # joined after the others gave up
            print(f"doctor: rank {env.rank} joined after the others stopped waiting: {store.get('abort')}", flush=True)
            return 1
        return check_collectives(args, env, device, backend, store)
    except dist.DistError as e:  # the store went away: its host, rank 0, ended
        print(f"doctor: rank {env.rank} lost the store at {_rendezvous()} (rank 0 ended? see its output): "
              f"{one_line(e)}", flush=True)
        return 1


def _rendezvous():
    return f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


def report_missing(args, env, backend, store, missing):
    """Some ranks did not join within --timeout: the lowest rank that did prints the report naming them."""
    joined = [r for r in range(env.world_size) if r not in missing]
    if env.rank != joined[0]:
        return 1
    what = (f"{ranks_text(missing)} never joined within {args.timeout:g} s (expected world size {env.world_size}; "
            f"joined: {ranks_text(joined)})")
    store.set("abort", what)
    facts = with_shared_cores({r: store.get(f"joined/{r}") for r in joined}, backend)
    findings = [finding(what, "its node is down, started late or failed before joining (see its output), or it "
                              f"cannot reach MASTER_ADDR:MASTER_PORT {_rendezvous()} (firewall, wrong MASTER_ADDR): "
                              "start every node within --timeout; under SLURM, srun --kill-on-bad-exit=1")]
    print(format_report(facts, {}, findings + _unique_findings(facts), world_size=env.world_size, backend=backend,
                        rendezvous=_rendezvous(), timeout=args.timeout), flush=True)
    return 1


def check_collectives(args, env, device, backend, store):
    """Every rank joined: run the collectives within --timeout; rank 0 gathers the results and
    prints the report, the others wait for its verdict. Returns the exit code."""
    # The process group gets a store connection of its own: a wait blocked in it must not block ours.
    pg_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size, False,
                             timedelta(seconds=args.timeout))
    state, deadline = {"phase": "start"}, time.monotonic() + args.timeout
    size_mb = args.size_mb or (64 if device.type == "cuda" else 8)
    worker = threading.Thread(target=run_collectives, daemon=True,
                              args=(state, dist.PrefixStore(_store_prefix() + "pg/", pg_store), env, device, backend,
                                    deadline, size_mb))
    worker.start()
    worker.join(args.timeout)
    hung = worker.is_alive()
    store.set(f"result/{env.rank}", dict(state, hung=hung))
    code = 1
    if env.rank == 0:
        keys = [f"result/{r}" for r in range(env.world_size)]
        store.wait(keys, deadline + 3)  # a rank that hangs sends its result at its own deadline
        results = {r: store.get(keys[r]) for r in range(env.world_size) if store.store.check([keys[r]])}
        facts = with_shared_cores({r: store.get(f"joined/{r}") for r in range(env.world_size)}, backend)
        findings = _unique_findings(facts) + job_findings(facts, results, env.world_size, backend, args.timeout)
        findings.sort(key=lambda f: f["kind"] != "problem")
        print(format_report(facts, results, findings, world_size=env.world_size, backend=backend,
                            rendezvous=_rendezvous(), timeout=args.timeout), flush=True)
        code = exit_code(findings)
        store.set("done", code)
        # Rank 0 may host the store: the others read "done" before it goes.
        wait_until = time.monotonic() + 3
        while int(store.store.add("left", 0)) < env.world_size - 1 and time.monotonic() < wait_until:
            time.sleep(0.05)
    else:
        try:
            if not store.wait(["done"], time.monotonic() + args.timeout + 10):
                code = store.get("done")
            store.store.add("left", 1)
        except dist.DistError:
            pass  # rank 0 ended: nothing left to wait for
    if hung:  # a collective still blocks a thread: the process group cannot be destroyed
        sys.stdout.flush()
        os._exit(code)
    cleanup(failed=True, seconds=5)  # leave without waiting long: rank 0 (the store's host) may be gone
    return code


def main(argv=None):
    """Check the job this process belongs to; exit 0 without problems, 1 with."""
    args = get_args_parser().parse_args(argv)
    check_args(args)
    if args.spawn and "RANK" not in os.environ:
        return spawn_processes(args, argv)
    env = read_dist_env(args.local_rank)
    if env.launcher == "torchrun":
        die_with_launcher()  # a torchrun killed with kill -9 takes its workers with it
    # Fewer GPUs than processes: each takes local rank mod GPUs (its own with one GPU per
    # task); ranks that end up on one GPU are a finding of the report, not a crash here.
    device = select_device(args.device, env.local_rank, env.local_world_size, shared_gpu_ok=True)
    if device.type == "mps":  # no backend runs collectives on Apple GPUs
        device = torch.device("cpu")
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise UserError(f"--backend nccl needs CUDA GPUs, but the device is {device}; use gloo")
    if not dist.is_backend_available(backend):
        raise UserError(f"--backend {backend}: not built into this torch; use gloo or nccl")
    sys.exit(check_job(args, env, device, backend))


def spawn_processes(args, argv):
    """--spawn N: start N local processes with torch.multiprocessing on a free port of 127.0.0.1."""
    argv = sys.argv[1:] if argv is None else argv
    context = start_local_processes(main, args.spawn, argv)
    # Wait for every process (context.join would stop the others at the first exit code 1,
    # which here only means "problems found"); each ends within its time-outs.
    for process in context.processes:
        process.join()
    codes = [process.exitcode for process in context.processes]
    sys.exit(max(codes) if min(codes) >= 0 else 1)  # a negative code: killed by a signal


if __name__ == "__main__":
    run_cli(main)
