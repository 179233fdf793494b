"""Edges the docs state as counts: ten unreadable training images in a row stop the run (nine
do not), the next image takes a bad one's place, the first after the last; a bad validation
image is left out, first and last alike; up to 5 classes without validation images get a note
each, 6 or more one line. Made-up files, in-process."""
import os

import pytest
from PIL import Image

from multi_train_utils.errors import MidRunError
from my_dataset import LEFT_OUT, MyDataSet


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
