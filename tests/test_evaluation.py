"""Exact evaluation: every validation image counted once at any world size; --eval-only
reproduces the run's own figures and writes nothing."""
import os
import re

import torch

from conftest import MODEL, PYTHON, assert_exact_accuracy, read_metrics, run, run_ranks, script, top1_line


def snapshot(folder):
    return {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in os.listdir(folder)}


def eval_only(weights, world_size, script_name="train_multi_gpu.py", *extra):
    """--eval-only with nothing but the weights: the rest comes from the run's args.json.
    Runs in an empty folder, which must stay empty (default --output-dir and --log-dir are
    relative to it)."""
    import tempfile

    cwd = tempfile.mkdtemp()
    cmd = [PYTHON, script(script_name), "--eval-only", "--weights", weights, "--workers", "0", *extra]
    # several ranks as srun starts them, one process each (torchrun's own tests are in test_launch_modes)
    result = run(cmd, cwd=cwd) if world_size == 1 else run_ranks(world_size, cmd, cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    assert os.listdir(cwd) == []
    return result.stdout


def test_same_exact_accuracy_at_world_size_1_2_3_4(single_run):
    out = single_run["out"]
    weights = os.path.join(out, "model-1.pth")
    before, tb_before = snapshot(out), os.listdir(out + "-tb")
    outputs = {ws: eval_only(weights, ws) for ws in (1, 2, 3, 4)}
    outputs["single"] = eval_only(weights, 1, "train_single.py")
    for stdout in outputs.values():  # the data described first, then evaluated (its bar), then the report
        assert stdout.index("split: ") < stdout.index("[valid]") < stdout.index("top1 accuracy")
    lines = {key: top1_line(stdout) for key, stdout in outputs.items()}
    expected = float(read_metrics(out)[-1]["val_accuracy"])
    correct = round(expected * 7)
    assert set(lines.values()) == {f"top1 accuracy: {correct / 7:.6f} ({correct}/7)"}, lines
    # per-class lines: 5 of them, adding up to the total
    per_class = re.findall(r"^  (\w+)\s+[\d.]+ \((\d+)/(\d+)\)$", outputs[2], flags=re.M)
    assert [name for name, _, _ in per_class] == ["daisy", "dandelion", "roses", "sunflowers", "tulips"]
    assert sum(int(c) for _, c, _ in per_class) == correct
    assert [int(t) for _, _, t in per_class] == [2, 2, 1, 1, 1]
    # precision, recall, F1, balanced accuracy and macro-F1: the same lines at every world size,
    # and balanced accuracy the mean of the per-class accuracies printed above
    reports = {key: stdout[stdout.index("per-class precision"):] for key, stdout in outputs.items()}
    assert len(set(reports.values())) == 1, reports
    balanced = sum(int(c) / int(t) for _, c, t in per_class) / 5
    assert f"balanced accuracy: {balanced:.6f}  macro-F1: " in reports[2]
    # nothing written: not in the run's folder, no TensorBoard logs
    assert snapshot(out) == before and os.listdir(out + "-tb") == tb_before


def buffer_checksum(weights):
    """Sum of |x| over the floating-point buffers (BatchNorm statistics) of a saved model."""
    from model import create_model

    model = create_model(MODEL, 5)
    model.load_state_dict(torch.load(weights, weights_only=True))
    return float(sum(b.double().abs().sum() for b in model.buffers() if b.is_floating_point()))


def test_ddp_run_reports_the_accuracy_of_the_weights_it_saves(ddp_run):
    """Each DDP rank updates its BatchNorm statistics from its own last batch, and in this run
    rank 1 even resets them after training (PROBE_SKEW_BN). Every rank must evaluate with
    rank 0's, which model-N.pth holds: the accuracy the run reports is then exactly what
    --eval-only of model-N.pth gives in one process."""
    out = ddp_run["out"]
    counts = assert_exact_accuracy(ddp_run["result"].stdout, out, epochs=2)
    for epoch, correct in enumerate(counts):
        weights = os.path.join(out, f"model-{epoch}.pth")
        assert top1_line(eval_only(weights, 1, "train_single.py")) == \
            f"top1 accuracy: {correct / 7:.6f} ({correct}/7)"
        saved = buffer_checksum(weights)
        assert [r["eval_buffers"][epoch] for r in ddp_run["probe"]] == [saved, saved]


def test_eval_only_refuses_a_mismatched_head(tiny_data, tmp_path):
    """Strict loading: weights of a 3-class model never evaluate as a 5-class classifier."""
    from model import create_model

    weights = tmp_path / "three_classes.pth"
    torch.save(create_model("resnet18", 3).state_dict(), weights)
    result = run([PYTHON, script("train_single.py"), "--eval-only", "--weights", str(weights), "--model", "resnet18",
                  "--data-path", tiny_data["train"], "--workers", "0"])
    assert result.returncode == 2
    assert "does not match this model exactly: fc.bias is (3,) in the file but (5,) in the model" in result.stderr
    assert "Traceback" not in result.stderr and "top1" not in result.stdout
