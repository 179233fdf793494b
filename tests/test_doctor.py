"""python -m tools.doctor: under torchrun 2 x CPU it reports both ranks, a checked
all-reduce and a barrier, and finds a planted problem with its fix; a rank that never joins,
a rank 0 that cannot be reached and a port in use are named within the time-out; and the
pure checks (interface names in NCCL's syntax, /dev/shm, the all-reduce value) one by one."""
import os
import re
import shutil
import socket
import time

import pytest

from conftest import PYTHON, TORCHRUN, free_port, run

DOCTOR = ["-m", "tools.doctor", "--device", "cpu"]
INTERFACES = [name for _, name in socket.if_nameindex()]
HOST = socket.gethostname()


def lines_after(stdout, start):
    """The line that begins with ``start``, and the one after it (a finding and its fix)."""
    lines = stdout.splitlines()
    found = [i for i, line in enumerate(lines) if line.startswith(start)]
    assert len(found) == 1, (start, stdout)
    return lines[found[0]], lines[found[0] + 1]


def assert_verdict(stdout, returncode):
    """The last line counts the "problem:" lines; exit code 1 with problems, 0 without."""
    problems = sum(line.startswith("problem: ") for line in stdout.splitlines())
    last = stdout.strip().splitlines()[-1]
    assert last == ("no problems found" if not problems else f"{problems} problem{'s' * (problems > 1)} found"), stdout
    assert returncode == int(problems > 0), stdout


@pytest.fixture(scope="module")
def torchrun_doctor(tmp_path_factory):
    """torchrun --nproc_per_node=2 -m tools.doctor --device cpu, with a planted
    problem: NCCL_SOCKET_IFNAME names an interface no node has (gloo does not read it)."""
    out = tmp_path_factory.mktemp("doctor") / "not-yet"
    result = run([*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), *DOCTOR,
                  "--output-dir", str(out)], timeout=120, env={"NCCL_SOCKET_IFNAME": "nosuch0"})
    return {"result": result, "out": out}


def test_doctor_under_torchrun_checks_both_ranks_and_finds_the_planted_interface(torchrun_doctor):
    result = torchrun_doctor["result"]
    stdout = result.stdout
    assert "Traceback" not in stdout
    assert stdout.count("doctor: 2 of 2 ranks joined, on 1 node(s); backend gloo; store 127.0.0.1:") == 1
    assert f"node {HOST}: ranks 0-1" in stdout
    pids = [int(p) for p in re.findall(r"^  rank (?:0|1): cpu \(local rank [01], pid (\d+)\)$", stdout, re.M)]
    assert len(set(pids)) == 2, stdout
    # every rank sent rank + 1; each got 1 + 2 in every element, and the bandwidth was timed
    match = re.search(r"^all-reduce: ok: every rank got 3 \(the sum of rank \+ 1 over 2 ranks\) in all 8 MiB; "
                      r"5 runs of ([\d.]+) ms, bus bandwidth ([\d.]+) GB/s$", stdout, re.M)
    assert match and float(match.group(1)) > 0 and float(match.group(2)) > 0, stdout
    assert "barrier: ok (all 2 ranks within 20 s)" in stdout
    assert re.search(r"^  variables: .*NCCL_SOCKET_IFNAME=nosuch0", stdout, re.M)
    what, fix = lines_after(stdout, f"problem: node {HOST}: NCCL_SOCKET_IFNAME=nosuch0 selects none")
    assert f"({', '.join(INTERFACES)})" in what
    example = re.match(r"  fix: NCCL_SOCKET_IFNAME=(\S+) \(this node has", fix)
    assert example and example.group(1) in INTERFACES, fix
    assert_verdict(stdout, result.returncode)
    assert result.returncode == 1


def test_doctor_reports_the_node_it_measured(torchrun_doctor):
    """/dev/shm and the free disk of --output-dir (a folder not yet made: its parent's disk)."""
    stdout = torchrun_doctor["result"].stdout
    stat = os.statvfs("/dev/shm")
    total = stat.f_blocks * stat.f_frsize
    shown = f"{total / 2**30:.1f} GiB" if total >= 2**30 else f"{total / 2**20:.0f} MiB"
    assert re.search(rf"^  /dev/shm: {re.escape(shown)} \(", stdout, re.M), stdout
    match = re.search(rf"^  free disk in {re.escape(str(torchrun_doctor['out']))}: ([\d.]+) GB$", stdout, re.M)
    assert match, stdout
    free = shutil.disk_usage(torchrun_doctor["out"].parent).free / 1e9
    assert abs(float(match.group(1)) - free) < 1.0, (match.group(1), free)
    cores = len(os.sched_getaffinity(0))
    assert f"  CPU cores per process: {max(1, cores // 2)} (of {cores} " in stdout


def test_a_rank_that_never_joins_is_named_within_the_time_out():
    """Rank 0 of two, started alone with plain variables (a missing node blocks torchrun's own
    rendezvous before any worker starts, so this is how a rank fails to arrive)."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    started = time.monotonic()
    result = run([PYTHON, *DOCTOR, "--timeout", "3"], timeout=60, env=env)
    seconds = time.monotonic() - started
    stdout = result.stdout
    what, fix = lines_after(stdout, "problem: rank 1 never joined")
    assert what == "problem: rank 1 never joined within 3 s (expected world size 2; joined: rank 0)"
    assert "srun --kill-on-bad-exit=1" in fix and "MASTER_ADDR" in fix
    assert "doctor: 1 of 2 ranks joined" in stdout and "all-reduce: not run" in stdout
    assert_verdict(stdout, result.returncode)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert seconds < 3 + 30  # the wait ends at --timeout (the rest is importing torch on a busy machine)


@pytest.fixture
def master_at(monkeypatch):
    """Point this process's MASTER_ADDR:MASTER_PORT at 127.0.0.1:``port``, outside torchrun."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)

    def point(port):
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))

    return point


def test_a_rank_that_cannot_reach_rank_0_says_so(master_at):
    from multi_train_utils.distributed_utils import DistEnv
    from tools.doctor import connect_store

    port = free_port()
    master_at(port)
    started = time.monotonic()
    store, found = connect_store(DistEnv(rank=1, world_size=2, launcher="env"), timeout=1)
    assert store is None and time.monotonic() - started < 1 + 2
    assert found["what"] == (f"rank 1 on node {HOST} could not reach the store at MASTER_ADDR:MASTER_PORT "
                             f"127.0.0.1:{port} within 1 s: rank 0 is not running (not started yet, or failed), or "
                             "that address is not reachable from here")
    assert "firewall" in found["fix"] and "srun --kill-on-bad-exit=1" in found["fix"]


def test_a_master_port_in_use_is_named_with_the_fix(master_at):
    from multi_train_utils.distributed_utils import DistEnv
    from tools.doctor import connect_store

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        master_at(port)
        store, found = connect_store(DistEnv(rank=0, world_size=2, launcher="env"), timeout=1)
    assert store is None and found["kind"] == "problem"
    assert found["what"] == (f"rank 0 cannot listen on MASTER_PORT {port} on node {HOST}: the port is in use "
                             "(another job, or one that did not end)")
    assert "--master_port" in found["fix"]


def test_spawn_with_a_wrong_gloo_interface_names_it_and_the_failed_start(tmp_path):
    """--spawn 2: GLOO_SOCKET_IFNAME names no interface, so the process group cannot start:
    both are reported, once, and every process ends."""
    result = run([PYTHON, *DOCTOR, "--spawn", "2", "--timeout", "10", "--output-dir", str(tmp_path)], timeout=120,
                 env={"GLOO_SOCKET_IFNAME": "nosuch0"})
    stdout = result.stdout
    assert "doctor: 2 of 2 ranks joined" in stdout
    what, fix = lines_after(stdout, f"problem: node {HOST}: GLOO_SOCKET_IFNAME=nosuch0")
    assert "no interface nosuch0" in what and "unset GLOO_SOCKET_IFNAME" in fix
    what, fix = lines_after(stdout, "problem: ranks 0-1: the process group did not start:")
    assert "nosuch0" in what and "GLOO_SOCKET_IFNAME" in fix
    assert "barrier: not passed" in stdout
    assert_verdict(stdout, result.returncode)


def test_nccl_interface_names_follow_nccls_syntax():
    from tools.doctor import interface_finding, nccl_selected_interfaces

    have = ["lo", "docker0", "eth0", "eth1", "ib0"]
    assert nccl_selected_interfaces("eth", have) == ["eth0", "eth1"]  # a prefix
    assert nccl_selected_interfaces("=eth", have) == []  # = : exact names
    assert nccl_selected_interfaces("=eth1,ib0", have) == ["eth1", "ib0"]
    assert nccl_selected_interfaces("^docker,lo", have) == ["eth0", "eth1", "ib0"]  # ^ : all but these
    assert nccl_selected_interfaces("^=eth0", have) == ["lo", "docker0", "eth1", "ib0"]
    assert interface_finding("NCCL_SOCKET_IFNAME", "^docker", have) is None
    assert interface_finding("NCCL_SOCKET_IFNAME", "en", have)["fix"].startswith("NCCL_SOCKET_IFNAME=eth0 ")
    assert interface_finding("NCCL_SOCKET_IFNAME", "^lo,docker,eth,ib", have) is not None
    # gloo: exact names, every one must exist
    assert interface_finding("GLOO_SOCKET_IFNAME", "eth1", have) is None
    assert interface_finding("GLOO_SOCKET_IFNAME", "eth", have) is not None
    assert "no interface ib1" in interface_finding("GLOO_SOCKET_IFNAME", "eth0,ib1", have)["what"]


def test_node_checks_flag_a_small_shm_and_a_wrong_sum():
    from tools.doctor import all_reduce_finding, consumer_gpu, format_findings, shm_finding

    small = shm_finding(64 * 2**20)  # Docker's default
    assert small is not None and "64 MiB" in small["what"] and "--shm-size" in small["fix"] and small["kind"] == "problem"
    assert shm_finding(2**30) is None and shm_finding(None) is None
    assert all_reduce_finding(10, 10, 4, rank=2) is None  # 1 + 2 + 3 + 4
    wrong = all_reduce_finding(10, 12, 4, rank=2)  # right in some elements only
    assert wrong is not None and wrong["what"].startswith("rank 2: the all-reduce gave values from 10 to 12, not 10")
    assert all_reduce_finding(9, 9, 4, rank=0) is not None
    assert [consumer_gpu(n) for n in ("NVIDIA GeForce RTX 4090", "NVIDIA RTX 3090", "NVIDIA RTX A6000",
                                      "NVIDIA H100 80GB HBM3")] == [True, True, False, False]
    assert format_findings([{"kind": "hint", "what": "w", "fix": "f"}])[-1] == "no problems found"
    assert format_findings([small, wrong])[-1] == "2 problems found"


def test_findings_across_ranks_one_gpu_twice_a_hang_a_silent_rank():
    """What only the collected facts and results show: two ranks on one GPU under NCCL, a hang
    named by its step with NCCL's fixes, the same error of many ranks once, a rank without result."""
    from tools.doctor import exit_code, job_findings

    def facts(uuid, version="2.5.0"):
        return {"gpu": {"name": "NVIDIA GeForce RTX 4090", "uuid": uuid}, "torch": version}

    same_gpu = {0: facts("GPU-a"), 1: facts("GPU-a"), 2: facts("GPU-b", "2.4.1")}
    results = {0: {"phase": "all-reduce", "hung": True}, 1: {"phase": "all-reduce", "hung": True}}
    found = job_findings(same_gpu, results, 3, "nccl", timeout=20)
    whats = [f["what"] for f in found]
    assert "ranks 0-1 all use GPU GPU-a: NCCL needs one GPU per rank" in whats
    assert "the ranks run different torch versions (2.4.1, 2.5.0)" in whats
    assert "rank 2 joined but sent no result: crashed or killed (see their output)" in whats
    hang = next(f for f in found if f["what"] == "the all-reduce did not finish within 20 s on ranks 0-1 (a hang)")
    assert "NCCL_P2P_DISABLE=1" in hang["fix"] and "NCCL_IB_DISABLE=1" in hang["fix"]
    assert exit_code(found) == 1
    # gloo may share a GPU; one error seen by every rank is one finding
    error = {"phase": "start", "error": "Unable to find address for: nosuch0", "hung": False}
    found = job_findings({0: facts("GPU-a"), 1: facts("GPU-a")}, {0: error, 1: dict(error)}, 2, "gloo", timeout=20)
    assert [f["what"] for f in found] == ["ranks 0-1: the process group did not start: Unable to find address "
                                         "for: nosuch0"]
    assert exit_code([]) == 0 and exit_code([{"kind": "hint", "what": "", "fix": ""}]) == 0


def test_the_node_lists_the_variables_that_decide_the_rendezvous_and_judges_shm_by_its_size(tmp_path, monkeypatch):
    """docs/multi-gpu.md: NCCL_*, GLOO_*, TORCH_NCCL*, TORCH_DISTRIBUTED*, MASTER_* and
    CUDA_VISIBLE_DEVICES, each that is set, and no other; /dev/shm under 1 GiB in size is a
    problem, a large one mostly in use is not."""
    import argparse

    import torch

    from tools import doctor
    from multi_train_utils.distributed_utils import DistEnv

    wanted = {"NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "lo", "TORCH_NCCL_BLOCKING_WAIT": "1",
              "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": "1,0"}
    for name in list(os.environ):
        if name.startswith(doctor.VARIABLE_PREFIXES):
            monkeypatch.delenv(name)
    for name, value in {**wanted, "CUDA_HOME": "/usr/local/cuda", "MY_NCCL_NOTE": "x", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(doctor, "_shm_size", lambda: (64 << 30, 512 << 20))  # 64 GiB, 512 MiB of it free
    args = argparse.Namespace(output_dir=str(tmp_path))
    facts = doctor.local_facts(args, DistEnv(), torch.device("cpu"), "gloo")
    assert facts["variables"] == wanted
    assert not any("/dev/shm" in f["what"] for f in facts["findings"])
    monkeypatch.setattr(doctor, "_shm_size", lambda: (64 << 20, 64 << 20))  # Docker's default
    facts = doctor.local_facts(args, DistEnv(), torch.device("cpu"), "gloo")
    assert [f["what"].split(":")[0] for f in facts["findings"] if "/dev/shm" in f["what"]] == ["/dev/shm is only 64 MiB"]


def test_the_all_reduce_time_is_that_of_one_run_the_mean_of_five(monkeypatch):
    """run_collectives on a fake group whose timed all-reduces take 10, 20, 30, 40 and 50 ms:
    the time of one all-reduce is their mean, 30 ms; the sum of rank + 1 comes back."""
    import time as real_time

    import torch

    from tools import doctor
    from multi_train_utils.distributed_utils import DistEnv

    clock, durations = [0.0], iter([0.0, 0.01, 0.02, 0.03, 0.04, 0.05])  # the warm-up first

    def all_reduce(tensor):
        clock[0] += next(durations)
        tensor.fill_(1 + 2)  # ranks 0 and 1

    monkeypatch.setattr(doctor.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(doctor.dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(doctor.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(doctor.dist, "barrier", lambda: None)
    state = {}
    doctor.run_collectives(state, None, DistEnv(rank=0, world_size=2), torch.device("cpu"), "nccl",
                           real_time.monotonic() + 30, 1)
    assert state["phase"] == "done" and "error" not in state
    assert state["seconds"] == pytest.approx(0.03) and (state["low"], state["high"]) == (3.0, 3.0)
    assert state["bytes"] == 2**20
