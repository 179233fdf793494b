"""Starting from pretrained weights, freezing, and the guard on an earlier run's files."""
import os
import shutil

import torch

from conftest import MODEL, PYTHON, assert_run_outputs, run, script, train_args


def test_imagenet_style_weights_load_except_the_head_and_freeze(tiny_data, tmp_path):
    """A 1000-class checkpoint (saved from DDP, so 'module.'-prefixed) starts a 5-class model:
    all but fc loads; with --freeze-layers only fc trains and BatchNorm statistics stay put."""
    from model import create_model

    pretrained = create_model(MODEL, 1000)
    with torch.no_grad():
        for p in pretrained.parameters():
            p.mul_(0.5)  # anything but the random init the run would draw
        for name, buf in pretrained.named_buffers():
            if name.endswith("running_var"):
                buf.fill_(2.0)
    state = {f"module.{k}": v for k, v in pretrained.state_dict().items()}
    state["module.aux.weight"] = torch.ones(3)  # a tensor the model lacks: skipped, not left at random init
    torch.save(state, tmp_path / "imagenet.pth")
    out = tmp_path / "out"
    result = run([PYTHON, script("train_single.py"),
                  *train_args(tiny_data, out, "--epochs", "1", "--workers", "0", "--lr", "0.05",
                              "--weights", str(tmp_path / "imagenet.pth"), "--freeze-layers")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "skipped ['module.fc.bias', 'module.fc.weight']" not in result.stdout  # prefixes are stripped
    assert "; skipped ['aux.weight', 'fc.bias', 'fc.weight']; left at random init ['fc.bias', 'fc.weight']" \
        in result.stdout
    head = pretrained.fc.in_features * 5 + 5  # the 5-class head's weights and biases
    assert f"freeze-layers: training only 'fc' ({head:,} parameters)" in result.stdout
    trained = torch.load(out / "model-0.pth", weights_only=True)
    for key, value in pretrained.state_dict().items():
        if key.startswith("fc."):
            assert trained[key].shape[0] == 5
        elif not key.endswith("num_batches_tracked"):
            torch.testing.assert_close(trained[key], value, rtol=0, atol=0, msg=key)
    fresh = create_model(MODEL, 5)
    assert not torch.equal(trained["fc.weight"], fresh.fc.weight)


def test_earlier_run_is_kept_unless_overwrite(single_run, tiny_data, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(single_run["out"], out)
    (out / "model-7.pth").write_bytes((out / "model-1.pth").read_bytes())
    (out / "notes.txt").write_text("mine")
    for name in ("model-final-for-paper.pth", "model-best.onnx", ".notes.tmp"):  # the user's, by their names
        (out / name).write_bytes(b"mine")
    (out / "checkpoint.pth.damaged").write_bytes(b"")  # the template's
    earlier_multi_label = ("thresholds.json", "per_class_metrics.csv", "per_class_ap.png", "pr_curves.png")
    for name in earlier_multi_label:  # the template's too: an earlier multi-label run's (this one is single-label)
        (out / name).write_bytes(b"earlier")
    before = {p: os.stat(out / p).st_mtime_ns for p in os.listdir(out) if p != "run.lock"}  # (any run takes the lock)

    refused = run([PYTHON, script("train_single.py"), *train_args(tiny_data, out, "--epochs", "1", "--workers", "0")])
    assert refused.returncode == 2
    assert refused.stderr.strip() == (f"error: --output-dir {out}: holds checkpoints of an earlier run "
                                      "(model-0.pth, model-1.pth, model-7.pth, ...); pass --resume auto to continue "
                                      "it, --overwrite to replace it, or choose another --output-dir")
    assert {p: os.stat(out / p).st_mtime_ns for p in os.listdir(out) if p != "run.lock"} == before

    replaced = run([PYTHON, script("train_single.py"),
                    *train_args(tiny_data, out, "--epochs", "1", "--workers", "0", "--overwrite")])
    assert replaced.returncode == 0, replaced.stdout + replaced.stderr
    assert_run_outputs(str(out), epochs=1)  # model-1 and model-7 of the earlier run are gone
    assert not (out / "checkpoint-prev.pth").exists()  # the earlier run's checkpoints too
    assert not (out / "checkpoint.pth.damaged").exists()
    assert [name for name in earlier_multi_label if (out / name).exists()] == []
    for name in ("notes.txt", "model-final-for-paper.pth", "model-best.onnx", ".notes.tmp"):
        assert (out / name).read_bytes() == b"mine", name  # the user's own files stay
