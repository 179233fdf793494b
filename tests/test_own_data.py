"""Your own data: a torchvision ImageFolder through both scripts (the README's "Make it yours"
example, via tests/helpers/own_dataset.py), and CSV label files (--train-list / --val-list)."""
import csv
import os
import re
import shutil

import pytest
from PIL import Image

from conftest import (CLASSES, FAST, PYTHON, REPO, assert_exact_accuracy, read_metrics, run, run_ranks, script,
                      write_class_folder)

OWN_DATASET = os.path.join(REPO, "tests", "helpers", "own_dataset.py")


@pytest.fixture(scope="module")
def image_folders(tiny_data, tmp_path_factory):
    """ROOT/train: 4 images of each of the 5 classes; ROOT/val: the 7 validation images."""
    import random

    root = tmp_path_factory.mktemp("imagefolder")
    rng = random.Random(3)
    for name in CLASSES:
        write_class_folder(str(root / "train"), name, 4, rng)
    shutil.copytree(tiny_data["val"], root / "val")
    return root


def own_dataset_args(root, out, *extra):
    return ["--data-path", str(root), *FAST, "--output-dir", str(out), "--log-dir", f"{out}-tb", *extra]


def top1_count(stdout):
    match = re.search(r"^top1 accuracy: [\d.]+ \((\d+)/(\d+)\)$", stdout, flags=re.M)
    assert match, stdout
    return int(match.group(1)), int(match.group(2))


def test_imagefolder_trains_in_one_process_with_its_pictures(image_folders, tmp_path):
    """train_single.py with ImageFolder datasets: exact counts, per-class counts from .targets,
    the pictures; and --threads."""
    out = tmp_path / "out"
    result = run([PYTHON, OWN_DATASET, "single", *own_dataset_args(image_folders, out, "--epochs", "1", "--plots",
                                                                   "--threads", "1", "--workers", "1")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert_exact_accuracy(result.stdout, str(out), epochs=1)
    assert "device: cpu (1 thread)" in result.stdout
    assert "6 daisy, 6 dandelion, 5 roses, 5 sunflowers, 5 tulips" in result.stdout  # train 4 each + val 2,2,1,1,1
    assert "split: 20 train, 7 val images" in result.stdout
    for name in ("class_distribution.png", "batch_preview.png", "curves.png", "confusion_matrix.png"):
        with Image.open(out / name) as img:
            assert img.format == "PNG" and min(img.size) >= 200, name


def test_imagefolder_trains_with_ddp_and_evaluates_exactly(image_folders, tmp_path):
    """train_multi_gpu.py on 2 ranks (as srun starts them) with ImageFolder datasets (float
    validation images), then --eval-only of its last weights in one process: the same count."""
    out = tmp_path / "out"
    result = run_ranks(2, [PYTHON, OWN_DATASET, "multi", *own_dataset_args(image_folders, out, "--epochs", "2",
                                                                          "--workers", "0")])
    assert result.returncode == 0, result.stdout + result.stderr
    counts = assert_exact_accuracy(result.stdout, str(out), epochs=2)
    evaluation = run([PYTHON, OWN_DATASET, "single", "--eval-only", "--weights", str(out / "model-1.pth"),
                      "--workers", "0"])
    assert evaluation.returncode == 0, evaluation.stdout + evaluation.stderr
    assert top1_count(evaluation.stdout) == (counts[1], 7)


# --- CSV label files -------------------------------------------------------------------------------

def write_list(path, rows, header=("path", "label")):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        if header:
            writer.writerow(header)
        writer.writerows(rows)
    return str(path)


def list_of_folder(folder, csv_dir):
    """(path relative to csv_dir, class) of every file in the class folders of ``folder``."""
    rows = []
    for name in sorted(os.listdir(folder)):
        if os.path.isdir(os.path.join(folder, name)) and not name.startswith("."):
            for file in sorted(os.listdir(os.path.join(folder, name))):
                rows.append((os.path.relpath(os.path.join(folder, name, file), csv_dir), name))
    return rows


def test_label_files_train_like_folders(tiny_data, tmp_path):
    """--train-list / --val-list listing the tiny folders' files (odd modes and a broken file
    included, paths relative to each CSV): the same 36 training and 7 validation images."""
    lists = tmp_path / "lists"
    lists.mkdir()
    train_rows = [r for r in list_of_folder(tiny_data["train"], lists) if not r[0].endswith(".txt")]
    train_list = write_list(lists / "train.csv", train_rows)
    val_list = write_list(tmp_path / "val.csv", list_of_folder(tiny_data["val"], tmp_path))
    out = tmp_path / "out"
    result = run([PYTHON, script("train_single.py"), "--train-list", train_list, "--val-list", val_list, "--check-images",
                  *FAST,
                  "--epochs", "1", "--workers", "0", "--output-dir", str(out), "--log-dir", str(tmp_path / "tb")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^warning: skipping \S*broken\.jpg: not a readable image$", result.stdout, flags=re.M)
    assert "split: 37 train, 7 val images" in result.stdout  # 36 + the hidden file, which a list names
    assert_exact_accuracy(result.stdout, str(out), epochs=1)
    with open(out / "class_indices.json") as f:
        assert list(__import__("json").load(f).values()) == CLASSES


@pytest.fixture
def lists(tiny_data, tmp_path):
    """A valid training list of tiny_data's images, and what read_label_files says of a list."""
    from utils import read_label_files

    rows = [r for r in list_of_folder(tiny_data["train"], tmp_path)
            if not r[0].endswith((".txt", "broken.jpg")) and not os.path.basename(r[0]).startswith(".")]
    broken = os.path.relpath(os.path.join(tiny_data["train"], "dandelion", "broken.jpg"), tmp_path)
    val_image = os.path.relpath(os.path.join(tiny_data["val"], "daisy", "daisy_000.jpg"), tmp_path)

    def error_of(train_rows=rows, val_rows=None, header=("path", "label"), check_images=False):
        train = write_list(tmp_path / "train.csv", train_rows, header)
        val = write_list(tmp_path / "val.csv", val_rows) if val_rows is not None else None
        from multi_train_utils.errors import UserError

        with pytest.raises(UserError) as error:
            read_label_files(train, val, check_images=check_images)
        message = str(error.value)
        assert "\n" not in message
        return message

    return {"rows": rows, "error_of": error_of, "dir": tmp_path, "broken": broken, "val_image": val_image}


def test_label_file_mistakes_are_one_clear_line(lists):
    rows, error_of, folder = lists["rows"], lists["error_of"], lists["dir"]
    from utils import read_label_files

    assert read_label_files(write_list(folder / "ok.csv", rows)).classes == CLASSES
    with pytest.raises(Exception, match="--train-list .*nope.csv: no such file"):
        read_label_files(str(folder / "nope.csv"))
    assert "the first line must be the header path,label (found file,class)" in error_of(header=("file", "class"))
    assert "line 3: expected path,label" in error_of(rows[:1] + [(rows[1][0], "")] + rows[2:])
    missing = error_of(rows + [("daisy/gone.jpg", "daisy")])
    assert f"line {len(rows) + 2}:" in missing and "gone.jpg: no such file" in missing
    assert "class 'lilies' is not one of the training classes" in error_of(val_rows=[(lists["val_image"], "lilies")])
    broken = error_of([r for r in rows if not r[1] == "tulips"] + [(lists["broken"], "tulips")], check_images=True)
    assert "class 'tulips' has no readable images" in broken
    assert "found 1 class (daisy)" in error_of([r for r in rows if r[1] == "daisy"])
    assert "lists no images" in error_of([])
    twice = error_of(rows + [("./" + rows[0][0], "roses")])
    assert f"line {len(rows) + 2}:" in twice and "is listed already on line 2; list each image once" in twice
    assert "is in --train-list too (line 3)" in error_of(val_rows=[(rows[1][0], rows[1][1])])


def test_resume_auto_of_a_finished_run_says_it_is_complete(single_run, tiny_data, tmp_path):
    from conftest import train_args

    import torch

    out = tmp_path / "out"
    shutil.copytree(single_run["out"], out)
    # a resumed run logs into its checkpoint's TensorBoard run: give the copy one of its own
    checkpoint = torch.load(out / "checkpoint.pth", weights_only=True)
    torch.save(dict(checkpoint, log_dir=str(tmp_path / "tb")), out / "checkpoint.pth")
    before = read_metrics(str(out))
    result = run([PYTHON, script("train_single.py"), *train_args(tiny_data, out, "--epochs", "2", "--workers", "0",
                                                                 "--resume", "auto")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the run is already complete (all 2 epochs done); to train longer, run it again with a larger --epochs" \
        in result.stdout
    assert "[epoch" not in result.stdout and read_metrics(str(out)) == before


def test_datasets_that_break_the_contract_are_refused_in_one_line():
    """A dataset of PIL images (ImageFolder without v2.ToImage()), one without 3 channels,
    and labels beyond the classes: each a UserError that says what the contract wants."""
    import torch

    from multi_train_utils.errors import UserError
    from multi_train_utils.run_files import check_datasets
    from multi_train_utils.datasets import Datasets

    class Items(torch.utils.data.Dataset):
        def __init__(self, item, targets=None):
            self.item = item
            if targets is not None:
                self.targets = targets

        def __len__(self):
            return 3

        def __getitem__(self, index):
            return self.item

    good = Items((torch.zeros(3, 8, 8, dtype=torch.uint8), 1), targets=[0, 1, 1])
    check_datasets(Datasets(good, Items((torch.rand(3, 8, 8), 0)), ["a", "b"]))  # uint8 and float both fit
    for bad, expected in ((Items((Image.new("RGB", (8, 8)), 0)), "its first image is a Image"),
                          (Items((torch.zeros(1, 8, 8), 0)), "first image has 1 channel, the data says 3"),
                          (Items((torch.zeros(3, 8, 8), "a")), "label an int"),
                          (Items((torch.zeros(3, 8, 8), torch.tensor(1.0))), "label an int"),
                          (Items((torch.full((3, 8, 8), 255.0), 0)), "float with values up to 255"),
                          (Items((torch.zeros(3, 8, 8), 2)), "first item: labels run from 2 to 2"),
                          (Items((torch.zeros(3, 8, 8), 0), targets=[0, 1, 2]), "labels run from 0 to 2, but there are 2 classes")):
        with pytest.raises(UserError, match=re.escape(expected)) as error:
            check_datasets(Datasets(good, bad, ["a", "b"]))
        assert "the validation dataset" in str(error.value) and "\n" not in str(error.value)
    other = Items((torch.zeros(3, 8, 8, dtype=torch.uint8), 0))
    other.classes = ["a", "c"]  # an ImageFolder whose folders differ: its labels mean other classes
    with pytest.raises(UserError, match=re.escape("has the classes ['a', 'c'], not ['a', 'b']")):
        check_datasets(Datasets(good, other, ["a", "b"]))
    with pytest.raises(UserError, match="return Datasets"):
        check_datasets((good, good))


def test_help_says_each_default_once():
    from multi_train_utils.options import get_args_parser

    for distributed in (False, True):
        text = get_args_parser(distributed).format_help()
        for block in re.split(r"\n  (?=-)", text):
            assert block.count("default") <= 1, " ".join(block.split())
        assert "default: 1, the last epoch's" in " ".join(text.split())


def test_items_asked_by_epoch_draw_seeded_randomness_from_torch_and_python():
    """SeededSamples: an item asked as (epoch, index) draws the same torch and Python random
    numbers on every ask, others in another epoch, and leaves the global states alone."""
    import random

    import torch

    from multi_train_utils.loaders import SeededSamples

    class Draws(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return torch.rand(1).item(), random.random()

    samples = SeededSamples(Draws(), seed=5)
    random.seed(1)
    torch.manual_seed(1)
    first = samples[(2, 3)]
    after = (torch.rand(1).item(), random.random())
    random.seed(1)
    torch.manual_seed(1)
    assert (torch.rand(1).item(), random.random()) == after  # the global generators went on untouched
    assert samples[(2, 3)] == first
    assert samples[(3, 3)][0] != first[0] and samples[(3, 3)][1] != first[1]
    assert SeededSamples(Draws(), seed=6)[(2, 3)] != first


def test_label_file_flags_that_do_not_go_together():
    from multi_train_utils.errors import UserError
    from multi_train_utils.options import get_args_parser, parse_args

    parser = get_args_parser(distributed=False)
    for argv, expected in ((["--val-list", "v.csv"], "--val-list needs --train-list"),
                           (["--train-list", "t.csv", "--val-path", "val"], "with --train-list give the validation images as --val-list"),
                           (["--train-list", "t.csv", "--demo"], "--train-list with --demo")):
        with pytest.raises(UserError, match=re.escape(expected)):
            parse_args(parser, argv)
    args = parse_args(parser, ["--train-list", "t.csv", "--val-list", "v.csv"])
    assert (args.train_list, args.val_list, args.keep_last, args.threads) == ("t.csv", "v.csv", 1, None)


def test_eval_only_takes_the_runs_data_flags_as_one_group(tmp_path):
    """--eval-only of a run trained on label files: without data flags it takes the run's
    lists; with --data-path given it takes none of them (folders and lists never mix)."""
    import json

    from multi_train_utils.errors import UserError
    from multi_train_utils.options import get_args_parser, parse_args

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "model-best.pth").write_bytes(b"")
    train, val = tmp_path / "train.csv", tmp_path / "val.csv"
    train.write_text("path,label\n")
    val.write_text("path,label\n")
    (run_dir / "args.json").write_text(json.dumps({"train_list": str(train), "val_list": str(val), "data_path": None,
                                                   "val_path": None, "model": "resnet18", "img_size": 32}))
    parser = get_args_parser(distributed=False)
    weights = ["--eval-only", "--weights", str(run_dir / "model-best.pth")]
    taken = parse_args(parser, weights)
    assert (taken.train_list, taken.val_list, taken.model, taken.img_size) == (str(train), str(val), "resnet18", 32)
    try:
        folders = parse_args(parser, weights + ["--data-path", str(tmp_path)])
    except UserError as e:  # the run's lists taken beside the given folder
        folders = str(e)
    assert not isinstance(folders, str), folders
    assert (folders.train_list, folders.val_list, folders.data_path) == (None, None, str(tmp_path))
