"""Each refusal that no run of the other tests reaches: the flags that do not go together,
predict.py's and export.py's inputs, weights that do not fit, a device that is not there, a
label file that is not one. In-process: each case checks the one line (it names the input
and what to do) and, beside it, that the value just inside is taken. test_bad_input.py
checks how such a line reaches the user (exit code 2, no traceback)."""
import os

import pytest
import torch
import torch.nn as nn

import multi_train_utils.model_setup as model_setup
import multi_train_utils.model_setup as weights_file
import predict
from conftest import SCRIPTS, full_flags
from multi_train_utils.options import config_of  # noqa: E402
from conftest import parse_flags as parse
from multi_train_utils import distributed_utils, run_files as exported, pictures
from multi_train_utils.checkpoint import load_checkpoint
from multi_train_utils.errors import UserError
from multi_train_utils.run_files import check_datasets
from multi_train_utils.run_files import read_run_settings
from multi_train_utils.datasets import Datasets
from utils import read_label_files


def load_data(args, build_datasets, **kwargs):
    """inputs.load_data as the scripts call it: the flags' Config, and build_datasets handed the flags."""
    from multi_train_utils.run_files import load_data as load

    return load(config_of(args), lambda: build_datasets(args), **kwargs)


def refusal(call, *args, **kwargs):
    """The UserError's line of ``call(*args, **kwargs)``; no refusal fails the test."""
    with pytest.raises(UserError) as caught:
        call(*args, **kwargs)
    line = str(caught.value)
    assert "\n" not in line, line
    return line


# --- Flags that do not go together, on both scripts -------------------------------------------------
@pytest.mark.parametrize("distributed", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_flags_that_do_not_go_together_are_one_line_each(distributed, tmp_path):
    weights = tmp_path / "model-best.pth"
    weights.write_bytes(b"")  # --eval-only reads the run's settings only where args.json is
    a_file = tmp_path / "report.txt"
    a_file.write_text("mine")
    d = ["--data-path", str(tmp_path)]
    cases = [
        (d + ["--eval-output", str(tmp_path / "out")], ["--eval-output is for --eval-only", "--output-dir"]),
        (d + ["--eval-only", "--weights", str(weights), "--eval-output", str(a_file)],
         [f"--eval-output {a_file}: is a file; give a folder"]),
        (["--download", "--demo"], ["--download and --demo do not go together"]),
        (d + ["--resume", "auto", "--eval-only", "--weights", str(weights)],
         ["--resume and --eval-only do not go together", "--weights"]),
        (["--train-list", str(a_file), "--data-path", str(tmp_path)], ["--data-path with --train-list", "drop --data-path"]),
        (d + ["--val-list", str(a_file)], ["--val-list needs --train-list"]),
        (["--train-list", str(a_file), "--val-path", str(tmp_path)], ["--val-path is for class folders", "--val-list"]),
        (["--train-list", str(a_file), "--demo"], ["--train-list with --demo"]),
        (["--train-list", str(a_file), "--download"], ["--train-list with --download"]),
        (d + ["--img-size", "64", "--val-resize-size", "63"], ["--val-resize-size 63: must be at least --img-size 64"]),
    ]
    for flags, expected in cases:
        line = refusal(parse, distributed, *flags)
        for text in expected:
            assert text in line, (flags, line)
    # each flag alone, and the value at the edge, are taken
    assert parse(distributed, *d, "--eval-only", "--weights", str(weights), "--eval-output",
                 str(tmp_path / "out")).eval_output == str(tmp_path / "out")
    assert parse(distributed, "--demo").demo and parse(distributed, "--download").download
    assert parse(distributed, *d, "--img-size", "64", "--val-resize-size", "64").val_resize_size == 64
    assert parse(distributed, "--train-list", str(a_file), "--val-list", str(a_file)).val_list == str(a_file)


def test_compile_with_data_parallel_is_refused_and_each_alone_is_taken(tmp_path):
    d = ["--data-path", str(tmp_path)]
    line = refusal(parse, False, *d, "--compile", "--data-parallel")
    assert "--compile with --data-parallel" in line and "train_multi_gpu.py --compile" in line
    assert parse(False, *d, "--compile").compile and parse(False, *d, "--data-parallel").data_parallel


# --- predict.py -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--top-k", "--batch-size"])
def test_predict_refuses_zero_top_k_or_batch_before_reading_anything(flag, tmp_path):
    line = refusal(predict.main, ["--weights", str(tmp_path / "none.pth"), "--image", str(tmp_path / "none"), flag, "0"])
    assert line == "--top-k and --batch-size must be at least 1"


def test_predict_names_a_missing_image_and_a_folder_without_images(tmp_path):
    assert refusal(predict.find_images, str(tmp_path / "nope")) == f"--image {tmp_path / 'nope'}: no such file or folder"
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / ".hidden.jpg").write_bytes(b"x")
    line = refusal(predict.find_images, str(tmp_path))
    assert line.startswith(f"--image {tmp_path}: no image files in that folder (") and ".jpg" in line


def test_predict_finds_images_by_extension_in_any_case_first_and_last_included(tmp_path):
    names = ["A.JPG", "b.png", "c.Jpeg", "d.txt", "z.WEBP"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "e.BMP").write_bytes(b"x")
    found, unreadable = predict.find_images(str(tmp_path))
    assert [os.path.relpath(p, tmp_path) for p in found] == ["A.JPG", "b.png", "c.Jpeg", "z.WEBP", os.path.join("sub", "e.BMP")]
    assert unreadable == []


# --- Weights that do not fit ---------------------------------------------------------------------------
class NoHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.out = nn.Linear(2, 3)


def test_weights_that_do_not_fit_are_named_with_counts_and_an_example():
    net = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 4))  # 0.weight 0.bias 1.weight 1.bias
    line = refusal(weights_file.load_matching_weights, net, {"other.weight": torch.zeros(1)}, source="--weights w.pth")
    assert line.startswith("--weights w.pth: none of its tensors fit this model")
    state = {"0.weight": torch.zeros(3, 2), "extra.a": torch.zeros(1), "extra.b": torch.zeros(1), "extra.c": torch.zeros(1)}
    line = refusal(weights_file.load_exact_weights, net, state, source="--weights w.pth")
    assert "3 missing (e.g. 0.bias)" in line and "3 unexpected (e.g. extra.a)" in line, line
    # a single matching tensor is enough for load_matching_weights
    skipped, not_loaded = weights_file.load_matching_weights(net, {"0.weight": torch.ones(3, 2)})
    assert skipped == [] and not_loaded == ["0.bias", "1.bias", "1.weight"]
    assert torch.equal(net[0].weight, torch.ones(3, 2))


def test_a_model_without_a_head_cannot_freeze_its_layers_and_the_last_head_is_the_one():
    assert refusal(model_setup.head_name, NoHead()).startswith("--freeze-layers: this model has no child named fc")
    net = nn.Module()
    net.fc, net.body, net.head = nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)
    assert model_setup.head_name(net) == "head"


def test_a_torchvision_weights_name_that_does_not_exist_is_named_with_the_model():
    line = refusal(weights_file.read_weights, "IMAGENET9K_V9", "resnet18")
    assert line == "--weights IMAGENET9K_V9: no such file, nor torchvision weights for resnet18"


def test_weights_without_their_runs_settings_ask_for_the_flags(tmp_path):
    weights = tmp_path / "model-best.pth"
    weights.write_bytes(b"x")
    line = refusal(read_run_settings, str(weights))
    assert "give --model and --img-size" in line and str(weights) in line
    line = refusal(read_run_settings, str(weights), model="resnet18", img_size=32)
    assert line == f"{tmp_path / 'class_indices.json'}: not found; give --class-indices (the run's class_indices.json)"
    (tmp_path / "mine.json").write_text('{"0": "cat", "1": "dog"}')
    assert read_run_settings(str(weights), model="resnet18", img_size=32, class_indices=str(tmp_path / "mine.json")) == (
        "resnet18", 32, ["cat", "dog"])


def test_a_pt2_that_is_missing_or_not_a_program_is_one_line(tmp_path):
    line = refusal(exported.load_program, str(tmp_path / "none.pt2"))
    assert line.startswith(f"--weights {tmp_path / 'none.pt2'}: no such file") and "export.py" in line
    (tmp_path / "text.pt2").write_text("not a program")
    line = refusal(exported.load_program, str(tmp_path / "text.pt2"))
    assert line.startswith(f"--weights {tmp_path / 'text.pt2'}: not a torch.export program")


def test_weights_alone_are_not_a_checkpoint_to_resume(tmp_path):
    path = tmp_path / "model-3.pth"
    torch.save({"fc.weight": torch.zeros(2, 2)}, path)
    line = refusal(load_checkpoint, str(path))
    assert line.startswith(f"--resume {path}: not a full checkpoint (needs ['args', 'classes', 'epoch', 'model', 'optimizer'])")
    assert "--weights" in line


def test_curves_of_a_run_without_epochs_yet_are_refused(tmp_path):
    (tmp_path / "metrics.csv").write_text("epoch,train_loss\n")
    assert refusal(pictures.main, [str(tmp_path)]) == f"{tmp_path}/metrics.csv has no epochs yet"
    assert not (tmp_path / "curves.png").exists()


# --- Devices --------------------------------------------------------------------------------------------
def test_a_device_that_is_not_there_is_named(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert refusal(distributed_utils.select_device, "mps").startswith("--device mps: no Apple GPU")
    assert refusal(distributed_utils.select_device, "gpu0") == (
        "--device gpu0: not a device; use auto, cpu, cuda, cuda:N or mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert refusal(distributed_utils.select_device, "cuda:2") == "--device cuda:2: only 2 GPU(s) visible (cuda:0 to cuda:1)"
    assert distributed_utils.select_device("cuda:1", make_current=False) == torch.device("cuda", 1)
    assert distributed_utils.select_device("cuda", local_rank=1, local_world_size=2, make_current=False) == torch.device("cuda", 1)


# --- Label files and datasets ---------------------------------------------------------------------------
def _label_file(tmp_path, lines):
    for name in ("a.png", "b.png", "c.png", "d.png"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "train.csv")


def test_a_label_file_skips_blank_lines_and_refuses_what_csv_cannot_read(tmp_path):
    path = _label_file(tmp_path, ["path,label", "a.png,cat", "", "  ,  ", "b.png,cat", "c.png,dog", "", "d.png,dog"])
    split = read_label_files(path, val_rate=0.5, seed=0)
    assert sorted(split.train_images_label + split.val_images_label) == [0, 0, 1, 1]
    assert split.classes == ["cat", "dog"] and len(split.val_images_path) == 2
    line = refusal(read_label_files, path, val_rate=0.0)
    assert line.startswith("--val-rate 0.0: the validation split of 4 images is empty") and "--val-list" in line
    path = _label_file(tmp_path, ["path,label", "a.png," + "x" * 200_000, "b.png,dog"])
    assert refusal(read_label_files, path).startswith(f"--train-list {path}: not a readable CSV file (")


@pytest.mark.parametrize("row", ["c.png", "c.png,dog,extra", "c,png,dog"])
def test_a_label_row_of_other_than_two_fields_is_named_with_its_file_and_line(tmp_path, row):
    """data.md: a wrong row is one line naming the file and line; a row is path,label: one
    field, a third column or a path with an unquoted comma are refused, not cut to two."""
    path = _label_file(tmp_path, ["path,label", "a.png,cat", "b.png,dog", row, "d.png,dog"])
    line = refusal(read_label_files, path)
    assert line == f"--train-list {path}, line 4: expected path,label; found {row!r}"
    quoted = _label_file(tmp_path, ["path,label", "a.png,cat", "b.png,dog", '"c.png",dog', "d.png,cat"])
    assert sorted(read_label_files(quoted, val_rate=0.5, seed=0).classes) == ["cat", "dog"]  # two fields: taken


def test_a_dataset_with_labels_that_are_not_integers_or_that_is_empty_is_named():
    good = [(torch.zeros(3, 4, 4, dtype=torch.uint8), 0), (torch.zeros(3, 4, 4, dtype=torch.uint8), 1)]

    class Listed(list):
        def __init__(self, items, targets):
            super().__init__(items)
            self.targets = targets

    line = refusal(check_datasets, Datasets(Listed(good, ["cat", "dog"]), good, ["cat", "dog"]))
    assert line == "my_dataset.build_datasets: the training dataset: its labels (targets) must be integers 0 to 1"
    line = refusal(check_datasets, Datasets(good, [], ["cat", "dog"]))
    assert line == "my_dataset.build_datasets: the validation dataset is empty"
    line = refusal(check_datasets, Datasets(good, good, ["cat"]))
    assert line.startswith("my_dataset.build_datasets: 1 class name(s) ['cat']; a classifier needs at least 2")
    check_datasets(Datasets(Listed(good, [0, 1]), good, ["cat", "dog"]))  # what fits is taken


@pytest.mark.parametrize("given, refused", [("0", True), ("1", True), ("2", False), ("3", True)])
def test_num_classes_must_equal_the_datas_count_zero_included(given, refused, tmp_path):
    import random

    from conftest import write_class_folder
    from my_dataset import build_datasets

    rng = random.Random(0)
    for name in ("daisy", "roses"):
        write_class_folder(str(tmp_path / "data"), name, 5, rng)
    args = parse(False, "--data-path", str(tmp_path / "data"), "--num-classes", given, "--batch-size", "2")
    if refused:
        line = refusal(load_data, args, build_datasets)
        assert line.startswith(f"--num-classes {given}: {tmp_path / 'data'} has 2 class folders (daisy, roses)"), line
    else:
        assert list(load_data(args, build_datasets).classes) == ["daisy", "roses"]


def test_more_processes_than_gpus_share_them_round_robin_under_gloo_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    select = distributed_utils.select_device
    # no store to compare GPUs through: gloo shares them round robin, NCCL is refused
    assert [select("cuda", r, 5, None, shared_gpu_ok=True, make_current=False).index for r in range(5)] == [0, 1, 0, 1, 0]
    assert refusal(select, "cuda", 2, 3, None, make_current=False) == (
        "3 processes per node but only 2 GPU(s) visible: use --nproc_per_node=2 or fewer")
    # each process sees the same two GPUs: shared (gloo) or refused (NCCL), naming every rank that shares
    peers = [{"local_rank": r, "gpus": ["uuid-a", "uuid-b"]} for r in range(3)]
    assert [select("cuda", r, 3, peers, shared_gpu_ok=True, make_current=False).index for r in range(3)] == [0, 1, 0]
    assert refusal(select, "cuda", 1, 3, peers, make_current=False).startswith("local ranks 0, 1, 2 of this node share GPU(s)")
    # each its own GPU (SLURM's --gpus-per-task=1): its first visible one, under NCCL too
    own = [{"local_rank": r, "gpus": [f"uuid-{r}", f"uuid-{r}b"]} for r in range(3)]
    assert [select("cuda", r, 3, own, make_current=False).index for r in range(3)] == [0, 0, 0]


def test_find_classes_lists_the_visible_sub_folders_sorted_first_and_last_included(tmp_path):
    from multi_train_utils.datasets import find_classes

    for name in ("zebra", "Ant", "bee", ".cache", "mid dle"):
        (tmp_path / name).mkdir()
    (tmp_path / "notes.txt").write_text("x")
    assert find_classes(str(tmp_path)) == ["Ant", "bee", "mid dle", "zebra"]
    assert refusal(find_classes, str(tmp_path / "zebra")).startswith(f"--data-path {tmp_path / 'zebra'}: no class folders")


@pytest.mark.parametrize("value, why", [("abc", "'abc' is not a number"), ("nan", "'nan' is not a finite number"),
                                        ("inf", "'inf' is not a finite number")])
def test_a_float_flag_that_is_not_a_finite_number_is_named(value, why, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse(False, "--data-path", "d", "--lr", value)
    assert stopped.value.code == 2
    assert f"argument --lr: {why}" in capsys.readouterr().err
    assert parse(False, "--data-path", "d", "--lr", "1e-3").lr == pytest.approx(1e-3)


def test_the_doctor_refuses_nccl_without_gpus_and_a_backend_not_built_in(monkeypatch):
    from conftest import LAUNCHER_VARIABLES
    from tools import doctor

    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert refusal(doctor.main, ["--device", "cpu", "--backend", "nccl"]) == (
        "--backend nccl needs CUDA GPUs, but the device is cpu; use gloo")
    monkeypatch.setattr(doctor.dist, "is_backend_available", lambda backend: backend != "gloo")
    assert refusal(doctor.main, ["--device", "cpu", "--backend", "gloo"]) == (
        "--backend gloo: not built into this torch; use gloo or nccl")


# --- Archives, the doctor's folder, the benchmark's process counts ----------------------------------
def test_an_archive_that_is_not_one_folder_of_classes_is_refused_and_leaves_nothing(tmp_path):
    import tarfile

    from multi_train_utils.datasets import extract_dataset

    for name in ("one", "two"):
        (tmp_path / "src" / name / "daisy").mkdir(parents=True)
    two_tops = tmp_path / "two.tgz"
    with tarfile.open(two_tops, "w:gz") as tar:
        tar.add(tmp_path / "src" / "one", arcname="one")
        tar.add(tmp_path / "src" / "two", arcname="two")
    (tmp_path / "data").mkdir()
    root = tmp_path / "data" / "flower_photos"
    assert refusal(extract_dataset, str(two_tops), str(root)) == "--download: the archive holds 2 top folders, expected one"
    (tmp_path / "cut.tgz").write_bytes(two_tops.read_bytes()[:40])
    assert refusal(extract_dataset, str(tmp_path / "cut.tgz"), str(root)).startswith(
        "--download: the archive cannot be extracted (")
    assert os.listdir(tmp_path / "data") == []  # no half-extracted folder left beside it


def test_the_doctor_refuses_an_output_dir_that_is_a_file(tmp_path):
    from tools import doctor

    (tmp_path / "f").write_text("mine")
    args = doctor.get_args_parser().parse_args(["--output-dir", str(tmp_path / "f")])
    assert refusal(doctor.check_args, args) == f"--output-dir {tmp_path / 'f'}: a file, not a folder"
    doctor.check_args(doctor.get_args_parser().parse_args(["--output-dir", str(tmp_path)]))


@pytest.mark.parametrize("max_processes, counts", [(None, [1, 2, 4, 6]), (2, [1, 2]), (3, [1, 2, 3]), (1, [1])])
def test_the_benchmark_scales_up_to_max_processes_or_the_cores(monkeypatch, max_processes, counts):

    import benchmark

    monkeypatch.setattr(benchmark, "cpu_cores_available", lambda: 6)
    monkeypatch.setattr(benchmark, "measure_scaling", lambda args, data, k, dev: (10.0 * k, {}))
    rows = benchmark.scaling_rows(full_flags(max_processes=max_processes), "d", torch.device("cpu"), 1000, {})
    assert [r["processes"] for r in rows] == counts


# --- A resume whose states do not fit --------------------------------------------------------------------
def test_a_checkpoint_whose_optimizer_or_ema_does_not_fit_is_one_line_and_changes_nothing():
    from multi_train_utils.checkpoint import TrainState, restore_training_state
    from multi_train_utils.model_setup import ModelEma

    def state_of(net, ema=False):
        return TrainState(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                          ema=ModelEma(net, 0.9) if ema else None)

    other = state_of(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 4)), ema=True)
    saved = {"optimizer": other.optimizer.state_dict(), "model_ema": other.ema.state_dict(), "epoch": 4,
             "rng": {}, "best_value": None}
    mine = state_of(nn.Linear(2, 2))
    line = refusal(restore_training_state, mine, saved)
    assert line.startswith("--resume: the checkpoint's optimizer state does not fit this model (")
    assert mine.epoch == 0
    mine = state_of(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 5)), ema=True)  # the same parameter count
    line = refusal(restore_training_state, mine, saved)
    assert line.startswith("--resume: the checkpoint's EMA weights do not fit this model (") and line.endswith(
        "resume from another checkpoint, or start over with --overwrite")
    assert mine.epoch == 0 and mine.ema.updates == 0


def test_the_data_a_run_cannot_use_is_one_line_naming_why(tmp_path):

    def missing(args):
        raise FileNotFoundError(2, "No such file or directory", "/data/gone")

    args = parse(False, "--data-path", str(tmp_path), "--batch-size", "1")
    line = refusal(load_data, args, missing)
    assert line.startswith("my_dataset.build_datasets: [Errno 2] No such file or directory: '/data/gone'")
    assert line.endswith("check --data-path (or where your datasets read)")
    two = [(torch.zeros(3, 4, 4, dtype=torch.uint8), 0), (torch.zeros(3, 4, 4, dtype=torch.uint8), 1)]
    tiny = lambda args: Datasets(two, two, ["cat", "dog"])  # noqa: E731
    assert refusal(load_data, args, tiny, world_size=3) == (
        "3 processes but only 2 training images; start fewer processes or add images")
    assert list(load_data(args, tiny, world_size=2).classes) == ["cat", "dog"]  # one image each: taken
    line = refusal(load_data, parse(False, "--data-path", str(tmp_path), "--batch-size", "2"), tiny, world_size=2)
    assert line == ("--batch-size 2: each of the 2 process(es) gets only 1 of the 2 training images; "
                    "use --batch-size 1 or less")


@pytest.mark.parametrize("readable", [0, 1])
def test_a_validation_where_no_image_could_be_read_stops_the_run_in_one_line(readable):
    """All images left out (labelled -1): the data is likely gone, a MidRunError; one image
    read is a result, the others counted as left out."""
    from multi_train_utils.errors import MidRunError
    from multi_train_utils.train_eval_utils import evaluate
    from multi_train_utils.datasets import LEFT_OUT

    net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    labels = [LEFT_OUT] * 3 + [1] * readable
    batches = [(torch.zeros(len(labels), 3, 4, 4, dtype=torch.uint8), torch.tensor(labels))]
    if readable:
        result = evaluate(net, batches, torch.device("cpu"), 2)
        assert (result.total, result.left_out) == (1, 3)
    else:
        with pytest.raises(MidRunError) as stopped:
            evaluate(net, batches, torch.device("cpu"), 2)
        assert str(stopped.value).startswith("none of the 3 validation images could be read: is the data still there")


@pytest.mark.parametrize("distributed", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_eval_only_names_a_data_folder_of_the_run_that_is_gone_and_takes_one_given(distributed, tmp_path):
    import json

    run = tmp_path / "run"
    run.mkdir()
    (run / "model-best.pth").write_bytes(b"")
    (tmp_path / "train").mkdir()
    (run / "args.json").write_text(json.dumps({"model": "resnet18", "img_size": 64, "data_path": str(tmp_path / "train"),
                                               "val_path": str(tmp_path / "gone")}))
    weights = str(run / "model-best.pth")
    line = refusal(parse, distributed, "--eval-only", "--weights", weights)
    assert line == (f"--val-path {tmp_path / 'gone'} (from {run / 'args.json'}) is not there any more; give --val-path")
    (tmp_path / "mine").mkdir()
    args = parse(distributed, "--eval-only", "--weights", weights, "--data-path", str(tmp_path / "mine"))
    assert (args.data_path, args.val_path, args.model, args.img_size) == (str(tmp_path / "mine"), None, "resnet18", 64)


@pytest.mark.parametrize("distributed", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_a_balancing_flag_on_a_dataset_without_targets_names_the_flag(distributed):
    from multi_train_utils.loaders import loss_class_weights, make_train_sampler

    items = [(torch.zeros(3, 2, 2), 0)] * 3
    line = refusal(make_train_sampler, parse(distributed, "--data-path", "d", "--sampler", "balanced"), items, 1, 0)
    assert line.startswith("--sampler balanced: the training dataset has no .targets") and "leave the flag out" in line
    from multi_train_utils.options import task_of

    def weights(args, dataset):
        return loss_class_weights(task_of(args), args.class_weights, dataset, 2)

    line = refusal(weights, parse(distributed, "--data-path", "d", "--class-weights", "balanced"), items)
    assert line.startswith("--class-weights balanced: the training dataset has no .targets")

    class Targeted(list):
        targets = [0, 1, 1]

    made = weights(parse(distributed, "--data-path", "d", "--class-weights", "balanced"), Targeted(items))
    assert made.tolist() == pytest.approx([1.5, 0.75])  # n / (classes x count): 3 / (2 x 1), 3 / (2 x 2)
    assert weights(parse(distributed, "--data-path", "d"), items) is None


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_contract_takes_uint8_or_any_float_images(dtype):
    """my_dataset.py's contract: a uint8 CHW image, or a float one in [0, 1], of any float dtype."""
    value = 255 if dtype == torch.uint8 else 1.0
    items = [(torch.full((3, 4, 4), value, dtype=dtype), 0), (torch.zeros(3, 4, 4, dtype=dtype), 1)]
    try:
        check_datasets(Datasets(items, items, ["cat", "dog"]))
    except UserError as e:
        raise AssertionError(f"{dtype} images refused: {e}") from None
    if dtype != torch.uint8:  # above 1: refused, naming the value
        high = [(torch.full((3, 4, 4), 2.0, dtype=dtype), 0)] + items[1:]
        assert "float with values up to 2" in refusal(check_datasets, Datasets(high, items, ["cat", "dog"]))


def test_check_images_skips_unreadable_files_of_both_label_files(tmp_path):
    from PIL import Image

    for name in ("a", "b", "c", "d"):
        Image.new("RGB", (4, 4)).save(tmp_path / f"{name}.png")
    (tmp_path / "bad_train.png").write_bytes(b"not an image")
    (tmp_path / "bad_val.png").write_bytes(b"not an image")
    (tmp_path / "train.csv").write_text("path,label\na.png,cat\nb.png,dog\nbad_train.png,dog\n")
    (tmp_path / "val.csv").write_text("path,label\nc.png,cat\nbad_val.png,cat\nd.png,dog\n")
    split = read_label_files(str(tmp_path / "train.csv"), str(tmp_path / "val.csv"), check_images=True)
    assert [os.path.basename(p) for p in split.train_images_path] == ["a.png", "b.png"]
    assert [os.path.basename(p) for p in split.val_images_path] == ["c.png", "d.png"]
    assert sorted(os.path.basename(p) for p in split.skipped) == ["bad_train.png", "bad_val.png"]
    unchecked = read_label_files(str(tmp_path / "train.csv"), str(tmp_path / "val.csv"))
    assert len(unchecked.val_images_path) == 3 and unchecked.skipped == []  # without it, nothing is opened
