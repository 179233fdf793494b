"""Everything a training script reads and checks before it builds anything."""
from typing import NamedTuple, Optional

from model import read_weights
from multi_train_utils.checkpoint import check_output_dir, check_resume_compatible, find_resume_checkpoint
from utils import DataSplit, load_data


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
