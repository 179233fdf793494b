"""Export trained weights for deployment: a torch.export program (.pt2), or ONNX.

    python export.py --weights weights/model-best.pth                  # model-best.pt2
    python export.py --weights weights/model-best.pth --format onnx    # pip install onnx onnxscript onnxruntime

The exported model takes float images of shape (N, C, H, W), any N, C the channels of the
run's images (3 for RGB), H = W = the training image size, normalised with the run's mean and
std (ImageNet's unless its data said otherwise), and returns one logit per class (a
multi-label run's: a class is predicted where its sigmoid reaches its threshold). A .pt2
loads with torch alone, without this project's code, and carries the class names, the
preprocessing and, multi-label, the thresholds (run.json inside it; predict.py reads them;
an ONNX file has the same text in its metadata, under "run.json"):

    program = torch.export.load("model-best.pt2", extra_files={"run.json": ""})
    logits = program.module()(images)

ONNX goes through torch.onnx's dynamo-based exporter (``dynamo=True``, the one torch recommends
since 2.9). TorchScript (--format torchscript) is deprecated by PyTorch and kept only for old
deployments. Each file is loaded back and its outputs compared with the eager model's on a
random batch before it takes the --output name, so a failed export leaves an earlier file there
as it was.
"""
import argparse
import inspect
import io
import os

import torch

from model import create_model
from multi_train_utils.errors import UserError, printable, run_cli
from multi_train_utils.files import check_new_output, write_bytes_atomic
from multi_train_utils.images import IMAGENET_MEAN, IMAGENET_STD
from multi_train_utils.options import add_trained_model_flags, make_task
from multi_train_utils.run_files import (ANY_BATCH, RUN_FILE, SUFFIX, export_program, is_program, load_program,
                                         load_trained_model, read_val_resize_size, run_json, trained_model_files)


TOLERANCE = 1e-4
SUFFIXES = {"pt2": SUFFIX, "onnx": ".onnx", "torchscript": ".torchscript.pt"}
ONNX_PACKAGES = "onnx onnxscript onnxruntime"


def get_args_parser():
    parser = argparse.ArgumentParser(description="Export trained weights to a torch.export program (.pt2) or ONNX.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_trained_model_flags(parser)
    parser.add_argument("--format", default="pt2", choices=list(SUFFIXES),
                        help=f"pt2: torch.export, loads with torch.export.load; onnx: needs pip install {ONNX_PACKAGES}; "
                             "torchscript: deprecated by PyTorch, for old deployments only")
    parser.add_argument("--output", default=None, help="the file to write (default: beside the weights, e.g. model-best.pt2)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file (never one this command reads: the weights, args.json or class_indices.json)")
    return parser


def export_pt2(model, example, path, run):
    """torch.export the model for any batch size, with ``run`` inside; loaded back as predict.py does."""
    export_program(model, example, path, run)
    return load_program(path)[0]


def export_onnx(model, example, path, run):
    """ONNX through torch.onnx's dynamo exporter, any batch size; checked with onnx.checker and
    run by onnxruntime."""
    try:
        import onnx
        import onnxruntime
        import onnxscript  # noqa: F401  (the dynamo exporter needs it)
    except ImportError:
        raise UserError(f"--format onnx needs the {ONNX_PACKAGES.replace(' ', ', ')} packages: pip install "
                        f"{ONNX_PACKAGES} (or use --format pt2, the default)") from None
    if "dynamo" not in inspect.signature(torch.onnx.export).parameters:
        raise UserError(f"--format onnx needs torch 2.5 or later (this is {torch.__version__}); or use --format pt2")
    program = torch.onnx.export(model, (example,), dynamo=True, dynamic_shapes=ANY_BATCH,
                                input_names=["images"], output_names=["logits"], verbose=False)
    proto = program.model_proto
    onnx.helper.set_model_props(proto, {RUN_FILE: run_json(run)})  # the run's settings, as a .pt2 has them
    onnx.checker.check_model(proto)
    write_bytes_atomic(proto.SerializeToString(), path)

    def run_exported(images):
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        return torch.from_numpy(session.run(None, {"images": images.numpy()})[0])

    return run_exported


def export_torchscript(model, example, path, run):
    """Trace the model (the same operations for every input of this shape) and save it. PyTorch
    deprecates TorchScript: its FutureWarnings are shown."""
    print("note: TorchScript is deprecated by PyTorch; --format pt2 (the default) is its successor")
    traced = torch.jit.trace(model, example)
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    write_bytes_atomic(buffer.getvalue(), path)
    return torch.jit.load(path)


EXPORTERS = {"pt2": export_pt2, "onnx": export_onnx, "torchscript": export_torchscript}


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    output = args.output or os.path.splitext(args.weights)[0] + SUFFIXES[args.format]
    # before any work: never a user's file without --overwrite, never an input (the default name too)
    check_new_output(output, trained_model_files(args), args.overwrite)
    if args.format == "pt2" and not is_program(output):
        raise UserError(f"--output {printable(output)}: a torch.export program's name must end in .pt2 "
                        "(torch.export.load reads it by that)")
    trained = load_trained_model(args, create_model, make_task)
    model, model_name, img_size, classes, channels = trained[:5]

    generator = torch.Generator().manual_seed(0)
    example = torch.randn(2, channels, img_size, img_size, generator=generator)
    resize = read_val_resize_size(args, img_size)  # the preprocessing the exported model expects
    run = {"model": model_name, "img_size": img_size, "val_resize_size": resize, "channels": channels,
           "mean": trained.mean, "std": trained.std, "classes": classes, "task": trained.task.name,
           "multi_label": trained.task.several_labels, "thresholds": trained.task.thresholds}
    unchecked = unchecked_path(output)
    try:
        with torch.no_grad():
            run_exported = EXPORTERS[args.format](model, example, unchecked, run)
            # another batch size, other values
            check = torch.randn(3, channels, img_size, img_size, generator=generator)
            difference = float((run_exported(check) - model(check)).abs().max())
        if difference > TOLERANCE:
            raise UserError(f"the exported {args.format} model differs from the eager one by {difference:.2e} "
                            f"(more than {TOLERANCE:g}); {model_name} may not export this way")
        os.replace(unchecked, output)  # only a checked file takes the name
    finally:
        if os.path.exists(unchecked):
            os.remove(unchecked)  # never leave a file that was not checked
    kind = "" if trained.task.name == "single-label" else f"{trained.task.name}, "
    print(printable(f"wrote {output} ({args.format}, {model_name}, {kind}{len(classes)} classes, input (N, {channels}, "
                    f"{img_size}, {img_size}): shorter side resized to {resize}, center-cropped, "
                    f"{normalisation_text(trained.mean, trained.std)}); max difference to the eager model on a check "
                    f"batch: {difference:.2e}"))


def normalisation_text(mean, std):
    """How the exported model's input is normalised, in words."""
    if mean is None:
        return "not normalised (pixel values as the data gave them)"
    if tuple(mean) == IMAGENET_MEAN and tuple(std) == IMAGENET_STD:
        return "normalised with ImageNet's mean and std"
    return f"normalised with mean {list(mean)} and std {list(std)}"


def unchecked_path(output):
    """A hidden name beside ``output`` for the file until it has been checked; it ends as
    ``output`` does (torch.export.load goes by the .pt2 ending)."""
    folder, name = os.path.split(os.path.abspath(output))
    stem, suffix = os.path.splitext(name)
    return os.path.join(folder, f".{stem}.{os.getpid()}.unchecked{suffix}")


if __name__ == "__main__":
    run_cli(main)
