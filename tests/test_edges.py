"""Edges the docs state as counts: ten unreadable training images in a row stop the run (nine
do not), the next image takes a bad one's place, the first after the last; a bad validation
image is left out, first and last alike; up to 5 classes without validation images get a note
each, 6 or more one line. Made-up files, in-process."""
import os

import pytest
from PIL import Image

from multi_train_utils.errors import MidRunError
from multi_train_utils.datasets import LEFT_OUT, MyDataSet


def files(tmp_path, pattern):
    """One file per letter of ``pattern``: g a readable 4x4 image, b a broken one; labels 0, 1, 2 ..."""
    paths = []
    for i, kind in enumerate(pattern):
        path = tmp_path / f"{i:02d}.png"
        if kind == "g":
            Image.new("RGB", (4, 4), (i, 0, 0)).save(path)
        else:
            path.write_bytes(b"broken")
        paths.append(str(path))
    return paths, list(range(len(pattern)))


def test_nine_unreadable_images_in_a_row_are_replaced_by_the_tenth(tmp_path):
    dataset = MyDataSet(*files(tmp_path, "b" * 9 + "g"), if_unreadable="replace")
    image, label = dataset[0]
    assert label == 9 and int(image[0, 0, 0]) == 9


def test_ten_unreadable_images_in_a_row_stop_the_run(tmp_path):
    dataset = MyDataSet(*files(tmp_path, "b" * 10 + "g"), if_unreadable="replace")
    with pytest.raises(MidRunError, match=r"^10 images in a row cannot be read, from .*00\.png"):
        dataset[0]
    assert dataset[1][1] == 10  # from the second on, the tenth try is the readable one


def test_the_last_images_place_is_taken_by_the_first(tmp_path):
    dataset = MyDataSet(*files(tmp_path, "gggb"), if_unreadable="replace")
    assert dataset[3][1] == 0


def test_a_set_smaller_than_ten_stops_after_trying_each_once(tmp_path):
    dataset = MyDataSet(*files(tmp_path, "bbb"), if_unreadable="replace")
    with pytest.raises(MidRunError, match=r"^3 images in a row cannot be read"):
        dataset[2]


def test_bad_validation_images_are_left_out_first_and_last_alike(tmp_path):
    dataset = MyDataSet(*files(tmp_path, "bgb"), transform=None, if_unreadable="leave out")
    assert [dataset[i][1] for i in range(3)] == [LEFT_OUT, 1, LEFT_OUT]


@pytest.mark.parametrize("missing, notes", [(5, 5), (6, 1)])
def test_up_to_five_classes_without_validation_images_get_a_note_each(tmp_path, missing, notes):
    from utils import read_split_data

    classes = [f"c{i}" for i in range(8)]
    for i, name in enumerate(classes):
        os.makedirs(tmp_path / name)
        for j in range(1 if i < missing else 5):  # 1 image: round(1 x 0.2) = 0 to validation
            (tmp_path / name / f"{j}.jpg").write_bytes(b"")
    split = read_split_data(str(tmp_path), val_rate=0.2)
    assert len(split.notes) == notes
    if notes == 1:
        assert split.notes[0].startswith("6 classes get no validation image ('c0', 'c1', 'c2', ...)")
    else:
        assert [n.split("'")[1] for n in split.notes] == classes[:5]  # the first and the last of them


@pytest.mark.parametrize("steps, counted", [(1, 4), (2, 8), (3, 4), (5, 12)])
def test_images_per_second_leave_out_two_warm_up_steps_only_in_longer_epochs(steps, counted):
    """Batches of 4: an epoch of 2 steps or fewer counts all its images, a longer one all but the
    first 2 steps' (8)."""
    import torch

    from multi_train_utils.train_eval_utils import EpochClock

    clock = EpochClock(torch.device("cpu"), images_per_step=4, steps=steps)
    for step in range(steps):
        clock.step_done(step)
    stats = clock.stats(1.0, 0.1)
    assert stats.images == 4 * steps
    assert stats.images - clock.warm_images == counted and stats.images_per_second > 0


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_training_bar_counts_the_whole_jobs_images_to_its_end(monkeypatch, world_size):
    """Each rank's bar stands for the job: it counts every rank's images and ends at its total."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from multi_train_utils import train_eval_utils
    from multi_train_utils.checkpoint import TrainState

    bars = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, n):
            self.n += n

        def set_postfix(self, **kwargs):
            pass

        def close(self):
            pass

    monkeypatch.setattr(train_eval_utils, "tqdm", Bar)
    monkeypatch.setattr(train_eval_utils, "get_world_size", lambda: world_size)
    images = [(torch.zeros(3, 4, 4, dtype=torch.uint8), 0)] * 12
    loader = DataLoader(images, batch_size=4)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 2))
    train_eval_utils.train_one_epoch(TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)), loader,
                                     torch.device("cpu"), 0)
    assert [(bar.total, bar.n) for bar in bars] == [(12 * world_size, 12 * world_size)]


@pytest.mark.parametrize("val_resize_size, val_side", [(None, 37), (48, 48)])
def test_large_validation_jpegs_keep_the_resize_size_and_training_ones_twice_the_crop(val_resize_size, val_side):
    from multi_train_utils.datasets import image_file_datasets
    from multi_train_utils.datasets import DataSplit

    split = DataSplit(train_images_path=["a.jpg"], train_images_label=[0], val_images_path=["b.jpg"],
                      val_images_label=[0], classes=["x"], skipped=[], skip_reasons={}, notes=[])
    data = image_file_datasets(split, 32, {"val_resize_size": val_resize_size})
    assert (data.train.keep_side, data.val.keep_side) == (64, val_side)  # round(32 x 256 / 224) = 37


@pytest.mark.parametrize("first_bad, stops", [(-1, False), (0, True), (1, True), (7, True)])
def test_a_non_finite_loss_at_any_step_the_first_included_stops_the_epoch(first_bad, stops):
    """LossDisplay: -1 means no non-finite loss yet; step 0 is the first step, not 'none'."""
    import torch

    from multi_train_utils.train_eval_utils import LossDisplay, NonFiniteLossError

    display = LossDisplay(epoch=3)
    loss_sum = torch.tensor(float("nan") if stops else 6.0, dtype=torch.float64)
    if stops:
        with pytest.raises(NonFiniteLossError) as raised:
            display.update(loss_sum, 8, torch.tensor(first_bad))
        assert str(raised.value).startswith(f"training loss became nan at epoch 3, step {first_bad}; lower --lr")
    else:
        display.update(loss_sum, 8, torch.tensor(first_bad))
        assert display.mean_loss == 0.75
