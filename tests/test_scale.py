"""ImageNet-sized data: one listing per job, no image opened at start, bad files met mid-epoch,
compact file lists in loader workers, and reports that stay legible at 1,000 classes.

Two 2-rank DDP runs (the shared list and bad files mid-epoch; data gone mid-run), one process
for a loader worker's memory; the rest runs in-process.
"""
import io
import os
import random
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import FAST, PROBE, PYTHON, REPO, outcome, probe_records, run, run_ranks
from multi_train_utils.options import config_of  # noqa: E402

from multi_train_utils.errors import UserError
from multi_train_utils.datasets import PathList

def small_jpeg(path, shade):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", (24, 20), (shade, 255 - shade, 90)).save(path, quality=80)


def many_classes_folder(root, classes=12, per_class=5):
    """``classes`` class folders of ``per_class`` JPEGs (one class with a nested sub-folder)."""
    for c in range(classes):
        for i in range(per_class):
            sub = "deep/" if c == 3 and i % 2 else ""
            small_jpeg(os.path.join(root, f"class_{c:02d}", f"{sub}img_{i}.jpg"), (c * 20 + i * 3) % 256)
    return root


# --- One listing per job ---------------------------------------------------------------------------

def cut_short_jpeg(path):
    """A JPEG whose header reads and whose pixels stop at 60 % (200 x 200 of noise)."""
    noise = np.random.default_rng(0).integers(0, 255, (200, 200, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, format="JPEG")
    with open(path, "wb") as f:
        f.write(buffer.getvalue()[: len(buffer.getvalue()) * 6 // 10])


def test_rank_0_alone_lists_the_files_and_bad_ones_met_mid_epoch_follow_the_rule(tmp_path):
    """12 class folders split by --val-rate 0.3 --seed 3, trained by 2 DDP ranks (over gloo, as
    srun starts them) without --check-images; one training file is not an image, one
    validation JPEG is cut short. Rank 0 alone lists the folders and the other rank gets its
    list, equal to a one-process scan; training puts the next image in the broken one's place
    (every rank runs its full number of steps); validation leaves the other out and counts
    the rest exactly once; each is one warning naming the file."""
    from utils import read_split_data

    root = many_classes_folder(str(tmp_path / "data"))
    alone = read_split_data(root, val_rate=0.3, seed=3)  # one process; the listing opens no file
    broken, cut_short = alone.train_images_path[7], alone.val_images_path[5]
    with open(broken, "wb") as f:
        f.write(b"not a jpeg")
    cut_short_jpeg(cut_short)
    out = tmp_path / "out"
    result = run_ranks(2, [PYTHON, PROBE, "multi", *FAST, "--data-path", root, "--val-rate", "0.3", "--seed", "3",
                           "--epochs", "1", "--workers", "1", "--output-dir", str(out), "--log-dir", str(tmp_path / "tb")],
                       env={"PROBE_OUT": f"{out}.probe", "PROBE_FILE_LISTS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    records = probe_records(f"{out}.probe", 2)
    assert [r["class_folders_listed"] for r in records] == [12, 0]  # rank 1 listed nothing itself
    for record in records:
        assert record["train"] == alone.train_images_path and record["val"] == alone.val_images_path
        assert record["train_labels"] == alone.train_images_label and record["val_labels"] == alone.val_images_label
        assert record["holders"] == ["PathList", "ndarray"]
    assert len(alone.val_images_path) == 12 * 2 and any("/deep/" in p for p in alone.train_images_path)
    # 36 training images: 18 a rank, 4 whole batches of 4 each, the broken one replaced
    assert [r["steps"] for r in records] == [4, 4]
    assert "Traceback" not in result.stdout + result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2, warnings
    assert [w for w in warnings if w.startswith(f"warning: cannot decode image {broken} ")][0].endswith(
        "; the next image of the training set takes its place")
    assert [w for w in warnings if w.startswith(f"warning: cannot decode image {cut_short} ")][0].endswith(
        "; left out of this validation")
    epoch = [line for line in result.stdout.splitlines() if line.startswith("[epoch 0] ")]
    assert len(epoch) == 1 and "/23, 1 unreadable left out)" in epoch[0], epoch  # 24 - 1


def test_a_rank_whose_rank_0_failed_to_list_says_so_in_one_line(monkeypatch):
    import multi_train_utils.datasets as file_list

    monkeypatch.setattr(file_list, "is_dist_avail_and_initialized", lambda: True)
    monkeypatch.setattr(file_list, "get_world_size", lambda: 2)
    monkeypatch.setattr(file_list.dist, "get_backend", lambda: "gloo")
    sent = "--data-path /nope: no such folder; ..."

    def from_rank_0(header, src, device=None):
        header[:] = [sent, None]  # what rank 0 broadcast: its error

    monkeypatch.setattr(file_list.dist, "broadcast_object_list", from_rank_0)
    monkeypatch.setattr(file_list, "get_rank", lambda: 1)
    listed = []
    with pytest.raises(UserError) as error:
        file_list.listed_once(lambda: listed.append(1))
    assert str(error.value) == "rank 0 could not list the data; see its error" and listed == []
    monkeypatch.setattr(file_list, "get_rank", lambda: 0)

    def fails():
        raise UserError(sent)

    with pytest.raises(UserError, match="^--data-path /nope: no such folder"):
        file_list.listed_once(fails)


def test_no_image_is_opened_before_training_unless_check_images(tmp_path, monkeypatch):
    from my_dataset import build_datasets
    from multi_train_utils.options import get_args_parser, parse_args
    import PIL.Image

    root = many_classes_folder(str(tmp_path / "data"), classes=3)
    with open(os.path.join(root, "class_01", "broken.jpg"), "wb") as f:
        f.write(b"not a jpeg")
    csv_path = tmp_path / "train.csv"
    csv_path.write_text("path,label\n" + "".join(f"data/class_{c:02d}/img_{i}.jpg,c{c}\n" for c in range(3)
                                                 for i in range(5)) + "data/class_01/broken.jpg,c1\n")
    real_open, opened = PIL.Image.open, []

    def counting_open(*args, **kwargs):
        opened.append(args[0])
        return real_open(*args, **kwargs)

    monkeypatch.setattr(PIL.Image, "open", counting_open)
    parser = get_args_parser(distributed=False)
    for flags in (["--data-path", root], ["--train-list", str(csv_path)]):
        data = build_datasets(parse_args(parser, flags + ["--val-rate", "0.2"]))
        assert opened == [] and len(data.train) + len(data.val) == 16 and data.skipped == []
        checked = build_datasets(parse_args(parser, flags + ["--val-rate", "0.2", "--check-images"]))
        assert len(opened) == 16 and len(checked.train) + len(checked.val) == 15
        assert checked.skip_reasons == {os.path.join(root, "class_01", "broken.jpg"): "not a readable image"}
        opened.clear()


# --- Bad files met mid-epoch -----------------------------------------------------------------------

def test_a_dataset_replaces_and_leaves_out_as_asked_and_stops_when_the_data_is_gone(tmp_path):
    from multi_train_utils.datasets import LEFT_OUT, MAX_UNREADABLE_IN_A_ROW, MyDataSet
    from multi_train_utils.errors import MidRunError, UnreadableImage
    from multi_train_utils.images import build_transforms

    paths = []
    for i in range(4):
        paths.append(str(tmp_path / f"{i}.jpg"))
        small_jpeg(paths[-1], 60 * i)
    (tmp_path / "1.jpg").write_bytes(b"broken")
    os.remove(tmp_path / "2.jpg")
    _, val_tf = build_transforms(16)
    train = MyDataSet(paths, [0, 1, 2, 3], val_tf, if_unreadable="replace")
    replaced = outcome(lambda: train[1])
    assert isinstance(replaced, tuple), f"no image took the place of the bad one: {replaced!r}"
    image, label = replaced
    assert label == 3 and torch.equal(image, train[3][0])  # 1 and 2 cannot be read: 3 takes their place
    assert train[0][1] == 0
    val = MyDataSet(paths, [0, 1, 2, 3], val_tf, if_unreadable="leave out")
    image, label = val[2]
    assert label == LEFT_OUT and image.shape == (3, 16, 16) and int(image.sum()) == 0
    with pytest.raises(UnreadableImage, match="cannot decode image .*1.jpg"):
        MyDataSet(paths, [0, 1, 2, 3], val_tf)[1]  # the default: stop
    for path in paths:
        if os.path.exists(path):
            os.remove(path)
    gone = MyDataSet([str(tmp_path / f"{i}.jpg") for i in range(12)], [0] * 12, val_tf, if_unreadable="replace")
    with pytest.raises(MidRunError, match=f"^{MAX_UNREADABLE_IN_A_ROW} images in a row cannot be read, from image "
                                          ".*0.jpg is gone .*: is the data still there"):
        gone[0]


def test_evaluation_leaves_out_unreadable_images_from_every_count():
    from multi_train_utils.datasets import LEFT_OUT
    from multi_train_utils.train_eval_utils import evaluate

    class Fixed(torch.nn.Module):  # predicts the class written in the image's first pixel
        def forward(self, images):
            return torch.nn.functional.one_hot(images[:, 0, 0, 0].round().long().clamp(0, 2), 3).float() * 5

    # float images in [0, 1] are normalised (x - mean) / std: write the class so that it survives
    def image(cls):
        return torch.full((3, 2, 2), 0.485 + 0.229 * cls)

    batches = [(torch.stack([image(0), image(1), image(2)]), torch.tensor([0, LEFT_OUT, 2])),
               (torch.stack([image(1), image(1)]), torch.tensor([LEFT_OUT, 0]))]
    result = evaluate(Fixed(), batches, torch.device("cpu"), num_classes=3)
    assert result.left_out == 2 and result.total == 3 and result.correct == 2
    assert result.confusion.tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 1]]


# --- Compact lists ---------------------------------------------------------------------------------

def test_a_path_list_gives_back_every_path_as_it_was_given():
    odd = os.fsdecode(b"/data/caf\xe9/x.jpg")
    for paths in ([], ["a.jpg"], ["/d/ab/c.jpg", "/d/ab/d.jpg", "/d/abc.jpg"], [odd, "/data/b.png", "/data/é.png"],
                  ["same.jpg", "same.jpg"], ["", "a"], ["rel/1.jpg", "/abs/2.jpg"]):
        held = PathList(paths)
        assert len(held) == len(paths) and list(held) == paths and held == paths
        assert held[-1:] == paths[-1:] and (not paths or held[-1] == paths[-1])
        assert held.data.dtype == np.uint8 and held.offsets.dtype == np.int64
        with pytest.raises(IndexError):
            held[len(paths)]
        again = PathList.from_arrays(*held.arrays())
        assert list(again) == paths
    shared = PathList(["/d/ab/c.jpg", "/d/ab/d.jpg"])
    assert shared.prefix == b"/d/ab/" and shared.data.tobytes() == b"c.jpgd.jpg"  # the shared prefix held once


WORKER_GROWTH = """
import os, sys
sys.path.insert(0, {repo!r})
from torch.utils.data import DataLoader, Dataset
from multi_train_utils.datasets import MyDataSet

def private_kb():
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(l.split()[1]) for l in f if l.startswith(("Private_Clean", "Private_Dirty")))

class Reads(Dataset):  # what a worker reads of each item, without decoding
    def __init__(self, held):
        self.held = held
    def __len__(self):
        return len(self.held)
    def __getitem__(self, i):
        return len(self.held.images_path[i]) + int(self.held.images_class[i]), private_kb() if i in (0, n - 1) else 0

n = 200_000
held = MyDataSet([f"/data/train/n{{i // 200:05d}}/n{{i // 200:05d}}_{{i}}.JPEG" for i in range(n)], [i // 200 for i in range(n)])
kb = [k for batch in DataLoader(Reads(held), batch_size=5000, num_workers=1, collate_fn=list) for _, k in batch if k]
print((kb[-1] - kb[0]) / 1024)
"""


def test_a_loader_worker_does_not_copy_the_file_list_as_it_reads_it():
    """200,000 paths read once each by a forked worker: its private memory grows by a few MB
    (Python lists of str grow it by ~25 MB: each item read gets its page copied)."""
    result = run([PYTHON, "-c", WORKER_GROWTH.format(repo=REPO)], timeout=120)
    assert result.returncode == 0, result.stderr
    growth_mb = float(result.stdout.strip().splitlines()[-1])
    assert growth_mb < 8, f"the worker's private memory grew by {growth_mb:.1f} MB over the epoch"


# --- The split and the fingerprint, unchanged by the compact lists ----------------------------------

def reference_split(images, labels, classes, val_rate, seed):
    """The split as it was defined: per class, shuffle the class's paths with random.Random(seed)
    and take the first round(n * val_rate) for validation; both lists in sorted order."""
    rng = random.Random(seed)
    train, val = [], []
    for label in range(len(classes)):
        members = [p for p, y in zip(images, labels) if y == label]
        rng.shuffle(members)
        n_val = int(round(len(members) * val_rate))
        chosen = set(members[:n_val])
        val += [(p, label) for p in sorted(members) if p in chosen]
        train += [(p, label) for p in sorted(members) if p not in chosen]
    return train, val


def test_the_split_of_a_seed_is_the_one_it_always_was():
    from multi_train_utils.datasets import split_by_class

    rng = random.Random(5)
    classes = [f"c{c}" for c in range(11)]
    images = [f"/d/{c}/{rng.random():.8f}.jpg" for c in range(11) for _ in range(rng.randint(3, 20))]
    rng.shuffle(images)  # label files list them in any order
    labels = [int(p.split("/")[2]) for p in images]
    for seed in (0, 7):
        train_images, train_labels, val_images, val_labels = split_by_class(images, labels, classes, 0.3, seed)
        train, val = reference_split(images, labels, classes, 0.3, seed)
        assert list(zip(train_images, train_labels)) == train and list(zip(val_images, val_labels)) == val


def test_a_checkpoint_of_another_fingerprint_version_is_compared_by_its_counts(tmp_path, capsys):
    from multi_train_utils.datasets import image_file_datasets
    from multi_train_utils.run_files import file_list_fingerprint, warn_if_files_changed
    from utils import read_split_data

    root = many_classes_folder(str(tmp_path / "a"), classes=3)
    data = image_file_datasets(read_split_data(root, 0.2, 0), 16)
    now = file_list_fingerprint(data)
    moved = str(tmp_path / "elsewhere")
    shutil.copytree(root, moved)
    assert file_list_fingerprint(image_file_datasets(read_split_data(moved, 0.2, 0), 16)) == now
    for name in ("cats", "dogs"):  # paths whose shared prefix ends at a folder: /.../pets/
        for i in range(5):
            small_jpeg(str(tmp_path / "pets" / name / f"{i}.jpg"), 40 * i)
    pets = file_list_fingerprint(image_file_datasets(read_split_data(str(tmp_path / "pets"), 0.2, 0), 16))
    shutil.copytree(tmp_path / "pets", tmp_path / "animals")
    assert file_list_fingerprint(image_file_datasets(read_split_data(str(tmp_path / "animals"), 0.2, 0), 16)) == pets
    relabelled = image_file_datasets(read_split_data(root, 0.2, 0), 16)
    relabelled.train.images_class[0] = 2
    assert file_list_fingerprint(relabelled)["sha1"] != now["sha1"]
    for before, warned in (({"train": now["train"], "val": now["val"], "sha1": "from an older version"}, False),
                           ({"train": now["train"] + 1, "val": now["val"], "sha1": "x"}, True),
                           (dict(now, sha1="other"), True), (now, False)):
        warn_if_files_changed({"file_list": before}, "c.pth", data)
        assert ("warning: --resume c.pth: the data's files are not those" in capsys.readouterr().out) == warned, before


def test_many_classes_without_validation_images_are_one_note(tmp_path):
    from utils import read_split_data

    for c in range(7):
        for i in range(5 if c == 0 else 1):
            small_jpeg(str(tmp_path / f"k{c}" / f"{i}.jpg"), 30 * c)
    split = read_split_data(str(tmp_path), val_rate=0.2, seed=0)
    assert split.notes == ["6 classes get no validation image ('k1', 'k2', 'k3', ...): their accuracy is never "
                           "measured; add images or raise --val-rate"]


# --- Reports at 1,000 classes ----------------------------------------------------------------------

CLASSES_1000 = [f"n{c:08d}" for c in range(1000)]


def made_up_confusion():
    """10 validation images a class, all right, except: class 9 gets 1 right and 9 as class 0
    (recall 0.1), class 3 gets 2 right and 8 as class 4 (0.2), class 5 gets 5 right and 5 as 6."""
    confusion = torch.zeros(1000, 1000, dtype=torch.int64)
    confusion.fill_diagonal_(10)
    for true, right, wrong_as in ((9, 1, 0), (3, 2, 4), (5, 5, 6)):
        confusion[true, true], confusion[true, wrong_as] = right, 10 - right
    return confusion


class Labelled(torch.utils.data.Dataset):
    def __init__(self, labels):
        self.targets = labels

    def __len__(self):
        return len(self.targets)


def test_the_start_summary_of_1000_classes_names_the_extremes_in_short_lines(capsys):
    from multi_train_utils.datasets import Datasets
    from multi_train_utils.options import get_args_parser, parse_args
    from multi_train_utils.recorder import print_data_summary

    # training images: class c has 20 + c % 7; class 500 has 2, class 7 has 300; 1 val image each
    counts = [2 if c == 500 else 300 if c == 7 else 20 + c % 7 for c in range(1000)]
    train = Labelled([c for c in range(1000) for _ in range(counts[c])])
    data = Datasets(train, Labelled(list(range(1000))), CLASSES_1000)
    args = parse_args(get_args_parser(distributed=False), ["--data-path", "/data/imagenet"])
    print_data_summary(config_of(args), data)
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 200 and len(lines) <= 5, lines
    total = sum(counts) + 1000
    # the three smallest: 500 (2 + 1), then the classes with c % 7 == 0 first by label: 0 and 14 (20 + 1)
    assert lines[0] == (f"data: /data/imagenet: 1000 classes, {total} images; smallest n00000500 (3), n00000000 (21), "
                        "n00000014 (21); largest n00000007 (301), n00000006 (27), n00000013 (27); median 24 images a "
                        "class")
    assert lines[1] == "imbalance: the largest class has 100.3x the images of the smallest; 1 class(es) have less than " \
                       "half the median"
    assert lines[2] == f"split: {sum(counts)} train, 1000 val images"
    assert lines[3].startswith("warning: the classes are imbalanced: n00000007 has 300 training images, n00000500 2")


def test_the_evaluation_report_of_1000_classes_lists_the_worst_classes_and_pairs(capsys):
    from multi_train_utils.single_label import evaluation_metrics_csv, print_evaluation
    from multi_train_utils.single_label import EvalResult

    result = EvalResult(made_up_confusion(), top5_correct=9990, loss_sum=1.0)
    print_evaluation(result, CLASSES_1000)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 30 and max(len(line) for line in lines) <= 200, lines
    worst = [line.split()[0] for line in lines[1:11]]
    assert worst == ["n00000009", "n00000003", "n00000005", "n00000000", "n00000001", "n00000002", "n00000004",
                     "n00000006", "n00000007", "n00000008"]  # recall 0.1, 0.2, 0.5, then 1.0 in label order
    assert lines[1].split()[1:3] == ["0.100000", "(1/10)"]
    assert lines[11:15] == ["most confused (true -> predicted: images):", "  n00000009 -> n00000000: 9",
                            "  n00000003 -> n00000004: 8", "  n00000005 -> n00000006: 5"]
    assert lines[-2:] == ["top5 accuracy: 0.999000 (9990/10000)", "top1 accuracy: 0.997800 (9978/10000)"]
    overall, per_class = evaluation_metrics_csv(result, CLASSES_1000)
    rows = per_class.splitlines()
    assert len(rows) == 1001 and rows[10].startswith("n00000009,10,1,1,")  # images, predicted, correct
    assert "top5_accuracy,0.999" in overall


def test_the_pictures_of_1000_classes_stay_legible(tmp_path):
    from multi_train_utils.pictures import (MAX_INCHES, plot_class_distribution, plot_confusion_matrix,
                                            plot_most_confused, save_confusion_matrix)

    confusion = made_up_confusion()
    heat = plot_confusion_matrix(confusion, CLASSES_1000)
    ax = heat.axes[0]
    assert len(ax.texts) == 0 and not [t for t in ax.get_xticklabels() if t.get_text().startswith("n0")]  # no names
    assert max(heat.get_size_inches()) <= MAX_INCHES
    small = plot_confusion_matrix(confusion[:30, :30], CLASSES_1000[:30]).axes[0]
    assert len(small.texts) == 900  # up to 30 classes every cell is written in
    assert len(plot_confusion_matrix(confusion[:31, :31], CLASSES_1000[:31]).axes[0].texts) == 0
    train = [20 + c % 7 for c in range(1000)]
    curve = plot_class_distribution(CLASSES_1000, train, [1] * 1000).axes[0]
    assert len(curve.patches) == 0 and len(curve.lines) == 2  # two curves, no 2,000 bars
    assert list(curve.lines[0].get_ydata()) == sorted(train, reverse=True)
    assert len(plot_class_distribution(CLASSES_1000[:5], [3] * 5, [1] * 5).axes[0].patches) == 10  # bars for few
    pairs = plot_most_confused(confusion, CLASSES_1000).axes[0]
    assert [t.get_text() for t in pairs.get_yticklabels()] == ["n00000009 -> n00000000", "n00000003 -> n00000004",
                                                               "n00000005 -> n00000006"]

    class Writer:  # what TensorBoard's SummaryWriter is asked
        tags = []

        def add_figure(self, tag, figure, step, close=True):
            self.tags.append(tag)

    drawn = save_confusion_matrix(confusion, CLASSES_1000, str(tmp_path), "best", writer=Writer())
    assert drawn == ["confusion_matrix", "most_confused"]
    assert Writer.tags == ["summary/confusion_matrix", "summary/most_confused"]
    for name in ("confusion_matrix.png", "most_confused.png"):
        with Image.open(tmp_path / name) as picture:
            assert max(picture.size) <= MAX_INCHES * 100 + 50, picture.size
    assert len((tmp_path / "confusion_matrix.csv").read_text().splitlines()) == 1001


def test_the_epoch_line_reports_top5_and_the_images_left_out():
    from multi_train_utils.recorder import epoch_line
    from multi_train_utils.single_label import EvalResult
    from multi_train_utils.train_eval_utils import TrainStats

    # 8 classes of 10 images: 6 all right, class 3 2 right, class 5 5 right: 67 of 80
    result = EvalResult(made_up_confusion()[:8, :8], top5_correct=70, loss_sum=1.0, left_out=2)
    assert epoch_line(3, TrainStats(0.5, 100, 1.0, 0.01, 50.0), result) == (
        "[epoch 3] train_loss: 0.5000  val_accuracy: 0.8375 (67/80, 2 unreadable left out)  val_top5: 0.8750  "
        "lr: 0.01  50.0 img/s")
    five = EvalResult(made_up_confusion()[:5, :5], loss_sum=1.0)
    assert epoch_line(0, TrainStats(0.5, 100, 1.0, 0.01, 50.0), five) == (
        "[epoch 0] train_loss: 0.5000  val_accuracy: 0.8400 (42/50)  lr: 0.01  50.0 img/s")  # no top-5 with 5
    one = EvalResult(made_up_confusion()[:5, :5], loss_sum=1.0, left_out=1)  # round 16: the first one is said too
    assert "val_accuracy: 0.8400 (42/50, 1 unreadable left out)  lr" in epoch_line(0, TrainStats(0.5, 100, 1.0, 0.01,
                                                                                                 50.0), one)


def test_data_gone_mid_run_stops_the_rank_that_meets_it_in_one_line(tiny_data, tmp_path):
    """Twelve unreadable training files in a row (the data is gone, as far as the loader can
    tell), 2 DDP ranks: the rank that meets them stops with one line naming itself and the first
    file, raised in a loader worker of its own, exit code 2 (bad data); the other stops too."""
    train = tmp_path / "train"
    shutil.copytree(tiny_data["train"], train)
    for i in range(12):  # sorted after dandelion's images: 12 indices in a row
        (train / "dandelion" / f"zz_gone_{i:02d}.jpg").write_bytes(b"")
    out = tmp_path / "out"
    result = run_ranks(2, [PYTHON, PROBE, "multi", *FAST, "--data-path", str(train), "--val-path", tiny_data["val"],
                           "--epochs", "1", "--workers", "1", "--output-dir", str(out), "--log-dir", str(tmp_path / "tb")],
                       env={"PROBE_OUT": f"{out}.probe"})
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    gone = [re.match(r"\[rank ([01])\] error: 10 images in a row cannot be read, from cannot decode image (\S+) ", line)
            for line in errors]
    readers = {int(m.group(1)): os.path.basename(m.group(2)) for m in gone if m}
    assert readers, errors
    for reader, name in readers.items():
        assert name.startswith("zz_gone_") and int(name[8:10]) <= 2, name  # 10 bad ones in a row from the first 3
        assert probe_records(f"{out}.probe", 2)[reader]["exit_code"] == 2
    line = next(line for line, m in zip(errors, gone) if m)
    assert line.endswith("is the data still there (a folder moved, a network file system gone)?; no checkpoint was "
                         "written yet"), line
    assert all(m or re.match(r"\[rank [01]\] error: lost contact with another process", line)
               for line, m in zip(errors, gone)), errors
    assert "Traceback" not in result.stdout + result.stderr


def test_the_extremes_of_many_classes_read_right_when_balanced_empty_or_tied():
    from multi_train_utils.pictures import most_confused_pairs
    from multi_train_utils.recorder import describe_many_classes

    names = [f"c{c}" for c in range(25)]
    assert describe_many_classes(names, [40] * 25)[1] == "imbalance: every class has 40 images"
    empty = [0 if c in (3, 11) else 40 for c in range(25)]
    lines = describe_many_classes(names, empty)
    assert lines[0].startswith("25 classes, 920 images; smallest c3 (0), c11 (0), c0 (40); largest c0 (40), c1 (40), c2 "
                               "(40); median 40") and lines[1] == "imbalance: 2 class(es) have no images"
    confusion = torch.zeros(4, 4, dtype=torch.int64)
    confusion[2, 1] = confusion[0, 3] = confusion[1, 0] = 5  # a three-way tie: row order, then column order
    confusion[3, 2] = 7
    assert most_confused_pairs(confusion, 3) == [(3, 2, 7), (0, 3, 5), (1, 0, 5)]
