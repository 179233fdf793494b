"""Your files are yours: the engine never imports model.py, my_dataset.py or utils.py, a copy
of the project whose model.py and my_dataset.py are replaced by minimal files of its own
trains, resumes, evaluates, predicts and exports, and data of 1 or 4 channels goes the whole
way (both scripts, predict.py on the .pth and on the .pt2, export.py).

Each kind of data is one copy of the project and three launches: torchrun (2 processes, gloo)
trains epoch 0, train_single.py resumes it (--resume auto) for epoch 1, and one Python process
runs --eval-only, predict.py, export.py and predict.py on the .pt2 in turn."""
import ast
import csv
import json
import os
import shutil
import sys

import pytest
import torch
from PIL import Image

from conftest import REPO, free_port
from conftest import run as run_script

USER_FILES = ("model.py", "my_dataset.py", "utils.py")
# What the entry programs take from the user's files: the user's functions, handed to the engine.
USER_FUNCTIONS = {"model": {"create_model", "create_loss", "create_optimizer", "create_lr_scheduler"},
                  "my_dataset": {"build_datasets"}, "utils": set()}
TIMEOUT = 600

# The minimal files the issue describes: the four functions and build_datasets, a tiny CNN and
# torchvision's ImageFolder (gray images: one channel, used as they come: mean and std None, so that
# --eval-only, predict.py and export.py read that back too; the 4-channel run has its own mean and std).
MINIMAL_MODEL = '''import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def create_model(name, num_classes, channels):
    return nn.Sequential(nn.Conv2d(channels, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, num_classes))


def create_loss(args, class_weights=None):
    return nn.CrossEntropyLoss(weight=class_weights)


def create_optimizer(model, args):
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def create_lr_scheduler(optimizer, args, batches_per_epoch, start_epoch=0):
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return LambdaLR(optimizer, lambda step: 0.5 ** (step // batches_per_epoch), last_epoch=start_epoch * batches_per_epoch - 1)
'''
MINIMAL_DATASET = '''from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from multi_train_utils.datasets import Datasets


def build_datasets(args):
    transform = v2.Compose([v2.Grayscale(), v2.PILToTensor(), v2.Resize(args.img_size), v2.CenterCrop(args.img_size)])
    train = ImageFolder(args.data_path + "/train", transform=transform)
    val = ImageFolder(args.data_path + "/val", transform=transform)
    return Datasets(train, val, train.classes, channels=1, mean=None, std=None)  # used as they come
'''
# Our own my_dataset.py, its built-in datasets read as RGBA: 4 channels, each with its mean and std.
FOUR_CHANNELS = ("return image_file_datasets(split, args.img_size, augment_settings(args))",
                 "return image_file_datasets(split, args.img_size, augment_settings(args), channels=4,\n"
                 "                               mean=(0.5, 0.5, 0.5, 0.4), std=(0.25, 0.25, 0.25, 0.3))")

DRIVER = '''import sys
import export, predict, train_single
from multi_train_utils.errors import run_cli
out, val, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
for main, argv in ((train_single.main, ["--eval-only", "--weights", out + "/model-1.pth", *flags]),
                   (predict.main, ["--weights", out + "/model-best.pth", "--image", val, "--output", out + "/pth.csv"]),
                   (export.main, ["--weights", out + "/model-best.pth"]),
                   (predict.main, ["--weights", out + "/model-best.pt2", "--image", val, "--output", out + "/pt2.csv"])):
    print("=== " + main.__module__, flush=True)
    try:
        run_cli(main, argv)
    except SystemExit as e:
        if e.code:
            raise
'''


def project_copy(root):
    """The project's files (without tests/, data, runs and weights files) in ``root``."""
    ignore = shutil.ignore_patterns("tests", ".git", "__pycache__", "data", "runs", "*.pth", "*.pt2", ".venv")
    shutil.copytree(REPO, root, ignore=ignore, dirs_exist_ok=True)
    return root


def write_images(root, mode):
    """ImageFolder's layout, train/ and val/ of two classes: "dark" and "light" images of
    ``mode`` (L or RGBA; in RGBA the classes differ in the alpha channel alone)."""
    generator = torch.Generator().manual_seed(3)
    for split, count in (("train", 8), ("val", 3)):
        for label, name in enumerate(("dark", "light")):
            folder = os.path.join(root, split, name)
            os.makedirs(folder)
            for i in range(count):
                noise = torch.randint(0, 60, (40, 40), generator=generator, dtype=torch.uint8)
                level = (noise + 40 + 150 * label).to(torch.uint8).numpy()
                if mode == "L":
                    Image.fromarray(level, "L").save(os.path.join(folder, f"{i}.png"))
                else:
                    rgb = torch.randint(0, 256, (40, 40, 3), generator=generator, dtype=torch.uint8).numpy()
                    rgba = Image.fromarray(rgb, "RGB").convert("RGBA")
                    rgba.putalpha(Image.fromarray(level, "L"))
                    rgba.save(os.path.join(folder, f"{i}.png"))


def run(cmd, cwd, timeout=TIMEOUT):
    """The finished process (the tests check its exit code: a failure is theirs, not the fixture's),
    forked from the prestarted Python in the copy's folder (whose files it imports, as a new
    interpreter there would)."""
    return run_script(cmd, timeout=timeout, cwd=cwd)


def train_everything(tmp_path_factory, name, replace):
    """One copy of the project with ``replace(copy)`` applied, its data, and the outputs of the
    three launches (see the module's docstring)."""
    root = project_copy(str(tmp_path_factory.mktemp(name)))
    replace(root)
    data = os.path.join(root, "images")
    write_images(data, "L" if name == "gray" else "RGBA")
    out = os.path.join(root, "out")
    if name == "gray":
        flags = ["--data-path", data, "--model", "tiny"]
        predict_on = os.path.join(data, "val")
    else:
        flags = ["--data-path", os.path.join(data, "train"), "--val-path", os.path.join(data, "val"), "--model",
                 "resnet18"]
        predict_on = os.path.join(data, "val")
    flags += ["--img-size", "32", "--batch-size", "4", "--workers", "0", "--amp", "off", "--lr", "0.05",
              "--output-dir", out, "--log-dir", os.path.join(root, "tb")]
    first = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                 "train_multi_gpu.py", *flags, "--epochs", "1"], root)
    resumed = run([sys.executable, "train_single.py", *flags, "--epochs", "2", "--resume", "auto"], root)
    with open(os.path.join(root, "driver.py"), "w") as f:
        f.write(DRIVER)
    rest = run([sys.executable, "driver.py", out, predict_on, "--data-path", flags[1]] +
               (flags[2:4] if name != "gray" else []), root)
    return {"root": root, "out": out, "first": first, "resumed": resumed, "rest": rest, "data": data}


@pytest.fixture(scope="module")
def gray(tmp_path_factory):
    def replace(root):
        with open(os.path.join(root, "model.py"), "w") as f:
            f.write(MINIMAL_MODEL)
        with open(os.path.join(root, "my_dataset.py"), "w") as f:
            f.write(MINIMAL_DATASET)
    return train_everything(tmp_path_factory, "gray", replace)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    def replace(root):
        path = os.path.join(root, "my_dataset.py")
        with open(path) as f:
            text = f.read()
        assert FOUR_CHANNELS[0] in text
        with open(path, "w") as f:
            f.write(text.replace(*FOUR_CHANNELS))
    return train_everything(tmp_path_factory, "four", replace)


def imported_modules(path):
    """{module: names imported from it} of a Python file, at any depth of its code."""
    found = {}
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name, set()).add("*module*")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.setdefault(node.module, set()).update(alias.name for alias in node.names)
    return found


def test_the_engine_and_tools_never_import_your_files_and_the_programs_take_only_your_functions():
    engine = [os.path.join(d, f) for d in ("multi_train_utils", "tools") for f in os.listdir(os.path.join(REPO, d))
              if f.endswith(".py")]
    for path in engine:
        imported = imported_modules(os.path.join(REPO, path))
        assert not set(imported) & {"model", "my_dataset", "utils"}, (path, imported)
    for program in ("train_single.py", "train_multi_gpu.py", "predict.py", "export.py", "benchmark.py"):
        imported = imported_modules(os.path.join(REPO, program))
        for user_file, allowed in USER_FUNCTIONS.items():
            assert imported.get(user_file, set()) <= allowed, (program, user_file, imported.get(user_file))
    # benchmark.py's scripts for child processes are code too
    assert "from utils" not in open(os.path.join(REPO, "benchmark.py")).read()


def test_your_two_files_are_short_and_hold_the_functions_you_edit():
    lines = {name: len(open(os.path.join(REPO, name)).read().splitlines()) for name in USER_FILES}
    assert lines["model.py"] + lines["my_dataset.py"] <= 250, lines
    model_functions = {node.name for node in ast.parse(open(os.path.join(REPO, "model.py")).read()).body
                       if isinstance(node, ast.FunctionDef)}
    assert USER_FUNCTIONS["model"] <= model_functions
    utils_functions = {node.name for node in ast.parse(open(os.path.join(REPO, "utils.py")).read()).body
                       if isinstance(node, ast.FunctionDef)}
    assert utils_functions == {"read_split_data", "read_label_files"}  # the tutorial's names, and only them


def read_csv(path):
    with open(path) as f:
        return list(csv.reader(f))


def check_whole_way(run, channels):
    """What both kinds of data must show after the three launches."""
    for step in ("first", "resumed", "rest"):
        result = run[step]
        assert result.returncode == 0, f"{step}: {result.args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        run = dict(run, **{step: result.stdout})
    out = run["out"]
    with open(os.path.join(out, "args.json")) as f:
        images = json.load(f)["images"]
    assert images["channels"] == channels
    with open(os.path.join(out, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [row["epoch"] for row in rows] == ["0", "1"]  # epoch 0 by torchrun, epoch 1 after the resume
    assert "resuming from" in run["resumed"] and "(epoch 0 done): epochs 1 to 1" in run["resumed"]
    # --eval-only on model-1.pth gives the val accuracy that metrics.csv holds for epoch 1
    eval_line = [line for line in run["rest"].splitlines() if line.startswith("val accuracy:") or
                 "accuracy" in line and "/" in line][0]
    assert f"{float(rows[1]['val_accuracy']):.4f}" in eval_line, (eval_line, rows[1])
    assert f"input (N, {channels}, 32, 32)" in run["rest"]
    pth, pt2 = read_csv(os.path.join(out, "pth.csv")), read_csv(os.path.join(out, "pt2.csv"))
    assert pth[0] == ["path", "prediction", "probability", "dark", "light"] == pt2[0]
    assert len(pth) == 1 + 6 and [row[0] for row in pth] == [row[0] for row in pt2]  # the 6 val images
    for a, b in zip(pth[1:], pt2[1:]):
        assert abs(float(a[3]) + float(a[4]) - 1) < 1e-5
        assert all(abs(float(x) - float(y)) < 1e-5 for x, y in zip(a[2:], b[2:])), (a, b)


def test_minimal_files_of_your_own_train_resume_evaluate_predict_and_export_with_gray_images(gray):
    check_whole_way(gray, channels=1)
    with open(os.path.join(gray["out"], "args.json")) as f:
        assert json.load(f)["images"] == {"channels": 1, "mean": None, "std": None}
    # the tiny CNN of the minimal model.py, not a torchvision model, is what was trained
    weights = torch.load(os.path.join(gray["out"], "model-1.pth"), weights_only=True)
    assert sorted(weights) == ["0.bias", "0.weight", "4.bias", "4.weight"] and weights["0.weight"].shape == (8, 1, 3, 3)


def test_four_channel_images_go_the_whole_way_through_our_files(four):
    check_whole_way(four, channels=4)
    assert "per process; images decoded by PIL\n" in four["resumed"].stdout  # RGBA files: PIL's mode, not TorchCodec
    weights = torch.load(os.path.join(four["out"], "model-1.pth"), weights_only=True)
    assert weights["conv1.weight"].shape[1] == 4  # resnet18's first convolution takes the 4 bands
    with open(os.path.join(four["out"], "args.json")) as f:
        assert json.load(f)["images"]["std"] == [0.25, 0.25, 0.25, 0.3]


def test_a_wrong_channel_count_is_one_line_naming_both_numbers():
    from multi_train_utils.datasets import Datasets
    from multi_train_utils.errors import UserError
    from multi_train_utils.run_files import check_datasets

    gray = [(torch.zeros(1, 8, 8, dtype=torch.uint8), 0), (torch.zeros(1, 8, 8, dtype=torch.uint8), 1)]
    with pytest.raises(UserError) as caught:
        check_datasets(Datasets(gray, gray, ["a", "b"]))  # 3 channels by default
    assert str(caught.value).startswith("my_dataset.build_datasets: the training dataset's first image has 1 "
                                        "channel, the data says 3 (Datasets.channels)")
    with pytest.raises(UserError) as caught:
        check_datasets(Datasets(gray, gray, ["a", "b"], channels=1))  # ImageNet's mean: 3 values
    assert str(caught.value) == ("my_dataset.build_datasets: Datasets.mean has 3 values, the images have 1 "
                                 "channel: give one value per channel")
    check_datasets(Datasets(gray, gray, ["a", "b"], channels=1, mean=(0.5,), std=(0.2,)))
    check_datasets(Datasets(gray, gray, ["a", "b"], channels=1, mean=None, std=None))


def test_the_normaliser_uses_the_datas_mean_and_std_and_none_leaves_the_values():
    from multi_train_utils.images import DeviceNormalizer

    images = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 1, 1, 3)
    normalised = DeviceNormalizer(torch.device("cpu"), mean=(0.2,), std=(0.5,)).normalize(images)
    assert torch.allclose(normalised.flatten(), torch.tensor([-0.4, 0.0, 1.6]), atol=1e-6)
    floats = torch.tensor([-3.0, 0.5, 700.0]).view(1, 1, 1, 3)
    assert torch.equal(DeviceNormalizer(torch.device("cpu"), mean=None, std=None).normalize(floats), floats)
    assert torch.allclose(DeviceNormalizer(torch.device("cpu"), mean=None, std=None).normalize(images).flatten(),
                          torch.tensor([0.0, 0.2, 1.0]), atol=1e-6)
