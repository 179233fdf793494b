"""Test helper: run a training script with my_dataset.build_datasets replaced by the README's
"Make it yours" example: torchvision ImageFolder datasets of --data-path/train and
--data-path/val (the validation images as float tensors in [0, 1], the training images uint8).

    python tests/helpers/own_dataset.py single|multi [script flags...]
"""
import importlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from torchvision.datasets import ImageFolder  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

from multi_train_utils.errors import run_cli  # noqa: E402
from my_dataset import augment_settings  # noqa: E402
from multi_train_utils.datasets import Datasets
from multi_train_utils.images import build_transforms  # noqa: E402


def build_datasets(args):
    """ImageFolder datasets, as a user who copies the template writes them."""
    train_tf, val_tf = build_transforms(args.img_size, **augment_settings(args))  # on uint8 tensors
    train = ImageFolder(os.path.join(args.data_path, "train"), transform=v2.Compose([v2.ToImage(), train_tf]))
    val = ImageFolder(os.path.join(args.data_path, "val"),
                      transform=v2.Compose([v2.ToImage(), val_tf, v2.ToDtype(torch.float32, scale=True)]))
    return Datasets(train, val, train.classes)


target = importlib.import_module({"single": "train_single", "multi": "train_multi_gpu"}[sys.argv[1]])
target.build_datasets = build_datasets
run_cli(target.main, sys.argv[2:])
