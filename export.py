"""Export trained weights for deployment: TorchScript, or ONNX when the onnx packages are there.

    python export.py --weights weights/model-best.pth --format torchscript
    python export.py --weights weights/model-best.pth --format onnx      # pip install onnx onnxruntime

The exported model takes float images of shape (N, 3, H, W), H = W = the training image
size, normalised with ImageNet's mean and std (multi_train_utils.images.IMAGENET_MEAN / IMAGENET_STD), and
returns one logit per class (class_indices.json). Each file is loaded back and its outputs
compared with the eager model's on a random batch before it takes the --output name, so a
failed export leaves an earlier file there as it was.
"""
import argparse
import inspect
import io
import os
import warnings

import torch

from multi_train_utils.errors import UserError, printable, run_cli
from multi_train_utils.files import check_new_output, write_bytes_atomic
from multi_train_utils.options import add_trained_model_flags
from multi_train_utils.run_files import load_trained_model, read_val_resize_size, trained_model_files

TOLERANCE = 1e-4
SUFFIXES = {"torchscript": ".torchscript.pt", "onnx": ".onnx"}


def get_args_parser():
    parser = argparse.ArgumentParser(description="Export trained weights to TorchScript or ONNX.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_trained_model_flags(parser)
    parser.add_argument("--format", required=True, choices=sorted(SUFFIXES), help="torchscript, or onnx (needs the onnx and onnxruntime packages)")
    parser.add_argument("--output", default=None, help="the file to write (default: beside the weights, e.g. model-best.torchscript.pt)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file (never one this command reads: the weights, args.json or class_indices.json)")
    return parser


def export_torchscript(model, example, path):
    """Trace the model (the same operations for every input of this shape) and save it."""
    with warnings.catch_warnings():  # torch marks TorchScript as deprecated in favour of torch.export
        warnings.simplefilter("ignore", FutureWarning)
        traced = torch.jit.trace(model, example)
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer)
    write_bytes_atomic(buffer.getvalue(), path)

    def run_exported(images):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return torch.jit.load(path)(images)

    return run_exported


def export_onnx(model, example, path):
    """Export with a dynamic batch dimension; checked with onnx.checker and run by onnxruntime."""
    try:
        import onnx
        import onnxruntime
    except ImportError:
        raise UserError("--format onnx needs the onnx and onnxruntime packages: pip install onnx onnxruntime "
                        "(or use --format torchscript)") from None
    buffer = io.BytesIO()
    options = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
    with warnings.catch_warnings():  # torch >= 2.9 calls this (TorchScript-based) exporter legacy
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (example,), buffer, input_names=["images"], output_names=["logits"],
                          dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}}, **options)
    onnx.checker.check_model(onnx.load_from_string(buffer.getvalue()))
    write_bytes_atomic(buffer.getvalue(), path)

    def run_exported(images):
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        return torch.from_numpy(session.run(None, {"images": images.numpy()})[0])

    return run_exported


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    output = args.output or os.path.splitext(args.weights)[0] + SUFFIXES[args.format]
    # before any work: never a user's file without --overwrite, never an input (the default name too)
    check_new_output(output, trained_model_files(args), args.overwrite)
    model, model_name, img_size, classes = load_trained_model(args)

    generator = torch.Generator().manual_seed(0)
    example = torch.randn(2, 3, img_size, img_size, generator=generator)
    unchecked = unchecked_path(output)
    try:
        with torch.no_grad():
            run_exported = {"torchscript": export_torchscript, "onnx": export_onnx}[args.format](model, example, unchecked)
            check = torch.randn(3, 3, img_size, img_size, generator=generator)  # another batch size, other values
            difference = float((run_exported(check) - model(check)).abs().max())
        if difference > TOLERANCE:
            raise UserError(f"the exported {args.format} model differs from the eager one by {difference:.2e} "
                            f"(more than {TOLERANCE:g}); {model_name} may not export this way")
        os.replace(unchecked, output)  # only a checked file takes the name
    finally:
        if os.path.exists(unchecked):
            os.remove(unchecked)  # never leave a file that was not checked
    resize = read_val_resize_size(args, img_size)  # the preprocessing the exported model expects
    print(printable(f"wrote {output} ({args.format}, {model_name}, {len(classes)} classes, input (N, 3, {img_size}, "
                    f"{img_size}): shorter side resized to {resize}, center-cropped, normalised with ImageNet's "
                    f"mean and std); max difference to the eager model on a check batch: {difference:.2e}"))


def unchecked_path(output):
    """A hidden name beside ``output`` for the file until it has been checked."""
    folder, name = os.path.split(os.path.abspath(output))
    return os.path.join(folder, f".{name}.{os.getpid()}.unchecked")


if __name__ == "__main__":
    run_cli(main)
