"""Predict the class of an image, or of every image in a folder, with trained weights.

    python predict.py --weights weights/model-best.pth --image my_photo.jpg
    python predict.py --weights weights/model-best.pth --image data/demo/ --output weights/predictions.csv
    python predict.py --weights weights/model-best.pt2 --image my_photo.jpg   # export.py's program

The model name and image size come from the run's args.json beside the weights, the class
names from its class_indices.json (or from --model, --img-size, --class-indices); a .pt2
from export.py carries all three and the resize inside. A multi-label run's model gives each
class a probability (sigmoid) and predicts the classes at or above their thresholds (the
run's thresholds.json, or inside the .pt2; 0.5 each without one). A file that
cannot be read is named and skipped; the rest of the folder is still predicted.
"""
import argparse
import errno
import os
import sys

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from model import create_model
from multi_train_utils.distributed_utils import configure_cpu_threads, select_device
from multi_train_utils.errors import UserError, one_line, printable, run_cli
from multi_train_utils.files import check_new_output, write_csv_atomic
from multi_train_utils.images import (DeviceNormalizer, IMG_EXTENSIONS, MODES, build_transforms, read_image_uint8,
                                      unreadable_reason)
from multi_train_utils.options import add_trained_model_flags, make_task
from multi_train_utils.run_files import (TrainedModel, is_program, load_program, load_trained_model, read_class_indices,
                                         read_val_resize_size, task_of_run, trained_model_files)


def get_args_parser():
    parser = argparse.ArgumentParser(description="Predict image classes with trained weights.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_trained_model_flags(parser, takes_pt2=True)
    parser.add_argument("--image", required=True, help="an image file, or a folder (searched recursively)")
    parser.add_argument("--top-k", type=int, default=3, help="how many classes to print per image")
    parser.add_argument("--output", default=None, help="write a CSV: path, prediction, probability, then every class's "
                        "probability (multi-label: path, the classes at or above their thresholds, then every class's "
                        "probability)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file (never one this command reads: the weights, args.json, class_indices.json or an image)")
    parser.add_argument("--batch-size", type=int, default=32, help="images per forward pass")
    parser.add_argument("--workers", type=int, default=None, help="loader processes (default: the cores, up to 8)")
    parser.add_argument("--device", default="auto", help="auto (GPU if there is one), cpu, cuda, cuda:N or mps")
    return parser


def find_images(path):
    """(``path`` itself, or the image files below it (recursively, hidden ones left out), sorted;
    [(folder, why)] of the sub-folders that could not be read)."""
    if os.path.isfile(path):
        return [path], []
    if not os.path.isdir(path):
        raise UserError(f"--image {printable(path)}: no such file or folder")
    found, unreadable = [], []

    def note(error):  # a sub-folder that cannot be listed: named and skipped like a file
        unreadable.append((error.filename, why_unreadable(error, error.filename)))

    for folder, subfolders, files in os.walk(path, onerror=note):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        found += [os.path.join(folder, name) for name in sorted(files)
                  if not name.startswith(".") and os.path.splitext(name)[1].lower() in IMG_EXTENSIONS]
    if not found and unreadable:
        raise UserError(printable(f"--image {path}: no image files could be listed ({unreadable[0][0]}: {unreadable[0][1]})"))
    if not found:
        raise UserError(f"--image {printable(path)}: no image files in that folder ({', '.join(IMG_EXTENSIONS)})")
    return found, unreadable


def why_unreadable(error, path):
    """Why a file cannot be predicted, in words: a broken symbolic link, the file system's
    reason, or the training's own reason for skipping such a file (too many pixels, ...)."""
    if path is not None and os.path.islink(path) and not os.path.exists(path):
        try:
            os.stat(path)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return "cannot read it: a loop of symbolic links"
        return "cannot read it: a symbolic link to a missing file"
    if isinstance(error, OSError):
        return f"cannot read it: {error.strerror or error}"
    return (unreadable_reason(path) if path is not None else None) or one_line(error)


class ImageFiles(Dataset):
    """Images for prediction; a file that cannot be read yields why instead."""

    def __init__(self, paths, transform, keep_side, channels=3):
        self.paths, self.transform, self.keep_side, self.channels = paths, transform, keep_side, channels

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        path = self.paths[index]
        try:
            return self.transform(read_image_uint8(path, self.keep_side, self.channels)), index, None
        except (UserError, OSError, Image.DecompressionBombError) as e:  # named and skipped, never fatal
            return None, index, why_unreadable(e, path)

    @staticmethod
    def collate_fn(batch):
        good = [(image, index) for image, index, error in batch if error is None]
        errors = [(index, error) for _, index, error in batch if error is not None]
        images = torch.stack([image for image, _ in good]) if good else None
        return images, [index for _, index in good], errors


@torch.no_grad()
def predict(model, loader, to_device, progress=True, task=None):
    """Yield (index, probabilities) for each decodable image and (index, error) for the others;
    ``to_device``: a DeviceNormalizer with the run's mean and std. Probabilities: ``task``'s
    (softmax over the classes; multi-label: each class's sigmoid)."""
    task = task or make_task("single-label")
    for images, indices, errors in tqdm(loader, desc="[predict]", disable=not progress, file=sys.stdout):
        for index, error in errors:
            yield index, error
        if images is not None:
            logits = model(to_device.normalize(images)).float()
            probabilities = task.probabilities(logits)
            yield from zip(indices, probabilities.cpu())


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    if args.top_k < 1 or args.batch_size < 1:
        raise UserError("--top-k and --batch-size must be at least 1")
    paths, unreadable_folders = find_images(args.image)
    if args.output:  # before any work: never a user's file without --overwrite, never an input
        check_new_output(args.output, trained_model_files(args) + [("an image to predict", p) for p in paths],
                         args.overwrite)
    device = select_device(args.device)
    configure_cpu_threads(device)

    trained, val_resize = load_model(args, device)
    if trained.channels not in MODES:
        raise UserError(f"--weights {printable(args.weights)}: its run's images have {trained.channels} channels; "
                        "predict.py reads image files as 1 (gray), 3 (RGB) or 4 (RGBA) channels")
    classes = trained.classes
    _, transform = build_transforms(trained.img_size, val_resize_size=val_resize)  # the validation transform
    dataset = ImageFiles(paths, transform, keep_side=val_resize, channels=trained.channels)
    workers = args.workers if args.workers is not None else min(8, os.cpu_count() or 1, max(0, len(paths) // 8))
    loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=workers, collate_fn=dataset.collate_fn,
                        pin_memory=device.type == "cuda")
    folder = os.path.isdir(args.image)
    for name, why in unreadable_folders:
        print(printable(f"warning: skipping folder {name}: {why}"))
    rows, skipped = [], len(unreadable_folders)
    to_device = DeviceNormalizer(device, mean=trained.mean, std=trained.std)
    for index, result in predict(trained.model, loader, to_device, progress=folder, task=trained.task):
        if isinstance(result, str):
            skipped += 1
            tqdm.write(printable(f"warning: skipping {paths[index]}: {result}"), file=sys.stdout)
            continue
        rows.append((paths[index], result))
        if args.output is None:
            tqdm.write(printable(f"{paths[index]}: " + trained.task.describe(result, classes, args.top_k)),
                       file=sys.stdout)
    if not rows:
        raise UserError(f"--image {printable(args.image)}: no image could be read (see the warnings above)")
    skipped_note = f"skipped {skipped} that could not be read (named above)" if skipped else "skipped none"
    if args.output:
        write_csv_atomic(trained.task.prediction_table(rows, classes), args.output)
        print(printable(f"wrote {len(rows)} prediction{'s' * (len(rows) != 1)} to {args.output}; {skipped_note}"))
    elif folder or skipped:
        print(f"predicted {len(rows)} image{'s' * (len(rows) != 1)}; {skipped_note}")


def load_model(args, device):
    """(the TrainedModel of --weights, its model on ``device`` in eval mode; the validation
    resize): a .pth with its run's files, made by model.py's create_model, or a .pt2 from
    export.py."""
    if not is_program(args.weights):
        trained = load_trained_model(args, create_model, make_task)
        return trained._replace(model=trained.model.to(device)), read_val_resize_size(args, trained.img_size)
    given = [flag for flag, value in (("--model", args.model), ("--img-size", args.img_size)) if value is not None]
    if given:
        raise UserError(f"{given[0]}: a .pt2 holds its model and image size; leave {' and '.join(given)} out")
    model, run = load_program(args.weights, device)
    classes = read_class_indices(args.class_indices) if args.class_indices else run["classes"]
    if len(classes) != len(run["classes"]):
        raise UserError(f"--class-indices {printable(args.class_indices)}: names {len(classes)} classes, the .pt2 "
                        f"predicts {len(run['classes'])}")
    task = make_task(task_of_run(run), run["thresholds"])
    trained = TrainedModel(model, run["model"], run["img_size"], classes, channels=run["channels"],
                           mean=run["mean"], std=run["std"], task=task)
    return trained, args.val_resize_size or run["val_resize_size"]


if __name__ == "__main__":
    run_cli(main)
