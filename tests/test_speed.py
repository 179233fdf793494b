"""The fast path: precision choice, uint8 decoding, normalisation on the device, gradient
accumulation, clipping, activation checkpointing, torch.compile, a loop without per-step
host syncs, and benchmark.py's smoke test."""
import io
import json
import os
import random

import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

from conftest import CORES, MODEL, PYTHON, REPO, cpuinfo_lists_bf16, outcome, run, torchcodec_decodes, full_flags
from model import create_model
from multi_train_utils.model_setup import plain_state_dict
from multi_train_utils import images, model_setup as performance
from multi_train_utils.errors import RankError, UserError
from multi_train_utils.datasets import DEMO_CLASSES, _draw_flower
from multi_train_utils.images import IMAGENET_MEAN, IMAGENET_STD, DeviceNormalizer, read_image_uint8
from multi_train_utils.checkpoint import TrainState
from multi_train_utils.model_setup import Precision, choose_precision, enable_grad_checkpoint, optimize_model
from multi_train_utils.train_eval_utils import LoopSettings, train_one_epoch

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


@pytest.mark.parametrize("amx, avx512_bf16, native", [(True, False, True), (False, True, True), (True, True, True),
                                                    (False, False, False)])
def test_either_bf16_instruction_set_makes_the_cpu_native(monkeypatch, amx, avx512_bf16, native):
    """AMX or AVX512-BF16, each alone, is native bf16 (whatever this CPU has)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert performance.cpu_runs_bf16_natively() is native
    assert choose_precision("auto", CPU).mode == ("bf16" if native else "off")


def test_this_cpus_bf16_flag_matches_proc_cpuinfo():
    assert performance.cpu_runs_bf16_natively() == cpuinfo_lists_bf16()


# --- Decoding and normalisation ---------------------------------------------------------------

def flower(size, seed=0):
    rng = random.Random(seed)
    return _draw_flower(rng, *DEMO_CLASSES["daisy"], size)


@pytest.mark.parametrize("decoder", ["TorchCodec", "PIL"])
def test_jpeg_decodes_to_the_same_pixels_as_pil(decoder, tmp_path, monkeypatch):
    if decoder == "TorchCodec" and not torchcodec_decodes():
        pytest.skip("TorchCodec is not installed: PIL decodes every JPEG (the other case)")
    if decoder == "PIL":
        monkeypatch.setattr(images, "decode_jpeg", None)  # the fallback
    path = tmp_path / "a.jpg"
    flower((90, 70)).save(path, quality=90)
    ours = outcome(lambda: read_image_uint8(str(path)))  # a deprecated decoder's warning is an error here
    pil = torch.from_numpy(__import__("numpy").array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
    assert isinstance(ours, torch.Tensor), ours
    assert ours.dtype == torch.uint8 and ours.shape == (3, 70, 90)
    assert (ours.float() - pil.float()).abs().mean() < 1.0  # libjpeg-turbo in both: equal here, up to its version


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
    # float images in [0, 1] (a dataset of your own) are normalised alike
    as_float, _ = DeviceNormalizer(CPU)(images.float() / 255, torch.tensor([1, 2]))
    torch.testing.assert_close(as_float, expected, rtol=0, atol=1e-5)


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
    return train_one_epoch(TrainState(model, optimizer), loader, CPU, 0, settings)


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


@pytest.mark.parametrize("mode", ["off", "fp16"])
def test_clip_grad_clips_the_true_gradient(mode):
    """Plain SGD with lr 1 and one step: the update is the gradient, so with --clip-grad 0.01
    its norm is 0.01 (the gradient's is larger). Under fp16 the loss is scaled by 2**16:
    clipping before unscaling would leave an update 65536 times too small."""
    settings = {"precision": Precision(mode, "cpu")}
    for clip in (None, 0.01):
        model = small_net()
        before = [p.detach().clone() for p in model.parameters()]
        train(model, 16, LoopSettings(clip_grad=clip, **settings), lr=1.0, momentum=0.0)
        update = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]).norm()
        if clip is None:
            assert update > 0.05, update
        else:
            assert update == pytest.approx(clip, rel=0.01), update


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


# bf16 keeps 8 significant bits: rounding a value to bf16 changes it by at most u = 2^-8 of itself.
BF16_UNIT_ROUNDOFF = 2.0 ** -8


@pytest.mark.parametrize("seed", [0, 7])
def test_one_bf16_step_moves_the_weights_as_fp32_does_within_bf16_precision(seed):
    """What bf16 decides, on any CPU (native or emulated, the same assertions): one step of the
    training loop from the same weights and batch, under --amp bf16 and off. The convolution runs
    in bf16 (its output's dtype) and the weights stay fp32. The loss (a mean over 16 images)
    is within 2u of fp32's; each weight's update within 16u of fp32's (relative L2 norm): each
    gradient passes through 2 products in the forward and 2 in the backward, each rounding both
    operands (4 roundings of u per product chain), doubled for cancellation in the sums. And
    bf16 really rounded something: the updates are not all fp32's exactly."""
    u = BF16_UNIT_ROUNDOFF
    torch.manual_seed(seed)
    start = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 3))
    before = {k: v.clone() for k, v in start.state_dict().items()}
    steps, losses, conv_dtypes = {}, {}, {}
    for amp in ("off", "bf16"):
        start.load_state_dict(before)
        hook = start[0].register_forward_hook(lambda m, i, output, amp=amp: conv_dtypes.update({amp: output.dtype}))
        stats = train(start, 16, LoopSettings(precision=Precision(amp, "cpu")), images=16, lr=1.0, momentum=0.0)
        hook.remove()
        assert all(p.dtype == torch.float32 for p in start.parameters())
        steps[amp] = {k: v - before[k] for k, v in start.state_dict().items()}
        losses[amp] = stats.mean_loss
    assert conv_dtypes == {"off": torch.float32, "bf16": torch.bfloat16}
    assert abs(losses["bf16"] - losses["off"]) <= 2 * u * abs(losses["off"]), losses
    differences = []
    for key, fp32 in steps["off"].items():
        assert fp32.norm() > 0, key  # every weight moved (lr 1, no momentum: the step is the gradient)
        difference = ((steps["bf16"][key] - fp32).norm() / fp32.norm()).item()
        assert difference <= 16 * u, (key, difference / u)
        differences.append(difference)
    assert max(differences) > 0  # bf16 rounded the products


# --- Activation checkpointing and compile ------------------------------------------------------

@pytest.mark.parametrize("name, stages", [("resnet18", 4), ("mobilenet_v3_small", 13), ("densenet121", 7)])
def test_grad_checkpoint_gives_the_plain_gradients_and_batchnorm_statistics(name, stages):
    torch.manual_seed(0)
    plain = create_model(name, 5)
    checkpointed = create_model(name, 5)
    checkpointed.load_state_dict(plain.state_dict())
    names = enable_grad_checkpoint(checkpointed)
    assert len(names) == stages
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    forwards = {id(plain): 0, id(checkpointed): 0}
    for model in (plain, checkpointed):
        stage_conv = next(m for m in model.get_submodule(names[-1]).modules() if isinstance(m, nn.Conv2d))
        stage_conv.register_forward_hook(lambda *_, key=id(model): forwards.__setitem__(key, forwards[key] + 1))
        model.train()
        torch.manual_seed(1)  # the same dropout masks (MobileNet's classifier)
        nn.functional.cross_entropy(model(images), labels).backward()
    assert forwards == {id(plain): 1, id(checkpointed): 2}  # recomputed in backward
    for (key, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=key)
    plain_state, checkpointed_state = plain.state_dict(), checkpointed.state_dict()
    assert plain_state.keys() == checkpointed_state.keys()  # checkpoints stay loadable anywhere
    for key in plain_state:  # running statistics updated once, not twice
        torch.testing.assert_close(plain_state[key], checkpointed_state[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("model", [nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()), create_model("vgg11", 5)])
def test_grad_checkpoint_on_a_model_without_blocks_is_an_error(model):
    with pytest.raises(UserError, match="--grad-checkpoint: no blocks to checkpoint in tiny"):
        enable_grad_checkpoint(model, "tiny")


class StagedNet(nn.Module):
    """A tiny net with ResNet's stage names, BatchNorm included."""

    def __init__(self):
        super().__init__()
        for i, (cin, cout) in enumerate([(3, 8), (8, 8), (8, 16), (16, 16)], start=1):
            setattr(self, f"layer{i}", nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout),
                                                     nn.ReLU(inplace=True)))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 3))

    def forward(self, x):
        return self.head(self.layer4(self.layer3(self.layer2(self.layer1(x)))))


def test_compiled_model_with_grad_checkpoint_trains_like_the_plain_one_and_saves_plain_weights():
    """torch.compile (with --grad-checkpoint) on a tiny model: the same weights and BatchNorm
    statistics as the eager model after training, and a state dict without _orig_mod.
    prefixes that loads into an uncompiled model. (A first compile takes a while.)"""
    torch.manual_seed(0)
    eager = StagedNet()
    torch.manual_seed(0)
    args = full_flags(channels_last=None, grad_checkpoint=True, compile=True, model="tiny")
    compiled, channels_last = optimize_model(StagedNet(), args, CPU)
    assert channels_last and hasattr(compiled, "_orig_mod")
    before = {k: v.clone() for k, v in eager.state_dict().items()}
    for model in (eager, compiled):
        train(model, 8, LoopSettings(channels_last=True))
    state = plain_state_dict(compiled)
    assert state.keys() == eager.state_dict().keys()  # no _orig_mod. prefix
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)
    assert (state["layer1.0.weight"] - before["layer1.0.weight"]).abs().max() > 1e-4  # it trained
    assert not torch.equal(state["layer1.1.running_mean"], before["layer1.1.running_mean"])
    plain = StagedNet()
    plain.load_state_dict(state, strict=True)


# --- benchmark.py ------------------------------------------------------------------------------

PER_CLASS, VAL_RATE = 20, 0.1  # make_benchmark_data; benchmark.py splits at --val-rate 0.1
WARMUP = 2  # train_eval_utils.WARMUP_STEPS: the first steps of every timed run are left out


def test_benchmark_quick_writes_every_row(tmp_path):
    """benchmark.py --quick: every row records what it timed, and that is what the settings say:
    the images and steps after the warm-up, and at the first convolution --amp's dtype with
    channels_last for our rows, fp32 NCHW for the tutorial's way."""
    out = tmp_path / "bench.json"
    data = tmp_path / "data"
    result = run([PYTHON, os.path.join(REPO, "benchmark.py"), "--quick", "--json", str(out),
                  "--data-path", str(make_benchmark_data(data)), "--max-processes", "2", "--img-size", "32", "--model", MODEL],
                 timeout=900)  # ~45 s idle, ~150 s beside two busy loops
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    results = report["results"]
    for key in ("data", "step", "loop"):
        assert results[key] > 0, key
    assert results["efficiency"] == pytest.approx(results["loop"] / results["step"])
    assert results["speedup_vs_baseline"] == pytest.approx(results["loop"] / results["baseline"]["loop"])
    processes = list(range(1, min(2, CORES) + 1))
    assert [row["processes"] for row in results["scaling"]] == processes
    assert all(row["images_per_second"] > 0 for row in results["scaling"])
    assert "loop / baseline" in result.stdout

    # --quick: batch 8, --steps 3 (the baseline's step row: max(2, 3 // 2)); 90 training images
    batch, train_images = 8, len(DEMO_CLASSES) * (PER_CLASS - round(PER_CLASS * VAL_RATE))
    assert report["settings"]["model"] == MODEL and report["settings"]["images"] == train_images == 90
    assert report["settings"]["warmup_steps_left_out"] == WARMUP

    def timed(steps, processes=1):  # steps of each process; images of all
        return {"images": steps * batch * processes, "steps": steps}

    epoch = train_images // batch - WARMUP  # whole batches only: 11, the first 2 left out
    ours = {"conv_dtype": "bfloat16" if cpuinfo_lists_bf16() else "float32", "memory_format": "channels_last"}
    tutorial = {"conv_dtype": "float32", "memory_format": "contiguous"}
    expected = {"data": timed(epoch), "step": {**timed(3), **ours}, "loop": {**timed(epoch), **ours},
                "baseline step": {**timed(2), **tutorial}, "baseline loop": {**timed(epoch), **tutorial}}
    for k in processes:  # each process: its share of the images (DistributedSampler pads), whole batches
        expected[f"scaling x{k}"] = timed(-(-train_images // k) // batch - WARMUP, k)
    assert results["timed"] == expected


def make_benchmark_data(root):
    rng = random.Random(0)
    for name, (petal, centre, petals) in DEMO_CLASSES.items():
        os.makedirs(root / name)
        for i in range(PER_CLASS):  # 18 training images a class at --val-rate 0.1: 11 batches of 8
            _draw_flower(rng, petal, centre, petals, (80, 64)).save(root / name / f"{i}.jpg")
    return root


def test_benchmark_decoders_times_each_decoder_with_and_without_the_reduced_decode(tmp_path, monkeypatch, capsys):
    """benchmark.py --decoders: a row per crop size x decoder x reduced-size decode, each timed
    over every JPEG (a PNG left out), and each decoder's full-size pixels against PIL's."""
    import benchmark

    data = make_benchmark_data(tmp_path / "data")
    flower((90, 70)).save(data / "daisy" / "not-a-jpeg.png")
    out = tmp_path / "decoders.json"
    benchmark.main(["--decoders", "32,48", "--decoder-repeats", "2", "--data-path", str(data), "--json", str(out)])
    report = json.loads(out.read_text())
    jpegs = len(DEMO_CLASSES) * PER_CLASS
    assert report["images"] == jpegs
    expected = ["TorchCodec", "PIL"] if images.decode_jpeg is not None else ["PIL"]
    assert [(r["img_size"], r["reduced"], r["decoder"]) for r in report["decoders"]] == [
        (size, reduced, name) for size in (32, 48) for reduced in (True, False) for name in expected]
    for row in report["decoders"]:
        assert len(row["passes"]) == 2 and row["images_per_second"] == pytest.approx(sum(row["passes"]) / 2)  # median
        assert row["mean_difference_to_pil"] < 1.0
    assert all(r["max_difference_to_pil"] == 0 for r in report["decoders"] if r["decoder"] == "PIL")
    assert f"{jpegs} JPEGs from {data}" in capsys.readouterr().out


@pytest.mark.parametrize("steps", [1, 4])
def test_the_tutorial_rows_time_exactly_the_steps_whose_images_they_count(monkeypatch, steps):
    """benchmark.py: the first 2 steps of every timed run are left out, of the clock and of the
    images alike. On a fake clock where each forward takes 1 s, batches of 3 images give 3
    images/s exactly, for any number of timed steps."""
    import benchmark
    from multi_train_utils.train_eval_utils import WARMUP_STEPS

    clock = [100.0]
    monkeypatch.setattr(benchmark.time, "perf_counter", lambda: clock[0])

    class OneSecondNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            clock[0] += 1.0
            return self.fc(x)

    model = OneSecondNet()
    batches = [(torch.randn(3, 2), torch.tensor([0, 1, 0]))] * (WARMUP_STEPS + steps)
    rate, timed = benchmark.tutorial_epoch(model, torch.optim.SGD(model.parameters(), lr=0.1), batches,
                                           torch.device("cpu"))
    assert (timed["images"], timed["steps"]) == (3 * steps, steps)
    assert rate == pytest.approx(3.0)


@pytest.mark.parametrize("device, efficiencies", [("cpu", [1.0, 1.8, 2.0]), ("cuda", [1.0, 0.9, 0.5])])
def test_scaling_efficiency_is_against_k_gpus_or_the_same_shared_cores(monkeypatch, device, efficiencies):
    """GPUs: k processes bring k GPUs, ideal is k x one process; CPUs: the k processes share
    the same cores, ideal is one process's rate. Each row's processes, threads and GPUs."""
    import benchmark

    rates = {1: 100.0, 2: 180.0, 4: 200.0}
    monkeypatch.setattr(benchmark, "measure_scaling", lambda args, data, k, dev: (rates[k], {"images": k}))
    monkeypatch.setattr(benchmark, "cpu_cores_available", lambda: 4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    timed = {}
    rows = benchmark.scaling_rows(full_flags(max_processes=None), "d", torch.device(device), 100, timed)
    assert [r["processes"] for r in rows] == [1, 2, 4]
    assert [r["efficiency"] for r in rows] == pytest.approx(efficiencies)
    assert [r["gpus"] for r in rows] == ([0, 0, 0] if device == "cpu" else [1, 2, 4])
    assert [r["threads_per_process"] for r in rows] == ([4, 2, 1] if device == "cpu" else [None] * 3)
    assert timed == {"scaling x1": {"images": 1}, "scaling x2": {"images": 2}, "scaling x4": {"images": 4}}


@pytest.mark.parametrize("flags, expected", [
    ([], {"--model": "resnet34", "--img-size": "224", "--batch-size": "16", "--amp": "auto"}),
    (["--model", "resnet18", "--img-size", "40", "--batch-size", "3", "--amp", "off", "--no-channels-last",
      "--workers", "2", "--compile"],
     {"--model": "resnet18", "--img-size": "40", "--batch-size": "3", "--amp": "off", "--workers": "2"})])
def test_the_scaling_rows_run_the_training_script_with_the_benchmarks_flags(monkeypatch, tmp_path, flags, expected):
    """benchmark.py's flags reach the torchrun command of each scaling row (run replaced)."""
    import types

    import benchmark

    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        out = cmd[cmd.index("--output-dir") + 1]
        with open(os.path.join(out, "metrics.csv"), "w") as f:
            f.write("epoch,images_per_second\n0,10\n1,12.5\n")
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    args = benchmark.get_args_parser().parse_args(flags)
    rate, timed = benchmark.measure_scaling(args, str(tmp_path), 2, torch.device("cpu"))
    cmd = commands[0]
    assert rate == 12.5 and "--nproc_per_node=2" in cmd and cmd[cmd.index("--data-path") + 1] == str(tmp_path)
    assert {flag: cmd[cmd.index(flag) + 1] for flag in expected} == expected
    assert ("--no-channels-last" in cmd, "--compile" in cmd, "--workers" in cmd) == (
        ("--no-channels-last" in flags,) * 2 + ("--workers" in flags,))
