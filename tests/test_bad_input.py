"""Bad input: one line naming the input and the fix, exit code 2, no traceback, nothing
written. Each case is a real process, as a user would start it."""
import os
import pickle

import pytest
import torch

from conftest import FAST, PYTHON, TORCHRUN, free_port, run, script, write_class_folder


class CreatesMarker:
    """A pickle that would create a file when unpickled (what weights_only=True must refuse)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _folder_with_classes(root, counts):
    import random

    rng = random.Random(0)
    names = ["daisy", "dandelion", "roses", "sunflowers", "tulips"]
    for name, count in zip(names, counts):
        write_class_folder(str(root), name, count, rng)
        if count == 0:
            open(os.path.join(root, name, "readme.txt"), "w").close()
    return str(root)


def case_missing_data_path(tmp, data):
    return ["--data-path", str(tmp / "nope")], ["--data-path", "no such folder", "flower_photos.tgz"]


def case_data_path_is_a_file(tmp, data):
    (tmp / "file.jpg").write_bytes(b"x")
    return ["--data-path", str(tmp / "file.jpg")], ["--data-path", "not a folder"]


def case_no_class_folders(tmp, data):
    (tmp / "empty").mkdir()
    return ["--data-path", str(tmp / "empty")], ["no class folders inside"]


def case_class_folder_without_images(tmp, data):
    return ["--data-path", _folder_with_classes(tmp / "d", [3, 0])], ["class folder 'dandelion' has no images"]


def case_one_class(tmp, data):
    return ["--data-path", _folder_with_classes(tmp / "d", [4])], ["found 1 class folder (daisy)", "at least 2"]


def case_num_classes_mismatch(tmp, data):
    return ["--data-path", data["train"], "--num-classes", "4"], ["--num-classes 4", "has 5 class folders"]


def case_empty_validation_split(tmp, data):
    return ["--data-path", data["train"], "--val-rate", "0.01"], ["--val-rate 0.01", "is empty", "--val-path"]


def case_val_path_with_other_classes(tmp, data):
    return (["--data-path", data["train"], "--val-path", _folder_with_classes(tmp / "v", [1, 1])],
            ["--val-path", "differ from --data-path's"])


def case_batch_larger_than_the_split(tmp, data):
    # 36 images and broken.jpg, listed by name: no image is opened before training
    return (["--data-path", data["train"], "--val-path", data["val"], "--batch-size", "38"],
            ["--batch-size 38", "only 37 of the 37 training images", "--batch-size 37 or less"])


def case_weights_missing(tmp, data):
    return ["--data-path", data["train"], "--weights", str(tmp / "none.pth")], ["--weights", "no such file"]


def case_weights_not_a_state_dict(tmp, data):
    torch.save([1, 2, 3], tmp / "list.pth")
    return ["--data-path", data["train"], "--weights", str(tmp / "list.pth")], ["not a state dict"]


def case_weights_that_would_run_code(tmp, data):
    with open(tmp / "evil.pth", "wb") as f:
        pickle.dump(CreatesMarker(str(tmp / "MARKER")), f)
    return ["--data-path", data["train"], "--weights", str(tmp / "evil.pth")], ["refused to load", "could run code"]


def case_weights_truncated(tmp, data):
    from model import create_model

    torch.save(create_model("resnet18", 5).state_dict(), tmp / "full.pth")
    blob = (tmp / "full.pth").read_bytes()
    (tmp / "cut.pth").write_bytes(blob[: len(blob) // 2])
    return ["--data-path", data["train"], "--weights", str(tmp / "cut.pth")], ["cannot be read", "truncated"]


def case_cuda_without_gpu(tmp, data):
    return ["--data-path", data["train"], "--device", "cuda"], ["--device cuda: no CUDA GPU is visible here"]


def case_eval_only_without_weights(tmp, data):
    return ["--data-path", data["train"], "--eval-only"], ["--eval-only needs --weights"]


def _weights_of_a_cats_and_dogs_run(tmp):
    """model-0.pth of a run on other classes, with its class_indices.json (no args.json)."""
    from model import create_model

    run_dir = tmp / "pets"
    run_dir.mkdir()
    torch.save(create_model("resnet18", 2).state_dict(), run_dir / "model-0.pth")
    (run_dir / "class_indices.json").write_text('{"0": "cats", "1": "dogs"}')
    return str(run_dir / "model-0.pth")


def case_eval_only_on_data_of_other_classes(tmp, data):
    return (["--data-path", data["train"], "--eval-only", "--weights", _weights_of_a_cats_and_dogs_run(tmp)],
            ["differ from the weights' class_indices.json ['cats', 'dogs']"])


def case_label_file_with_an_unknown_class(tmp, data):
    train = tmp / "train.csv"
    train.write_text("path,label\n" + "".join(f"{data['train']}/{c}/{c}_000.jpg,{c}\n" for c in ("daisy", "roses")))
    (tmp / "val.csv").write_text(f"path,label\n{data['val']}/tulips/tulips_000.jpg,tulips\n")
    return (["--train-list", str(train), "--val-list", str(tmp / "val.csv")],
            [f"--val-list {tmp / 'val.csv'}, line 2: class 'tulips' is not one of the training classes"])


def case_unknown_model(tmp, data):
    return ["--data-path", data["train"], "--model", "resnet9000"], ["--model resnet9000", "resnet18"]


def case_boolean_flag_given_a_value(tmp, data):
    # the tutorial's type=bool made "--freeze-layers False" mean True
    return ["--data-path", data["train"], "--freeze-layers", "False"], ["unrecognized arguments: False"]


def case_torchvision_weights_offline(tmp, data):
    return (["--data-path", data["train"], "--model", "resnet18", "--weights", "IMAGENET1K_V1"],
            ["--weights IMAGENET1K_V1: could not download", "resnet18-", "pass its path"])


def case_demo_over_real_data(tmp, data):
    return ["--demo", "--data-path", data["train"]], ["--demo --data-path", "exists and is not demo data"]


def case_class_entirely_in_validation(tmp, data):
    return (["--data-path", _folder_with_classes(tmp / "d", [3, 2]), "--val-rate", "0.75"],
            ["--val-rate 0.75", "class 'dandelion' has only 2 image(s)"])


def case_negative_momentum(tmp, data):
    return ["--data-path", data["train"], "--momentum", "-1"], ["--momentum -1.0: must not be negative"]


def case_resume_that_would_run_code(tmp, data):
    with open(tmp / "evil.pth", "wb") as f:
        pickle.dump({"model": CreatesMarker(str(tmp / "MARKER"))}, f)
    return ["--data-path", data["train"], "--resume", str(tmp / "evil.pth")], ["--resume", "refused to load"]


def case_resume_truncated(tmp, data):
    torch.save({"model": {"w": torch.zeros(1000)}, "optimizer": {}, "epoch": 0, "classes": [], "args": {}},
               tmp / "full.pth")
    blob = (tmp / "full.pth").read_bytes()
    (tmp / "cut.pth").write_bytes(blob[: len(blob) - 100])
    return ["--data-path", data["train"], "--resume", str(tmp / "cut.pth")], [f"--resume {tmp / 'cut.pth'}",
                                                                              "may be truncated"]


def case_resume_with_other_classes(tmp, data):
    from model import create_model

    out = tmp / "out"  # the run's --output-dir
    out.mkdir()
    torch.save({"model": create_model("resnet18", 2).state_dict(), "optimizer": {}, "epoch": 0,
                "classes": ["cats", "dogs"], "args": {"model": "resnet18"}}, out / "checkpoint.pth")
    return ["--data-path", data["train"], "--resume", "auto"], ["trained on classes ['cats', 'dogs']",
                                                                "start a new --output-dir"]


def case_fp16_on_cpu(tmp, data):
    return (["--data-path", data["train"], "--device", "cpu", "--amp", "fp16"],
            ["--amp fp16 on a CPU", "--amp bf16, off or auto"])


def case_zero_accumulation_steps(tmp, data):
    return ["--data-path", data["train"], "--accum-steps", "0"], ["--accum-steps 0: must be at least 1"]


def case_random_erase_above_one(tmp, data):
    return ["--data-path", data["train"], "--random-erase", "1.5"], ["--random-erase 1.5: must be from 0 to 1"]


def case_val_resize_below_the_crop(tmp, data):
    return (["--data-path", data["train"], "--val-resize-size", "16"],
            ["--val-resize-size 16: must be at least --img-size 32"])


def case_download_offline(tmp, data):
    """No network (the proxy goes nowhere): one line with the manual steps, no half dataset."""
    return ["--download", "--data-path", str(tmp / "flowers")], ["--download: cannot fetch", "tar xzf flower_photos.tgz"]


CASES = [v for k, v in sorted(globals().items()) if k.startswith("case_")]


def launch_bad_input(case, tmp_path, tiny_data):
    """Run train_single.py with ``case``'s flags in ``tmp_path``: (result, expected texts)."""
    argv, expected = case(tmp_path, tiny_data)
    env = {"TORCH_HOME": str(tmp_path / "torch_home"),  # empty cache, and no network:
           "https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "no_proxy": ""}
    # --epochs 1: a check that is gone shows as this case's failed assertion, not as a time-out
    result = run([PYTHON, script("train_single.py"), *FAST, "--epochs", "1", *argv, "--workers", "0",
                  "--output-dir", str(tmp_path / "out"), "--log-dir", str(tmp_path / "tb")], env=env, timeout=120)
    return result, expected


@pytest.fixture(scope="module")
def bad_input_runs(tiny_data, tmp_path_factory):
    """Every case's process, started two at a time (each is mostly start-up, one core's work),
    in a folder of its own: {case name: (folder, result, expected)}."""
    from concurrent.futures import ThreadPoolExecutor

    folders = {case.__name__: tmp_path_factory.mktemp(case.__name__) for case in CASES}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {case.__name__: pool.submit(launch_bad_input, case, folders[case.__name__], tiny_data)
                   for case in CASES}
        return {name: (folders[name], *future.result()) for name, future in futures.items()}


@pytest.mark.parametrize("case", CASES, ids=[c.__name__[5:] for c in CASES])
def test_bad_input_single(case, bad_input_runs):
    tmp_path, result, expected = bad_input_runs[case.__name__]
    out = tmp_path / "out"
    assert result.returncode == 2, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "error:" in last
    for text in expected:
        assert text in last, last
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "tb").exists()
    assert not out.exists() or os.listdir(out) == ["checkpoint.pth"]  # nothing written (some cases bring a file)
    assert not (tmp_path / "MARKER").exists()
    assert not (tmp_path / "flowers").exists() and not list(tmp_path.glob(".flower_photos-*"))


def test_download_offline_under_torchrun_stops_every_rank_at_once(tmp_path):
    """Local rank 0 downloads while rank 1 waits for the folder: when the download fails,
    rank 1 stops with the same message instead of waiting (or timing out a collective)."""
    env = {"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "no_proxy": ""}
    result = run([*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), script("train_multi_gpu.py"),
                  *FAST, "--epochs", "1", "--download", "--data-path", str(tmp_path / "data" / "flower_photos"),
                  "--output-dir", str(tmp_path / "out"), "--dist-timeout", "60"], env=env, timeout=50)
    assert result.returncode != 0
    assert "error: --download: cannot fetch" in result.stderr
    assert "collective timed out" not in result.stderr
    assert not (tmp_path / "data" / "flower_photos").exists() and not (tmp_path / "out").exists()


def test_nccl_on_cpu_is_refused(tiny_data, tmp_path):
    result = run([PYTHON, script("train_multi_gpu.py"), *FAST, "--epochs", "1", "--data-path", tiny_data["train"],
                  "--device", "cpu",
                  "--dist-backend", "nccl", "--output-dir", str(tmp_path / "out")],
                 env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": str(free_port())})
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --dist-backend nccl needs CUDA GPUs, but the device is cpu; use gloo"


def test_batch_larger_than_a_ranks_share_under_torchrun(tiny_data, tmp_path):
    """37 files (broken.jpg among them: no image is opened at start) over 2 ranks: 18 each.
    Both ranks stop; the error is printed once."""
    result = run([*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), script("train_multi_gpu.py"),
                  *FAST, "--epochs", "1", "--data-path", tiny_data["train"], "--val-path", tiny_data["val"],
                  "--batch-size", "19",
                  "--output-dir", str(tmp_path / "out")])
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == ["error: --batch-size 19: each of the 2 process(es) gets only 18 of the 37 training images; "
                      "use --batch-size 18 or less"], result.stderr
    assert not (tmp_path / "out").exists()
