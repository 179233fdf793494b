"""A torch.export program (.pt2) as export.py writes and predict.py reads it.

The model's graph and weights, with the run's class names and preprocessing inside (RUN_FILE),
so that it loads with torch alone."""
import io
import json

import torch

from multi_train_utils.errors import UserError, one_line, printable
from multi_train_utils.files import write_bytes_atomic

SUFFIX = ".pt2"  # torch.export.load goes by it
RUN_FILE = "run.json"  # inside a .pt2 (and an ONNX file's metadata): the run's settings, RUN_KEYS and the rest
RUN_KEYS = ("model", "img_size", "val_resize_size", "mean", "std", "classes")  # a .pt2 must have them
# What an earlier export.py did not write, as its programs were: RGB, one class an image. The
# task says how the outputs read ("multi_label" before "task" was written); "thresholds": per
# class, where the task predicts by thresholds (None: its default).
EARLIER_PROGRAMS = {"channels": 3, "task": None, "multi_label": False, "thresholds": None}
# torch.export's dynamic_shapes of the one input: any batch size, the rest as the example's
ANY_BATCH = ({0: torch.export.Dim("batch", min=1)},)


def is_program(path):
    """Whether ``path`` names a torch.export program (by its .pt2 ending, as torch.export.load does)."""
    return str(path).endswith(SUFFIX)


def export_program(model, example, path, run):
    """torch.export ``model`` for image batches of any size like ``example`` and save it to
    ``path`` with ``run`` (a dict of RUN_KEYS) inside."""
    try:
        program = torch.export.export(model, (example,), dynamic_shapes=ANY_BATCH)
    except Exception as e:  # torch raises many types for what it cannot capture (data-dependent control flow, ...)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]  # torch's first line says what; the rest, where
        raise UserError(f"torch.export cannot capture {run['model']} ({printable(why)}); see "
                        "https://pytorch.org/docs/stable/export.html for what it needs") from None
    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files={RUN_FILE: run_json(run)})
    write_bytes_atomic(buffer.getvalue(), path)


def run_json(run):
    """The text of RUN_FILE: the keys of RUN_KEYS and EARLIER_PROGRAMS of ``run``."""
    run = {**EARLIER_PROGRAMS, **run}
    return json.dumps({key: run[key] for key in (*RUN_KEYS, *EARLIER_PROGRAMS)})


def load_program(path, device=None):
    """(the callable model, its run dict) of a .pt2 that export.py wrote, on ``device`` (CPU
    if None); a file that is not one is a UserError naming it."""
    extra = {RUN_FILE: ""}
    try:
        program = torch.export.load(path, extra_files=extra)
    except FileNotFoundError:
        raise UserError(f"--weights {printable(path)}: no such file (export one: python export.py --weights "
                        "model-best.pth)") from None
    except Exception as e:  # torch raises many types for a file that is not a program
        raise UserError(f"--weights {printable(path)}: not a torch.export program ({one_line(e)}); export one "
                        "with export.py") from None
    try:
        run = json.loads(extra[RUN_FILE])
        missing = [key for key in RUN_KEYS if key not in run]
    except (ValueError, TypeError):
        run, missing = {}, list(RUN_KEYS)
    if missing:
        raise UserError(f"--weights {printable(path)}: has no {RUN_FILE} with {', '.join(missing)} (a program "
                        "export.py did not write); export it again with export.py")
    if device is not None and device.type != "cpu":
        program = torch.export.passes.move_to_device_pass(program, device)
    return program.module(), {**EARLIER_PROGRAMS, **run}
