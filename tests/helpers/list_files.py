"""Test helper: build the datasets as a training script does, under a launcher, and write
what each rank got.

    torchrun --nproc_per_node=2 tests/helpers/list_files.py OUT_PREFIX [training flags...]

Each rank writes OUT_PREFIX.rank{R}.json: how many class folders it listed itself, the
classes, and the paths and labels of both splits with the types that hold them.
"""
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch.distributed as dist  # noqa: E402

import my_dataset  # noqa: E402
import utils  # noqa: E402
from multi_train_utils.options import get_args_parser, parse_args  # noqa: E402

listed = []
real_scan = utils._scan_class_folders


def counting_scan(root, classes, *args, **kwargs):
    listed.append(len(classes))
    return real_scan(root, classes, *args, **kwargs)


utils._scan_class_folders = counting_scan
dist.init_process_group("gloo")
args = parse_args(get_args_parser(distributed=True), sys.argv[2:])
data = my_dataset.build_datasets(args)
record = {"rank": dist.get_rank(), "class_folders_listed": sum(listed), "classes": list(data.classes),
          "holders": [type(data.train.images_path).__name__, type(data.train.images_class).__name__]}
for name, dataset in (("train", data.train), ("val", data.val)):
    record[name] = list(dataset.images_path)
    record[name + "_labels"] = [int(y) for y in dataset.images_class]
with open(f"{sys.argv[1]}.rank{dist.get_rank()}.json", "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
