"""docs/multi-gpu.md, docs/performance.md and docs/layout.md: the doctor's, benchmark.py's and the DDP helpers' figures, defaults and conditions, in-process."""
import contextlib
import io
import json
import os
import statistics
import sys
import types
from collections import Counter

import pytest
import torch
from PIL import Image
from torch import nn

from conftest import REPO, parse_flags
from multi_train_utils.options import config_of  # noqa: E402


# --- benchmark.py --scale: simulated ImageNet-like folders ----------------------------------------

def test_scale_folders_are_1000_class_folders_of_hard_links_to_32_jpegs_made_once(tmp_path):
    """performance.md: "simulated ImageNet-like folders ... (1,000 class folders of hard links to
    32 small JPEGs, made once)"; the start-up is measured "against a 20-file folder"."""
    import benchmark

    root = benchmark.make_scale_folder(str(tmp_path / "scale-10500"), 10500)
    classes = sorted(os.listdir(root))
    folders = [c for c in classes if os.path.isdir(os.path.join(root, c))]
    assert len(folders) == 1000
    per_class = {c: os.listdir(os.path.join(root, c)) for c in folders}
    # 10,500 files over 1,000 classes: 500 classes of 11, 500 of 10, none left out
    assert Counter(len(files) for files in per_class.values()) == {11: 500, 10: 500}
    paths = [os.path.join(root, c, f) for c, files in per_class.items() for f in files]
    inodes = {os.stat(p).st_ino for p in paths}
    assert len(inodes) == 32  # hard links to 32 distinct small JPEGs
    assert all(os.stat(p).st_nlink > 1 for p in paths[:50])
    with Image.open(paths[0]) as image:
        assert image.format == "JPEG"
    # made once: a second call finds the finished folder and leaves it as it is
    os.remove(paths[-1])
    benchmark.make_scale_folder(root, 10500)
    assert not os.path.exists(paths[-1])
    tiny = benchmark.make_scale_folder(str(tmp_path / "scale-20"), 20)
    tiny_classes = [c for c in os.listdir(tiny) if os.path.isdir(os.path.join(tiny, c))]
    assert [len(os.listdir(os.path.join(tiny, c))) for c in tiny_classes] == [10, 10]


def test_scale_start_up_is_the_median_of_paired_differences_not_the_difference_of_medians(monkeypatch):
    """performance.md: what the data adds to the time to the first step is "the median over 3
    pairs of launches of the difference against a 20-file folder"; each pair launches the tiny
    folder first, then the large one."""
    import benchmark

    times = {"tiny": iter([1.0, 10.0, 2.0]), "big": iter([5.0, 11.0, 9.0])}
    launched = []

    def time_to_first_step(root, ranks, work):
        launched.append((root, ranks))
        return next(times[root])

    monkeypatch.setattr(benchmark, "time_to_first_step", time_to_first_step)
    added, big, small = benchmark.data_startup_seconds("big", "tiny", 2, "work", repeats=3)
    # differences 4, 1, 7: median 4 (the medians' difference would be 9 - 2 = 7)
    assert (added, big, small) == (4.0, 9.0, 2.0)
    assert launched == [("tiny", 2), ("big", 2)] * 3


def test_scale_report_times_1_2_and_8_ranks_over_3_pairs_and_both_kinds_of_file_list(tmp_path, monkeypatch, capsys):
    """performance.md: `--scale 10000,...` (default `--scale-ranks 1,2,8`) measures for each size
    the listing, the start-up "for 1 process and for 2 and 8 ranks" over 3 pairs against a
    20-file folder, and a worker's memory "with the template's compact file list and with the
    same paths as Python lists" (its end less its start); folders under data/benchmark-scale/."""
    import benchmark

    made, startups, memories = [], [], []

    def make_scale_folder(root, files):
        made.append((os.path.basename(root), files))
        return root

    def data_startup_seconds(root, tiny, ranks, work, repeats=3):
        startups.append((os.path.basename(root), os.path.basename(tiny), ranks, repeats))
        return 0.1 * ranks, 1.0 + 0.1 * ranks, 1.0

    def worker_memory(root, compact):
        memories.append((os.path.basename(root), compact))
        return {"start_kb": 1024, "end_kb": 2048 if compact else 11264, "items": 9}

    monkeypatch.setattr(benchmark, "make_scale_folder", make_scale_folder)
    monkeypatch.setattr(benchmark, "imagefolder_listing_seconds", lambda root: 0.25)
    monkeypatch.setattr(benchmark, "data_startup_seconds", data_startup_seconds)
    monkeypatch.setattr(benchmark, "worker_memory", worker_memory)
    defaults = benchmark.get_args_parser().parse_args(["--scale", "10"])
    assert (defaults.scale_dir, defaults.scale_ranks, defaults.scale_repeats) == (
        os.path.join(REPO, "data", "benchmark-scale"), [1, 2, 8], 3)
    out = tmp_path / "scale.json"
    benchmark.main(["--scale", "100,1000", "--scale-dir", str(tmp_path), "--json", str(out)])
    assert made == [("scale-20", 20), ("scale-100", 100), ("scale-1000", 1000)]
    assert startups == [(f"scale-{n}", "scale-20", r, 3) for n in (100, 1000) for r in (1, 2, 8)]
    assert memories == [(f"scale-{n}", compact) for n in (100, 1000) for compact in (True, False)]
    rows = json.loads(out.read_text())["scale"]
    assert [(r["files"], r["classes"]) for r in rows] == [(100, 10), (1000, 100)]
    assert rows[0]["data_startup_s"] == {"1": 0.1, "2": 0.2, "8": 0.8}
    assert (rows[0]["worker_compact_kb"], rows[0]["worker_lists_kb"]) == ([1024, 2048], [1024, 11264])
    assert "worker growth compact +1.0 MB, lists +10.0 MB" in capsys.readouterr().out
    startups.clear()  # --scale-repeats and --scale-ranks reach every measurement
    benchmark.main(["--scale", "100", "--scale-ranks", "4", "--scale-repeats", "5", "--scale-dir", str(tmp_path),
                    "--json", str(tmp_path / "other.json")])
    assert startups == [("scale-100", "scale-20", 4, 5)]


def test_scale_start_up_runs_train_single_alone_and_train_multi_gpu_under_torchrun(tmp_path, monkeypatch):
    """performance.md: the start-up "for 1 process and for 2 and 8 ranks under torchrun", each
    launch stopped at its first training step."""
    import benchmark
    from multi_train_utils import train_eval_utils
    from multi_train_utils.errors import UserError

    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        return types.SimpleNamespace(returncode=0, stdout="first step\n", stderr="")

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    for ranks in (1, 8):
        benchmark.time_to_first_step("/data/scale-100", ranks, str(tmp_path))
    single, multi = commands
    assert single[:2] == [sys.executable, os.path.join(str(tmp_path), "first_step.py")]
    assert multi[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8"]
    assert single[single.index("--data-path") + 1] == multi[multi.index("--data-path") + 1] == "/data/scale-100"
    # the probe script of the last launch runs train_multi_gpu.py, stopped at its first optimizer step
    probe = (tmp_path / "first_step.py").read_text()
    assert repr(os.path.join(REPO, "train_multi_gpu.py")) in probe and "loop.optimizer_step = first_step" in probe
    assert callable(train_eval_utils.optimizer_step)
    monkeypatch.setattr(benchmark.subprocess, "run", lambda cmd, **kw: types.SimpleNamespace(
        returncode=1, stdout="", stderr="boom"))
    with pytest.raises(UserError, match="did not reach its first step"):
        benchmark.time_to_first_step("/data/scale-100", 1, str(tmp_path))
    assert repr(os.path.join(REPO, "train_single.py")) in (tmp_path / "first_step.py").read_text()


def test_worker_memory_reads_the_compact_file_list_or_python_lists(tmp_path, monkeypatch):
    """performance.md: a loader worker's memory over an epoch "with the template's compact file
    list and with the same paths as Python lists". The measuring script runs here, in-process."""
    import benchmark
    for name in ("a", "b"):  # the worker reads paths and labels, never an image
        os.makedirs(tmp_path / "data" / name)
        for i in range(10):
            (tmp_path / "data" / name / f"{i}.jpg").write_bytes(b"")
    scopes = []

    def run_here(cmd, **kwargs):  # python -c CODE, run in this process
        scope, out = {}, io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(cmd[-1], scope)
        scopes.append(scope)
        return types.SimpleNamespace(returncode=0, stdout=out.getvalue(), stderr="")

    monkeypatch.setattr(benchmark.subprocess, "run", run_here)
    monkeypatch.setattr(sys, "path", list(sys.path))
    compact = benchmark.worker_memory(str(tmp_path / "data"), True)
    lists = benchmark.worker_memory(str(tmp_path / "data"), False)
    assert compact["items"] == lists["items"] == 18  # every training file of 20 at --val-rate 0.1
    assert compact["start_kb"] > 0 and compact["end_kb"] > 0
    assert not isinstance(scopes[0]["paths"], list)  # the dataset's compact list
    assert isinstance(scopes[1]["paths"], list) and isinstance(scopes[1]["labels"], list)


# --- benchmark.py --decoders ------------------------------------------------------------------------

def test_decoder_rows_interleave_the_decoders_and_report_the_median_pass(monkeypatch):
    """performance.md: "median of 5 interleaved passes", each decoder "with and without the
    reduced-size decode" (training keeps twice the crop size)."""
    import benchmark
    from multi_train_utils import images

    assert benchmark.get_args_parser().parse_args(["--decoders", "96"]).decoder_repeats == 5
    clock, log, reads = [0.0], [], []
    # seconds per image of each pass: Fast's passes take 1, 3 and 2 s for its 2 images
    costs = {"Fast": iter([0.5, 1.5, 1.0] * 2), "PIL": iter([2.0, 2.0, 1.0] * 2)}
    current = {}

    class Choice:  # a decoder: entering it starts a pass of its own speed
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            log.append(self.name)
            current["cost"] = next(costs[self.name])

        def __exit__(self, *exc):
            return False

    def choices():
        return {"Fast": Choice("Fast"), "PIL": Choice("PIL")}

    def read_image_uint8(path, keep_side=None):
        reads.append(keep_side)
        clock[0] += current["cost"]
        return torch.zeros(3, 40, 40, dtype=torch.uint8)

    monkeypatch.setattr(benchmark, "decoder_choices", choices)
    monkeypatch.setattr(benchmark.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(images, "read_image_uint8", read_image_uint8)
    monkeypatch.setattr(benchmark, "pixel_difference", lambda paths, decoder: (0.0, 0))
    rows = benchmark.decoder_rows(["x.jpg", "y.jpg"], [16], repeats=3)
    assert log == ["Fast", "PIL"] * 6  # interleaved: a pass of each in turn, 3 with and 3 without reduction
    assert reads[:12] == [32] * 12 and reads[12:24] == [None] * 12  # reduced: decoded to twice the crop
    by_row = {(r["decoder"], r["reduced"]): r for r in rows}
    assert by_row["Fast", True]["passes"] == pytest.approx([2.0, 2 / 3, 1.0])
    assert by_row["Fast", True]["images_per_second"] == pytest.approx(1.0)  # the median, not the mean 1.22
    assert by_row["PIL", False]["images_per_second"] == pytest.approx(statistics.median([0.5, 0.5, 1.0]))


def test_decoder_report_prints_kilopixels_bits_per_pixel_and_speed_against_pil(tmp_path, monkeypatch, capsys):
    """performance.md: the JPEGs are described by their mean kilopixels and bits per pixel, and each
    decoder's images/s is compared with PIL's at the same crop, with or without the reduced decode.
    Only JPEGs are timed."""
    import benchmark

    for name, size in (("a", (200, 150)), ("b", (100, 60))):
        os.makedirs(tmp_path / "data" / name)
        Image.new("RGB", size, (10, 200, 30)).save(tmp_path / "data" / name / "x.jpg", quality=90)
    Image.new("RGB", (50, 50)).save(tmp_path / "data" / "a" / "y.png")
    rows = [{"img_size": 96, "decoder": d, "reduced": r, "images_per_second": v, "passes": [v],
             "mean_difference_to_pil": 0.0, "max_difference_to_pil": 0}
            for d, r, v in (("TorchCodec", True, 300.0), ("PIL", True, 200.0), ("TorchCodec", False, 450.0),
                            ("PIL", False, 250.0))]
    seen = []
    monkeypatch.setattr(benchmark, "decoder_rows", lambda paths, sizes, repeats: seen.append(
        (sorted(os.path.basename(p) for p in paths), sizes, repeats)) or rows)
    out = tmp_path / "decoders.json"
    benchmark.main(["--decoders", "96", "--data-path", str(tmp_path / "data"), "--json", str(out)])
    assert seen == [(["x.jpg", "x.jpg"], [96], 5)]
    printed = capsys.readouterr().out
    sizes = [os.path.getsize(tmp_path / "data" / n / "x.jpg") for n in ("a", "b")]
    bits = statistics.mean(8 * s for s in sizes) / 18000  # (30,000 + 6,000) / 2 pixels
    assert f"2 JPEGs from {tmp_path / 'data'}: 18 kilopixels, {bits:.2f} bits per pixel on average" in printed
    table = [line.split() for line in printed.splitlines() if line.startswith("   96 ")]
    assert [(t[1], t[2], t[4]) for t in table] == [("TorchCodec", "yes", "1.50x"), ("PIL", "yes", "1.00x"),
                                                    ("TorchCodec", "no", "1.80x"), ("PIL", "no", "1.00x")]
    assert json.loads(out.read_text())["images"] == 2


# --- benchmark.py: the speed rows ---------------------------------------------------------------------

def test_the_benchmark_generates_320_jpegs_of_240_to_500_px_by_default(monkeypatch):
    """performance.md: `python benchmark.py` trains on "320 generated JPEGs of 240-500 px"; a
    --data-path is used as it is."""
    import benchmark
    from multi_train_utils.datasets import DEMO_CLASSES

    made = []
    monkeypatch.setattr(benchmark, "make_demo_dataset", lambda root, **kw: made.append((root, kw)))
    args = benchmark.get_args_parser().parse_args([])
    assert benchmark.prepare_data(args) == os.path.join(REPO, "data", "benchmark-320")
    assert made == [(os.path.join(REPO, "data", "benchmark-320"),
                     {"images_per_class": 320 // len(DEMO_CLASSES), "min_size": 240, "max_size": 500})]
    assert 320 // len(DEMO_CLASSES) * len(DEMO_CLASSES) == 320
    args = benchmark.get_args_parser().parse_args(["--data-path", "data/flower_photos"])
    assert benchmark.prepare_data(args) == "data/flower_photos" and len(made) == 1


def test_the_data_row_times_the_loader_after_its_first_2_batches(monkeypatch):
    """performance.md: "The first 2 steps of every timed run are left out" (of the clock and of
    the images). Each batch of 3 images takes 1 s on a fake clock: exactly 3 images/s."""
    import benchmark

    clock = [0.0]
    monkeypatch.setattr(benchmark.time, "perf_counter", lambda: clock[0])

    class Loader:
        def __len__(self):
            return 6

        def __iter__(self):
            for _ in range(6):
                clock[0] += 1.0
                yield torch.zeros(3, 1), torch.tensor([0, 1, 2])

    class Sampler:
        epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

    sampler = Sampler()
    rate, timed = benchmark.measure_data(Loader(), sampler, epoch=4)
    assert timed == {"images": 12, "steps": 4}
    assert rate == pytest.approx(3.0)
    assert sampler.epochs == [4]


def test_timed_rows_read_the_first_convolution_at_the_first_timed_step_and_not_when_compiled():
    """performance.md: each row records "conv_dtype and memory_format of the first convolution's
    output (left out with --compile)", after the warm-up. Here the third forward (the first
    timed one) is the only one in channels_last."""
    import benchmark

    conv = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1))
    inputs = [torch.rand(2, 3, 4, 4) for _ in range(4)]
    inputs[2] = inputs[2].contiguous(memory_format=torch.channels_last)
    batches = [(x, torch.tensor([0, 1])) for x in inputs]
    run = benchmark.TimedRun(batches, conv)
    for x, _ in run:
        conv(x)
    assert run.record() == {"images": 4, "steps": 2, "conv_dtype": "float32", "memory_format": "channels_last"}

    class Compiled(nn.Module):  # what torch.compile returns: the model under _orig_mod
        def __init__(self, model):
            super().__init__()
            self._orig_mod = model

        def forward(self, x):
            return self._orig_mod(x)

    compiled = Compiled(nn.Sequential(nn.Conv2d(3, 4, 1)))
    run = benchmark.TimedRun(batches, compiled)
    for x, _ in run:
        compiled(x)
    assert run.record() == {"images": 4, "steps": 2}


def test_the_start_up_line_prints_the_effective_batch_of_every_process_and_accumulation_step(
        tmp_path, monkeypatch, capsys):
    """performance.md: `--accum-steps N` ... "the start-up line prints the effective batch";
    multi-gpu.md: the batch size is per process. 5 per process x 3 steps x 2 processes = 30."""
    from multi_train_utils import recorder as summary
    from multi_train_utils.checkpoint import TrainState
    from multi_train_utils.train_eval_utils import LoopSettings
    from multi_train_utils.datasets import Datasets

    class Labelled(torch.utils.data.Dataset):
        def __init__(self, targets):
            self.targets = targets

        def __len__(self):
            return len(self.targets)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(summary, "get_world_size", lambda: 2)
    args = parse_flags(True, "--model", "resnet18", "--batch-size", "5", "--accum-steps", "3")
    model = nn.Linear(2, 2)
    data = Datasets(Labelled([0, 1, 0, 1]), Labelled([0, 1]), ["a", "b"])
    summary.print_start_summary(config_of(args), data, TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                                LoopSettings(), torch.device("cpu"), workers=1, log_dir="runs/x")
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("batch: 5 per process x 3 accumulation steps x 2 processes = 30 per optimizer step")
               for line in lines), lines


# --- tools/doctor.py ----------------------------------------------------------------------------------

def node_facts(rank, host, **changes):
    """The facts one rank of the doctor sends, with nothing wrong unless ``changes`` say so."""
    facts = {"rank": rank, "local_rank": rank % 2, "host": host, "pid": 100 + rank, "device": "cpu", "gpu": None,
             "torch": "2.14.1", "cores": 8, "cores_per_process": 4, "cpus": list(range(8)),
             "shm_total": 8 << 30, "shm_free": 8 << 30, "output_dir": "/out", "disk_free": 50e9,
             "interfaces": ["lo", "eth0"], "variables": {}, "findings": []}
    facts.update(changes)
    return facts


def test_the_doctor_names_a_problem_of_each_node_once_per_node():
    """multi-gpu.md: the doctor prints "per node" what it found; a problem that two nodes share
    is named for each of them, a problem two ranks of one node share once."""
    from tools.doctor import _unique_findings, finding

    small = finding("/dev/shm is only 64 MiB: ...", "docker run --shm-size=8g")
    facts = {0: node_facts(0, "a", findings=[small]), 1: node_facts(1, "a", findings=[small]),
             2: node_facts(2, "b", findings=[small]), 3: node_facts(3, "b", findings=[])}
    assert [f["what"] for f in _unique_findings(facts)] == ["node a: /dev/shm is only 64 MiB: ...",
                                                            "node b: /dev/shm is only 64 MiB: ..."]


def test_the_doctors_barrier_passes_only_when_every_rank_reports_it_done():
    """multi-gpu.md: every rank passes "a barrier, each step within --timeout"; a rank that sent
    no result did not pass it, even if all the others did."""
    from tools.doctor import format_report

    facts = {0: node_facts(0, "a"), 1: node_facts(1, "a")}
    done = {"phase": "done", "low": 3.0, "high": 3.0, "seconds": 0.01, "bytes": 8 << 20}

    def barrier_line(results):
        report = format_report(facts, results, [], world_size=2, backend="gloo", rendezvous="a:1", timeout=20)
        return [line for line in report.splitlines() if line.startswith("barrier: ")]

    assert barrier_line({0: done, 1: dict(done)}) == ["barrier: ok (all 2 ranks within 20 s)"]
    assert barrier_line({0: done}) == ["barrier: not passed (see the problems)"]
    assert barrier_line({0: done, 1: dict(done, phase="barrier")}) == ["barrier: not passed (see the problems)"]


# --- distributed_utils: clean-up, rank 0's statistics, --spawn ---------------------------------------

def test_a_failing_process_gives_the_clean_up_at_most_30_s(monkeypatch):
    """multi-gpu.md: "A process leaving on an error ... gives the clean-up at most 30 s, so its
    error gets out"."""
    import torch.distributed as dist

    from multi_train_utils import distributed_utils

    waits = []

    class Thread:
        def __init__(self, target, args=(), daemon=None):
            pass

        def start(self):
            pass

        def join(self, seconds=None):
            waits.append(seconds)

        def is_alive(self):
            return False

    monkeypatch.setattr(distributed_utils, "threading", types.SimpleNamespace(Thread=Thread))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")

    @distributed_utils.leaves_process_group
    def main():
        raise RuntimeError("a rank failed")

    with pytest.raises(RuntimeError):
        main()
    assert waits == [30]


def test_every_rank_takes_rank_0s_batchnorm_statistics(monkeypatch):
    """multi-gpu.md: "Evaluation and the saved weights use rank 0's statistics either way": with
    2 processes every buffer comes from rank 0."""
    import torch.distributed as dist

    from multi_train_utils import distributed_utils

    sent = []
    monkeypatch.setattr(distributed_utils, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src, *a, **k: sent.append(src))
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
    distributed_utils.broadcast_buffers(model)
    assert sent == [0, 0, 0]  # running_mean, running_var, num_batches_tracked


def test_spawn_starts_n_local_ranks_of_one_job_on_a_free_port_of_127_0_0_1(monkeypatch):
    """multi-gpu.md: `--spawn N` "starts N local processes with torch.multiprocessing.spawn" and
    "picks a free port on 127.0.0.1 (one node)": each is rank = local rank of N, N on its node."""
    import socket

    from multi_train_utils import distributed_utils

    started = {}
    monkeypatch.setattr(distributed_utils.mp, "start_processes",
                        lambda fn, args, nprocs, join: started.update(fn=fn, args=args, nprocs=nprocs, join=join))
    main = object()
    distributed_utils.start_local_processes(main, 3, ["--epochs", "1"])
    assert (started["nprocs"], started["join"]) == (3, False)
    given_main, nprocs, port, argv = started["args"]
    assert (given_main, nprocs, argv) == (main, 3, ["--epochs", "1"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free

    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for name in names:
        monkeypatch.setenv(name, "unset")  # so that monkeypatch restores them
    ran = []
    monkeypatch.setattr(distributed_utils, "die_with_launcher", lambda: None)
    monkeypatch.setattr(distributed_utils, "run_cli", lambda fn, argv: ran.append((fn, argv)))
    started["fn"](2, *started["args"])
    assert {n: os.environ[n] for n in names} == dict(RANK="2", WORLD_SIZE="3", LOCAL_RANK="2", LOCAL_WORLD_SIZE="3",
                                                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert ran == [(main, ["--epochs", "1"])]


# --- benchmark.py --multi-label-eval ----------------------------------------------------------------

def eval_pass_restoring_threads(*args):
    """benchmark.eval_pass(*args) in this process; the threads it ran on (it sets its own, as a
    rank of torchrun would), this process's count restored after."""
    import benchmark

    threads = torch.get_num_threads()
    try:
        benchmark.eval_pass(*args)
        return torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)


def test_the_multi_label_eval_row_times_the_pass_of_the_images_it_names(tmp_path):
    """performance.md: --multi-label-eval IMAGESxCLASSES times one pass of that many generated
    images (the last batch holds what is left) through the multi-label tally; its mAP is that
    of those images' scores, computed here (one process, in this one)."""
    import json

    import benchmark
    from multi_train_utils.multi_label import MultiLabelResult

    # "one thread a process as torchrun gives each rank of a 2-core machine"
    assert eval_pass_restoring_threads(0, 1, 0, 600, 7, str(tmp_path)) == 1
    row = json.loads((tmp_path / "0.json").read_text())
    batches = [benchmark.eval_batch(i, 7, 600) for i in range(3)]
    scores = torch.sigmoid(torch.cat([logits for logits, _, _ in batches]))
    targets = torch.cat([labels for _, labels, _ in batches])
    assert row["images"] == len(scores) == 600 and row["seconds"] > 0
    assert row["map"] == pytest.approx(MultiLabelResult.from_scores(scores, targets).map, abs=1e-12)
    assert benchmark.get_args_parser().parse_args(["--multi-label-eval", "125000x600"]).multi_label_eval == [125000, 600]
    for nothing in ("0x600", "125000x0"):  # images x classes: two positive numbers
        with pytest.raises(SystemExit):
            benchmark.get_args_parser().parse_args(["--multi-label-eval", nothing])


def test_each_rank_of_the_multi_label_eval_pass_takes_every_world_th_batch(tmp_path, monkeypatch):
    """performance.md: the pass is "as an epoch does it", each image once: of 600 images in
    batches of 256 (the last 88), rank 0 of 2 takes batches 0 and 2 (344 images), rank 1
    batch 1 (256); each rank's tally is its own here (no process group: what a rank adds)."""
    import json

    import benchmark

    monkeypatch.setattr(benchmark.dist, "init_process_group", lambda *args, **kwargs: None)
    monkeypatch.setattr(benchmark.dist, "destroy_process_group", lambda: None)
    for rank in (0, 1):
        eval_pass_restoring_threads(rank, 2, 0, 600, 7, str(tmp_path))
    assert [json.loads((tmp_path / f"{rank}.json").read_text())["images"] for rank in (0, 1)] == [344, 256]


def test_the_multi_label_eval_row_peak_is_the_highest_memory_growth_and_the_report_is_at_tuned_thresholds(
        tmp_path, monkeypatch):
    """performance.md: "peak: each rank's highest memory growth" (Linux's VmHWM, the highest,
    less VmRSS before the pass: here 5,000 less 1,000 bytes), and the pass includes "the best
    epoch's report at tuned thresholds" (the result's figures at the tuned thresholds)."""
    import json

    import benchmark
    from multi_train_utils.multi_label import MultiLabelResult

    monkeypatch.setattr(benchmark, "memory_bytes", lambda field: {"VmRSS": 1000, "VmHWM": 5000}[field])
    tuned, calls = MultiLabelResult.tuned, []
    monkeypatch.setattr(MultiLabelResult, "tuned", lambda self: calls.append(self) or tuned(self))
    eval_pass_restoring_threads(0, 1, 0, 300, 3, str(tmp_path))
    row = json.loads((tmp_path / "0.json").read_text())
    assert row["peak_bytes"] == 4000
    assert calls and calls[-1].total == 300  # the timed pass's report, at its tuned thresholds


def test_the_multi_label_eval_report_sets_the_peak_against_the_float32_scores(tmp_path, monkeypatch, capsys):
    """performance.md: "(125,000 images × 600 classes ...; 0.30 GB of float32 scores)" and the
    table's "peak / scores": the scores are images x classes x 4 bytes; 1,000 x 30 is 120,000
    bytes, and a peak of 240,000 bytes is 2.00x of them."""
    import json
    from argparse import Namespace

    import benchmark

    rows = [{"processes": 1, "seconds": 0.5, "peak_bytes": 240000, "map": 0.5, "micro_f1": 0.25, "images": 1000,
             "same_on_every_rank": True}]
    monkeypatch.setattr(benchmark, "eval_rows", lambda images, classes, processes: rows)
    report = tmp_path / "report.json"
    benchmark.report_multi_label_eval(Namespace(multi_label_eval=[1000, 30], eval_processes=[1], json=str(report)))
    assert json.loads(report.read_text())["scores_bytes"] == 120000
    line = next(l for l in capsys.readouterr().out.splitlines() if l.split()[:1] == ["1"])
    assert line.split()[3] == "2.00x", line


def test_the_multi_label_eval_row_is_the_slowest_rank_and_the_largest_peak(monkeypatch):
    """performance.md: "Seconds: the slowest rank; peak: each rank's highest memory growth" (the
    row's peak is the largest of them), and the row says whether every rank's figures agree."""
    import json
    import os

    import benchmark

    def spawn(function, args, nprocs):
        folder = args[-1]
        for rank, (seconds, peak) in enumerate([(1.5, 900), (2.5, 300), (2.0, 1200)][:nprocs]):
            with open(os.path.join(folder, f"{rank}.json"), "w") as f:
                json.dump({"seconds": seconds, "peak_bytes": peak, "map": 0.5, "micro_f1": 0.25, "images": 10,
                           "cells": {"val_map": "0.5" if rank < 2 else "0.4"}}, f)

    monkeypatch.setattr(benchmark.mp, "spawn", spawn)
    two, three = benchmark.eval_rows(10, 3, [2, 3])
    assert (two["seconds"], two["peak_bytes"], two["same_on_every_rank"]) == (2.5, 900, True)
    assert (three["seconds"], three["peak_bytes"], three["same_on_every_rank"]) == (2.5, 1200, False)
