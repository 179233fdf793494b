"""Measure train_single.py's training-recipe flags on real images: scikit-learn's digits.

The 1,797 digits (8x8 px, 10 classes) are upscaled to 32 px and written once as PNG class
folders: a fixed stratified split (seed 0, 20 % validation), the whole training part, and a
10:1 imbalanced subset of it. Each configuration of GRID is trained with 3 seeds; the table
reports the LAST epoch's validation metrics (the best epoch would be chosen on the validation
set itself), per seed, their mean and min-max spread, and the mean's difference to the same
dataset's baseline. A difference is flagged "beyond spread" only when the seed ranges do not
overlap. Runs whose flag does not exist (yet) fail and show "-".

    python tools/measure_recipe.py                      # the whole grid: 42 runs, ~27 min on 2 idle cores
    python tools/measure_recipe.py --only baseline --seeds 0

Calibration (2-core AMD EPYC, today's code): ResNet-18 at 32 px trains at ~85 img/s on one
thread; two 1-thread runs side by side beat one 2-thread run. 4 epochs, batch 64, SGD lr 0.01:
a whole-set run ~90 s (imbalanced ~45 s) on idle cores, baseline 90.8 / 87.8 / 88.9 % (seeds 0-2);
lr 0.05 or batch 32 did worse in 4 epochs. Other processes on the machine slow it down 2x or more.
"""
import argparse
import csv
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ImportError:
    sys.exit("measure_recipe.py needs scikit-learn: pip install scikit-learn")
import numpy as np
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# {ema_decay} is set per dataset so that the random initial weights keep 1 % of the average at
# the end: 0.01 ** (1 / optimizer steps). With 4 epochs: 88 steps and 0.949 on the whole set, 36 and
# 0.88 on the imbalanced one; a fixed 0.999 (~1000 steps) would mostly average the random init.
RECIPE = ("--opt adamw --lr 0.001 --weight-decay 0.05 --no-norm-bias-decay --auto-augment ta_wide "
          "--random-erase 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0 --label-smoothing 0.1 "
          "--model-ema --model-ema-decay {ema_decay} --warmup-epochs 1")
# (dataset, name, extra flags); {step} is half of --epochs. Edit freely.
GRID = [
    ("whole", "baseline", ""),
    ("whole", "ta_wide", "--auto-augment ta_wide"),
    ("whole", "random_erase", "--random-erase 0.25"),
    ("whole", "mixup", "--mixup-alpha 0.2"),
    ("whole", "cutmix", "--cutmix-alpha 1.0"),
    ("whole", "label_smoothing", "--label-smoothing 0.1"),
    ("whole", "ema", "--model-ema --model-ema-decay {ema_decay}"),
    ("whole", "adamw", "--opt adamw --lr 0.001 --weight-decay 0.05"),
    ("whole", "step_lr", "--lr-scheduler step --lr-step-size {step}"),
    ("whole", "recipe", RECIPE),
    ("imbalanced", "baseline", ""),
    ("imbalanced", "class_weights", "--class-weights balanced"),
    ("imbalanced", "sampler", "--sampler balanced"),
    ("imbalanced", "recipe", RECIPE),
]
TRAIN_FOLDER = {"whole": "train", "imbalanced": "train_imbalanced"}
METRICS = ["val_accuracy", "val_balanced_accuracy", "val_macro_f1",
           "ema_val_accuracy", "ema_val_balanced_accuracy", "ema_val_macro_f1"]


def write_digits(data_dir):
    """Write the PNG folders once; a marker file says a previous write finished."""
    marker = os.path.join(data_dir, ".complete")
    if os.path.exists(marker):
        return
    digits = load_digits()
    index = np.arange(len(digits.target))
    train_idx, val_idx = train_test_split(index, test_size=0.2, stratify=digits.target, random_state=0)
    # Imbalanced subset: counts fall geometrically from class 0's full count to a tenth of it.
    n0 = int((digits.target[train_idx] == 0).sum())
    rng = np.random.default_rng(0)
    imbalanced = []
    for c in range(10):
        members = rng.permutation(train_idx[digits.target[train_idx] == c])
        imbalanced += list(members[:round(n0 * 0.1 ** (c / 9))])
    for folder, indices in (("val", val_idx), ("train", train_idx), ("train_imbalanced", imbalanced)):
        for i in indices:
            class_dir = os.path.join(data_dir, folder, str(digits.target[i]))
            os.makedirs(class_dir, exist_ok=True)
            pixels = (digits.images[i] * (255 / 16)).astype(np.uint8)  # values 0-16 -> 0-255
            Image.fromarray(pixels, "L").resize((32, 32), Image.BILINEAR).save(
                os.path.join(class_dir, f"{i:04d}.png"))
    open(marker, "w").close()


def ema_decay(dataset, args):
    """EMA decay that leaves the initial weights 1 % of the average after the run's optimizer steps."""
    folder = os.path.join(args.data_dir, TRAIN_FOLDER[dataset])
    images = sum(len(files) for _, _, files in os.walk(folder))
    steps = max(1, images // args.batch_size) * args.epochs  # the loader drops the last partial batch
    return round(0.01 ** (1 / steps), 3)


def expand(flags, dataset, args):
    """A config's flags with {step} (half of --epochs) and {ema_decay} filled in."""
    return flags.format(step=max(1, args.epochs // 2), ema_decay=ema_decay(dataset, args))


def base_flags(args):
    """The flags every run gets. --amp off: fp32 on every CPU; --workers 0: no loader processes
    competing with the other run for the 2 cores."""
    return ["--model", "resnet18", "--img-size", "32", "--device", "cpu", "--amp", "off", "--no-plots",
            "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
            "--threads", str(args.threads), "--workers", "0"]


def run_one(job, args, work_dir):
    """Train one (dataset, config, seed); return (job, wall seconds, last metrics row or None, error)."""
    dataset, name, flags, seed = job
    out = os.path.join(work_dir, f"{dataset}-{name}-s{seed}")
    command = [sys.executable, "train_single.py",
               "--data-path", os.path.join(args.data_dir, TRAIN_FOLDER[dataset]),
               "--val-path", os.path.join(args.data_dir, "val"), "--output-dir", out,
               "--log-dir", os.path.join(work_dir, "tb"), "--seed", str(seed)]
    command += base_flags(args) + shlex.split(expand(flags, dataset, args))  # a config's --lr comes later and wins
    start = time.perf_counter()
    with open(out + ".log", "w") as log:
        rc = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    rows = []
    if os.path.exists(os.path.join(out, "metrics.csv")):
        with open(os.path.join(out, "metrics.csv"), newline="") as f:
            rows = list(csv.DictReader(f))
    for pth in (p for p in os.listdir(out) if p.endswith(".pth")) if os.path.isdir(out) else ():
        os.remove(os.path.join(out, pth))  # ~200 MB of weights per run; the metrics are what we keep
    if rc != 0 or not rows:
        with open(out + ".log") as f:
            lines = [line.strip() for line in f if line.strip()]
        return job, wall, None, f"rc {rc}: {lines[-1] if lines else 'no output'}"
    return job, wall, rows[-1], None


def value(row, column):
    """A metric of the last epoch as a float, or None where the run failed or lacks the column."""
    try:
        return float(row[column])
    except (TypeError, KeyError, ValueError):
        return None


def seed_values(results, dataset, name, metric, seeds):
    """Per-seed values (None where missing) and (mean, min, max) of those present, or None."""
    values = [value(results.get((dataset, name, s)), metric) for s in seeds]
    got = [v for v in values if v is not None]
    return values, (statistics.mean(got), min(got), max(got)) if got else None


def summary_table(metric, configs, results, seeds):
    """Markdown table of one metric: per-seed values, mean, min-max, difference to the baseline.
    ema_ metrics are compared with the baseline's plain metric (the baseline has no EMA)."""
    head = ["dataset", "config"] + [f"seed {s}" for s in seeds] + ["mean", "min-max", "mean - baseline", ""]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dataset, name, flags in configs:
        if metric.startswith("ema_") and "--model-ema" not in flags:
            continue
        values, stats = seed_values(results, dataset, name, metric, seeds)
        if stats is None:  # failed runs, or a column today's train_single.py does not write
            lines.append("| " + " | ".join([dataset, name] + ["-"] * (len(head) - 3)) + " | |")
            continue
        mean, low, high = stats
        _, base = seed_values(results, dataset, "baseline", metric.removeprefix("ema_"), seeds)
        diff, flag = "-", ""
        if base is not None and name != "baseline":
            diff = f"{100 * (mean - base[0]):+.1f}"
            flag = "beyond spread" if low > base[2] or high < base[1] else ""  # seed ranges do not overlap
        cells = [f"{100 * v:.1f}" if v is not None else "-" for v in values]
        lines.append("| " + " | ".join([dataset, name] + cells +
                                        [f"{100 * mean:.1f}", f"{100 * low:.1f}-{100 * high:.1f}", diff, flag]) + " |")
    return lines if len(lines) > 2 else []


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data-dir", default="/tmp/digits32", help="where the PNG folders are written (once)")
    parser.add_argument("--only", default="", metavar="NAME[,NAME]",
                        help="config names of GRID to run; baseline and recipe mean both datasets' (empty: all)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per run (4: about 90 s per whole-set run)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per step")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (configs may override)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at the same time")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    parser.add_argument("--work-dir", default="", help="where run folders and logs go (empty: a new temporary folder)")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "recipe_digits.md"), help="markdown report")
    args = parser.parse_args()

    write_digits(args.data_dir)
    only = set(args.only.split(",")) if args.only else None
    if only and only - {name for _, name, _ in GRID}:
        parser.error(f"--only: no config named {', '.join(sorted(only - {n for _, n, _ in GRID}))} in GRID")
    configs = [c for c in GRID if only is None or c[1] in only]
    seeds = [int(s) for s in args.seeds.split(",")]
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="measure_recipe_")
    os.makedirs(work_dir, exist_ok=True)
    jobs = [(dataset, name, flags, s) for dataset, name, flags in configs for s in seeds]
    print(f"{len(jobs)} runs, {args.parallel} at a time; logs in {work_dir}", flush=True)

    results, cpu_seconds, start = {}, 0.0, time.perf_counter()
    with ThreadPoolExecutor(args.parallel) as pool:  # threads only wait for the subprocesses
        for (dataset, name, _, seed), wall, row, error in pool.map(lambda j: run_one(j, args, work_dir), jobs):
            results[(dataset, name, seed)] = row
            cpu_seconds += wall * args.threads
            status = error or f"val_accuracy {row.get('val_accuracy')}"
            print(f"{dataset:10} {name:16} seed {seed}: {wall:5.0f} s  {status}", flush=True)

    report = ["# Training-recipe flags on digits (8x8 upscaled to 32 px), last epoch", "",
              "Command: `" + " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv) + "`", "",
              f"{len(jobs)} runs: {cpu_seconds / 60:.1f} CPU-minutes (run wall time x threads), "
              f"{(time.perf_counter() - start) / 60:.1f} minutes wall. Values in %; \"-\": run failed or column "
              "missing. \"beyond spread\": the seed ranges of the config and the baseline do not overlap. "
              "ema_ tables compare with the baseline's plain value.", "",
              "Every run: `" + " ".join(base_flags(args)) + "` plus:", ""]
    report += [f"- {dataset} {name}: `{expand(flags, dataset, args) or '(nothing)'}`" for dataset, name, flags in configs]
    report += [""]
    for metric in METRICS:
        table = summary_table(metric, configs, results, seeds)
        report += [f"## {metric}", ""] + table + [""] if table else [f"## {metric}", "", "-", ""]
    text = "\n".join(report)
    print(text)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
