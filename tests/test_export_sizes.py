"""Exports take every batch size the docs promise ("any batch size"), not just the example's:
a batch of 1 and of 200, beside the example of 2, give the eager model's logits (1e-4). The
.pt2 carries every run setting predict.py reads (run.json). In-process, a small conv net with
BatchNorm in eval mode, exported as export.py exports."""
import pytest
import torch
from torch import nn

import export
from multi_train_utils.run_files import RUN_KEYS, load_program

RUN = {"model": "tiny", "img_size": 16, "val_resize_size": 18, "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.3, 0.4],
       "classes": ["a", "b", "c"]}


def tiny_net():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(8, 3))
    net[1].running_mean.uniform_(-0.5, 0.5)
    return net.eval()


def check_every_batch_size(model, exported):
    for batch in (1, 2, 200):
        images = torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            expected = model(images)
        got = exported(images)
        assert got.shape == (batch, 3), batch
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4, msg=f"batch {batch}")


def trained_run(folder):
    """What export.py reads of a run in ``folder``: model-best.pth, args.json, class_indices.json."""
    import json

    from model import create_model

    torch.manual_seed(0)
    torch.save(create_model("shufflenet_v2_x0_5", 3).state_dict(), folder / "model-best.pth")
    (folder / "args.json").write_text(json.dumps({"model": "shufflenet_v2_x0_5", "img_size": 32}))
    (folder / "class_indices.json").write_text(json.dumps({"0": "a", "1": "b", "2": "c"}))


def test_a_pt2_takes_a_batch_of_1_and_of_200_and_carries_the_run(tmp_path):
    model = tiny_net()
    path = str(tmp_path / "tiny.pt2")
    exported = export.export_pt2(model, torch.randn(2, 3, 16, 16), path, RUN)
    check_every_batch_size(model, exported)
    _, run = load_program(path)
    # a run without channels: RGB; without multi_label: one class an image
    assert run == {"channels": 3, "task": None, "multi_label": False, "thresholds": None,
                   **{key: RUN[key] for key in RUN_KEYS}}
    assert set(RUN_KEYS) >= {"mean", "std", "classes"}
    # the program itself declares any batch size from 1 up (a torch that checks the declared
    # range refuses a single image otherwise, whatever this torch lets through)
    program = torch.export.load(path)
    images = program.graph_signature.user_inputs[0]
    batch = next(n.meta["val"].shape[0] for n in program.graph.nodes if n.name == images)
    ranges = {str(symbol): r for symbol, r in program.range_constraints.items()}
    assert (int(ranges[str(batch)].lower), str(ranges[str(batch)].upper)) == (1, "int_oo")


def test_an_onnx_model_takes_a_batch_of_1_and_of_200(tmp_path):
    for package in ("onnx", "onnxscript"):
        pytest.importorskip(package, reason="ONNX export is optional: pip install onnx onnxscript onnxruntime")
    pytest.importorskip("onnxruntime", reason="ONNX export is optional: pip install onnx onnxscript onnxruntime")
    model = tiny_net()
    exported = export.export_onnx(model, torch.randn(2, 3, 16, 16), str(tmp_path / "tiny.onnx"), RUN)
    check_every_batch_size(model, exported)


def test_export_py_checks_the_export_on_another_batch_size_than_its_example(tmp_path, monkeypatch):
    """An export specialised to its example's batch size would pass a check on that size: the
    check batch is another size (and other values)."""
    trained_run(tmp_path)
    seen = {}

    def exporter(model, example, path, run):
        seen["example"] = example.clone()
        open(path, "wb").close()

        def run_exported(images):
            seen["check"] = images.clone()
            return model(images)
        return run_exported

    monkeypatch.setitem(export.EXPORTERS, "pt2", exporter)
    export.main(["--weights", str(tmp_path / "model-best.pth")])
    assert (tmp_path / "model-best.pt2").is_file()
    example, check = seen["example"], seen["check"]
    assert example.shape[1:] == check.shape[1:] == (3, 32, 32)
    assert example.shape[0] != check.shape[0], (example.shape, check.shape)


@pytest.mark.parametrize("offset", [-1.0, 1.0])
def test_an_export_off_by_more_than_1e_4_either_way_is_refused_and_leaves_no_file(tmp_path, monkeypatch, offset):
    from multi_train_utils.errors import UserError

    trained_run(tmp_path)

    def exporter(model, example, path, run):
        open(path, "wb").close()
        return lambda images: model(images) + offset  # logits too high or too low

    monkeypatch.setitem(export.EXPORTERS, "pt2", exporter)
    with pytest.raises(UserError, match=r"the exported pt2 model differs from the eager one by 1\.00e\+00"):
        export.main(["--weights", str(tmp_path / "model-best.pth")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["args.json", "class_indices.json", "model-best.pth"]


@pytest.mark.parametrize("fmt, name", [("pt2", "model-best.pt2"), ("onnx", "model-best.onnx"),
                                       ("torchscript", "model-best.torchscript.pt")])
def test_each_format_has_its_default_name_beside_the_weights(tmp_path, monkeypatch, fmt, name):
    trained_run(tmp_path)

    def exporter(model, example, path, run):
        open(path, "wb").close()
        return model

    monkeypatch.setitem(export.EXPORTERS, fmt, exporter)
    export.main(["--weights", str(tmp_path / "model-best.pth"), "--format", fmt])
    assert (tmp_path / name).is_file()


def test_a_pt2_without_one_of_the_run_settings_is_refused_naming_it(tmp_path):
    """A .pt2 that export.py did not write (its run.json lacks a setting predict.py reads) is a
    one-line error naming what is missing, for each setting."""
    import json

    from multi_train_utils.errors import UserError

    program = torch.export.export(tiny_net(), (torch.randn(2, 3, 16, 16),))
    for missing in RUN_KEYS:
        path = str(tmp_path / f"without-{missing}.pt2")
        run = {key: RUN[key] for key in RUN_KEYS if key != missing}
        torch.export.save(program, path, extra_files={"run.json": json.dumps(run)})
        with pytest.raises(UserError, match=rf"has no run\.json with {missing} \(a program export\.py did not"):
            load_program(path)
