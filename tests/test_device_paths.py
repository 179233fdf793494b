"""In-process CPU checks of the GPU code paths: DataParallel's autocast dtype, CPU tensors in
saved files, evaluation without host syncs and with one batch shape, and benchmark.py's
scaling rows started before the process touches CUDA. tests/test_gpu.py runs them for real."""
import threading
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import CLASSES, write_class_folder


def tiny_conv_net(classes=5):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, classes))


# --- DataParallel ---------------------------------------------------------------------------------

class FakeDataParallel(nn.Module):
    """Stands in for nn.DataParallel, which needs 2 GPUs: keeps what it was given."""

    def __init__(self, module, device_ids):
        super().__init__()
        self.module, self.device_ids = module, device_ids


def test_data_parallel_replicas_run_in_the_chosen_dtype(monkeypatch):
    """DataParallel runs each replica in a thread of its own, where the caller's autocast
    (thread-local) is not in force; torch's parallel_apply re-enters autocast there with the
    device's default dtype (fp16 on CUDA). The replica must still run in --amp's bf16."""
    from multi_train_utils.model_setup import plain_state_dict
    from multi_train_utils.model_setup import Precision, wrap_data_parallel

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(nn, "DataParallel", FakeDataParallel)
    model = tiny_conv_net()
    wrapped = wrap_data_parallel(model, torch.device("cuda", 0), Precision("bf16", "cpu"))
    assert isinstance(wrapped, FakeDataParallel) and wrapped.device_ids == [0, 1]
    dtypes, errors = [], []
    model[0].register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))

    def replica_thread():  # as parallel_apply's worker: autocast re-entered with the default half dtype
        try:
            with torch.autocast("cpu", dtype=torch.float16):
                wrapped.module(torch.randn(2, 3, 8, 8))
        except Exception as e:  # pragma: no cover - shown by the assertion below
            errors.append(e)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        thread = threading.Thread(target=replica_thread)
        thread.start()
        thread.join()
    assert errors == [] and dtypes == [torch.bfloat16]
    # saved weights keep plain names, as without DataParallel
    assert list(plain_state_dict(wrapped)) == list(model.state_dict())


# --- Saved files ----------------------------------------------------------------------------------

def test_saved_files_hold_cpu_tensors_only(tmp_path, monkeypatch):
    """save_atomic (checkpoints and weights) moves every tensor, however nested, to the CPU, so
    a file saved on a GPU loads anywhere; everything else is saved as it was."""
    from multi_train_utils.files import cpu_tensors, save_atomic

    weights = OrderedDict(w=torch.ones(2), b=torch.zeros(3))
    weights._metadata = OrderedDict({"": {"version": 2}})  # as state_dict() has
    state = {"model": weights, "optimizer": {"state": {0: {"momentum_buffer": torch.full((2,), 3.0)}},
                                             "param_groups": [{"lr": 0.1, "params": [0]}]},
             "nested": (torch.arange(4), [torch.eye(2)]), "rng": {"python": (3, (1, 2), None)},
             "rows": [[0, "0.5"]], "epoch": 1, "scaler": None}
    tensors = [weights["w"], weights["b"], state["optimizer"]["state"][0]["momentum_buffer"], state["nested"][0],
               state["nested"][1][0]]
    moved = []
    real_cpu = torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        moved.append(self.data_ptr())
        return real_cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    save_atomic(state, tmp_path / "checkpoint.pth")
    assert sorted(moved) == sorted(t.data_ptr() for t in tensors)

    loaded = torch.load(tmp_path / "checkpoint.pth", map_location="cpu", weights_only=True)
    assert loaded["model"]._metadata == weights._metadata
    assert torch.equal(loaded["optimizer"]["state"][0]["momentum_buffer"], torch.full((2,), 3.0))
    assert isinstance(loaded["nested"], tuple) and torch.equal(loaded["nested"][1][0], torch.eye(2))
    converted = cpu_tensors(state)
    for key in ("rng", "rows", "epoch", "scaler"):
        assert converted[key] == state[key] and type(converted[key]) is type(state[key])
    assert converted["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert converted["model"]._metadata is weights._metadata


# --- Evaluation -----------------------------------------------------------------------------------

# aten ops that read a device tensor's value back to the host (each a host sync on CUDA)
SYNCING_OPS = ("_local_scalar_dense", "bincount", "nonzero", "masked_select", "unique", "repeat_interleave")


class Batches(list):
    """A loader's batches, loaded, with its batch_sampler."""


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_evaluation_counts_exactly_with_one_batch_shape_and_no_host_syncs():
    """7 images in batches of 3: the short last batch reaches the model padded to 3 (a
    compiled model compiles once), the padding is not counted, the confusion matrix is that of
    one image at a time, and no operation reads the device back per batch."""
    from multi_train_utils.train_eval_utils import LoopSettings, evaluate

    torch.manual_seed(1)
    images = torch.randint(0, 256, (7, 3, 8, 8), dtype=torch.uint8)
    labels = torch.tensor([0, 1, 2, 3, 4, 0, 1])
    model = tiny_conv_net()
    with torch.no_grad():
        model[1].running_mean.normal_()  # eval-mode BatchNorm with statistics of its own
    shapes = []
    model.register_forward_pre_hook(lambda module, inputs: shapes.append(tuple(inputs[0].shape)))
    loader = DataLoader(TensorDataset(images, labels), batch_size=3)
    batches = Batches(loader)  # loaded before recording: the loader's seed is read with .item()
    batches.batch_sampler = loader.batch_sampler
    recorder = OpRecorder()
    with recorder:
        result = evaluate(model, batches, torch.device("cpu"), 5, LoopSettings(channels_last=True))
    assert shapes == [(3, 3, 8, 8)] * 3
    syncs = [op for op in recorder.ops if any(name in op for name in SYNCING_OPS)]
    assert syncs == []

    from multi_train_utils.images import DeviceNormalizer

    normalized, _ = DeviceNormalizer(torch.device("cpu"))(images, labels)
    with torch.no_grad():
        predictions = torch.cat([model(image[None]).argmax(dim=1) for image in normalized])
    expected = torch.bincount(labels * 5 + predictions, minlength=25).view(5, 5)
    assert torch.equal(result.confusion, expected) and result.total == 7


# --- benchmark.py ---------------------------------------------------------------------------------

class ScalingStarted(Exception):
    pass


def test_benchmark_starts_the_scaling_rows_before_touching_cuda(tmp_path, monkeypatch):
    """Under the EXCLUSIVE_PROCESS compute mode a GPU takes one process: the torchrun children of
    the scaling rows fail where benchmark.py itself holds a CUDA context. So they run first,
    before this process creates a model or a (pinned-memory) loader. Stops at the first row."""
    import random

    import benchmark

    rng = random.Random(0)
    for name in CLASSES:
        write_class_folder(str(tmp_path / "data"), name, 6, rng, size_range=(40, 48))
    done = {"models": 0, "loaders": 0}
    started = []
    real_create_model, real_make_loader = benchmark.create_model, benchmark.make_loader

    def create_model(*args, **kwargs):
        model = real_create_model(*args, **kwargs)
        done["models"] += not next(model.parameters()).is_meta  # the input-size check's shapes-only model is none
        return model

    def make_loader(*args, **kwargs):
        done["loaders"] += 1
        return real_make_loader(*args, **kwargs)

    def measure_scaling(args, data_path, processes, device):
        started.append({"processes": processes, "cuda_initialized": torch.cuda.is_initialized(), **done})
        raise ScalingStarted

    monkeypatch.setattr(benchmark, "create_model", create_model)
    monkeypatch.setattr(benchmark, "make_loader", make_loader)
    monkeypatch.setattr(benchmark, "measure_scaling", measure_scaling)
    monkeypatch.setattr(benchmark, "configure_cpu_threads", lambda device: None)  # pytest's threads stay
    with pytest.raises(ScalingStarted):
        benchmark.main(["--quick", "--device", "cpu", "--batch-size", "2", "--data-path", str(tmp_path / "data"),
                        "--json", str(tmp_path / "bench.json")])
    assert started == [{"processes": 1, "cuda_initialized": False, "models": 0, "loaders": 0}]

    # The same on a GPU (mocked: counted, never set): select_device must not make it current
    # (torch.cuda.set_device creates the context) before the scaling rows.
    made_current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: made_current.append(device))
    monkeypatch.setattr(benchmark, "configure_backends", lambda device: None)

    def measure_scaling_on_gpu(args, data_path, processes, device):
        started.append({"processes": processes, "made_current": list(made_current)})
        raise ScalingStarted

    monkeypatch.setattr(benchmark, "measure_scaling", measure_scaling_on_gpu)
    with pytest.raises(ScalingStarted):
        benchmark.main(["--quick", "--device", "cuda", "--batch-size", "2", "--data-path", str(tmp_path / "data"),
                        "--json", str(tmp_path / "bench.json")])
    assert started[1:] == [{"processes": 1, "made_current": []}]
