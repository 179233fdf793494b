"""Promises of docs/data.md, docs/outputs.md, docs/recipe.md and docs/recipe_digits.md (tools/measure_recipe.py) that no other test pinned down; in-process."""
import csv
import importlib
import os
import sys
import types

import numpy as np
import pytest

from conftest import REPO, parse_flags, full_flags

DOCS = os.path.join(REPO, "docs")


def doc_lines(name):
    with open(os.path.join(DOCS, name), encoding="utf-8") as f:
        return f.read().splitlines()


# --- tools/measure_recipe.py and docs/recipe_digits.md ------------------------------------------

@pytest.fixture
def measure(monkeypatch):
    """tools/measure_recipe.py imported with a stand-in scikit-learn (not a requirement) that
    records how the split is asked for: 10 classes of 5 images of 8x8 pixels valued 0-16."""
    targets = np.repeat(np.arange(10), 5)
    images = np.zeros((len(targets), 8, 8))
    images[:, 0, 0] = 16  # the brightest value of the digits, top left
    digits = types.SimpleNamespace(target=targets, images=images)
    asked = {}

    def train_test_split(index, **kwargs):
        asked.update(kwargs, index=index)
        train = np.concatenate([index[targets == c][:4] for c in range(10)])
        return train, np.setdiff1d(index, train)

    monkeypatch.setitem(sys.modules, "sklearn", types.ModuleType("sklearn"))
    monkeypatch.setitem(sys.modules, "sklearn.datasets", types.SimpleNamespace(load_digits=lambda: digits))
    monkeypatch.setitem(sys.modules, "sklearn.model_selection",
                        types.SimpleNamespace(train_test_split=train_test_split))
    monkeypatch.delitem(sys.modules, "tools.measure_recipe", raising=False)
    module = importlib.import_module("tools.measure_recipe")
    module.asked_split = asked
    return module


def digits_folders(data_dir, whole=1437, imbalanced=582):
    """Training folders of the sizes docs/recipe.md gives (1,437 and 582 images; empty files:
    measure_recipe only counts them)."""
    for folder, count in (("train", whole), ("train_imbalanced", imbalanced)):
        os.makedirs(os.path.join(data_dir, folder, "0"))
        for i in range(count):
            open(os.path.join(data_dir, folder, "0", f"{i:04d}.png"), "w").close()


def report_of_defaults(measure, tmp_path, monkeypatch, argv=()):
    """The report main() writes with its default flags (and ``argv``), each run replaced by a
    made-up 60 s one; (its lines, the jobs run)."""
    data_dir = str(tmp_path / "digits")
    digits_folders(data_dir)
    jobs = []

    def fake_run(job, args, work_dir):
        jobs.append(job)
        return job, 60.0, {"val_accuracy": "0.5"}, None

    monkeypatch.setattr(measure, "write_digits", lambda folder: None)
    monkeypatch.setattr(measure, "run_one", fake_run)
    out = tmp_path / "report.md"
    monkeypatch.setattr(sys, "argv", ["tools/measure_recipe.py", "--data-dir", data_dir, "--work-dir",
                                      str(tmp_path / "work"), "--out", str(out), *argv])
    measure.main()
    return out.read_text().splitlines(), jobs


def test_every_digits_run_gets_the_base_flags_that_recipe_digits_md_lists(measure, tmp_path, monkeypatch, capsys):
    """recipe_digits.md: "Every run: `--model resnet18 --img-size 32 --device cpu --amp off
    --no-plots --epochs 4 --batch-size 64 --lr 0.01 --threads 1 --workers 0` plus:" (the
    defaults of measure_recipe.py, in this order)."""
    lines, _ = report_of_defaults(measure, tmp_path, monkeypatch)
    capsys.readouterr()
    expected = [line for line in doc_lines("recipe_digits.md") if line.startswith("Every run: ")]
    assert expected == ["Every run: `--model resnet18 --img-size 32 --device cpu --amp off --no-plots --epochs 4 "
                        "--batch-size 64 --lr 0.01 --threads 1 --workers 0` plus:"]
    assert [line for line in lines if line.startswith("Every run: ")] == expected
    # and the flags' own values where they are not the defaults
    other = full_flags(epochs=6, batch_size=32, lr=0.05, threads=2, parallel=3)
    assert measure.base_flags(other) == ["--model", "resnet18", "--img-size", "32", "--device", "cpu", "--amp", "off",
                                         "--no-plots", "--epochs", "6", "--batch-size", "32", "--lr", "0.05",
                                         "--threads", "2", "--workers", "0"]


def test_each_digits_config_gets_the_flags_that_recipe_digits_md_lists(measure, tmp_path, monkeypatch, capsys):
    """recipe_digits.md's list "- whole baseline: `(nothing)`" ... "- imbalanced recipe: ...":
    each config's flags, {step} half of the 4 epochs (2) and the EMA decay of each set's 88
    and 36 optimizer steps (0.949 and 0.88)."""
    lines, _ = report_of_defaults(measure, tmp_path, monkeypatch)
    capsys.readouterr()
    configs = [line for line in doc_lines("recipe_digits.md") if line.startswith(("- whole ", "- imbalanced "))]
    assert len(configs) == 14 and "- whole step_lr: `--lr-scheduler step --lr-step-size 2`" in configs
    assert [line for line in lines if line.startswith(("- whole ", "- imbalanced "))] == configs


def test_the_digits_grid_is_42_runs_of_3_seeds_and_its_command_is_recorded(measure, tmp_path, monkeypatch, capsys):
    """recipe_digits.md: "42 runs: 96.0 CPU-minutes (run wall time x threads)"; recipe.md: "3
    seeds each" (0, 1, 2); the report's Command line is the command as it was run, in order."""
    lines, jobs = report_of_defaults(measure, tmp_path, monkeypatch)
    capsys.readouterr()
    assert len(jobs) == 42 and sorted({seed for *_, seed in jobs}) == [0, 1, 2]
    assert sum(1 for dataset, name, _, seed in jobs if (dataset, name) == ("imbalanced", "sampler")) == 3
    runs = next(line for line in lines if " runs: " in line)
    assert runs.startswith("42 runs: 42.0 CPU-minutes (run wall time x threads), ")  # 42 x 60 s x 1 thread
    command = next(line for line in lines if line.startswith("Command: "))
    assert command == (f"Command: `{sys.executable} tools/measure_recipe.py --data-dir {tmp_path / 'digits'} "
                       f"--work-dir {tmp_path / 'work'} --out {tmp_path / 'report.md'}`")


def test_the_digits_are_split_once_stratified_with_seed_0_and_a_fifth_held_out(measure, tmp_path):
    """measure_recipe.py: "a fixed stratified split (seed 0, 20 % validation)" (recipe.md: the
    same balanced 360 of 1,797 images), upscaled to 32 px, the digits' 0-16 made 0-255."""
    from PIL import Image

    measure.write_digits(str(tmp_path))
    asked = measure.asked_split
    assert asked["test_size"] == 0.2 and asked["random_state"] == 0
    assert np.array_equal(asked["stratify"], np.repeat(np.arange(10), 5))
    with Image.open(tmp_path / "val" / "0" / "0004.png") as img:
        assert img.size == (32, 32) and img.mode == "L" and img.getpixel((0, 0)) == 255


def test_each_run_trains_on_its_sets_folder_and_validates_on_the_shared_one(measure, tmp_path, monkeypatch):
    """recipe.md: "last epoch's validation figures on the same balanced 360 images" for the
    whole set and the 10:1 imbalanced one alike; each run with its own seed and output folder."""
    commands = []

    def fake_run(command, cwd, stdout, stderr):
        commands.append(command)
        return types.SimpleNamespace(returncode=1)

    monkeypatch.setattr(measure.subprocess, "run", fake_run)
    args = full_flags(data_dir=str(tmp_path / "d"), batch_size=4, epochs=4, lr=0.01, threads=1)
    for job in (("whole", "baseline", "", 1), ("imbalanced", "sampler", "--sampler balanced", 2)):
        measure.run_one(job, args, str(tmp_path))
    whole, imbalanced = (parse_flags(False, *command[2:]) for command in commands)
    assert whole.data_path == str(tmp_path / "d" / "train") and whole.seed == 1
    assert imbalanced.data_path == str(tmp_path / "d" / "train_imbalanced") and imbalanced.seed == 2
    assert whole.val_path == imbalanced.val_path == str(tmp_path / "d" / "val")
    assert imbalanced.sampler == "balanced" and whole.sampler == "shuffle"
    assert whole.output_dir != imbalanced.output_dir


def test_a_run_that_failed_shows_a_dash_even_with_epochs_in_its_metrics(measure, tmp_path, monkeypatch):
    """recipe_digits.md: '"-": run failed'; a run that wrote some epochs and then failed is failed."""
    def fake_run(command, cwd, stdout, stderr):
        out = command[command.index("--output-dir") + 1]
        os.makedirs(out)
        with open(os.path.join(out, "metrics.csv"), "w", newline="") as f:
            csv.writer(f).writerows([["epoch", "val_accuracy"], [0, "0.5"]])
        stdout.write("killed at epoch 1\n")
        return types.SimpleNamespace(returncode=1)

    monkeypatch.setattr(measure.subprocess, "run", fake_run)
    args = full_flags(data_dir=str(tmp_path), batch_size=4, epochs=4, lr=0.01, threads=1)
    _, _, row, error = measure.run_one(("whole", "baseline", "", 0), args, str(tmp_path))
    assert row is None and error == "rc 1: killed at epoch 1"
    table = measure.summary_table("val_accuracy", [("whole", "baseline", "")], {("whole", "baseline", 0): row}, [0])
    assert table[2] == "| whole | baseline | - | - | - | - | |"  # seed 0, mean, min-max, difference; no flag


# --- docs/outputs.md ----------------------------------------------------------------------------

def test_overwrite_removes_every_file_of_the_list_and_keeps_exports_and_yours(tmp_path):
    """outputs.md: --overwrite removes model-<epoch>.pth, model-best.pth, checkpoint.pth,
    checkpoint-prev.pth, checkpoint.pth.damaged, metrics.csv, args.json, class_indices.json,
    train.log, the pictures and confusion_matrix.csv "and nothing else": model-final-for-paper.pth,
    model-best.pt2 and model-best.onnx stay."""
    from multi_train_utils.run_files import clear_earlier_run

    ours = ["model-0.pth", "model-12.pth", "model-best.pth", "checkpoint.pth", "checkpoint-prev.pth",
            "checkpoint.pth.damaged", "metrics.csv", "args.json", "class_indices.json", "train.log",
            "class_distribution.png", "batch_preview.png", "curves.png", "confusion_matrix.png", "most_confused.png",
            "confusion_matrix.csv"]
    kept = ["model-final-for-paper.pth", "model-best.pt2", "model-best.onnx", "model-best.torchscript.pt"]
    for name in ours + kept:
        (tmp_path / name).write_text(name)
    clear_earlier_run(full_flags(output_dir=str(tmp_path), overwrite=True, resume=None), None)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


@pytest.mark.parametrize("n", [31, 40])
def test_the_sorted_class_curve_names_the_largest_and_the_smallest_class(n):
    """outputs.md: "Beyond 30 classes the class distribution is a sorted curve (the largest and
    smallest class named)", with its training images; the largest here is neither first nor last."""
    from multi_train_utils.pictures import plot_class_distribution

    names = [f"class{i:02d}" for i in range(n)]
    train = [10 + (7 * c + 3) % n for c in range(n)]  # every count once, in shuffled order
    largest, smallest = train.index(max(train)), train.index(min(train))
    ax = plot_class_distribution(names, train, [3] * n).axes[0]
    assert sorted(t.get_text() for t in ax.texts) == sorted([f"{names[largest]} ({max(train)})",
                                                              f"{names[smallest]} ({min(train)})"])


@pytest.mark.parametrize("apart, refused", [(0.5e-4, False), (2e-4, True)])
def test_an_export_more_than_1e_4_from_the_eager_model_is_refused_and_writes_nothing(tmp_path, monkeypatch, capsys,
                                                                                     apart, refused):
    """outputs.md: "Each file is loaded back ... and its outputs compared with the eager model's on a
    batch of another size; more than 1e-4 apart is an error. The file takes its name only once
    checked, so a failed export writes nothing." The exporter is replaced by one whose program is
    off by ``apart``."""
    import json

    import torch

    import export
    from conftest import MODEL
    from model import create_model
    from multi_train_utils.errors import UserError

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    torch.save(create_model(MODEL, 2).state_dict(), run_dir / "model-best.pth")
    (run_dir / "args.json").write_text(json.dumps({"model": MODEL, "img_size": 32}))
    (run_dir / "class_indices.json").write_text(json.dumps({"0": "cat", "1": "dog"}))

    def exporter(model, example, path, run):
        with open(path, "wb") as f:
            f.write(b"program")
        return lambda images: model(images) + apart

    monkeypatch.setitem(export.EXPORTERS, "pt2", exporter)
    argv = ["--weights", str(run_dir / "model-best.pth")]
    if refused:
        with pytest.raises(UserError, match=r"differs from the eager one by 2\.00e-04 \(more than 0\.0001\)"):
            export.main(argv)
        assert sorted(os.listdir(run_dir)) == ["args.json", "class_indices.json", "model-best.pth"]
    else:
        export.main(argv)
        assert (run_dir / "model-best.pt2").read_bytes() == b"program"
    capsys.readouterr()


@pytest.mark.parametrize("source, said", [("model", "the model's weights"),
                                          ("ema", "the EMA of the weights (--model-ema)")], ids=["model", "ema"])
def test_the_end_summary_names_the_best_epoch_its_figure_and_whose_weights(capsys, source, said):
    """outputs.md: "At the end: the best validation accuracy and its epoch, the time taken, and
    the paths of the best weights and the pictures"; "The end summary says which (`best weights:
    weights/model-best.pth (the EMA of the weights (--model-ema), epoch 7)`)". The best epoch (7)
    is neither the first nor the last of 10."""
    from multi_train_utils.checkpoint import BestEpoch, TrainState
    from multi_train_utils.recorder import print_end_summary

    state = TrainState(None, epoch=10, best=BestEpoch(value=0.8125, accuracy=0.8125, epoch=7, source=source))
    args = full_flags(output_dir="weights", best_metric="accuracy", model_ema=True)  # the run had an EMA either way
    print_end_summary(args, state, seconds=3725.4, plots=["curves", "confusion_matrix"])
    lines = capsys.readouterr().out.splitlines()
    assert "best val accuracy: 0.8125 at epoch 7; this session took 1h02m05s" in lines
    assert f"best weights: {os.path.join('weights', 'model-best.pth')} ({said}, epoch 7)" in lines
    assert f"plots: {os.path.join('weights', 'curves.png')}, {os.path.join('weights', 'confusion_matrix.png')}" in lines
