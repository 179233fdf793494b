"""The data path's promises, code first: seeds per item, label files' classes, the download's checks, and more."""
import os
import random
import tarfile

import pytest
import torch

from conftest import Labelled
from multi_train_utils.errors import UserError
from multi_train_utils.datasets import extract_dataset
from multi_train_utils.loaders import SeededSamples
from utils import read_label_files


# --- my_dataset.SeededSamples ------------------------------------------------------------------------

class Draws(torch.utils.data.Dataset):
    """Each item: one torch and one Python random number (what a random transform draws)."""

    def __len__(self):
        return 12

    def __getitem__(self, index):
        return torch.rand(1).item(), random.random()


def test_each_items_augmentation_is_seeded_by_its_index_too():
    """README: "the loader seeds both from (--seed, epoch, index) for each item": two images of
    one epoch draw different crops, the first and the last alike; asked again, the same."""
    samples = SeededSamples(Draws(), seed=5)
    draws = [samples[(2, index)] for index in range(12)]
    assert len({torch_draw for torch_draw, _ in draws}) == 12  # torch's generator: one stream per index
    assert len({python_draw for _, python_draw in draws}) == 12  # Python's random: one stream per index
    assert samples[(2, 11)] == draws[11] and samples[(2, 0)] == draws[0]


# --- utils.read_label_files -----------------------------------------------------------------------

def write_label_file(folder, rows, name="train.csv"):
    """A CSV path,label of ``rows`` (each file created empty: no image is opened)."""
    lines = ["path,label"]
    for path, label in rows:
        (folder / path).write_bytes(b"")
        lines.append(f"{path},{label}")
    (folder / name).write_text("\n".join(lines) + "\n")
    return str(folder / name)


def test_the_classes_of_a_label_file_are_its_labels_sorted_whatever_their_order(tmp_path):
    """data.md: "The classes are the labels of the training list, sorted." The list names zebra
    first and apple last: the labels are still 0 apple, 1 mango, 2 zebra."""
    rows = [(f"{name}{i}.jpg", name) for name in ("zebra", "mango", "apple") for i in range(2)]
    split = read_label_files(write_label_file(tmp_path, rows), val_rate=0.5, seed=0)
    assert split.classes == ["apple", "mango", "zebra"]
    labelled = dict(zip(split.train_images_path, split.train_images_label))
    labelled.update(zip(split.val_images_path, split.val_images_label))
    assert {os.path.basename(path): label for path, label in labelled.items()} == {
        "apple0.jpg": 0, "apple1.jpg": 0, "mango0.jpg": 1, "mango1.jpg": 1, "zebra0.jpg": 2, "zebra1.jpg": 2}


# --- example_data.extract_dataset (--download) ---------------------------------------------------------

def class_archive(tmp_path, counts):
    """A .tgz of one top folder flower_photos/ with ``counts`` ({class: images}) empty JPEGs."""
    top = tmp_path / "src" / "flower_photos"
    for name, count in counts.items():
        (top / name).mkdir(parents=True)
        for i in range(count):
            (top / name / f"{i}.jpg").write_bytes(b"")
    archive = tmp_path / "flower_photos.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(top, arcname="flower_photos")
    (tmp_path / "data").mkdir()
    return str(archive), str(tmp_path / "data" / "flower_photos")


@pytest.mark.parametrize("found", [2, 4])
def test_the_download_is_refused_unless_each_class_has_exactly_its_images(tmp_path, found):
    """data.md: --download "checks the images per class (daisy 633, ...), and only then renames
    the extracted folder": one image fewer or one more than recorded is refused, nothing kept."""
    archive, root = class_archive(tmp_path, {"daisy": 3, "roses": found})
    with pytest.raises(UserError, match=f"^--download: roses has {found} images, expected 3; try again$"):
        extract_dataset(archive, root, {"daisy": 3, "roses": 3})
    assert os.listdir(tmp_path / "data") == []


def test_the_download_with_the_recorded_counts_becomes_the_data_folder(tmp_path):
    archive, root = class_archive(tmp_path, {"daisy": 3, "roses": 3})
    extract_dataset(archive, root, {"daisy": 3, "roses": 3})
    assert sorted(os.listdir(root)) == ["daisy", "roses"] and len(os.listdir(os.path.join(root, "roses"))) == 3


def test_download_does_nothing_when_the_data_folder_is_there(tmp_path, monkeypatch):
    """data.md: "When the folder is there it does nothing": nothing fetched, nothing written beside it."""
    from multi_train_utils import datasets as example_data

    fetched = []  # what a download would do, recorded instead
    for step in ("_fetch", "check_archive", "extract_dataset"):
        monkeypatch.setattr(example_data, step, lambda *args, step=step: fetched.append(step))
    root = tmp_path / "flower_photos"
    (root / "daisy").mkdir(parents=True)
    assert example_data.download_flower_photos(str(root)) == str(root)
    assert fetched == [] and os.listdir(tmp_path) == ["flower_photos"]


# --- inputs.check_datasets (your own dataset's contract) ----------------------------------------------

@pytest.mark.parametrize("targets, low, high", [([-1, 0, 1], -1, 1), ([0, 1, 2], 0, 2)])
def test_own_dataset_labels_below_0_or_from_the_class_count_on_are_refused(targets, low, high):
    """my_dataset.py's contract (README: "label an int"; data.md: "checked against its contract"):
    labels in range(len(classes)); -1 is refused as 2 is, with one line saying the range."""
    from multi_train_utils.run_files import check_datasets
    from multi_train_utils.datasets import Datasets

    good = Labelled([0, 1, 1], readable=True)
    with pytest.raises(UserError, match=f"the validation dataset: labels run from {low} to {high}, but there are 2 "
                                        r"classes \(labels 0 to 1\)$"):
        check_datasets(Datasets(good, Labelled(targets, readable=True), ["a", "b"]))
    check_datasets(Datasets(good, Labelled([1, 0, 1], readable=True), ["a", "b"]))  # 0 and 1 both fit


# --- model.freeze_all_but_head (--freeze-layers) --------------------------------------------------

def test_freeze_layers_trains_the_head_alone_not_a_layer_whose_name_starts_like_it():
    """data.md: "--freeze-layers then trains only the head" (the child called exactly fc, classifier,
    heads or head): a layer fc_hidden before the head fc stays frozen."""
    from torch import nn

    from multi_train_utils.model_setup import freeze_all_but_head

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Linear(4, 8)
            self.fc_hidden = nn.Linear(8, 8)
            self.fc = nn.Linear(8, 2)

    net = Net()
    assert freeze_all_but_head(net) == "fc"
    assert [name for name, p in net.named_parameters() if p.requires_grad] == ["fc.weight", "fc.bias"]
