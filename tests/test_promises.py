"""Promises of README.md that only a case of their own makes fail: 12 classes, a seed other
than the default, both scripts built from the same flags, a resume with other --lr and
--weight-decay, files renamed or swapped with the counts unchanged, a short last validation
batch, two non-finite steps. Expected values come from the file system, torch's own samplers
or a hand computation, never from the code under test."""
import csv
import json
import math
import os
import random
import re
import shutil
from pathlib import Path

import pytest
import numpy as np
import torch
from PIL import Image
from torch import nn

import export
from conftest import (FAST, MODEL, PROBE, PYTHON, metrics_without_timing, outcome, probe_records, read_metrics, run,
                      run_ranks, script, train_args)

# --- 12 classes: every index keeps its own name in predict.py, export.py and --eval-only ----------

# sorted as the folders are; with 12, "10" and "11" sort before "2" as text
TWELVE = ["apple", "banana", "cherry", "date", "elder", "fig", "grape", "hazel", "iris", "juniper", "kiwi", "lemon"]
# the crafted head ranks the classes in this order of index, whatever the image
RANKING = [5, 11, 0, 7, 2, 10, 3, 9, 1, 8, 4, 6]


def write_twelve_class_folder(root):
    """12 class folders of 4 small images each (one flat colour per class)."""
    rng = random.Random(12)
    for c, name in enumerate(TWELVE):
        os.makedirs(os.path.join(root, name))
        for i in range(4):
            colour = (20 * c, 255 - 20 * c, rng.randrange(256))
            Image.new("RGB", (36 + i, 40), colour).save(os.path.join(root, name, f"{name}_{i}.png"))


def crafted_weights(num_classes, ranking):
    """A state dict of the tests' model whose logits rank the classes as ``ranking`` for every image."""
    import torchvision

    model = torchvision.models.get_model(MODEL, num_classes=num_classes)
    with torch.no_grad():
        model.fc.weight.zero_()
        for place, index in enumerate(ranking):
            model.fc.bias[index] = float(len(ranking) - place)
    return model.state_dict()


@pytest.fixture(scope="module")
def twelve_class_run(tmp_path_factory):
    """One epoch of train_single.py on 12 classes, and crafted weights beside its files."""
    root = tmp_path_factory.mktemp("twelve")
    data, out = root / "data", root / "run"
    write_twelve_class_folder(str(data))
    result = run([PYTHON, script("train_single.py"), "--data-path", str(data), "--val-rate", "0.25", *FAST,
                  "--epochs", "1", "--workers", "0", "--output-dir", str(out), "--log-dir", str(root / "tb")])
    assert result.returncode == 0, result.stdout + result.stderr
    torch.save(crafted_weights(12, RANKING), out / "crafted.pth")
    return {"data": data, "out": out, "classes": sorted(os.listdir(data)), "stdout": result.stdout}


def test_a_run_of_twelve_classes_writes_each_index_with_its_folders_name(twelve_class_run):
    classes = twelve_class_run["classes"]
    assert classes == TWELVE
    with open(twelve_class_run["out"] / "class_indices.json") as f:
        assert json.load(f) == {str(i): name for i, name in enumerate(classes)}
    checkpoint = torch.load(twelve_class_run["out"] / "checkpoint.pth", weights_only=True)
    assert checkpoint["classes"] == classes
    assert "split: 36 train, 12 val images" in twelve_class_run["stdout"]
    assert read_metrics(twelve_class_run["out"])[0]["val_top5_accuracy"] != ""  # more than 5 classes


def test_predict_names_every_index_of_twelve_classes(twelve_class_run, tmp_path):
    classes, weights = twelve_class_run["classes"], twelve_class_run["out"] / "crafted.pth"
    image = twelve_class_run["data"] / "apple" / "apple_0.png"
    result = run([PYTHON, script("predict.py"), "--weights", str(weights), "--image", str(image), "--top-k", "12"])
    assert result.returncode == 0, result.stdout + result.stderr
    line = [l for l in result.stdout.splitlines() if l.startswith(str(image))][0]
    names = [part.split()[0] for part in line.split(": ", 1)[1].split(", ")]
    assert names == [classes[i] for i in RANKING]
    out = tmp_path / "predictions.csv"
    result = run([PYTHON, script("predict.py"), "--weights", str(weights), "--image",
                  str(twelve_class_run["data"] / "kiwi"), "--output", str(out)])
    assert result.returncode == 0, result.stdout + result.stderr
    with open(out) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["path", "prediction", "probability", *classes]
    assert len(rows) == 5 and all(row[1] == classes[RANKING[0]] for row in rows[1:])
    probabilities = [float(p) for p in rows[1][3:]]
    assert sorted(range(12), key=lambda i: -probabilities[i]) == RANKING  # each column is its class's


def test_eval_only_of_twelve_classes_counts_each_prediction_under_its_class(twelve_class_run, tmp_path):
    classes, run_dir = twelve_class_run["classes"], twelve_class_run["out"]
    result = run([PYTHON, script("train_single.py"), "--eval-only", "--weights", str(run_dir / "crafted.pth"),
                  "--batch-size", "5", "--workers", "0", "--eval-output", str(tmp_path / "eval")])
    assert result.returncode == 0, result.stdout + result.stderr
    with open(tmp_path / "eval" / "confusion_matrix.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["true/predicted", *classes] and [r[0] for r in rows[1:]] == classes
    predicted = classes.index(classes[RANKING[0]]) + 1  # every image predicted as the top-ranked class
    assert [[int(v) for v in r[1:]] for r in rows[1:]] == [[1 if j + 1 == predicted else 0 for j in range(12)]
                                                           for _ in range(12)]
    assert "top1 accuracy: 0.083333 (1/12)" in result.stdout
    assert re.search(rf"^  {classes[RANKING[0]]} +0.083333  1.000000  0.153846$", result.stdout, flags=re.M)
    assert "top5 accuracy: 0.416667 (5/12)" in result.stdout  # one image of each of the top 5 classes


def test_export_keeps_the_twelve_logits_in_index_order(twelve_class_run, tmp_path, capsys):
    output = tmp_path / "crafted.pt2"
    exported = outcome(lambda: export.main(["--weights", str(twelve_class_run["out"] / "crafted.pth"),
                                            "--output", str(output)]))
    assert exported is None, exported
    assert f"(pt2, {MODEL}, 12 classes, input (N, 3, 32, 32)" in capsys.readouterr().out
    inside = {"run.json": ""}
    logits = torch.export.load(str(output), extra_files=inside).module()(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 12)
    assert logits[0].argsort(descending=True).tolist() == RANKING
    with open(twelve_class_run["out"] / "class_indices.json") as f:
        names = json.load(f)
    assert json.loads(inside["run.json"])["classes"] == [names[str(i)] for i in range(12)]  # class i's name at index i


# --- --seed: the data order of both scripts; both scripts make the same recipe from the same flags --

RECIPE = ["--seed", "7", "--amp", "off", "--label-smoothing", "0.1", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
          "--class-weights", "balanced", "--model-ema", "--model-ema-decay", "0.9", "--opt", "adamw",
          "--no-norm-bias-decay", "--random-erase", "0.25", "--warmup-epochs", "1", "--lr", "0.002"]


@pytest.fixture(scope="module")
def seeded_runs(tiny_data, tmp_path_factory):
    """--seed 7 with a recipe: train_single.py, and train_multi_gpu.py as one process (world
    size 1), 2 epochs each; then train_multi_gpu.py on 2 ranks (as srun starts them), 1 epoch,
    --seed 7 alone. All through the probe: {name: (output dir, result, probe records)}."""
    runs = {}
    root = tmp_path_factory.mktemp("seeded")
    for name, entry, flags in (("single", "single", RECIPE), ("multi", "multi", RECIPE)):
        out = root / name
        result = run([PYTHON, PROBE, entry, *train_args(tiny_data, out, "--epochs", "2", "--workers", "0", *flags)],
                     env={"PROBE_OUT": f"{out}.probe"})
        assert result.returncode == 0, result.stdout + result.stderr
        runs[name] = (out, result, probe_records(f"{out}.probe", 1))
    out = root / "ddp"
    result = run_ranks(2, [PYTHON, PROBE, "multi", *train_args(tiny_data, out, "--epochs", "1", "--workers", "0",
                                                              "--seed", "7")], env={"PROBE_OUT": f"{out}.probe"})
    assert result.returncode == 0, result.stdout + result.stderr
    runs["ddp"] = (out, result, probe_records(f"{out}.probe", 2))
    return runs


def distributed_sampler_order(n, seed, epoch, rank=0, world_size=1):
    """The indices torch's DistributedSampler(shuffle=True, seed) gives ``rank`` in ``epoch``."""
    sampler = torch.utils.data.DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_seed_sets_the_data_order_of_both_scripts(single_run, ddp_run, seeded_runs):
    """The same --seed, the same shuffle; another --seed, another. 36 images: batches of 4 take
    all 36 in one process and 16 of each rank's 18 in two."""
    default_single, default_ddp = single_run["probe"], ddp_run["probe"]
    for epoch in (0, 1):
        assert default_single["orders"][str(epoch)] == distributed_sampler_order(36, 0, epoch)
    for name in ("single", "multi"):
        record = seeded_runs[name][2][0]
        for epoch in (0, 1):
            assert record["orders"][str(epoch)] == distributed_sampler_order(36, 7, epoch), (name, epoch)
        assert record["orders"]["0"] != default_single["orders"]["0"]
    for seed, records in ((0, default_ddp), (7, seeded_runs["ddp"][2])):
        for record in records:
            assert record["orders"]["0"] == distributed_sampler_order(36, seed, 0, record["rank"], 2)[:16]
    assert seeded_runs["ddp"][2][0]["orders"]["0"] != default_ddp[0]["orders"]["0"]
    # the initial weights follow --seed too: the same in both scripts at one seed, others at another
    same = pytest.approx(default_single["before_wrap"], rel=1e-9)  # a sum: its last digits follow the threads
    assert default_ddp[0]["before_wrap"] == same and default_ddp[1]["before_wrap"] == same
    seeded = seeded_runs["ddp"][2]
    assert seeded[0]["before_wrap"] == pytest.approx(seeded[1]["before_wrap"], rel=1e-9)
    assert abs(seeded[0]["before_wrap"] - default_single["before_wrap"]) > 1e-3 * abs(default_single["before_wrap"])


def test_both_scripts_build_the_same_recipe_from_the_same_flags(tiny_data, seeded_runs):
    """train_single.py and train_multi_gpu.py (one process) with one set of recipe flags: the
    same loss reaches the loop (smoothing, class weights n / (C * count), soft targets), and
    the two runs end with the same metrics and the same model and EMA weights."""
    from utils import read_split_data

    labels = read_split_data(tiny_data["train"], val_root=tiny_data["val"], check_images=True).train_images_label
    counts = [labels.count(c) for c in range(5)]
    assert counts == [8, 6, 8, 7, 7]  # the odd files: 2 daisy, 1 dandelion unreadable, 1 roses, ...
    for name in ("single", "multi"):
        loss = seeded_runs[name][2][0]["loss"]
        assert loss["label_smoothing"] == 0.1 and loss["soft_targets"] is True, name
        assert loss["class_weights"] == pytest.approx([36 / (5 * n) for n in counts]), name
        assert seeded_runs[name][2][0]["steps"] == 2 * 9
    single, multi = (seeded_runs[name][0] for name in ("single", "multi"))
    assert metrics_without_timing(single) == metrics_without_timing(multi)
    assert read_metrics(single)[0]["ema_val_accuracy"] != ""
    a, b = (torch.load(d / "checkpoint.pth", weights_only=True) for d in (single, multi))
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=1e-5, msg=key)
    for key in a["model_ema"]["weights"]:
        torch.testing.assert_close(a["model_ema"]["weights"][key], b["model_ema"]["weights"][key], rtol=0, atol=1e-5,
                                   msg=key)
    groups = a["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]  # adamw's default; none on norm and bias
    assert "betas" in groups[0]  # AdamW


def hand_computed_val_loss(weights, tiny_data, img_size=32):
    """Mean cross-entropy of ``weights`` over the 7 validation images, one image at a time,
    normalised by hand with ImageNet's mean and std."""
    import torchvision

    from multi_train_utils.datasets import MyDataSet
    from multi_train_utils.images import build_transforms
    from utils import read_split_data

    split = read_split_data(tiny_data["train"], val_root=tiny_data["val"])
    _, val_transform = build_transforms(img_size)
    dataset = MyDataSet(split.val_images_path, split.val_images_label, transform=val_transform)
    model = torchvision.models.get_model(MODEL, num_classes=5)
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    losses = []
    with torch.no_grad():
        for i in range(len(dataset)):
            image, label = dataset[i]
            x = ((image.float() / 255 - mean) / std)[None]
            losses.append(float(nn.functional.cross_entropy(model(x), torch.tensor([label]))))
    assert len(losses) == 7
    return sum(losses) / len(losses)


def test_val_loss_of_a_run_is_the_mean_over_its_validation_images(tiny_data, seeded_runs):
    """7 images in batches of 4: the padding of the short last batch counts nowhere."""
    out = seeded_runs["single"][0]
    rows = read_metrics(out)
    for epoch in (0, 1):
        expected = hand_computed_val_loss(out / f"model-{epoch}.pth", tiny_data)
        assert float(rows[epoch]["val_loss"]) == pytest.approx(expected, rel=1e-4), epoch


class Lookup(nn.Module):
    """Logits looked up per image: the uint8 image whose pixel [0, 0, 0] holds i gets row i
    (the pixel is read back from its normalised value)."""

    def __init__(self, table):
        super().__init__()
        self.table = nn.Parameter(table)

    def forward(self, images):
        pixel = images[:, 0, 0, 0] * (0.229 * 255) + 0.485 * 255
        return self.table[pixel.round().long()]


class BatchesOf(list):
    """A list of batches with the loader attribute evaluate reads (the batch size)."""

    def __init__(self, batches, batch_size):
        super().__init__(batches)
        self.batch_sampler = type("BatchSampler", (), {"batch_size": batch_size})()


def test_val_loss_is_the_mean_over_real_images_at_any_batch_size():
    """The padded copies of a short last batch change neither the loss nor its denominator:
    the first image of the padded batch has a loss far from the others', so counting it
    again (or dividing by the padded count) shows."""
    from multi_train_utils.train_eval_utils import evaluate

    count = 7
    table = torch.randn(count, 5, generator=torch.Generator().manual_seed(3))
    labels = torch.tensor([0, 1, 2, 3, 4, 0, 1])
    table[4] = torch.tensor([9.0, 0, 0, 0, -9.0])  # image 4: very wrong, a loss of ~18
    images = torch.zeros(count, 3, 2, 2, dtype=torch.uint8)
    images[:, 0, 0, 0] = torch.arange(count, dtype=torch.uint8)
    expected = float(nn.functional.cross_entropy(table, labels))  # the mean over the 7
    model = Lookup(table)
    for batch_size in (1, 2, 3, 4, 7, 8):  # 4: the last batch (4, 5, 6) is padded with copies of image 4
        batches = BatchesOf([(images[i:i + batch_size], labels[i:i + batch_size])
                             for i in range(0, count, batch_size)], batch_size)
        result = evaluate(model, batches, torch.device("cpu"), 5)
        assert result.total == count
        assert result.loss == pytest.approx(expected, rel=1e-6), batch_size


# --- --resume takes this run's --lr and --weight-decay -------------------------------------------

@pytest.mark.parametrize("kind", ["single", "multi"])
def test_resume_takes_this_runs_lr_and_weight_decay(kind, single_run, ddp_run, tiny_data, tmp_path):
    """A 2-epoch run resumed to 3 epochs with another --lr and --weight-decay: the optimizer
    goes on with this run's values, not those in the checkpoint's optimizer state; the
    schedule is the cosine of the new --lr (both scripts; the DDP run resumed in one
    process). The checkpoint is read where it lies; the run goes on in a new --output-dir."""
    source = Path(single_run["out"] if kind == "single" else ddp_run["out"])
    before = torch.load(source / "checkpoint.pth", weights_only=True)
    assert before["optimizer"]["param_groups"][0]["weight_decay"] == 0.005  # SGD's default
    listing = {p.name: p.stat().st_mtime_ns for p in source.iterdir()}
    out = tmp_path / "out"
    entry = script("train_single.py" if kind == "single" else "train_multi_gpu.py")
    result = run([PYTHON, entry, *train_args(tiny_data, out, "--epochs", "3", "--workers", "0", "--lr", "0.004",
                                             "--weight-decay", "0.0123", "--resume", str(source / "checkpoint.pth"))])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "(epoch 1 done): epochs 2 to 2" in result.stdout
    after = torch.load(out / "checkpoint.pth", weights_only=True)
    (group,) = after["optimizer"]["param_groups"]
    assert group["weight_decay"] == 0.0123 and group["initial_lr"] == pytest.approx(0.004)
    rows = read_metrics(out)
    assert len(rows) == 3
    steps = 9  # 36 images, batches of 4, one process
    last_step, total = 3 * steps - 1, 3 * steps
    factor = 0.1 + 0.9 * (1 + math.cos(math.pi * last_step / total)) / 2
    assert float(rows[2]["lr"]) == pytest.approx(0.004 * factor, rel=1e-5)
    assert group["lr"] == pytest.approx(0.004 * 0.1, rel=1e-5)  # the schedule's end: lr * lrf
    assert rows[:2] == read_metrics(source)  # the epochs before, as they were
    assert {p.name: p.stat().st_mtime_ns for p in source.iterdir()} == listing  # the source untouched


# --- --resume warns when the data's files are not those of the checkpoint -------------------------

def _datasets(train, val=None, val_rate="0.2"):
    from multi_train_utils.options import get_args_parser, parse_args
    from my_dataset import build_datasets

    flags = ["--data-path", str(train), "--val-rate", val_rate, *FAST, "--output-dir", "/nonexistent"]
    if val:
        flags += ["--val-path", str(val)]
    return build_datasets(parse_args(get_args_parser(distributed=False), flags))


def _warns(checkpoint_data, data, capsys):
    from multi_train_utils.run_files import file_list_fingerprint, warn_if_files_changed

    capsys.readouterr()
    warn_if_files_changed({"file_list": file_list_fingerprint(checkpoint_data)}, "ckpt", data)
    out = capsys.readouterr().out
    assert out == "" or out.startswith("warning: --resume ckpt: the data's files are not those"), out
    return out != ""


def test_resume_warns_when_files_were_renamed_moved_or_swapped_with_the_same_counts(tiny_data, tmp_path, capsys):
    train, val = tmp_path / "train", tmp_path / "val"
    shutil.copytree(tiny_data["train"], train)
    shutil.copytree(tiny_data["val"], val)
    original = _datasets(train, val)
    counts = (len(original.train), len(original.val))
    assert not _warns(original, _datasets(train, val), capsys)  # the same files

    # the whole data moved to another folder: the same files, nothing to warn about
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path, moved, ignore=shutil.ignore_patterns("elsewhere"))
    assert not _warns(original, _datasets(moved / "train", moved / "val"), capsys)

    # one file renamed
    os.rename(train / "daisy" / "daisy_000.jpg", train / "daisy" / "daisy_000_renamed.jpg")
    renamed = _datasets(train, val)
    assert (len(renamed.train), len(renamed.val)) == counts
    assert _warns(original, renamed, capsys)
    os.rename(train / "daisy" / "daisy_000_renamed.jpg", train / "daisy" / "daisy_000.jpg")

    # a daisy and a rose swap folders: the same counts per class, other labels
    os.rename(train / "daisy" / "daisy_001.png", train / "roses" / "daisy_001.png")
    os.rename(train / "roses" / "roses_001.png", train / "daisy" / "roses_001.png")
    swapped = _datasets(train, val)
    assert list(np.bincount(swapped.train.images_class, minlength=5)) == \
        list(np.bincount(original.train.images_class, minlength=5))
    assert _warns(original, swapped, capsys)
    os.rename(train / "daisy" / "roses_001.png", train / "roses" / "roses_001.png")
    os.rename(train / "roses" / "daisy_001.png", train / "daisy" / "daisy_001.png")

    # a training image and a validation image of one class trade places
    os.rename(train / "tulips" / "tulips_000.jpg", tmp_path / "t.jpg")
    os.rename(val / "tulips" / "tulips_000.jpg", train / "tulips" / "tulips_000.jpg")
    os.rename(tmp_path / "t.jpg", val / "tulips" / "tulips_from_train.jpg")
    traded = _datasets(train, val)
    assert (len(traded.train), len(traded.val)) == counts
    assert _warns(original, traded, capsys)

    # a file replaced by another of another name (same class, same counts)
    shutil.rmtree(train)
    shutil.copytree(tiny_data["train"], train)
    shutil.rmtree(val)
    shutil.copytree(tiny_data["val"], val)
    assert not _warns(original, _datasets(train, val), capsys)  # all back as it was
    os.remove(train / "sunflowers" / "sunflowers_002.jpeg")
    shutil.copy(train / "sunflowers" / "sunflowers_003.jpg", train / "sunflowers" / "another.jpg")
    assert _warns(original, _datasets(train, val), capsys)


# --- the NaN message names the first non-finite step ---------------------------------------------

def test_the_nan_message_names_the_first_non_finite_step_of_several():
    """Steps 2 (inf) and 4 (nan) are non-finite; the loss is read every 6 steps: the message
    names step 2, with the epoch."""
    from multi_train_utils.checkpoint import TrainState
    from multi_train_utils.train_eval_utils import LoopSettings, NonFiniteLossError, train_one_epoch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    loader = BatchesOf([(torch.rand(2, 3, 2, 2), torch.tensor([0, 1])) for _ in range(8)], 2)
    bad = {2: float("inf"), 4: float("nan")}
    calls = []

    def loss_function(logits, targets):
        loss = nn.functional.cross_entropy(logits, targets)
        step = len(calls)
        calls.append(step)
        return loss + bad[step] if step in bad else loss

    loss_function.to = lambda device: loss_function
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(NonFiniteLossError) as raised:
        train_one_epoch(TrainState(model, optimizer, loss_function=loss_function), loader, torch.device("cpu"), 3,
                        LoopSettings(print_freq=6))
    assert "at epoch 3, step 2;" in str(raised.value)
    assert len(calls) == 6  # it stopped at the first read of the loss
