"""Images of 1, 3 or 4 channels, read and augmented as the data says (docs/data.md, "Images
other than RGB"): gray and RGBA files, transparency, random erasing's fill, the preview."""
import pytest
import torch
from PIL import Image


def write(path, mode, colour, alpha=None, size=(6, 4)):
    image = Image.new(mode, size, colour)
    if alpha is not None:
        image.putalpha(alpha)
    image.save(path)
    return str(path)


@pytest.mark.parametrize("mode, colour", [("RGBA", (200, 100, 50)), ("LA", (80,))])
def test_a_transparent_image_read_for_gray_data_is_gray_on_white(tmp_path, mode, colour):
    from multi_train_utils.images import read_image_uint8

    path = write(tmp_path / f"{mode}.png", mode, colour, alpha=0)  # wholly transparent: white shows
    gray = read_image_uint8(path, channels=1)
    assert gray.shape == (1, 4, 6) and gray.dtype == torch.uint8
    assert int(gray.min()) == int(gray.max()) == 255
    opaque = read_image_uint8(write(tmp_path / f"o{mode}.png", mode, colour, alpha=255), channels=1)
    expected = round(0.299 * 200 + 0.587 * 100 + 0.114 * 50) if mode == "RGBA" else 80  # ITU-R 601-2 luma
    assert opaque.shape == (1, 4, 6) and abs(int(opaque[0, 0, 0]) - expected) <= 1
    four = read_image_uint8(write(tmp_path / f"h{mode}.png", mode, colour, alpha=90), channels=4)
    assert four.shape == (4, 4, 6) and int(four[3, 0, 0]) == 90  # RGBA keeps the alpha channel as it is


def test_random_erasing_fills_with_the_datas_own_mean(tmp_path):
    from torchvision.transforms import v2

    from multi_train_utils.datasets import image_file_datasets

    split = type("Split", (), dict(train_images_path=["a.png"], train_images_label=[0], val_images_path=["b.png"],
                                    val_images_label=[1], classes=["a", "b"], skipped=[], skip_reasons={}, notes=[]))
    for channels, mean, fill in ((1, (0.2,), [51]), (4, (0.1, 0.2, 0.3, 1.0), [26, 51, 76, 255]),
                                 (3, (0.485, 0.456, 0.406), [124, 116, 104]), (1, None, [0.0])):
        std = None if mean is None else (0.5,) * channels
        data = image_file_datasets(split, 16, {"random_erase": 1.0}, channels=channels, mean=mean, std=std)
        erasing = [t for t in data.train.transform.transforms if isinstance(t, v2.RandomErasing)]
        assert len(erasing) == 1 and erasing[0].value == fill, (channels, mean, erasing)
        image = torch.full((channels, 16, 16), 7, dtype=torch.uint8)
        erased = erasing[0](image)
        if mean is not None:  # where it erased, each channel holds its own mean in 0-255
            changed = (erased != image).any(dim=0)
            assert changed.any()
            assert [int(erased[c][changed].unique()[0]) for c in range(channels)] == fill


def test_the_preview_shows_rgb_as_it_is_the_first_three_of_four_bands_and_gray_as_gray():
    from multi_train_utils.pictures import displayable

    rgb = torch.tensor([[[255]], [[0]], [[51]]], dtype=torch.uint8)
    assert displayable(rgb).shape == (1, 1, 3) and displayable(rgb)[0, 0].tolist() == pytest.approx([1.0, 0.0, 0.2])
    four = torch.cat([rgb, torch.tensor([[[9]]], dtype=torch.uint8)])
    assert displayable(four)[0, 0].tolist() == pytest.approx([1.0, 0.0, 0.2])
    gray = torch.tensor([[[0, 102]]], dtype=torch.uint8)
    assert displayable(gray).shape == (1, 2) and displayable(gray).flatten().tolist() == pytest.approx([0.0, 0.4])
    raw = torch.tensor([[[-2.0, 0.0, 6.0]]])  # floats used as they come: stretched from lowest to highest
    assert displayable(raw).flatten().tolist() == pytest.approx([0.0, 0.25, 1.0])


@pytest.mark.parametrize("std, ok", [((0.0,), False), ((-0.1,), False), ((1e-6,), True)])
def test_a_std_of_zero_or_less_is_refused_at_the_start(std, ok):
    from multi_train_utils.datasets import Datasets
    from multi_train_utils.errors import UserError
    from multi_train_utils.run_files import check_datasets

    gray = [(torch.zeros(1, 8, 8, dtype=torch.uint8), 0), (torch.zeros(1, 8, 8, dtype=torch.uint8), 1)]
    data = Datasets(gray, gray, ["a", "b"], channels=1, mean=(0.5,), std=std)
    if ok:
        check_datasets(data)
        return
    with pytest.raises(UserError) as caught:
        check_datasets(data)
    assert str(caught.value) == f"my_dataset.build_datasets: Datasets.std is {list(std)}: every value must be positive"


def test_image_files_of_two_channels_are_refused_in_one_line_naming_the_count():
    from multi_train_utils.datasets import image_file_datasets
    from multi_train_utils.errors import UserError

    split = type("Split", (), dict(train_images_path=["a.png"], train_images_label=[0], val_images_path=["b.png"],
                                    val_images_label=[1], classes=["a", "b"], skipped=[], skip_reasons={}, notes=[]))
    with pytest.raises(UserError) as caught:
        image_file_datasets(split, 16, channels=2, mean=(0.5, 0.5), std=(0.2, 0.2))
    assert str(caught.value) == ("image_file_datasets(channels=2): image files are read as 1 (gray), 3 (RGB) or 4 "
                                 "(RGBA) channels; for 2, give build_datasets a dataset of your own")
    assert image_file_datasets(split, 16, channels=4, mean=(0.5,) * 4, std=(0.2,) * 4).channels == 4
