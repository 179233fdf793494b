"""Measure training speed: loader, compute ceiling, real loop, scaling, the tutorial's way.

    python benchmark.py                    # ResNet-34, 224 px, batch 16, 320 generated JPEGs
    python benchmark.py --quick            # a smoke test in seconds (what CI runs)
    python benchmark.py --data-path data/flower_photos --num-images 3670
    python benchmark.py --scale 10000,100000,1281000   # start-up and worker memory against the file count
    python benchmark.py --decoders 96,224  # one loader worker's JPEG decoding at these crop sizes
    python benchmark.py --save-cost resnet34,resnet50   # seconds a checkpoint inside the epoch pauses training
    python benchmark.py --multi-label-eval 125000x600   # one multi-label validation pass at 1 and 2 processes

Prints a table and writes it as JSON (--json). What each row means:
  data       the training loader alone (decode, augment, collate), images/s
  step       training steps on one batch already in memory: the compute ceiling
  loop       one real epoch: train_one_epoch through the real loader
  efficiency loop / step (how much of the ceiling the loop keeps)
  scaling    an epoch of train_multi_gpu.py under torchrun with 1, 2, 4, ... processes (the
             second of two, so that every process is warm)
  baseline   the tutorial's way: fp32, NCHW, PIL -> float transforms, .item() every step
--scale rows instead: for simulated ImageNet-like folders of N files, ImageFolder's listing
time, what the data adds to the time to the first step with 1, 2, 8 ranks, and a loader
worker's memory growth over an epoch.
--decoders rows instead: for each JPEG decoder the template can use (TorchCodec, PIL), with
and without the reduced-size decode, one loader worker's images/s (one thread: read, decode,
the train transform) and the mean and largest pixel difference of its full-size decode to PIL's.
--save-cost rows instead: for each model, with SGD (momentum) and AdamW state after one optimizer
step and 1000 classes, the size of checkpoint.pth and the seconds one save takes, as training
writes it inside an epoch (off the device, build, atomic write, the previous kept): the pause.
--multi-label-eval rows instead: one multi-label validation pass of generated scores (images x
classes) at 1, 2, ... processes of one thread each (gloo), as an epoch does it: the tally of
every batch, its result (the classes split across the ranks), and the figures the epoch reads
(metrics.csv's cells, the best epoch's report at tuned thresholds); its seconds (the slowest
rank) and each rank's peak memory growth, against the size of all the scores in float32.
The first steps of every timed run (start-up, kernel selection) are left out. results.timed
records, per row, what was timed: images and steps after the warm-up and, for rows that run
the model here, the dtype and memory format of the first convolution's output.
"""
import argparse
import contextlib
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.transforms.v2.functional import pil_to_tensor
from tqdm import tqdm

from model import create_model
from multi_train_utils import images
from multi_train_utils.checkpoint import TrainState, build_checkpoint, save_checkpoint
from multi_train_utils.datasets import MyDataSet, image_file_datasets, make_demo_dataset, split_class_folders
from multi_train_utils.distributed_utils import (configure_cpu_threads, cpu_cores_available, default_workers,
                                                 select_device)
from multi_train_utils.errors import UserError, run_cli
from multi_train_utils.files import cpu_tensors
from multi_train_utils.images import IMAGENET_MEAN, IMAGENET_STD, load_rgb
from multi_train_utils.loaders import EpochBatchSampler, EpochPosition, SeededSamples, make_loader, stack_batch
from multi_train_utils.model_setup import (ModelSpec, check_input_size, choose_precision, configure_backends,
                                           optimize_model, plain_state_dict)
from multi_train_utils.multi_label import MultiLabel
from multi_train_utils.options import given_on_command_line
from multi_train_utils.run_files import read_metrics
from multi_train_utils.train_eval_utils import LoopSettings, WARMUP_STEPS, train_one_epoch


REPO = os.path.dirname(os.path.abspath(__file__))
QUICK = {"model": "resnet18", "img_size": 64, "batch_size": 8, "num_images": 60, "steps": 3, "max_processes": 2}


def file_counts(text):
    """argparse type: a comma-separated list of positive integers."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive whole numbers separated by commas, e.g. 10000,100000")
    return counts


def images_by_classes(text):
    """argparse type: IMAGESxCLASSES, two positive integers."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give images x classes as two positive numbers, e.g. 125000x600")
    return [int(part) for part in parts]


def get_args_parser():
    parser = argparse.ArgumentParser(description="Benchmark the training pipeline (see the module docstring).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data-path", default=None, help="folder of class sub-folders (default: generate --num-images flower-like JPEGs of 240-500 px into data/benchmark-N)")
    parser.add_argument("--num-images", type=int, default=320, help="images to generate when --data-path is not given")
    parser.add_argument("--model", default="resnet34", help="torchvision classification model")
    parser.add_argument("--img-size", type=int, default=224, help="training crop size in pixels")
    parser.add_argument("--batch-size", type=int, default=16, help="images per step per process")
    parser.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"], help="mixed precision of our pipeline (the baseline is always fp32)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None, help="NHWC memory format (default: on for conv nets)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model for the step and loop rows")
    parser.add_argument("--workers", type=int, default=None, help="loader workers (default: as train_single.py)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps for the step rows (after warm-up)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--scaling", action=argparse.BooleanOptionalAction, default=True, help="run the torchrun scaling rows")
    parser.add_argument("--max-processes", type=int, default=None, help="largest process count for scaling: 1, 2, 4, ... and this (default: GPUs, or CPU cores)")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True, help="run the tutorial-way rows")
    parser.add_argument("--json", default="runs/benchmark.json", help="where to write the results")
    parser.add_argument("--scale", type=file_counts, default=None, metavar="N,N,...", help="instead of the speed rows: start-up and loader-worker memory on simulated ImageNet-like folders of N files each (e.g. 10000,100000,1281000; hard links, made once under --scale-dir)")
    parser.add_argument("--scale-ranks", type=file_counts, default=[1, 2, 8], metavar="R,R,...", help="with --scale: the rank counts to time the start-up with")
    parser.add_argument("--scale-repeats", type=int, default=3, help="with --scale: pairs of launches (tiny folder, then the large one) whose median difference is the start-up row")
    parser.add_argument("--scale-dir", default=os.path.join(REPO, "data", "benchmark-scale"), help="with --scale: where the simulated folders go")
    parser.add_argument("--decoders", type=file_counts, default=None, metavar="SIZE,SIZE,...", help="instead of the speed rows: one loader worker's JPEG decoding + train transform at these crop sizes (e.g. 96,224), for each decoder")
    parser.add_argument("--decoder-repeats", type=int, default=5, help="with --decoders: passes over the images per row, interleaved; the median is reported")
    parser.add_argument("--save-cost", type=lambda text: [m for m in text.split(",") if m], default=None,
                        metavar="MODEL,MODEL,...", help="instead of the speed rows: seconds per checkpoint save with "
                        "SGD and AdamW state (e.g. resnet34,resnet50), written into --save-dir")
    parser.add_argument("--save-dir", default=os.path.join(REPO, "weights", "save-cost"),
                        help="with --save-cost: where the checkpoints are written (the disk of your --output-dir), "
                             "removed afterwards")
    parser.add_argument("--save-repeats", type=int, default=5, help="with --save-cost: saves per row; the median "
                        "is reported")
    parser.add_argument("--multi-label-eval", type=images_by_classes, default=None, metavar="IMAGESxCLASSES",
                        help="instead of the speed rows: one multi-label validation pass of this size")
    parser.add_argument("--eval-processes", type=file_counts, default=[1, 2], metavar="P,P,...",
                        help="with --multi-label-eval: the process counts")
    parser.add_argument("--quick", action="store_true", help="smoke test in seconds: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()) + " (unless given)")
    return parser


# --- Our pipeline -----------------------------------------------------------------------------

class InMemoryBatches:
    """A stand-in for the DataLoader that yields one batch, already in memory, ``steps`` times."""

    def __init__(self, images, labels, steps):
        self.batch = (images, labels)
        self.steps = steps
        self.batch_sampler = argparse.Namespace(batch_size=len(labels))

    def __iter__(self):
        return (self.batch for _ in range(self.steps))

    def __len__(self):
        return self.steps


class TimedRun:
    """Batches for one timed row, and a record of what it timed: the images and steps after the
    warm-up (counted as the batches are handed out) and, given the model, the dtype and memory
    format of its first Conv2d's output at the first timed step (a forward hook that then
    removes itself; not on a compiled model, whose graph a hook would change)."""

    def __init__(self, batches, model=None):
        self.batches, self.images, self.steps = batches, 0, 0
        self.batch_sampler = getattr(batches, "batch_sampler", None)  # train_one_epoch reads its batch_size
        self.conv, self.calls = {}, 0
        if model is not None and not hasattr(model, "_orig_mod"):
            conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
            self.hook = conv.register_forward_hook(self.see_conv) if conv is not None else None

    def see_conv(self, module, inputs, output):
        self.calls += 1
        if self.calls > WARMUP_STEPS:  # the first timed step
            channels_last = output.is_contiguous(memory_format=torch.channels_last)
            self.conv = {"conv_dtype": str(output.dtype).removeprefix("torch."),
                         "memory_format": "channels_last" if channels_last else "contiguous"}
            self.hook.remove()

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for step, batch in enumerate(self.batches):
            if step >= WARMUP_STEPS:
                self.images, self.steps = self.images + len(batch[1]), self.steps + 1
            yield batch

    def record(self):
        return {"images": self.images, "steps": self.steps, **self.conv}


def measure_data(loader, sampler, epoch):
    """Images/s of the loader alone, over one epoch, the first batches left out; and what it timed."""
    sampler.set_epoch(epoch)
    batches = TimedRun(loader)
    start = time.perf_counter()
    for step, _ in enumerate(batches):
        if step + 1 == WARMUP_STEPS:
            start = time.perf_counter()
    return batches.images / (time.perf_counter() - start), batches.record()


def new_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-3)


def measure_step(model, batch, device, settings, steps):
    """Images/s of train_one_epoch on one in-memory ``batch`` (images, labels): the compute
    ceiling of the loop; and what it timed."""
    batches = TimedRun(InMemoryBatches(*batch, WARMUP_STEPS + steps), model)
    stats = train_one_epoch(TrainState(model, new_optimizer(model)), batches, device, 0, settings)
    return stats.images_per_second, batches.record()


# --- The tutorial's way -------------------------------------------------------------------------

class TutorialDataSet(MyDataSet):
    """The tutorial's dataset: PIL image -> torchvision.transforms (float tensors on the CPU)."""

    def __getitem__(self, index):
        return self.transform(load_rgb(self.images_path[index])), self.images_class[index]


def tutorial_loader(split, img_size, batch_size):
    from torchvision import transforms

    transform = transforms.Compose([transforms.RandomResizedCrop(img_size), transforms.RandomHorizontalFlip(),
                                    transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    dataset = TutorialDataSet(split.train_images_path, split.train_images_label, transform)
    workers = min(os.cpu_count(), batch_size if batch_size > 1 else 0, 8)  # the tutorial's formula
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, drop_last=True,
                      pin_memory=torch.cuda.is_available(), collate_fn=stack_batch)


def tutorial_epoch(model, optimizer, data_loader, device):
    """The tutorial's train_one_epoch: fp32, the running mean loss read with .item() every step.
    Returns images/s and what it timed."""
    model.train()
    loss_function = nn.CrossEntropyLoss()
    mean_loss = torch.zeros(1).to(device)
    start = time.perf_counter()
    timed = TimedRun(data_loader, model)  # counts the images after the warm-up
    data_loader = tqdm(timed, file=sys.stdout, leave=False)
    for step, (batch, labels) in enumerate(data_loader):
        pred = model(batch.to(device))
        loss = loss_function(pred, labels.to(device))
        loss.backward()
        mean_loss = (mean_loss * step + loss.detach()) / (step + 1)
        data_loader.desc = "[epoch 0] mean loss {}".format(round(mean_loss.item(), 3))
        if not torch.isfinite(loss):
            sys.exit("non-finite loss")
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == WARMUP_STEPS:
            start = time.perf_counter()
    return timed.images / (time.perf_counter() - start), timed.record()


def measure_tutorial_step(model, images, labels, device, steps):
    """The compute ceiling of the tutorial's way: fp32 NCHW steps on one in-memory batch."""
    optimizer = new_optimizer(model)
    images = ((images.float() / 255 - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1))
              / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)).to(device)
    return tutorial_epoch(model, optimizer, [(images, labels)] * (WARMUP_STEPS + steps), device)


# --- Scaling under torchrun -----------------------------------------------------------------------

def measure_scaling(args, data_path, processes, device):
    """Images/s of train_multi_gpu.py under torchrun with ``processes`` processes: the second of
    two epochs, when every process is warm (kernels chosen, workers started); and what it timed."""
    with tempfile.TemporaryDirectory(prefix="benchmark-") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               os.path.join(REPO, "train_multi_gpu.py"), "--data-path", data_path, "--val-rate", "0.1",
               "--epochs", "2", "--model", args.model, "--img-size", str(args.img_size),
               "--batch-size", str(args.batch_size), "--amp", args.amp, "--device", device.type,
               "--output-dir", out, "--log-dir", os.path.join(out, "runs"), "--no-scale-lr"]
        if args.channels_last is not None:  # else the script's default, the rule this process follows
            cmd += ["--channels-last" if args.channels_last else "--no-channels-last"]
        cmd += ["--workers", str(args.workers)] if args.workers is not None else []
        cmd += ["--compile"] if args.compile else []
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        if result.returncode != 0:
            raise UserError(f"scaling run with {processes} processes failed:\n{result.stdout[-2000:]}"
                            f"{result.stderr[-2000:]}")
        rate = float(read_metrics(out)[-1]["images_per_second"])
    return rate, scaling_timed(result.stdout, args.batch_size * processes)


def scaling_rows(args, data_path, device, batches, timed):
    """The scaling rows for 1, 2, 4, ... processes (``batches``: of one process's epoch); what
    each timed goes into ``timed``."""
    devices = torch.cuda.device_count() if device.type == "cuda" else cpu_cores_available()
    rows = []
    for processes in process_counts(min(devices, args.max_processes or devices)):
        if batches // processes <= WARMUP_STEPS + 1:
            print(f"scaling x{processes}: skipped, {batches // processes} batches a process are too few "
                  "to time; raise --num-images", flush=True)
            continue
        rate, timed[f"scaling x{processes}"] = measure_scaling(args, data_path, processes, device)
        first = rows[0]["images_per_second"] if rows else rate
        # GPUs: each process adds a GPU, ideal is k x one; CPU: the same cores are shared.
        ideal = first * (processes if device.type == "cuda" else 1)
        rows.append({
            "processes": processes, "images_per_second": rate, "efficiency": rate / ideal,
            "threads_per_process": max(1, cpu_cores_available() // processes) if device.type == "cpu" else None,
            "gpus": processes if device.type == "cuda" else 0})
        print(f"scaling x{processes}: {rate:.1f} images/s", flush=True)
    return rows


def scaling_timed(stdout, images_per_step):
    """Images and steps (each process's) a scaling run timed, read from the last progress bar of
    its second epoch (``[train epoch 1]: 100%|...| 80/80``: images of all processes), the
    warm-up left out; None where the bar is not found."""
    bars = re.findall(r"\[train epoch 1\][^|]*\|[^|]*\| *(\d+)/\d+", stdout)
    if not bars:
        return {"images": None, "steps": None}
    steps = int(bars[-1]) // images_per_step - WARMUP_STEPS
    return {"images": steps * images_per_step, "steps": steps}


# --- Scale: start-up and loader-worker memory against the number of files ------------------------

SCALE_CLASSES = 1000  # ImageNet's
SCALE_SEEDS = 32  # distinct small JPEGs; the files are hard links to them (ext4 allows 65,000 links a file)
# Run as a script by time_to_first_step: the training script, stopped at its first optimizer step.
FIRST_STEP = """import os, runpy, sys
sys.path.insert(0, {repo!r})
import multi_train_utils.train_eval_utils as loop
def first_step(*args, **kwargs):
    print("first step", flush=True)
    os._exit(0)
loop.optimizer_step = first_step
runpy.run_path({script!r}, run_name="__main__")
"""
# Run as a script by worker_memory: a loader worker's private memory (USS) over one epoch.
WORKER_MEMORY = """import os, sys, json
sys.path.insert(0, {repo!r})
import torch
from torch.utils.data import DataLoader, Dataset
from multi_train_utils.datasets import split_class_folders
from multi_train_utils.datasets import MyDataSet

def private_kb():
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean", "Private_Dirty")))

class PathsOnly(Dataset):  # what a worker reads of an item, without decoding the image
    def __init__(self, paths, labels):
        self.paths, self.labels = paths, labels
    def __len__(self):
        return len(self.paths)
    def __getitem__(self, i):
        return len(self.paths[i]) + int(self.labels[i]), private_kb() if i in (0, len(self) - 1) else 0

split = split_class_folders({root!r}, val_rate=0.1, seed=0)
held = MyDataSet(split.train_images_path, split.train_images_label)
paths, labels = (held.images_path, held.images_class) if {compact!r} else (list(split.train_images_path),
                                                                         list(split.train_images_label))
del split, held
loader = DataLoader(PathsOnly(paths, labels), batch_size=4096, num_workers=1, collate_fn=lambda b: b)
seen = [kb for batch in loader for _, kb in batch if kb]
print(json.dumps({{"start_kb": seen[0], "end_kb": seen[-1], "items": len(paths)}}))
"""


def make_scale_folder(root, files):
    """``files`` hard links to SCALE_SEEDS small JPEGs in SCALE_CLASSES class folders (fewer
    for small counts: 10 files a class at least), like ImageNet's; kept for the next run."""
    classes = min(SCALE_CLASSES, max(2, files // 10))
    marker = os.path.join(root, ".complete")
    if os.path.exists(marker):
        return root
    from PIL import Image

    seeds = os.path.join(root + "-seeds")
    os.makedirs(seeds, exist_ok=True)
    for i in range(SCALE_SEEDS):
        Image.new("RGB", (40, 32), (8 * i, 100, 250 - 7 * i)).save(os.path.join(seeds, f"{i}.jpg"), quality=80)
    for c in range(classes):
        folder = os.path.join(root, f"n{c:08d}")
        os.makedirs(folder, exist_ok=True)
        for j in range(files // classes + (c < files % classes)):
            target = os.path.join(folder, f"n{c:08d}_{j}.JPEG")
            if not os.path.exists(target):
                os.link(os.path.join(seeds, f"{(c * 7 + j) % SCALE_SEEDS}.jpg"), target)
    open(marker, "w").close()
    return root


def imagefolder_listing_seconds(root):
    """Seconds torchvision's ImageFolder takes to list ``root`` (no image opened): the best of 2."""
    from torchvision.datasets import ImageFolder

    times = []
    for _ in range(2):
        started = time.perf_counter()
        ImageFolder(root, loader=lambda path: path)
        times.append(time.perf_counter() - started)
    return min(times)


def data_startup_seconds(root, tiny, ranks, work, repeats=3):
    """What the data of ``root`` adds to the time to the first step with ``ranks`` ranks: the
    median over ``repeats`` pairs of launches (on ``tiny``, then on ``root``) of the
    difference, so that a machine whose speed drifts moves both of a pair; and the median time
    of each."""
    pairs = [(time_to_first_step(tiny, ranks, work), time_to_first_step(root, ranks, work)) for _ in range(repeats)]
    return (statistics.median(big - small for small, big in pairs), statistics.median(big for _, big in pairs),
            statistics.median(small for small, _ in pairs))


def time_to_first_step(root, ranks, work):
    script = os.path.join(REPO, "train_single.py" if ranks == 1 else "train_multi_gpu.py")
    probe = os.path.join(work, "first_step.py")
    with open(probe, "w") as f:
        f.write(FIRST_STEP.format(repo=REPO, script=script))
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc_per_node={ranks}"]
    out = os.path.join(work, f"out-{ranks}-{os.path.basename(root)}")
    cmd = [*launcher, probe, "--data-path", root, "--device", "cpu", "--model", "resnet18", "--img-size", "32",
           "--batch-size", "2", "--workers", "1", "--epochs", "1", "--output-dir", out, "--overwrite",
           "--log-dir", os.path.join(work, "tb"), "--val-rate", "0.1"]
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - started
    if "first step" not in result.stdout:
        raise UserError(f"start-up run ({ranks} rank(s), {root}) did not reach its first step:\n"
                        f"{result.stdout[-1500:]}{result.stderr[-1500:]}")
    return seconds


def worker_memory(root, compact):
    """A loader worker's private memory (kB) after its first and its last item of an epoch over
    every file of ``root``: the dataset's compact lists (``compact``) or plain Python lists."""
    code = WORKER_MEMORY.format(repo=REPO, root=root, compact=compact)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        raise UserError(f"worker memory run failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def scale_rows(sizes, ranks, folder, repeats=3):
    """For each file count of ``sizes``: ImageFolder's listing time, the time the data adds to
    the first step (against a 20-file folder, ``data_startup_seconds``) for each rank count of
    ``ranks``, and a loader worker's memory growth over an epoch (compact lists, and plain lists)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="benchmark-scale-") as work:
        tiny = make_scale_folder(os.path.join(folder, "scale-20"), 20)
        for files in sizes:
            root = make_scale_folder(os.path.join(folder, f"scale-{files}"), files)
            row = {"files": files, "classes": min(SCALE_CLASSES, max(2, files // 10)),
                   "imagefolder_listing_s": imagefolder_listing_seconds(root), "startup_s": {}, "tiny_startup_s": {},
                   "data_startup_s": {}}
            for r in ranks:
                row["data_startup_s"][r], row["startup_s"][r], row["tiny_startup_s"][r] = data_startup_seconds(
                    root, tiny, r, work, repeats)
            for kind in ("compact", "lists"):
                memory = worker_memory(root, kind == "compact")
                row[f"worker_{kind}_kb"] = [memory["start_kb"], memory["end_kb"]]
            print(f"scale {files}: listing {row['imagefolder_listing_s']:.2f} s; data start-up "
                  + ", ".join(f"{r} rank(s) {row['data_startup_s'][r]:.2f} s" for r in ranks)
                  + "; worker growth compact {:+.1f} MB, lists {:+.1f} MB".format(
                      *((row[f"worker_{k}_kb"][1] - row[f"worker_{k}_kb"][0]) / 1024 for k in ("compact", "lists"))),
                  flush=True)
            rows.append(row)
    return rows


def print_scale_table(rows):
    ranks = list(rows[0]["data_startup_s"]) if rows else []
    print(f"\n{'files':>9} {'classes':>7} {'ImageFolder':>11} " + " ".join(f"{f'+start x{r}':>10}" for r in ranks)
          + f" {'worker +MB':>10} {'(lists)':>8}")
    for row in rows:
        growth = [(row[f"worker_{k}_kb"][1] - row[f"worker_{k}_kb"][0]) / 1024 for k in ("compact", "lists")]
        print(f"{row['files']:>9} {row['classes']:>7} {row['imagefolder_listing_s']:>10.2f}s "
              + " ".join(f"{row['data_startup_s'][r]:>9.2f}s" for r in ranks)
              + f" {growth[0]:>+10.1f} {growth[1]:>+8.1f}")
    print("ImageFolder: listing the folder; +start xN: what the data adds to the time to the first step with N "
          "ranks (median over pairs of launches, against a 20-file folder); worker +MB: a loader worker's private "
          "memory at the end of an epoch less at its start (lists: the same paths and labels as Python lists)")


# --- JPEG decoders (--decoders) ------------------------------------------------------------------

def decoder_choices():
    """{name: context manager under which read_image_uint8 decodes JPEGs that way}."""
    choices = {"PIL": mock.patch.object(images, "decode_jpeg", None)}
    if images.decode_jpeg is not None:
        choices = {"TorchCodec": contextlib.nullcontext(), **choices}
    return choices


def pixel_difference(paths, decoder):
    """(mean, largest) |difference| of ``decoder``'s full-size decode to PIL's, over ``paths``."""
    means, largest = [], 0
    with decoder:
        for path in paths:
            ours = images.read_image_uint8(path).int()
            pil = pil_to_tensor(images.load_rgb(path)).int()
            difference = (ours - pil).abs()
            means.append(float(difference.float().mean()))
            largest = max(largest, int(difference.max()))
    return statistics.mean(means), largest


def decoder_rows(paths, sizes, repeats):
    """Images/s of one thread reading, decoding and transforming ``paths`` for each decoder,
    with and without the reduced-size decode, at each crop size (passes interleaved, median)."""
    torch.set_num_threads(1)  # as in a loader worker
    rows = []
    for size in sizes:
        train_transform, _ = images.build_transforms(size)
        for keep_side in (2 * size, None):  # training decodes at twice the crop size at least
            passes = {name: [] for name in decoder_choices()}
            for _ in range(repeats):
                for name, decoder in decoder_choices().items():
                    with decoder:
                        start = time.perf_counter()
                        for path in paths:
                            train_transform(images.read_image_uint8(path, keep_side))
                        passes[name].append(len(paths) / (time.perf_counter() - start))
            for name, rates in passes.items():
                rows.append({"img_size": size, "decoder": name, "reduced": keep_side is not None,
                             "images_per_second": statistics.median(rates), "passes": rates})
    for name, decoder in decoder_choices().items():
        mean, largest = pixel_difference(paths[:50], decoder)
        for row in rows:
            if row["decoder"] == name:
                row.update(mean_difference_to_pil=mean, max_difference_to_pil=largest)
    return rows


def report_decoders(args):
    """--decoders: the decoder rows, printed and written to --json."""
    root = prepare_data(args)
    paths = [path for path in images.find_image_files(root).paths if path.lower().endswith((".jpg", ".jpeg"))]
    if not paths:
        raise UserError(f"--data-path {root}: no JPEG files to decode")
    rows = decoder_rows(paths, args.decoders, args.decoder_repeats)
    pixels = statistics.mean(math.prod(Image.open(path).size) for path in paths)
    bits = statistics.mean(8 * os.path.getsize(path) for path in paths) / pixels
    machine = machine_description(torch.device("cpu"))
    print(f"\n{machine}\n{len(paths)} JPEGs from {root}: {pixels / 1000:.0f} kilopixels, {bits:.2f} bits per pixel "
          "on average")
    print(f"{'crop':>5} {'decoder':<11} {'reduced':<8} {'images/s':>9} {'vs PIL':>7} {'mean |diff|':>12} {'max':>4}")
    pil = {(r["img_size"], r["reduced"]): r["images_per_second"] for r in rows if r["decoder"] == "PIL"}
    for row in rows:
        ratio = row["images_per_second"] / pil[row["img_size"], row["reduced"]]
        print(f"{row['img_size']:>5} {row['decoder']:<11} {'yes' if row['reduced'] else 'no':<8} "
              f"{row['images_per_second']:>9.0f} {ratio:>6.2f}x "
              f"{row['mean_difference_to_pil']:>12.3f} {row['max_difference_to_pil']:>4}")
    print("one thread, as in a loader worker: read, decode, random resized crop + flip; reduced: JPEGs at least "
          "twice the decode size (2 x crop) decoded at 1/2, 1/4 or 1/8 by PIL's draft mode; |diff|: full-size "
          "decode against PIL's, 0-255")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": machine, "images": len(paths), "data_path": os.path.abspath(root), "decoders": rows},
                  f, indent=2)
    print(f"\nwritten to {args.json}")


# --- --save-cost: what a checkpoint inside the epoch costs ---------------------------------------

def save_cost_rows(models, folder, repeats, device):
    """Per model and optimizer: checkpoint.pth's size and the median seconds of one save, as
    ``recorder.RunRecorder`` writes it inside an epoch."""
    rows = []
    os.makedirs(folder, exist_ok=True)
    try:
        for name in models:
            for opt in ("sgd", "adamw"):
                torch.manual_seed(0)
                model = create_model(name, 1000, 3).to(device)
                optimizer = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt == "sgd" else
                             torch.optim.AdamW(model.parameters(), lr=0.001))
                model(torch.randn(2, 3, 64, 64, device=device)).sum().backward()
                optimizer.step()  # the optimizer's state exists, as it does inside an epoch
                state = TrainState(model, optimizer)
                position = EpochPosition(epoch=0, done=0, end=1, order_world_size=1, step=0, train_images=1)
                seconds = []
                for _ in range(repeats + 1):  # the first one warms the file system's cache
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    start = time.perf_counter()
                    save_checkpoint(folder, build_checkpoint(
                        state, cpu_tensors(plain_state_dict(model)), metrics=[], flags={}, classes=[],
                        file_list=None, world_size=1, log_dir=None, position=position))
                    seconds.append(time.perf_counter() - start)
                size = os.path.getsize(os.path.join(folder, "checkpoint.pth"))
                rows.append({"model": name, "optimizer": opt, "megabytes": size / 1e6,
                             "seconds": statistics.median(seconds[1:]), "max_seconds": max(seconds[1:])})
                print(f"{name} {opt}: {size / 1e6:.0f} MB, {rows[-1]['seconds']:.2f} s a save", flush=True)
    finally:
        for leftover in ("checkpoint.pth", "checkpoint-prev.pth"):
            path = os.path.join(folder, leftover)
            if os.path.exists(path):
                os.remove(path)
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    return rows


def report_save_cost(args):
    """--save-cost: the rows, printed and written to --json."""
    device = select_device(args.device)
    configure_cpu_threads(device)
    rows = save_cost_rows(args.save_cost, args.save_dir, args.save_repeats, device)
    machine = machine_description(device)
    print(f"\n{machine}; written to {os.path.abspath(args.save_dir)}")
    print(f"{'model':<16}{'optimizer':<10}{'checkpoint':>11}{'s a save':>10}{'max':>7}{'MB/s':>8}")
    for row in rows:
        print(f"{row['model']:<16}{row['optimizer']:<10}{row['megabytes']:>8.0f} MB{row['seconds']:>10.2f}"
              f"{row['max_seconds']:>7.2f}{row['megabytes'] / row['seconds']:>8.0f}")
    print(f"median of {args.save_repeats} saves after one more; a save inside the epoch pauses training this long, "
          "once every --checkpoint-every minutes")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": machine, "device": str(device), "save_dir": os.path.abspath(args.save_dir),
                   "save_cost": rows}, f, indent=2)
    print(f"\nwritten to {args.json}")


# --- --multi-label-eval: a multi-label validation pass at scale ----------------------------------

EVAL_BATCH = 256  # images a generated validation batch


def eval_batch(index, classes, images=EVAL_BATCH * (1 << 40)):
    """Generated batch ``index`` of (logits, labels, weights) of a pass over ``images``, from
    its own seed (the same images at any world size): each class positive in 0.5-20 % of the
    images, its logits 2 higher on its positives; the last batch holds what is left."""
    size = min(EVAL_BATCH, images - index * EVAL_BATCH)
    generator = torch.Generator().manual_seed(index)
    labels = (torch.rand(size, classes, generator=generator) < torch.linspace(0.005, 0.2, classes)).float()
    logits = torch.randn(size, classes, generator=generator) + 2 * labels - 2
    return logits, labels, torch.ones(size, dtype=torch.int64)


def memory_bytes(field):
    """This process's resident memory now (VmRSS) or at its highest (VmHWM), from Linux's /proc."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def eval_pass(rank, world, port, images, classes, folder):
    """One rank's pass: batches rank, rank + world, ... through the multi-label tally, then its
    result and the figures an epoch reads; its seconds and peak memory growth to ``folder``."""
    torch.set_num_threads(1)  # as torchrun gives each rank of a 2-core machine
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    task = MultiLabel(tune_thresholds=True)
    batches = [eval_batch(i, classes) for i in range(2)]  # warm-up: the first calls of each operation
    warm = task.evaluation(classes, torch.device("cpu"))
    for batch in batches:
        warm.add(*batch)
    task.keep(warm.result())
    del warm, batches
    before, seconds = memory_bytes("VmRSS"), 0.0
    tally = task.evaluation(classes, torch.device("cpu"))
    for index in range(rank, math.ceil(images / EVAL_BATCH), world):
        batch = eval_batch(index, classes, images)  # made outside the timer
        start = time.perf_counter()
        tally.add(*batch)
        seconds += time.perf_counter() - start
    start = time.perf_counter()
    result = tally.result()
    cells, kept = task.cells(result), task.keep(result)
    seconds += time.perf_counter() - start
    peak = memory_bytes("VmHWM") - before
    with open(os.path.join(folder, f"{rank}.json"), "w") as f:
        json.dump({"seconds": seconds, "peak_bytes": peak, "map": result.map, "micro_f1": result.micro_f1,
                   "images": result.total, "tuned_map": kept["report"]["map"], "cells": cells}, f)
    if world > 1:
        dist.destroy_process_group()


def eval_rows(images, classes, processes):
    """One row per process count: the pass's seconds (slowest rank), peak growth (largest), mAP."""
    rows = []
    for world in processes:
        with tempfile.TemporaryDirectory() as folder:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(eval_pass, args=(world, port, images, classes, folder), nprocs=world)
            ranks = [json.load(open(os.path.join(folder, f"{rank}.json"))) for rank in range(world)]
        rows.append({"processes": world, "seconds": max(r["seconds"] for r in ranks),
                     "peak_bytes": max(r["peak_bytes"] for r in ranks), "map": ranks[0]["map"],
                     "micro_f1": ranks[0]["micro_f1"], "images": ranks[0]["images"],
                     "same_on_every_rank": all(r["cells"] == ranks[0]["cells"] for r in ranks)})
        print(f"{world} process(es): {rows[-1]['seconds']:.2f} s, peak +{rows[-1]['peak_bytes'] / 1e9:.2f} GB", flush=True)
    return rows


def report_multi_label_eval(args):
    """--multi-label-eval: the rows, printed and written to --json."""
    images, classes = args.multi_label_eval
    rows = eval_rows(images, classes, args.eval_processes)
    scores = images * classes * 4
    machine = machine_description(torch.device("cpu"))
    print(f"\n{machine}\none multi-label validation pass, {images} images x {classes} classes (scores: "
          f"{scores / 1e9:.2f} GB in float32), one thread a process")
    print(f"{'processes':>9} {'seconds':>8} {'peak GB':>8} {'/ scores':>9} {'mAP':>10}")
    for row in rows:
        print(f"{row['processes']:>9} {row['seconds']:>8.2f} {row['peak_bytes'] / 1e9:>8.2f} "
              f"{row['peak_bytes'] / scores:>8.2f}x {row['map']:>10.6f}{'' if row['same_on_every_rank'] else ' (ranks differ!)'}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": machine, "images": images, "classes": classes, "scores_bytes": scores,
                   "multi_label_eval": rows}, f, indent=2)
    print(f"\nwritten to {args.json}")


# --- The report ---------------------------------------------------------------------------------

def machine_description(device):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{cpu}, {cpu_cores_available()} cores"
    if device.type == "cuda":
        text = f"{torch.cuda.get_device_name(device)} x {torch.cuda.device_count()}; {text}"
    return f"{text}; torch {torch.__version__}"


def print_table(report):
    r = report["results"]
    rows = [("data", r["data"], "loader only"),
            ("step", r["step"], "compute ceiling, in-memory batch"),
            ("loop", r["loop"], "one real epoch"),
            ("efficiency", r["efficiency"], "loop / step")]
    for row in r.get("scaling", []):
        each = f"{row['threads_per_process']} thread(s)" if row["threads_per_process"] else "1 GPU"
        rows.append((f"scaling x{row['processes']}", row["images_per_second"],
                     f"{row['processes']} process(es) x {each}, efficiency {row['efficiency']:.2f}"))
    if "baseline" in r:
        rows += [("baseline step", r["baseline"]["step"], "tutorial way, in-memory batch"),
                 ("baseline loop", r["baseline"]["loop"], "tutorial way, one real epoch"),
                 ("loop / baseline", r["speedup_vs_baseline"], "")]
    s = report["settings"]
    print(f"\n{report['machine']}")
    print(f"{s['model']}, {s['img_size']} px, batch {s['batch_size']}, {s['images']} training images, "
          f"amp {s['amp']}, channels_last {'on' if s['channels_last'] else 'off'}, {s['workers']} workers")
    print(f"{'':<16}{'images/s':>10}")
    for name, value, note in rows:
        number = f"{value:10.2f}" if name in ("efficiency", "loop / baseline") else f"{value:10.1f}"
        print(f"{name:<16}{number}  {note}")


def report_scale(args):
    """--scale: the scale rows, printed and written to --json."""
    rows = scale_rows(args.scale, args.scale_ranks, args.scale_dir, args.scale_repeats)
    print(f"\n{machine_description(torch.device('cpu'))}")
    print_scale_table(rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": machine_description(torch.device("cpu")), "scale": rows}, f, indent=2)
    print(f"\nwritten to {args.json}")


def process_counts(largest):
    """1, 2, 4, ... up to ``largest``, and ``largest`` itself."""
    counts = [1]
    while counts[-1] * 2 <= largest:
        counts.append(counts[-1] * 2)
    return counts + ([largest] if counts[-1] != largest else [])


def prepare_data(args):
    if args.data_path:
        return args.data_path
    root = os.path.join(REPO, "data", f"benchmark-{args.num_images}")
    per_class = max(2, args.num_images // 5)
    make_demo_dataset(root, images_per_class=per_class, min_size=240, max_size=500)
    return root


def main(argv=None):
    parser = get_args_parser()
    args = parser.parse_args(argv)
    if args.quick:
        given = given_on_command_line(parser, argv)
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
    if args.scale:
        return report_scale(args)
    if args.decoders:
        return report_decoders(args)
    if args.save_cost:
        return report_save_cost(args)
    if args.multi_label_eval:
        return report_multi_label_eval(args)
    # before the data is made (the class count does not change which sizes a model takes)
    check_input_size(ModelSpec(create_model, args.model, 2, args.img_size), args.batch_size, training=True)
    device = select_device(args.device, make_current=False)  # counts GPUs without creating a CUDA context
    configure_cpu_threads(device)
    configure_backends(device)
    # On a GPU the precision check creates a CUDA context: only after the scaling rows.
    precision = choose_precision(args.amp, device) if device.type != "cuda" else None
    data_path = prepare_data(args)

    split = split_class_folders(data_path, val_rate=0.1, seed=0)
    train_set = SeededSamples(image_file_datasets(split, args.img_size).train, seed=0)  # the built-in pipeline
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=0)
    batches = EpochBatchSampler(sampler, args.batch_size, world_size=1, rank=0)  # as the scripts batch
    if len(batches) <= WARMUP_STEPS:
        raise UserError(f"{len(split.train_images_path)} training images give {len(batches)} batches of "
                        f"{args.batch_size}; need more than {WARMUP_STEPS}: raise --num-images")
    results, timed = {}, {}  # timed: what each row timed, by the table's row names
    # Scaling rows first, while this process holds no CUDA context: under the EXCLUSIVE_PROCESS
    # compute mode of many clusters, a GPU takes one process at a time, and the children need it.
    if args.scaling:
        results["scaling"] = scaling_rows(args, data_path, device, len(batches), timed)

    if device.type == "cuda":
        torch.cuda.set_device(device)  # the CUDA context of this process, on the chosen GPU
    precision = precision or choose_precision(args.amp, device)
    workers = args.workers if args.workers is not None else default_workers()
    loader = make_loader(train_set, batches, workers, device)  # pin_memory on CUDA: a context from here on
    results["data"], timed["data"] = measure_data(loader, sampler, epoch=0)
    print(f"data: {results['data']:.1f} images/s", flush=True)

    num_classes = len(split.classes)
    torch.manual_seed(0)
    model = create_model(args.model, num_classes, 3).to(device)
    flags = argparse.Namespace(**vars(args), grad_checkpoint=False, data_parallel=False)
    model, channels_last = optimize_model(model, flags, device)
    settings = LoopSettings(precision, channels_last)  # as train_single.py runs it
    batch = next(iter(loader))
    results["step"], timed["step"] = measure_step(model, batch, device, settings, args.steps)
    print(f"step: {results['step']:.1f} images/s", flush=True)

    sampler.set_epoch(1)
    epoch = TimedRun(loader, model)
    stats = train_one_epoch(TrainState(model, new_optimizer(model)), epoch, device, 1, settings)
    results["loop"], timed["loop"] = stats.images_per_second, epoch.record()
    results["efficiency"] = results["loop"] / results["step"]
    print(f"loop: {results['loop']:.1f} images/s", flush=True)
    del loader  # its workers

    if args.baseline:
        torch.manual_seed(0)
        model = create_model(args.model, num_classes, 3).to(device)
        steps = max(2, args.steps // 2)
        step, timed["baseline step"] = measure_tutorial_step(model, *batch, device, steps)
        loop, timed["baseline loop"] = tutorial_epoch(model, new_optimizer(model),
                                                      tutorial_loader(split, args.img_size, args.batch_size), device)
        results["baseline"] = {"step": step, "loop": loop}
        results["speedup_vs_baseline"] = results["loop"] / loop
        print(f"baseline: step {step:.1f}, loop {loop:.1f} images/s", flush=True)

    if "scaling" in results:  # measured first (see above); in the JSON after the rows of this process
        results["scaling"] = results.pop("scaling")
    results["timed"] = timed
    report = {
        "machine": machine_description(device),
        "settings": {"model": args.model, "img_size": args.img_size, "batch_size": args.batch_size,
                     "images": len(split.train_images_path), "data_path": os.path.abspath(data_path),
                     "amp": precision.mode, "channels_last": channels_last, "compile": args.compile,
                     "workers": workers, "device": str(device), "warmup_steps_left_out": WARMUP_STEPS},
        "results": results,
    }
    print_table(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    run_cli(main)
