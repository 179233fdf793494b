"""Every image mode the docs name (grayscale, palette, RGBA put on white, CMYK, 16-bit ...) in
every file format that holds it, through every decoder (TorchCodec where installed, and PIL,
its fallback) and every way in: the loader of training and validation, predict.py's, and a
large JPEG decoded at reduced size. Each pixel's expected RGB value is worked out by hand from
the mode's definition, not by the code under test."""
import os

import pytest
import torch
from PIL import Image

from conftest import torchcodec_decodes
from multi_train_utils import images

WHITE = (255, 255, 255)


def two_pixel_files(tmp_path):
    """{name: (path, [expected RGB of the left pixel, of the right pixel])}: 2x1 images whose
    right pixel is, where the mode has transparency, fully transparent over a hidden colour."""
    files = {}

    def save(name, img, expected, **kwargs):
        path = tmp_path / name
        img.save(path, **kwargs)
        files[name] = (str(path), expected)

    def pixels(mode, values):
        img = Image.new(mode, (2, 1))
        img.putdata(values)
        return img

    save("gray.png", pixels("L", [77, 200]), [(77,) * 3, (200,) * 3])
    save("bilevel.png", pixels("1", [0, 255]), [(0,) * 3, (255,) * 3])
    save("gray_alpha.png", pixels("LA", [(77, 255), (30, 0)]), [(77,) * 3, WHITE])
    save("rgb.png", pixels("RGB", [(10, 20, 30), (200, 100, 50)]), [(10, 20, 30), (200, 100, 50)])
    save("rgba.png", pixels("RGBA", [(10, 20, 30, 255), (200, 100, 50, 0)]), [(10, 20, 30), WHITE])
    save("rgba.webp", pixels("RGBA", [(10, 20, 30, 255), (200, 100, 50, 0)]), [(10, 20, 30), WHITE], lossless=True)
    palette = pixels("P", [1, 2])
    palette.putpalette([0, 0, 0, 10, 20, 30, 200, 100, 50] + [0] * (256 * 3 - 9))
    save("palette.png", palette, [(10, 20, 30), (200, 100, 50)])
    save("palette.bmp", palette, [(10, 20, 30), (200, 100, 50)])
    # palette index 2 transparent: a PNG's tRNS chunk and a GIF's transparent colour
    save("palette_transparent.png", palette, [(10, 20, 30), WHITE], transparency=2)
    save("palette_transparent.gif", palette, [(10, 20, 30), WHITE], transparency=2)
    # CMYK: (255 - C) x (255 - K) / 255 and so on; no ink is white, full K black, full C cyan
    save("cmyk.tif", pixels("CMYK", [(0, 0, 0, 0), (255, 0, 0, 0)]), [WHITE, (0, 255, 255)])
    save("cmyk_black.tif", pixels("CMYK", [(0, 0, 0, 255), (0, 255, 0, 0)]), [(0, 0, 0), (255, 0, 255)])
    # 16 bits: the top 8 (0x12 of 0x1234), whatever the byte order of the file
    save("gray16.png", pixels("I;16", [0x1234, 0xFFFF]), [(0x12,) * 3, (0xFF,) * 3])
    save("gray16_little.tif", pixels("I;16", [0x1234, 0xFFFF]), [(0x12,) * 3, (0xFF,) * 3])
    save("gray16_big.tif", pixels("I;16B", [0x1234, 0xFFFF]), [(0x12,) * 3, (0xFF,) * 3])
    save("gray32.tif", pixels("I", [0x1234, 0xFF00]), [(0x12,) * 3, (0xFF,) * 3])
    return files


DECODERS = ["TorchCodec", "PIL"]


@pytest.fixture(params=DECODERS)
def decoder(request, monkeypatch):
    if request.param == "TorchCodec" and not torchcodec_decodes():
        pytest.skip("TorchCodec is not installed: PIL decodes every JPEG (the other case)")
    if request.param == "PIL":
        monkeypatch.setattr(images, "decode_jpeg", None)
    return request.param


def test_the_files_hold_the_modes_the_docs_name(tmp_path):
    """The files above really are of those modes (a format that converted one on saving would
    make its case test something else)."""
    modes = {name: Image.open(path).mode for name, (path, _) in two_pixel_files(tmp_path).items()}
    assert modes == {"gray.png": "L", "bilevel.png": "1", "gray_alpha.png": "LA", "rgb.png": "RGB",
                     "rgba.png": "RGBA", "rgba.webp": "RGBA", "palette.png": "P", "palette.bmp": "P",
                     "palette_transparent.png": "P", "palette_transparent.gif": "P", "cmyk.tif": "CMYK",
                     "cmyk_black.tif": "CMYK", "gray16.png": "I;16", "gray16_little.tif": "I;16",
                     "gray16_big.tif": "I;16B", "gray32.tif": "I"}


def test_every_mode_becomes_its_rgb_pixels(tmp_path, decoder):
    for name, (path, expected) in two_pixel_files(tmp_path).items():
        for keep_side in (None, 1):
            tensor = images.read_image_uint8(path, keep_side)
            assert tensor.dtype == torch.uint8 and tensor.shape == (3, 1, 2), name
            got = [tuple(tensor[:, 0, x].tolist()) for x in range(2)]
            assert got == expected, (name, keep_side)


def flat_jpeg(path, mode, colour, size=(64, 48), exif_orientation=None):
    """A JPEG of one colour (JPEG keeps a flat colour to within a step or two)."""
    img = Image.new(mode, size, colour)
    kwargs = {"quality": 100}
    if exif_orientation:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kwargs["exif"] = exif.tobytes()
    img.save(path, "JPEG", **kwargs)
    return str(path)


@pytest.mark.parametrize("keep_side", [None, 8])  # 8: decoded at reduced size (1/4 of 48 is 12)
def test_jpegs_of_every_mode_become_rgb_on_every_decoder(tmp_path, decoder, keep_side):
    cases = {"gray": ("L", 77, (77,) * 3), "rgb": ("RGB", (200, 100, 50), (200, 100, 50)),
             "cmyk": ("CMYK", (0, 0, 0, 0), WHITE)}
    for name, (mode, colour, expected) in cases.items():
        path = flat_jpeg(tmp_path / f"{name}.jpg", mode, colour)
        tensor = images.read_image_uint8(path, keep_side).int()
        assert tensor.shape[0] == 3 and min(tensor.shape[1:]) >= (keep_side or 48), (name, tensor.shape)
        for channel, value in enumerate(expected):
            assert (tensor[channel] - value).abs().max() <= 3, (name, channel, tensor[channel].unique())


@pytest.mark.parametrize("keep_side", [None, 8])
def test_a_portrait_photo_is_turned_upright_on_every_decoder(tmp_path, decoder, keep_side):
    """EXIF orientation 6 (rotate 90 degrees clockwise to show): stored 64 wide and 48 high, shown
    48 wide and 64 high."""
    path = flat_jpeg(tmp_path / "portrait.jpg", "RGB", (200, 100, 50), exif_orientation=6)
    tensor = images.read_image_uint8(path, keep_side)
    height, width = tensor.shape[1:]
    assert height > width and height * 48 == width * 64, tensor.shape


def test_predict_and_the_dataset_read_every_mode_as_the_decoder_does(tmp_path):
    """The dataset of training and validation, and predict.py's loader, take the decoder's pixels
    (their transforms at the image's own size change no pixel)."""
    from multi_train_utils.datasets import MyDataSet
    from predict import ImageFiles

    files = two_pixel_files(tmp_path)
    paths = [path for path, _ in files.values()]
    keep = lambda t: t  # noqa: E731 (the identity transform)
    dataset = MyDataSet(paths, [0] * len(paths), keep)
    predicted = ImageFiles(paths, keep, None)
    for index, (name, (path, expected)) in enumerate(files.items()):
        for tensor in (dataset[index][0], predicted[index][0]):
            got = [tuple(tensor[:, 0, x].tolist()) for x in range(2)]
            assert got == expected, name


def test_check_images_skips_the_unreadable_files_of_the_training_and_the_validation_folder(tmp_path):
    """--check-images with --val-path: a broken file in either folder is skipped at the start and
    named; without it, both are kept (found by their extension) for the loader to meet."""
    from utils import read_split_data

    for split in ("train", "val"):
        for name in ("a", "b"):
            os.makedirs(tmp_path / split / name)
            for i in range(2):
                Image.new("RGB", (4, 4), (i, 0, 0)).save(tmp_path / split / name / f"{i}.png")
        (tmp_path / split / "b" / "broken.jpg").write_bytes(b"not an image")
    checked = read_split_data(str(tmp_path / "train"), val_root=str(tmp_path / "val"), check_images=True)
    assert (len(checked.train_images_path), len(checked.val_images_path)) == (4, 4)
    assert sorted(checked.skipped) == [str(tmp_path / s / "b" / "broken.jpg") for s in ("train", "val")]
    unchecked = read_split_data(str(tmp_path / "train"), val_root=str(tmp_path / "val"))
    assert (len(unchecked.train_images_path), len(unchecked.val_images_path)) == (5, 5)


@pytest.mark.parametrize("mode, fmt", [("RGBA", "png"), ("LA", "png"), ("RGBA", "webp"), ("P", "png"), ("RGB", "png")])
def test_transparent_and_opaque_images_are_turned_upright_too(tmp_path, mode, fmt):
    """EXIF orientation 6 on a 4 wide, 2 high image with a transparent left column (where the
    mode has transparency): shown 2 wide and 4 high, the transparent column on top, white."""
    colour = {"RGBA": (200, 100, 50, 255), "LA": (77, 255), "P": 1, "RGB": (200, 100, 50)}[mode]
    clear = {"RGBA": (9, 9, 9, 0), "LA": (9, 0), "P": 2, "RGB": (9, 9, 9)}[mode]
    img = Image.new(mode, (4, 2), colour)
    if mode == "P":
        img.putpalette([0, 0, 0, 200, 100, 50, 9, 9, 9] + [0] * (256 * 3 - 9))
    for y in range(2):
        img.putpixel((0, y), clear)
    exif = Image.Exif()
    exif[0x0112] = 6
    kwargs = {"exif": exif.tobytes()}
    if fmt == "webp":
        kwargs["lossless"] = True
    if mode == "P":
        kwargs["transparency"] = 2
    path = tmp_path / f"turned.{fmt}"
    img.save(path, **kwargs)
    tensor = images.read_image_uint8(str(path))
    assert tensor.shape == (3, 4, 2), tensor.shape
    top = tuple(tensor[:, 0, 0].tolist())
    assert top == ((9, 9, 9) if mode == "RGB" else WHITE), top  # the left column, turned to the top
    assert tuple(tensor[:, 3, 1].tolist()) == ((77,) * 3 if mode == "LA" else (200, 100, 50))


def test_the_tutorials_utils_build_transforms_is_the_engines():
    """utils.py re-exports build_transforms (where the tutorial's scripts import it from)."""
    import utils

    assert getattr(utils, "build_transforms", None) is images.build_transforms


@pytest.mark.parametrize("side, keep_side, decoded", [(96, 48, 48), (95, 48, 95), (192, 48, 48), (64, 8, 8)])
def test_a_jpeg_exactly_twice_the_side_kept_is_decoded_at_reduced_size(tmp_path, side, keep_side, decoded):
    """"At least twice as large as needed": 96 px for 48 is decoded at 1/2, 95 px is not."""
    path = flat_jpeg(tmp_path / "big.jpg", "RGB", (200, 100, 50), size=(side + 32, side))
    tensor = images.read_image_uint8(path, keep_side)
    assert min(tensor.shape[1:]) == decoded, tensor.shape
