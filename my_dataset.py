"""The datasets to train on: ``build_datasets`` is the function to edit for your data.

What both training scripts need from a dataset (the contract):

- a map-style ``torch.utils.data.Dataset``: ``len(dataset)`` and ``dataset[i]``;
- ``dataset[i]`` is ``(image, label)``: ``image`` a CHW tensor of ``Datasets.channels``
  channels (3 unless you say), either uint8 (0-255) or float in [0, 1], of the same size for
  every item (the transforms crop to --img-size), and ``label`` an int in
  ``range(len(classes))`` (--multi-label: a float tensor of one 0/1 entry per class). Do not
  normalise: the loop normalises on the device with
  ``Datasets.mean`` and ``std`` (ImageNet's unless you say; ``None``: the images are used as
  they come, floats of any range, uint8 scaled to [0, 1]). predict.py and the export do the same;
- optional, ``dataset.targets``: the label of every item, in order (torchvision's
  ``ImageFolder`` has it; multi-label: an images x classes array). The start summary's
  images per class and class_distribution.png use it; without it they show the totals only.

Exact resume: the training loader asks each dataset item as ``(epoch, index)``, and
``SeededSamples`` seeds torch's CPU generator and Python's ``random`` from (--seed, epoch,
index) just for that item. Random transforms that draw from them (all of torchvision's do)
then repeat exactly on a rerun or a resume, whichever loader worker or rank loads the item.
NumPy's global generator is not seeded: a dataset that wants exact resume draws from torch
or ``random`` instead.
"""
from multi_train_utils.datasets import Datasets, MyDataSet, image_file_datasets  # noqa: F401 (the tutorial's MyDataSet)
from multi_train_utils.datasets import listed_once
from multi_train_utils.images import build_transforms  # noqa: F401 (for datasets of your own, as below)
from multi_train_utils.options import task_of
from utils import read_label_files, read_split_data


def build_datasets(args):
    """The training and validation datasets and the class names. Edit this for your own data.

    Built in: the class folders of --data-path (split by --val-rate, or --val-path for the
    validation images), or the CSV label files --train-list / --val-list (with --multi-label,
    several classes a row); as ``MyDataSet``
    with the transforms of ``multi_train_utils.images``. Any datasets that keep the contract
    at the top of this file work in their place, for example torchvision's ImageFolder on
    folders data/train and data/val (each with one sub-folder per class)::

        from torchvision.datasets import ImageFolder
        from torchvision.transforms import v2

        train_tf, val_tf = build_transforms(args.img_size, **augment_settings(args))  # on uint8 tensors
        train = ImageFolder("data/train", transform=v2.Compose([v2.ToImage(), train_tf]))
        val = ImageFolder("data/val", transform=v2.Compose([v2.ToImage(), val_tf]))
        return Datasets(train, val, train.classes)  # val.classes must be the same

    Images of other than 3 channels say so, with their mean and std per channel, for example
    gray X-rays: ``image_file_datasets(split, args.img_size, augment_settings(args), channels=1,
    mean=(0.5,), std=(0.25,))`` (image files are read as gray: 1, RGB: 3 or RGBA: 4 channels).

    Errors a user can fix (a missing folder, a bad file) should be ``UserError``s: one line.
    """
    check = args.check_images  # open every image first (slow on large data)
    if args.train_list:
        rows = task_of(args).several_labels  # path,labels: several classes a row (--multi-label, or a task's)
        split = listed_once(lambda: read_label_files(args.train_list, args.val_list, args.val_rate, args.seed, check,
                                                     multi_label=rows))
    else:
        split = listed_once(lambda: read_split_data(args.data_path, args.val_rate, args.seed, args.val_path, check))
    return image_file_datasets(split, args.img_size, augment_settings(args))


def augment_settings(args):
    """build_transforms' keyword arguments from the flags: the training augmentation
    (--hflip, --auto-augment, --random-erase) and the validation resize (--val-resize-size)."""
    return {"hflip": args.hflip, "auto_augment": args.auto_augment, "random_erase": args.random_erase,
            "val_resize_size": args.val_resize_size}
