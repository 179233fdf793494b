"""Everything a training script reads and checks before it builds anything.

The data (made or downloaded first if asked, split, checked against the flags), --weights,
--resume and --output-dir.
"""
import glob
import os
from typing import NamedTuple, Optional

from model import read_weights
from multi_train_utils.checkpoint import check_resume_compatible, find_resume_checkpoint
from multi_train_utils.errors import UserError
from multi_train_utils.example_data import (DEMO_MARKER, download_failure_marker, download_flower_photos,
                                            make_demo_dataset, wait_for_folder)
from multi_train_utils.run_files import check_output_dir, read_run_classes
from utils import DataSplit, read_split_data


class RunInputs(NamedTuple):
    split: DataSplit
    weights_state: Optional[dict]  # --weights, unless resuming
    resume_path: Optional[str]
    checkpoint: Optional[dict]  # the full checkpoint to resume from, or None for a fresh start


def read_inputs(args, local_rank=0, world_size=1, verbose=True):
    """Split the data, read --weights and --resume, check --output-dir: a UserError on bad input."""
    resume_path, checkpoint = find_resume_checkpoint(args.resume, args.output_dir, verbose)
    if not args.eval_only:  # before --download or --demo fetch or write anything
        check_output_dir(args.output_dir, args.overwrite, resume_path)
    split = load_data(args, local_rank, world_size)
    if checkpoint is not None:
        check_resume_compatible(checkpoint, resume_path, args, split.classes, args.epochs)
    weights = read_weights(args.weights, args.model, progress=verbose) if args.weights and not checkpoint else None
    return RunInputs(split, weights, resume_path, checkpoint)


def resume_hint(args):
    """What to tell a user whose run was interrupted."""
    return (f"to continue from the last finished epoch (in {args.output_dir}/checkpoint.pth), "
            "run the same command with --resume auto")


def load_data(args, local_rank=0, world_size=1):
    """Generate the demo data if asked, split the data and check it against the flags (and,
    for --eval-only, against the classes of the run that wrote --weights).

    Every rank runs this (it only reads), so every rank fails the same way on bad input.
    """
    # --eval-only: the data must have the classes in class_indices.json beside the weights
    expected_classes = read_run_classes(os.path.dirname(os.path.abspath(args.weights))) if args.eval_only else None
    if args.demo:
        if os.path.exists(args.data_path) and not os.path.exists(os.path.join(args.data_path, DEMO_MARKER)):
            raise UserError(f"--demo --data-path {args.data_path}: that folder exists and is not demo data; "
                            "drop --data-path (demo data goes to data/demo) or run without --demo")
        if local_rank == 0:
            make_demo_dataset(args.data_path)
        else:
            wait_for_folder(args.data_path)
    if args.download:
        marker = download_failure_marker(args.data_path)
        if local_rank == 0:
            for stale in glob.glob(glob.escape(marker.rsplit("-", 1)[0]) + "-*"):
                os.remove(stale)
            try:
                download_flower_photos(args.data_path)
            except UserError as e:
                if world_size > 1:  # tell the other local ranks, which wait for the folder
                    with open(marker, "w") as f:
                        f.write(str(e))
                raise
        else:
            wait_for_folder(args.data_path, timeout_s=3600, failure_marker=marker)
    split = read_split_data(args.data_path, args.val_rate, args.seed, args.val_path)
    found = len(split.classes)
    if args.num_classes is not None and args.num_classes != found:
        raise UserError(
            f"--num-classes {args.num_classes}: {args.data_path} has {found} class folders "
            f"({', '.join(split.classes)}); drop the flag or fix the folders"
        )
    if expected_classes is not None and expected_classes != split.classes:
        raise UserError(
            f"--data-path {args.data_path}: classes {split.classes} differ from the weights' class_indices.json "
            f"{expected_classes}; evaluate on data with the same class folders"
        )
    share = len(split.train_images_path) // world_size
    if not args.eval_only and share == 0:
        raise UserError(
            f"{world_size} processes but only {len(split.train_images_path)} training images; "
            "start fewer processes or add images"
        )
    if not args.eval_only and args.batch_size > share:
        raise UserError(
            f"--batch-size {args.batch_size}: each of the {world_size} process(es) gets only {share} of the "
            f"{len(split.train_images_path)} training images; use --batch-size {max(1, share)} or less"
        )
    return split
