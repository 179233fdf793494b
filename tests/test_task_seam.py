"""The task seam holds: a third task, written as a user would in one file outside the engine
(tests/helpers/ordinal_task.py: ordered classes scored by their mean absolute error), runs
through torchrun, train_single.py (resuming it inside an epoch), --eval-only, predict.py and
export.py with no engine edit; and a --task that cannot be had is one line.

Four launches: torchrun (2 processes, gloo) trains epoch 0 and is preempted inside epoch 1,
train_single.py resumes there and ends epoch 1, then --eval-only, predict.py on the .pth,
export.py and predict.py on the .pt2."""
import csv
import os
import re

import pytest
import torch

from conftest import FAST, PROBE, PYTHON, REPO, TORCHRUN, free_port, outcome, read_metrics, run, script

TASK = os.path.join(REPO, "tests", "helpers", "ordinal_task.py") + ":Ordinal"


@pytest.fixture(scope="module")
def ordinal_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ordinal") / "out"
    flags = ["--data-path", tiny_data["train"], "--val-path", tiny_data["val"], "--check-images", *FAST,
             "--output-dir", str(out), "--log-dir", str(out) + "-tb", "--workers", "0", "--task", TASK,
             "--amp", "off"]  # fp32 on every CPU kind: predict.py's fp32 argmax is then --eval-only's
    # torchrun trains epoch 0 and is preempted inside epoch 1 (SIGTERM to torchrun as its step 1
    # begins: saved at that step's end); train_single.py resumes there and decides the best epoch
    # with the task's lower-is-better metric across the stop.
    inside = ["--epochs", "2", "--checkpoint-every", "0.00001", "--print-freq", "1"]
    ddp = run([*TORCHRUN, "--nproc_per_node=2", "--max-restarts=0", "--master_port", str(free_port()), PROBE, "multi",
               *flags, *inside], env={"PROBE_STOP": "SIGTERM:step-1-1:launcher"})
    assert ddp.returncode != 0 and "on a preemption notice" in ddp.stderr, ddp.stdout + ddp.stderr
    stopped = torch.load(out / "checkpoint.pth", weights_only=True)
    assert (stopped["epoch"], stopped["position"]["epoch"], stopped["position"]["step"]) == (0, 1, 2)
    single = run([PYTHON, script("train_single.py"), *flags, *inside, "--resume", "auto"])
    assert single.returncode == 0, single.stdout + single.stderr
    return {"out": out, "ddp": ddp, "single": single, "val": tiny_data["val"]}


def true_grades(val_folder, classes):
    """Each validation image's class index, from its folder's name (outside the code under test)."""
    return {os.path.join(val_folder, name, f): classes.index(name)
            for name in classes for f in os.listdir(os.path.join(val_folder, name))}


def test_a_task_of_your_own_trains_resumes_evaluates_predicts_and_exports(ordinal_run, tmp_path):
    import json

    out, val = ordinal_run["out"], ordinal_run["val"]
    classes = [json.loads((out / "class_indices.json").read_text())[str(i)] for i in range(5)]
    # Training: its own columns and epoch line, its metric by default, its lower-is-better best.
    rows = read_metrics(out)
    with open(out / "metrics.csv", newline="") as f:
        header = next(csv.reader(f))
    assert header[-2:] == ["val_mae", "ema_val_mae"] and [r["epoch"] for r in rows] == ["0", "1"]
    maes = [float(r["val_mae"]) for r in rows]
    for stdout, epoch in ((ordinal_run["ddp"].stdout, 0), (ordinal_run["single"].stdout, 1)):
        line = re.search(rf"^\[epoch {epoch}\] train_loss: \S+  val_mae: ([\d.]+)  val_accuracy: [\d.]+ \((\d+)/7\)",
                         stdout, flags=re.M)
        assert line and float(line.group(1)) == pytest.approx(maes[epoch], abs=5e-5), stdout
    args = json.loads((out / "args.json").read_text())
    assert args["task"] == TASK and args["best_metric"] == "mae"
    best_epoch = min(range(2), key=lambda e: (maes[e], e))
    summary = ordinal_run["single"].stdout
    assert f"best val mae: {maes[best_epoch]:.4f} at epoch {best_epoch}" in summary, summary
    assert f"grades: {maes[best_epoch]:.4f} off on average over 7 validation images" in summary, summary

    # --eval-only takes the task from args.json and prints its own figures.
    evaluated = run([PYTHON, script("train_single.py"), "--eval-only", "--weights", str(out / "model-best.pth"),
                     "--workers", "0", "--device", "cpu", "--eval-output", str(tmp_path / "eval")])
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    printed = re.search(r"^mae: ([\d.]+) \(7 images\)", evaluated.stdout, flags=re.M)
    assert printed, evaluated.stdout  # the task's own lines, not single-label's
    mae = float(printed.group(1))
    assert mae == pytest.approx(maes[best_epoch], abs=1e-6)
    with open(tmp_path / "eval" / "overall_metrics.csv", newline="") as f:
        assert float(dict(list(csv.reader(f))[1:])["mae"]) == pytest.approx(mae, abs=1e-6)

    # predict.py: the task's CSV; its mean absolute error, counted here, is --eval-only's.
    predictions = tmp_path / "grades.csv"
    predicted = run([PYTHON, script("predict.py"), "--weights", str(out / "model-best.pth"), "--image", val,
                     "--output", str(predictions), "--device", "cpu", "--workers", "0"])
    assert predicted.returncode == 0, predicted.stdout + predicted.stderr
    with open(predictions, newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == ["path", "grade", "expected"] and len(table) == 8
    truth = true_grades(val, classes)
    off = [abs(classes.index(grade) - truth[path]) for path, grade, _ in table[1:]]
    assert sum(off) / 7 == pytest.approx(mae, abs=1e-6)  # printed to 6 places
    for path, grade, expected in table[1:]:
        assert 0 <= float(expected) <= 4

    # export.py carries the task in the .pt2; predict.py on it writes the same table.
    program = tmp_path / "model.pt2"
    exported = run([PYTHON, script("export.py"), "--weights", str(out / "model-best.pth"), "--output", str(program)])
    assert exported.returncode == 0, exported.stdout + exported.stderr
    line = run([PYTHON, script("predict.py"), "--weights", str(program), "--image",
                os.path.join(val, classes[0], sorted(os.listdir(os.path.join(val, classes[0])))[0]), "--device", "cpu"])
    assert line.returncode == 0, line.stdout + line.stderr
    first = next(row for row in table[1:] if row[0].startswith(os.path.join(val, classes[0]) + os.sep))
    assert re.search(rf"grade {re.escape(first[1])} \([\d.]+\), expected grade {float(first[2]):.2f}$",
                     line.stdout.strip()), (line.stdout, first)


@pytest.mark.parametrize("spec, message", [
    ("nowhere.py:Ordinal", "--task nowhere.py:Ordinal: no such file"),
    (TASK.replace(":Ordinal", ":Missing"), ":Missing: cannot be loaded (AttributeError"),
    (TASK.replace(":Ordinal", ":GradeTally"), ":GradeTally: GradeTally is not a subclass of multi_train_utils.task.Task"),
    ("ordinal", "--task ordinal: give single-label, multi-label, or FILE.py:ClassName"),
])
def test_a_task_that_cannot_be_had_is_one_line(spec, message):
    from multi_train_utils.errors import UserError
    from multi_train_utils.options import get_args_parser, parse_args

    error = outcome(lambda: parse_args(get_args_parser(distributed=False), ["--task", spec]))
    assert isinstance(error, UserError), repr(error)  # refused in one line, not a crash on the class
    assert message in str(error) and "\n" not in str(error)


def test_a_tasks_own_metric_and_the_flags_it_refuses():
    from multi_train_utils.errors import UserError
    from multi_train_utils.options import get_args_parser, make_task, parse_args

    args = parse_args(get_args_parser(distributed=True), ["--task", TASK])
    assert args.best_metric == "mae" and args.task == TASK and args.multi_label is False
    task = make_task(TASK)  # a mean absolute error is better low, whatever the engine's default
    assert task.is_better("mae", 0.5, 1.5) and not task.is_better("mae", 1.5, 0.5) and task.is_better("mae", 3.0, None)
    assert task.is_better("accuracy", 0.9, 0.5) and not task.is_better("accuracy", 0.5, 0.9)
    with pytest.raises(UserError, match=r"--best-metric map: for --multi-label runs; add --multi-label or use mae, "
                                        r"accuracy or loss"):
        parse_args(get_args_parser(distributed=False), ["--task", TASK, "--best-metric", "map"])
    with pytest.raises(UserError, match=r"--multi-label with --task .*: give one of them"):
        parse_args(get_args_parser(distributed=False), ["--task", TASK, "--multi-label"])
    with pytest.raises(UserError, match="--tune-thresholds is for --multi-label runs"):
        parse_args(get_args_parser(distributed=False), ["--task", TASK, "--tune-thresholds"])
