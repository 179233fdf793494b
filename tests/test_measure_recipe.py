"""tools/measure_recipe.py, which writes docs/recipe_digits.md: the 10:1 imbalanced subset, the
EMA decay it derives from the run's optimizer steps, the last epoch's row (not the best), and
the table's mean, difference to the baseline's mean and "beyond spread" flag. In-process, with
made-up results; scikit-learn (not a requirement) is replaced by a stand-in with the digits'
shape."""
import argparse
import csv
import importlib
import os
import sys
import types

import numpy as np
import pytest


@pytest.fixture
def measure(monkeypatch):
    """The module, imported with a stand-in scikit-learn: 10 classes of 50 images of 8x8 pixels,
    split 40 / 10 per class."""
    targets = np.repeat(np.arange(10), 50)
    digits = types.SimpleNamespace(target=targets, images=np.zeros((len(targets), 8, 8)))

    def train_test_split(index, test_size, stratify, random_state):
        train = np.concatenate([index[stratify == c][:40] for c in range(10)])
        return train, np.setdiff1d(index, train)

    sklearn = types.ModuleType("sklearn")
    monkeypatch.setitem(sys.modules, "sklearn", sklearn)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", types.SimpleNamespace(load_digits=lambda: digits))
    monkeypatch.setitem(sys.modules, "sklearn.model_selection",
                        types.SimpleNamespace(train_test_split=train_test_split))
    monkeypatch.delitem(sys.modules, "tools.measure_recipe", raising=False)
    return importlib.import_module("tools.measure_recipe")


def test_the_imbalanced_subset_falls_from_the_largest_class_to_a_tenth(measure, tmp_path):
    measure.write_digits(str(tmp_path))
    counts = [len(os.listdir(tmp_path / "train_imbalanced" / str(c))) for c in range(10)]
    # round(40 x 0.1 ** (c / 9)): geometric from class 0's 40 to a tenth of it
    assert counts == [40, 31, 24, 19, 14, 11, 9, 7, 5, 4]
    assert [len(os.listdir(tmp_path / "train" / str(c))) for c in range(10)] == [40] * 10
    assert [len(os.listdir(tmp_path / "val" / str(c))) for c in range(10)] == [10] * 10


def test_the_ema_decay_counts_whole_batches(measure, tmp_path):
    """10 images in batches of 4 drop the last partial batch: 2 steps an epoch, 6 in 3 epochs;
    0.01 ** (1 / 6) = 0.46416."""
    os.makedirs(tmp_path / "train" / "0")
    for i in range(10):
        (tmp_path / "train" / "0" / f"{i}.png").write_bytes(b"")
    args = argparse.Namespace(data_dir=str(tmp_path), batch_size=4, epochs=3)
    assert measure.ema_decay("whole", args) == 0.464


def test_a_run_reports_its_last_epoch_not_its_best(measure, tmp_path, monkeypatch):
    def fake_run(command, cwd, stdout, stderr):
        out = command[command.index("--output-dir") + 1]
        os.makedirs(out)
        with open(os.path.join(out, "metrics.csv"), "w", newline="") as f:
            csv.writer(f).writerows([["epoch", "val_accuracy"], [0, "0.5"], [1, "0.9"], [2, "0.7"]])
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(measure.subprocess, "run", fake_run)
    args = argparse.Namespace(data_dir=str(tmp_path), batch_size=4, epochs=3, lr=0.01, threads=1)
    job, _, row, error = measure.run_one(("whole", "baseline", "", 0), args, str(tmp_path))
    assert error is None and row == {"epoch": "2", "val_accuracy": "0.7"}


def test_the_table_compares_each_mean_with_the_baselines_and_flags_ranges_that_do_not_overlap(measure):
    configs = [("whole", "baseline", ""), ("whole", "apart", "--x"), ("whole", "overlapping", "--y"),
               ("whole", "touching", "--z"), ("whole", "ema", "--model-ema")]
    values = {"baseline": [0.80, 0.85, 0.90], "apart": [0.91, 0.92, 0.93], "overlapping": [0.88, 0.95, 0.92],
              "touching": [0.90, 0.95, 1.0], "ema": [0.84, 0.84, 0.84]}
    results = {("whole", name, seed): {"val_accuracy": str(v), "ema_val_accuracy": ""}
               for name, row in values.items() for seed, v in enumerate(row)}
    for seed, v in enumerate([0.95, 0.96, 0.97]):
        results[("whole", "ema", seed)]["ema_val_accuracy"] = str(v)
    table = measure.summary_table("val_accuracy", configs, results, [0, 1, 2])
    assert table[0] == "| dataset | config | seed 0 | seed 1 | seed 2 | mean | min-max | mean - baseline |  |"
    assert table[2:] == [
        "| whole | baseline | 80.0 | 85.0 | 90.0 | 85.0 | 80.0-90.0 | - |  |",
        "| whole | apart | 91.0 | 92.0 | 93.0 | 92.0 | 91.0-93.0 | +7.0 | beyond spread |",
        "| whole | overlapping | 88.0 | 95.0 | 92.0 | 91.7 | 88.0-95.0 | +6.7 |  |",
        "| whole | touching | 90.0 | 95.0 | 100.0 | 95.0 | 90.0-100.0 | +10.0 |  |",
        "| whole | ema | 84.0 | 84.0 | 84.0 | 84.0 | 84.0-84.0 | -1.0 |  |"]
    # ema_ tables: the EMA's values against the baseline's plain ones (the baseline has no EMA)
    assert measure.summary_table("ema_val_accuracy", configs, results, [0, 1, 2])[2:] == [
        "| whole | ema | 95.0 | 96.0 | 97.0 | 96.0 | 95.0-97.0 | +11.0 | beyond spread |"]


def test_each_run_trains_with_its_configs_flags_over_the_base_flags(measure, tmp_path, monkeypatch):
    """docs/recipe_digits.md: adamw is `--opt adamw --lr 0.001 --weight-decay 0.05` although every
    run gets the base --lr 0.01; the flags the training script reads are what the table says."""
    from multi_train_utils.options import get_args_parser, parse_args

    commands = []

    def fake_run(command, cwd, stdout, stderr):
        commands.append(command)
        return types.SimpleNamespace(returncode=1)

    monkeypatch.setattr(measure.subprocess, "run", fake_run)
    args = argparse.Namespace(data_dir=str(tmp_path), batch_size=4, epochs=6, lr=0.01, threads=1)
    configs = {name: flags for dataset, name, flags in measure.GRID if dataset == "whole"}
    for name in ("baseline", "adamw"):
        measure.run_one(("whole", name, configs[name], 3), args, str(tmp_path))
    baseline, adamw = (parse_args(get_args_parser(False), command[2:]) for command in commands)
    assert (baseline.opt, baseline.lr, baseline.seed, baseline.epochs) == ("sgd", 0.01, 3, 6)
    assert (adamw.opt, adamw.lr, adamw.weight_decay, adamw.seed) == ("adamw", 0.001, 0.05, 3)


def test_a_seed_that_scored_zero_counts_and_only_a_missing_one_is_left_out(measure):
    results = {("whole", "x", 0): {"val_accuracy": "0.0"}, ("whole", "x", 1): {"val_accuracy": "0.5"},
               ("whole", "x", 2): None}
    values, stats = measure.seed_values(results, "whole", "x", "val_accuracy", [0, 1, 2])
    assert values == [0.0, 0.5, None] and stats == (0.25, 0.0, 0.5)
    zero = {("whole", "x", 0): {"val_accuracy": "0.0"}}
    assert measure.seed_values(zero, "whole", "x", "val_accuracy", [0])[1] == (0.0, 0.0, 0.0)


def test_the_report_counts_cpu_minutes_as_wall_time_times_threads_for_the_configs_chosen(measure, tmp_path,
                                                                                         monkeypatch, capsys):
    """main() with the runs replaced: --only adamw, 2 seeds, --threads 3, 2 at a time, 30 s a
    run: 2 runs, 3.0 CPU-minutes; the table holds those seeds' values."""
    def fake_run(job, args, work_dir):
        dataset, name, flags, seed = job
        return job, 30.0, {"val_accuracy": str(0.5 + seed / 10)}, None

    monkeypatch.setattr(measure, "write_digits", lambda data_dir: None)
    monkeypatch.setattr(measure, "run_one", fake_run)
    out = tmp_path / "report.md"
    monkeypatch.setattr(sys, "argv", ["measure_recipe.py", "--only", "adamw", "--seeds", "0,1", "--threads", "3",
                                      "--parallel", "2", "--work-dir", str(tmp_path / "w"), "--out", str(out)])
    measure.main()
    text = out.read_text()
    assert "\n2 runs: 3.0 CPU-minutes (run wall time x threads), " in "\n" + text
    assert "- whole adamw: `--opt adamw --lr 0.001 --weight-decay 0.05`" in text
    assert "| whole | adamw | 50.0 | 60.0 | 55.0 | 50.0-60.0 |" in text
    capsys.readouterr()


def test_each_dataset_gets_the_ema_decay_of_its_own_steps(measure, tmp_path):
    """10 images of the whole set and 6 of the imbalanced one, batches of 4, 3 epochs: 6 and 3
    optimizer steps; 0.01 ** (1 / 6) = 0.464 and 0.01 ** (1 / 3) = 0.215."""
    for folder, count in (("train", 10), ("train_imbalanced", 6)):
        os.makedirs(tmp_path / folder / "0")
        for i in range(count):
            (tmp_path / folder / "0" / f"{i}.png").write_bytes(b"")
    args = argparse.Namespace(data_dir=str(tmp_path), batch_size=4, epochs=3)
    assert (measure.ema_decay("whole", args), measure.ema_decay("imbalanced", args)) == (0.464, 0.215)
