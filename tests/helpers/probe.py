"""Test helper: run a training script's main() with probes patched in.

    python tests/helpers/probe.py single|multi [script flags...]

Environment:
  PROBE_OUT       prefix of the JSON file each rank writes (PREFIX.rank{R}.json): the
                  parameter checksum before and after the DDP wrap, and the sample indices
                  this rank trains on in each epoch
  PROBE_PERTURB   "1": add noise to the weights of ranks other than 0 before the DDP wrap,
                  so that identical weights afterwards prove DDP's broadcast
  PROBE_BN_EVAL   "1": keep every BatchNorm in eval mode while training (batch-size
                  independent model, for the equivalence test)
  PROBE_NAN_RANK  R: the loss of rank R becomes NaN
  PROBE_RAISE_RANK R: rank R raises an exception at its first training step
  PROBE_HANG_RANK R: rank R stops responding at its first training step
  PROBE_COUNT_SYNCS "1": count DDP's gradient all-reduces (bucket by bucket) into the JSON
  PROBE_STEP_SLEEP seconds to sleep in every training step (to stop a run mid-way)
Probes live here, not in the product's flags.
"""
import importlib
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import multi_train_utils.train_eval_utils as train_eval_utils  # noqa: E402
from multi_train_utils.errors import run_cli  # noqa: E402

target = importlib.import_module({"single": "train_single", "multi": "train_multi_gpu"}[sys.argv[1]])
rank = int(os.environ.get("RANK", "0"))
record = {"rank": rank, "orders": {}}


def checksum(model):
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


real_build_model = target.build_model


def build_model(*args, **kwargs):
    model = real_build_model(*args, **kwargs)
    if os.environ.get("PROBE_PERTURB") == "1" and rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    record["before_wrap"] = checksum(model)
    return model


real_train_one_epoch = target.train_one_epoch


def train_one_epoch(model, optimizer, data_loader, device, epoch, *args, **kwargs):
    if os.environ.get("PROBE_RAISE_RANK") == str(rank):
        raise RuntimeError(f"probe: rank {rank} fails")
    if os.environ.get("PROBE_HANG_RANK") == str(rank):
        time.sleep(3600)
    if epoch == 0:
        record["after_wrap"] = checksum(model)
    record["orders"][epoch] = [index for batch in data_loader.batch_sampler for (_, index) in batch]
    return real_train_one_epoch(model, optimizer, data_loader, device, epoch, *args, **kwargs)


target.build_model = build_model
target.train_one_epoch = train_one_epoch

if os.environ.get("PROBE_BN_EVAL") == "1":
    real_set_train_mode = train_eval_utils.set_train_mode

    def set_train_mode_bn_eval(model):
        real_set_train_mode(model)
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()

    train_eval_utils.set_train_mode = set_train_mode_bn_eval

if os.environ.get("PROBE_COUNT_SYNCS") == "1":
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    real_ddp = target.DDP
    record["gradient_syncs"] = 0

    def counting_allreduce(state, bucket):
        record["gradient_syncs"] += 1
        return allreduce_hook(state, bucket)

    def ddp_counting_syncs(*args, **kwargs):
        model = real_ddp(*args, **kwargs)
        model.register_comm_hook(None, counting_allreduce)
        return model

    target.DDP = ddp_counting_syncs

if float(os.environ.get("PROBE_STEP_SLEEP", "0")) > 0:
    loss_forward = nn.CrossEntropyLoss.forward

    def slow_forward(self, x, y):
        time.sleep(float(os.environ["PROBE_STEP_SLEEP"]))
        return loss_forward(self, x, y)

    nn.CrossEntropyLoss.forward = slow_forward

if os.environ.get("PROBE_NAN_RANK") == str(rank):
    real_forward = nn.CrossEntropyLoss.forward
    nn.CrossEntropyLoss.forward = lambda self, x, y: real_forward(self, x, y) * float("nan")

try:
    run_cli(target.main, sys.argv[2:])
finally:
    if os.environ.get("PROBE_OUT"):
        with open(f"{os.environ['PROBE_OUT']}.rank{rank}.json", "w") as f:
            json.dump(record, f)
