"""The fast path: precision choice, uint8 decoding, normalisation on the device, gradient
accumulation, clipping, activation checkpointing, torch.compile, a loop without per-step
host syncs, and benchmark.py's smoke test."""
import argparse
import io
import json
import os
import random

import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

from conftest import CORES, PYTHON, REPO, run
from model import create_model, plain_state_dict
from multi_train_utils import performance
from multi_train_utils.errors import RankError, UserError
from multi_train_utils.performance import Precision, choose_precision, enable_grad_checkpoint, optimize_model
from multi_train_utils.train_eval_utils import DeviceNormalizer, LoopSettings, train_one_epoch
from my_dataset import read_image_uint8
from utils import IMAGENET_MEAN, IMAGENET_STD, DEMO_CLASSES, _draw_flower

CPU = torch.device("cpu")


# --- --amp ------------------------------------------------------------------------------------

@pytest.mark.parametrize("native, expected", [(True, "bf16"), (False, "off")])
def test_auto_precision_on_cpu(monkeypatch, native, expected):
    monkeypatch.setattr(performance, "cpu_runs_bf16_natively", lambda: native)
    assert choose_precision("auto", CPU).mode == expected


@pytest.mark.parametrize("major, expected", [(9, "bf16"), (8, "bf16"), (7, "fp16")])
def test_auto_precision_on_gpus(monkeypatch, major, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    precision = choose_precision("auto", torch.device("cuda", 0))
    assert precision.mode == expected


def test_precision_requests_that_cannot_work_are_errors(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Old GPU")
    with pytest.raises(UserError, match="--amp bf16: Old GPU has no bf16"):
        choose_precision("bf16", torch.device("cuda", 0))
    with pytest.raises(UserError, match="--amp fp16 on a CPU"):
        choose_precision("fp16", CPU)
    assert choose_precision("off", CPU).mode == "off"
    assert choose_precision("bf16", CPU).mode == "bf16"  # asked for: emulated where not native


def test_this_cpus_bf16_flag_matches_proc_cpuinfo():
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split())
    assert performance.cpu_runs_bf16_natively() == bool({"avx512_bf16", "amx_bf16"} & flags)


# --- Decoding and normalisation ---------------------------------------------------------------

def flower(size, seed=0):
    rng = random.Random(seed)
    return _draw_flower(rng, *DEMO_CLASSES["daisy"], size)


def test_jpeg_decodes_to_the_same_pixels_as_pil(tmp_path):
    path = tmp_path / "a.jpg"
    flower((90, 70)).save(path, quality=90)
    ours = read_image_uint8(str(path))
    pil = torch.from_numpy(__import__("numpy").array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
    assert ours.dtype == torch.uint8 and ours.shape == (3, 70, 90)
    assert (ours.float() - pil.float()).abs().mean() < 1.0


def test_odd_modes_become_rgb(tmp_path):
    gray, rgba = tmp_path / "gray.jpg", tmp_path / "rgba.png"
    flower((40, 30)).convert("L").save(gray)
    clear = Image.new("RGBA", (20, 10), (255, 0, 0, 0))  # fully transparent red
    clear.save(rgba)
    assert read_image_uint8(str(gray)).shape == (3, 30, 40)
    assert read_image_uint8(str(rgba)).eq(255).all()  # transparent pixels go on white


def test_large_jpegs_are_decoded_at_reduced_size_but_never_below_keep_side(tmp_path):
    path = tmp_path / "big.jpg"
    flower((800, 600)).save(path)
    assert read_image_uint8(str(path)).shape == (3, 600, 800)
    reduced = read_image_uint8(str(path), keep_side=140)
    assert reduced.shape == (3, 150, 200)  # 1/4 size: the largest reduction that keeps >= 140
    assert read_image_uint8(str(path), keep_side=400).shape == (3, 600, 800)  # 1/2 would be too small


def test_truncated_jpeg_is_named(tmp_path):
    path = tmp_path / "cut.jpg"
    buffer = io.BytesIO()
    flower((64, 64)).save(buffer, "JPEG")
    path.write_bytes(buffer.getvalue()[:300])
    with pytest.raises(RankError, match="cut.jpg"):
        read_image_uint8(str(path))


def test_device_normalizer_matches_torchvision_normalize():
    from torchvision.transforms import v2

    images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    expected = v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)(v2.ToDtype(torch.float32, scale=True)(images))
    normalized, labels = DeviceNormalizer(CPU, channels_last=True)(images, torch.tensor([1, 2]))
    torch.testing.assert_close(normalized, expected, rtol=0, atol=1e-5)
    assert normalized.is_contiguous(memory_format=torch.channels_last) and labels.tolist() == [1, 2]


# --- The training loop -------------------------------------------------------------------------

class RandomImages(Dataset):
    def __init__(self, n, size=16):
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(0, 3, (n,), generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def small_net():
    """No BatchNorm: its output does not depend on how images are grouped into batches."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


def train(model, batch_size, settings, images=16, lr=0.1, momentum=0.9):
    loader = DataLoader(RandomImages(images), batch_size=batch_size, shuffle=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return train_one_epoch(model, optimizer, loader, CPU, 0, settings=settings)


@pytest.mark.parametrize("micro_batch, accum, batch", [(2, 2, 4), (4, 4, 16)])
def test_accumulated_micro_batches_equal_one_big_batch(micro_batch, accum, batch):
    accumulated, big = small_net(), small_net()
    train(accumulated, micro_batch, LoopSettings(accum_steps=accum))
    train(big, batch, LoopSettings())
    for a, b in zip(accumulated.parameters(), big.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_short_last_group_is_averaged_over_its_own_batches():
    """6 micro-batches of 2 with 4 accumulation steps: groups of 8 and 4 images."""
    accumulated, reference = small_net(), small_net()
    train(accumulated, 2, LoopSettings(accum_steps=4), images=12)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    data = RandomImages(12)
    to_device = DeviceNormalizer(CPU)
    for group in (range(0, 8), range(8, 12)):
        images, labels = to_device(data.images[group.start:group.stop], data.labels[group.start:group.stop])
        nn.functional.cross_entropy(reference(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    for a, b in zip(accumulated.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_clip_grad_bounds_each_update():
    """Plain SGD with lr 1: the update is the gradient, so its norm is at most --clip-grad."""
    for clip, bounded in ((None, False), (0.01, True)):
        model = small_net()
        before = [p.detach().clone() for p in model.parameters()]
        train(model, 16, LoopSettings(clip_grad=clip), lr=1.0, momentum=0.0)
        update = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]).norm()
        assert (update <= 0.01 + 1e-6) == bounded, update


def test_the_loop_reads_the_loss_only_every_print_freq_steps(monkeypatch):
    """Reading a device tensor on the host (.item(), float(), bool(), .tolist()) waits for the
    device. 16 steps with --print-freq 8: the loop reads twice, not 16 times."""
    import sys

    reads = []
    for name in ("item", "__float__", "__bool__", "__int__", "tolist"):
        def counted(self, *args, _real=getattr(torch.Tensor, name), **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith("train_eval_utils.py"):
                reads.append(sys._getframe(1).f_lineno)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    stats = train(small_net(), 1, LoopSettings(print_freq=8))
    monkeypatch.undo()
    assert len(reads) == 2, reads  # the mean loss and NaN flag, at steps 8 and 16
    assert stats.images == 16 and stats.mean_loss > 0


def test_bf16_autocast_trains_in_bf16():
    seen = []
    model = small_net()
    model[0].register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    train(model, 8, LoopSettings(precision=Precision("bf16", "cpu")))
    assert seen and set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32


# --- Activation checkpointing and compile ------------------------------------------------------

def test_grad_checkpoint_gives_the_plain_gradients_and_batchnorm_statistics():
    torch.manual_seed(0)
    plain = create_model("resnet18", 5)
    checkpointed = create_model("resnet18", 5)
    checkpointed.load_state_dict(plain.state_dict())
    assert enable_grad_checkpoint(checkpointed) == ["layer1", "layer2", "layer3", "layer4"]
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    for model in (plain, checkpointed):
        model.train()
        nn.functional.cross_entropy(model(images), labels).backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    plain_state, checkpointed_state = plain.state_dict(), checkpointed.state_dict()
    assert plain_state.keys() == checkpointed_state.keys()  # checkpoints stay loadable anywhere
    for key in plain_state:  # running statistics updated once, not twice
        torch.testing.assert_close(plain_state[key], checkpointed_state[key], rtol=0, atol=1e-6, msg=key)
    assert type(checkpointed.layer1).__name__ == "CheckpointedSequential"


def test_grad_checkpoint_on_a_model_without_stages_is_an_error():
    with pytest.raises(UserError, match="--grad-checkpoint: no known stages in tiny"):
        enable_grad_checkpoint(small_net(), "tiny")


def test_compiled_model_trains_and_saves_plain_weights():
    """torch.compile on a tiny model (a first compile takes a while): it trains, and its
    weights have no _orig_mod. prefix and load into an uncompiled model."""
    args = argparse.Namespace(channels_last=None, grad_checkpoint=False, compile=True, model="tiny")
    model = optimize_model(small_net(), args, CPU, verbose=False)
    assert args.channels_last and hasattr(model, "_orig_mod")
    before = [p.detach().clone() for p in model.parameters()]
    train(model, 8, LoopSettings(channels_last=True))
    state = plain_state_dict(model)
    assert not any(k.startswith("_orig_mod.") for k in state)
    plain = small_net()
    plain.load_state_dict(state, strict=True)
    assert any((p - b).abs().max() > 0 for p, b in zip(plain.parameters(), before))  # it trained
    images = DeviceNormalizer(CPU)(RandomImages(4).images, torch.zeros(4))[0]
    with torch.no_grad():
        torch.testing.assert_close(model(images), plain(images), rtol=1e-4, atol=1e-5)


# --- benchmark.py ------------------------------------------------------------------------------

def test_benchmark_quick_writes_every_row(tmp_path):
    out = tmp_path / "bench.json"
    data = tmp_path / "data"
    result = run([PYTHON, os.path.join(REPO, "benchmark.py"), "--quick", "--json", str(out),
                  "--data-path", str(make_benchmark_data(data)), "--max-processes", "2"], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    results = report["results"]
    for key in ("data", "step", "loop"):
        assert results[key] > 0, key
    assert results["efficiency"] == pytest.approx(results["loop"] / results["step"])
    assert results["speedup_vs_baseline"] == pytest.approx(results["loop"] / results["baseline"]["loop"])
    assert [row["processes"] for row in results["scaling"]] == list(range(1, min(2, CORES) + 1))
    assert all(row["images_per_second"] > 0 for row in results["scaling"])
    assert report["settings"]["model"] == "resnet18" and report["settings"]["images"] == 55
    assert "loop / baseline" in result.stdout


def make_benchmark_data(root):
    rng = random.Random(0)
    for name, (petal, centre, petals) in DEMO_CLASSES.items():
        os.makedirs(root / name)
        for i in range(12):
            _draw_flower(rng, petal, centre, petals, (80, 64)).save(root / name / f"{i}.jpg")
    return root
