"""What only a CUDA GPU can show (skipped where torch.cuda.is_available() is false): the demo
in bf16 and channels_last, torchrun over NCCL, two ranks on one GPU over gloo with
SyncBatchNorm, fp16 with its loss scaler through a resume, --compile without recompiles for the
short last validation batch, predict.py and multi-label's class table on GPU and CPU alike,
saved files that load without a GPU, and benchmark.py on CUDA. About 4 minutes on one H200.

Every run is a subprocess and this process never creates a CUDA context: on a GPU in the
EXCLUSIVE_PROCESS compute mode it would lock the runs out. One GPU cannot show DataParallel,
NCCL between several ranks, or that compute mode itself.
"""
import json
import os
import re

import pytest
import torch

from conftest import (PROBE, PYTHON, REPO, TORCHRUN, assert_exact_accuracy, free_port, probe_records, read_metrics,
                      run, script, train_args)
from test_speed import make_benchmark_data

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = "cuda"  # the device of every run here (--device)
# One GPU for every run: the first visible one (two ranks on it in test_two_ranks_share_one_gpu_over_gloo).
ONE_GPU = {"CUDA_VISIBLE_DEVICES": (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]}
GPU_INFO = """
import json, torch
p = torch.cuda.get_device_properties(0)
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "name": p.name,
                  "capability": [p.major, p.minor], "count": torch.cuda.device_count()}))
"""


@pytest.fixture(scope="module", autouse=True)
def gpu(pytestconfig):
    """The GPU and torch these tests run on, printed even under pytest -q (read in a subprocess:
    see the module docstring)."""
    result = run([PYTHON, "-c", GPU_INFO], timeout=120, env=ONE_GPU)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout.strip().splitlines()[-1])
    major, minor = info["capability"]
    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print(f"\ntests/test_gpu.py: torch {info['torch']} (CUDA {info['cuda']}) on {info['name']}, compute "
              f"capability {major}.{minor}, {info['count']} GPU(s) visible", flush=True)
    return info


def expected_amp(gpu):
    """What --amp auto must choose: bf16 from compute capability 8 (Ampere) on, else fp16."""
    return "bf16" if gpu["capability"][0] >= 8 else "fp16"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """train_single.py --demo (ResNet-18, 96 px, 3 epochs) on the GPU, every epoch's weights kept."""
    root = tmp_path_factory.mktemp("gpu-demo")
    out = root / "weights"
    result = run([PYTHON, script("train_single.py"), "--demo", "--data-path", str(root / "demo"),
                  "--output-dir", str(out), "--log-dir", str(root / "runs"), "--device", DEVICE, "--no-plots",
                  "--keep-last", "0", "--workers", "4"], timeout=300, env=ONE_GPU, cwd=str(root))
    assert result.returncode == 0, result.stdout + result.stderr
    return {"root": root, "out": out, "result": result}


def test_demo_trains_in_bf16_and_channels_last(demo_run, gpu):
    stdout = demo_run["result"].stdout
    assert re.search(rf"^amp: {expected_amp(gpu)} \(auto: .*\), channels_last: on", stdout, flags=re.M), stdout
    assert re.search(r"device: cuda:0 \(", stdout), stdout
    rows = read_metrics(demo_run["out"])
    assert len(rows) == 3
    losses = [float(r["train_loss"]) for r in rows]
    assert losses[-1] < losses[0], losses
    assert float(rows[-1]["val_accuracy"]) >= 0.6, rows  # chance is 0.2 (5 classes)


def test_torchrun_one_process_over_nccl(tiny_data, tmp_path):
    out = tmp_path / "out"
    result = run([*TORCHRUN, "--nproc_per_node=1", "--master_port", str(free_port()), script("train_multi_gpu.py"),
                  *train_args(tiny_data, out, "--epochs", "1", "--workers", "2", "--device", DEVICE)], env=ONE_GPU)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world size: 1 (torchrun, backend nccl)" in result.stdout, result.stdout
    assert_exact_accuracy(result.stdout, out, epochs=1)


def test_two_ranks_share_one_gpu_over_gloo(tiny_data, tmp_path):
    """Two ranks on the one visible GPU, gloo with CUDA tensors, SyncBatchNorm across them."""
    out = tmp_path / "out"
    result = run([*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), PROBE, "multi",
                  *train_args(tiny_data, out, "--epochs", "1", "--workers", "1", "--device", DEVICE,
                              "--dist-backend", "gloo", "--sync-bn")],
                 env={**ONE_GPU, "PROBE_OUT": f"{out}.probe"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world size: 2 (torchrun, backend gloo)" in result.stdout, result.stdout
    records = probe_records(f"{out}.probe", 2)
    assert [(r["sync_bn"], r["device"]) for r in records] == [(True, "cuda:0")] * 2
    assert records[0]["after_wrap"] == records[1]["after_wrap"]  # DDP's broadcast over gloo
    assert_exact_accuracy(result.stdout, out, epochs=1)


def test_fp16_with_accumulation_and_clipping_resumes_with_its_loss_scale(tiny_data, tmp_path):
    """--amp fp16 saves the GradScaler's state; --resume auto continues with it: a loss scale
    set in the checkpoint (1024, the default starts at 65536 and grows only every 2000 steps)
    is where the resumed run goes on from."""
    out = tmp_path / "out"
    flags = ["--device", DEVICE, "--amp", "fp16", "--accum-steps", "2", "--clip-grad", "1", "--workers", "2"]
    first = run([PYTHON, script("train_single.py"), *train_args(tiny_data, out, "--epochs", "1", *flags)], env=ONE_GPU)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "amp: fp16, channels_last: on" in first.stdout
    assert "batch: 4 per process x 2 accumulation steps x 1 process = 8 per optimizer step" in first.stdout
    path = out / "checkpoint.pth"
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    assert checkpoint["scaler"] is not None and checkpoint["scaler"]["scale"] > 0
    checkpoint["scaler"]["scale"] = 1024.0
    torch.save(checkpoint, path)

    second = run([PYTHON, script("train_single.py"),
                  *train_args(tiny_data, out, "--epochs", "2", "--resume", "auto", *flags)], env=ONE_GPU)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming from" in second.stdout and "(epoch 0 done)" in second.stdout
    resumed = torch.load(path, map_location="cpu", weights_only=True)
    assert resumed["epoch"] == 1 and 0 < resumed["scaler"]["scale"] <= 1024.0, resumed["scaler"]
    assert all(0 < float(r["train_loss"]) < 10 for r in read_metrics(out))


def test_compile_does_not_recompile_for_the_short_validation_batch(tiny_data, tmp_path):
    """7 validation images in batches of 4: the last batch of 3 is padded, so evaluation
    compiles once (the switch from training to evaluation is the one expected recompile)."""
    out = tmp_path / "out"
    result = run([PYTHON, script("train_single.py"),
                  *train_args(tiny_data, out, "--epochs", "1", "--workers", "2", "--device", DEVICE, "--compile")],
                 timeout=400, env={**ONE_GPU, "TORCH_LOGS": "recompiles"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert_exact_accuracy(result.stdout, out, epochs=1)
    assert "Recompiling function" in result.stderr  # the log works: training -> evaluation
    shape_guards = [line for line in result.stderr.splitlines() if re.search(r"(size|stride) mismatch", line)]
    assert shape_guards == [], result.stderr[-3000:]


def predictions(stdout):
    """{image: [(class, probability), ...]} from predict.py's lines (top-3)."""
    found = {}
    for line in stdout.splitlines():
        path, sep, rest = line.rpartition(": ")
        pairs = re.findall(r"(\w+) ([\d.]+)", rest)
        if sep and pairs and os.path.isfile(path):
            found[path] = [(name, float(p)) for name, p in pairs]
    return found


def test_predict_on_gpu_agrees_with_cpu(demo_run):
    weights = str(demo_run["out"] / "model-best.pth")
    images = str(demo_run["root"] / "demo" / "roses")
    found = {}
    for device in (DEVICE, "cpu"):
        result = run([PYTHON, script("predict.py"), "--weights", weights, "--image", images, "--device", device,
                      "--workers", "2"], env=ONE_GPU)
        assert result.returncode == 0, result.stdout + result.stderr
        found[device] = predictions(result.stdout)
    gpu, cpu = found[DEVICE], found["cpu"]
    assert len(cpu) >= 10 and gpu.keys() == cpu.keys()
    for path in cpu:
        (cpu_top, cpu_p), (second, second_p) = cpu[path][:2]
        gpu_p = dict(gpu[path])
        if cpu_p - second_p > 0.01:  # a near tie may flip under TF32
            assert gpu[path][0][0] == cpu_top, (path, gpu[path], cpu[path])
        assert abs(gpu_p.get(cpu_top, 0.0) - cpu_p) <= 0.01, (path, gpu[path], cpu[path])


CLASS_TABLE_ON_BOTH = """
import json, torch
from multi_train_utils.multi_label import class_table
g = torch.Generator().manual_seed(7)
scores = (torch.randint(0, 40, (500, 12), generator=g) / 40.0).float()  # many ties
positives = (torch.rand(500, 12, generator=g) < 0.3).float()
positives[:, 3] = 0  # a class without positives
thresholds = torch.full((12,), 0.5)
blocks = lambda t, device: [b.to(device) for b in t.split(128)]
tables = {d: class_table(blocks(scores, d), blocks(positives, d), thresholds).tolist() for d in ("cpu", "cuda")}
print(json.dumps(tables))
"""


def test_the_multi_label_class_table_on_cuda_equals_the_cpus():
    """Ranking sorts all rows at once on a GPU and one row at a time on the CPU: every figure of
    the class table (AP, counts, tuned threshold and its counts) the same, with ties and a class
    without positives."""
    result = run([PYTHON, "-c", CLASS_TABLE_ON_BOTH], env=ONE_GPU)
    assert result.returncode == 0, result.stdout + result.stderr
    tables = json.loads(result.stdout.strip().splitlines()[-1])
    cpu, cuda = torch.tensor(tables["cpu"]), torch.tensor(tables["cuda"])
    assert cpu.shape == (12, 7) and torch.isnan(cpu[3, 0]) and not torch.isnan(cpu[[0, 1, 2, 4], 0]).any()
    torch.testing.assert_close(cuda, cpu, rtol=1e-9, atol=1e-12, equal_nan=True)


LOAD_WITHOUT_GPU = """
import json, sys, torch
devices, momentum = {}, {}
def walk(x, found):
    if torch.is_tensor(x):
        found.append(str(x.device))
    elif isinstance(x, dict):
        for v in x.values():
            walk(v, found)
    elif isinstance(x, (list, tuple)):
        for v in x:
            walk(v, found)
for path in sys.argv[1:]:
    obj = torch.load(path, weights_only=True)  # no map_location
    devices[path] = []
    walk(obj, devices[path])
    if "optimizer" in obj:
        momentum[path] = sum("momentum_buffer" in s for s in obj["optimizer"]["state"].values())
print(json.dumps({"cuda": torch.cuda.is_available(), "devices": devices, "momentum": momentum}))
"""


def test_saved_files_load_on_a_machine_without_gpu(demo_run):
    out = demo_run["out"]
    files = [str(out / name) for name in ("model-best.pth", "model-2.pth", "checkpoint.pth", "checkpoint-prev.pth")]
    result = run([PYTHON, "-c", LOAD_WITHOUT_GPU, *files], env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["cuda"] is False
    for path in files:
        assert report["devices"][path] and set(report["devices"][path]) == {"cpu"}, (path, report["devices"][path])
    for path in files[2:]:
        assert report["momentum"][path] > 0  # the optimizer's momentum buffers are in there, on the CPU


BENCHMARK = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import benchmark
from multi_train_utils.errors import run_cli
seen, real = [], benchmark.measure_scaling
def measure_scaling(*args, **kwargs):
    seen.append(torch.cuda.is_initialized())
    return real(*args, **kwargs)
benchmark.measure_scaling = measure_scaling
try:
    run_cli(benchmark.main, sys.argv[3:])
finally:
    with open(sys.argv[2], "w") as f:
        json.dump(seen, f)
"""


def test_benchmark_quick_on_cuda(tmp_path, gpu):
    """--quick on the GPU; the scaling row's torchrun child starts before this process has
    initialised CUDA (as the EXCLUSIVE_PROCESS compute mode needs)."""
    out, seen = tmp_path / "bench.json", tmp_path / "seen.json"
    result = run([PYTHON, "-c", BENCHMARK, REPO, str(seen), "--quick", "--device", DEVICE, "--max-processes", "1",
                  "--json", str(out), "--data-path", str(make_benchmark_data(tmp_path / "data"))],
                 timeout=300, env=ONE_GPU)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(seen.read_text()) == [False]
    report = json.loads(out.read_text())
    assert report["settings"]["device"].startswith("cuda") and report["settings"]["amp"] == expected_amp(gpu)
    results = report["results"]
    assert [row["processes"] for row in results["scaling"]] == [1] and results["scaling"][0]["gpus"] == 1
    assert results["timed"]["step"]["conv_dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[expected_amp(gpu)]
    assert results["timed"]["loop"]["memory_format"] == "channels_last"
    assert all(results[key] > 0 for key in ("data", "step", "loop"))


def test_two_ranks_on_one_gpu_multi_label_stopped_inside_an_epoch_resume_to_the_straight_run(tmp_path):
    """Two ranks on the one GPU (gloo), --multi-label, a checkpoint at every step: SIGTERM to
    torchrun inside epoch 1, exit 75 on both, then --resume auto ends with the weights and
    metrics.csv rows of the same run uninterrupted."""
    from test_multi_label import write_lists
    from test_preemption import assert_same_run

    write_lists(str(tmp_path / "data"))
    data = tmp_path / "data"

    def job(out, *extra, env=None):
        return run([*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), PROBE, "multi",
                    "--train-list", str(data / "train.csv"), "--val-list", str(data / "val.csv"), "--multi-label",
                    "--model", "resnet18", "--img-size", "32", "--batch-size", "3", "--epochs", "2", "--no-plots",
                    "--workers", "1", "--print-freq", "1", "--checkpoint-every", "0.00001", "--device", DEVICE,
                    "--dist-backend", "gloo", "--output-dir", str(out), "--log-dir", f"{out}-tb", *extra],
                   env={**ONE_GPU, **(env or {})})

    straight, out = tmp_path / "straight", tmp_path / "out"
    assert job(straight).returncode == 0
    stopped = job(out, "--resume", "auto", env={"PROBE_STOP": "SIGTERM:step-1-1:launcher", "PROBE_OUT": f"{out}.p"})
    assert [r["exit_code"] for r in probe_records(f"{out}.p", 2)] == [75, 75], stopped.stderr
    assert torch.load(out / "checkpoint.pth", map_location="cpu", weights_only=True)["position"]["step"] == 2
    resumed = job(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_run(out, straight)


def test_a_resume_inside_an_epoch_on_cuda_with_dropout_equals_the_straight_run(tiny_data, tmp_path):
    """mobilenet_v3_small (dropout before its head) on the GPU: SIGUSR1 inside epoch 1, then
    --resume auto: the GPU's generator is put back on the GPU in use, so the dropout masks and
    the weights equal the uninterrupted run's."""
    from test_preemption import assert_same_run

    flags = ["--epochs", "2", "--batch-size", "2", "--workers", "1", "--model", "mobilenet_v3_small", "--device",
             DEVICE, "--amp", "off", "--checkpoint-every", "0"]
    straight, out = tmp_path / "straight", tmp_path / "out"
    assert run([PYTHON, PROBE, "single", *train_args(tiny_data, straight, *flags)], env=ONE_GPU).returncode == 0
    stopped = run([PYTHON, PROBE, "single", *train_args(tiny_data, out, *flags)],
                  env={**ONE_GPU, "PROBE_STOP": "SIGUSR1:step-1-5:self"})
    assert stopped.returncode == 75, stopped.stderr
    assert "cuda_device" in torch.load(out / "checkpoint.pth", map_location="cpu", weights_only=True)["position"]["rng"][0]
    resumed = run([PYTHON, PROBE, "single", *train_args(tiny_data, out, *flags, "--resume", "auto")], env=ONE_GPU)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_run(out, straight)
