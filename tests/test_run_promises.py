"""The run's figures as the pages promise them, read code first: TensorBoard, metrics.csv, curves, start summary, speed settings."""
import csv
import os

import pytest
import torch
from torch import nn

from conftest import Labelled, parse_flags, full_flags
from multi_train_utils.options import config_of  # noqa: E402

from multi_train_utils.checkpoint import TrainState
from multi_train_utils.single_label import EvalResult
from multi_train_utils.train_eval_utils import TrainStats


def run_flags(tmp_path, *extra):
    """train_single.py's flags with a run folder and a TensorBoard folder in ``tmp_path``; --lr 0.05
    so that the learning rate of an epoch's last step (0.01 below) is told apart from --lr."""
    return parse_flags(False, "--model", "resnet18", "--output-dir", str(tmp_path / "out"), "--log-dir",
                       str(tmp_path / "tb"), "--no-plots", "--keep-last", "0", "--lr", "0.05", *extra)


def result(confusion, loss_sum):
    return EvalResult(torch.tensor(confusion), None, loss_sum)


# Two evaluations of 10 images of 3 classes (rows true, columns predicted), figured out by hand:
# the model: recall 3/4, 2/4, 1/2 -> balanced 0.583333; F1 6/8, 4/7, 2/5 -> macro-F1 0.573810;
# accuracy 0.6; loss 7.5 / 10.
MODEL_RESULT = ([[3, 1, 0], [0, 2, 2], [1, 0, 1]], 7.5)
# the EMA: recall 4/4, 1/4, 2/2 -> balanced 0.75; F1 8/11, 2/5, 4/4 -> macro-F1 0.709091;
# accuracy 0.7; loss 4.2 / 10.
EMA_RESULT = ([[4, 0, 0], [3, 1, 0], [0, 0, 2]], 4.2)


def record_one_epoch(tmp_path, ema=True):
    """A RunRecorder (rank 0) of a tiny model through one epoch: training loss 1.5, last lr 0.01
    (--lr 0.05), 4.0 images/s (while images / seconds is 12 / 2.0 = 6.0)."""
    from multi_train_utils.model_setup import ModelEma
    from conftest import run_recorder

    args = run_flags(tmp_path, *(["--model-ema"] if ema else []))
    model = nn.Linear(2, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = TrainState(model, optimizer, scheduler, ema=ModelEma(model, 0.9) if ema else None)
    recorder = run_recorder(args, full_flags(classes=["a", "b", "c"]), state, enabled=True, world_size=1)
    stats = TrainStats(mean_loss=1.5, images=12, seconds=2.0, last_lr=0.01, images_per_second=4.0)
    recorder.end_epoch(0, stats, result(*MODEL_RESULT), result(*EMA_RESULT) if ema else None, seconds=2.5)
    recorder.close()
    return recorder, args


def test_metrics_csv_ema_cells_are_the_emas_accuracy_loss_balanced_accuracy_and_macro_f1(tmp_path, capsys):
    """outputs.md: metrics.csv's columns "... the EMA's `ema_val_accuracy`, `ema_val_loss`,
    `ema_val_balanced_accuracy`, `ema_val_macro_f1`", each the EMA's own figure (hand-computed
    above), in that order, after the model's."""
    _, args = record_one_epoch(tmp_path)
    with open(os.path.join(args.output_dir, "metrics.csv")) as f:
        row = next(csv.DictReader(f))
    assert (row["val_accuracy"], row["val_loss"], row["val_balanced_accuracy"], row["val_macro_f1"]) == \
        ("0.600000", "0.750000", "0.583333", "0.573810")
    assert (row["ema_val_accuracy"], row["ema_val_loss"], row["ema_val_balanced_accuracy"],
            row["ema_val_macro_f1"]) == ("0.700000", "0.420000", "0.750000", "0.709091")
    assert row["best_source"] == "ema"  # 0.7 beats 0.6
    capsys.readouterr()


def logged_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir)
    events.Reload()
    return {tag: events.Scalars(tag)[0].value for tag in events.Tags()["scalars"]}


def test_tensorboard_logs_the_epochs_loss_learning_rate_and_speed(tmp_path, capsys):
    """outputs.md: TensorBoard logs `loss`, ..., `learning_rate`, `images_per_second`: the
    epoch's training loss (1.5), the rate of its last step (0.01, not --lr 0.05) and its images/s
    (4.0, the warm-up left out; not images / seconds = 6.0)."""
    recorder, _ = record_one_epoch(tmp_path, ema=False)
    logged = logged_scalars(recorder.log_dir)
    assert logged["loss"] == pytest.approx(1.5)
    assert logged["learning_rate"] == pytest.approx(0.01)
    assert logged["images_per_second"] == pytest.approx(4.0)
    assert logged["val_loss"] == pytest.approx(0.75)
    capsys.readouterr()


def test_tensorboard_logs_the_emas_own_figures_under_ema(tmp_path, capsys):
    """outputs.md: "`accuracy`, `balanced_accuracy`, `macro_f1`, ..., `val_loss`, the same
    under `ema/` with `--model-ema`": the EMA's figures, not the model's."""
    recorder, _ = record_one_epoch(tmp_path)
    logged = logged_scalars(recorder.log_dir)
    model = {"accuracy": 0.6, "balanced_accuracy": 0.583333, "macro_f1": 0.573810, "val_loss": 0.75}
    ema = {"accuracy": 0.7, "balanced_accuracy": 0.75, "macro_f1": 0.709091, "val_loss": 0.42}
    assert {name: round(logged[name], 6) for name in model} == pytest.approx(model)
    assert {name: round(logged["ema/" + name], 6) for name in ema} == pytest.approx(ema)
    capsys.readouterr()


def test_curves_png_draws_the_training_loss_validation_accuracy_and_learning_rate(tmp_path):
    """outputs.md: "`curves.png` (loss, validation accuracy and learning rate per epoch)": the
    three panels plot metrics.csv's train_loss, val_accuracy and lr (not val_loss)."""
    from multi_train_utils.pictures import plot_training_curves

    rows = [{"epoch": "0", "train_loss": "1.6", "val_accuracy": "0.4", "lr": "0.001", "val_loss": "1.9"},
            {"epoch": "1", "train_loss": "1.2", "val_accuracy": "0.5", "lr": "0.0005", "val_loss": "1.7"},
            {"epoch": "2", "train_loss": "0.9", "val_accuracy": "0.7", "lr": "0.0001", "val_loss": "1.4"}]
    axes = plot_training_curves(rows).axes
    assert [ax.get_title() for ax in axes] == ["training loss", "validation accuracy", "learning rate"]
    assert [list(ax.lines[0].get_ydata()) for ax in axes] == [[1.6, 1.2, 0.9], [0.4, 0.5, 0.7],
                                                               [0.001, 0.0005, 0.0001]]
    assert list(axes[0].lines[0].get_xdata()) == [0, 1, 2]


def test_the_start_summary_says_where_the_outputs_and_this_runs_tensorboard_folder_go(tmp_path, monkeypatch,
                                                                                      capsys):
    """outputs.md: at the start rank 0 prints "where the outputs and TensorBoard logs go"; the
    logs go "to a new sub-folder of `--log-dir` per run: `tensorboard --logdir runs`"."""
    from multi_train_utils import recorder as summary
    from multi_train_utils.train_eval_utils import LoopSettings
    from multi_train_utils.datasets import Datasets

    args = parse_flags(True, "--model", "resnet18", "--output-dir", "weights/pets", "--log-dir", "tb")
    data = Datasets(Labelled([0, 1, 0, 1]), Labelled([0, 1]), ["a", "b"])
    model = nn.Linear(2, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.001))
    monkeypatch.setattr(summary, "get_world_size", lambda: 1)
    summary.print_start_summary(config_of(args), data, state, LoopSettings(), torch.device("cpu"),
                                log_dir=os.path.join("tb", "pets-20990101-000000-42"))
    lines = capsys.readouterr().out.splitlines()
    assert "outputs: weights/pets (train.log, metrics.csv, model-best.pth, checkpoint.pth, plots)" in lines
    assert f"TensorBoard: {os.path.join('tb', 'pets-20990101-000000-42')}; view with: tensorboard --logdir tb" in lines


def test_cudnns_autotuner_and_tf32_are_on_for_cuda_devices_only():
    """guarantees.md: "On GPUs, cuDNN's autotuner (on for speed) may pick other kernels after a
    restart"; configure_backends turns it (and TF32) on for a CUDA device, and leaves a CPU run's
    settings alone. No GPU is needed: these are flags of torch.backends."""
    from multi_train_utils.model_setup import configure_backends

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    # saved and put back by hand: matmul's flags live behind a __getattr__, which pytest 9.2's
    # monkeypatch takes for no attribute (and fails to delete at its undo)
    saved = cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32
    try:
        cudnn.benchmark = cudnn.allow_tf32 = matmul.allow_tf32 = False
        configure_backends(torch.device("cpu"))
        assert not cudnn.benchmark and not matmul.allow_tf32
        configure_backends(torch.device("cuda", 1))
        assert cudnn.benchmark
        assert cudnn.allow_tf32 and matmul.allow_tf32
    finally:
        cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = saved
