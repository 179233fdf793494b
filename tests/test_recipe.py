"""The modern recipe: augmentation, MixUp/CutMix, label smoothing, EMA, AdamW and schedules,
class weights and the balanced sampler, --best-metric and --patience; each exact under DDP
and on resume. Expected values are computed here by hand, not by the code under test."""
import json
import os
import time

import pytest
import torch
from torch import nn

from conftest import (CLASSES, PYTHON, REPO, TORCHRUN, free_port, kill_tree, metrics_without_timing, probe_records,
                      read_metrics, run, run_ranks, script, train_args)
from multi_train_utils.options import config_of  # noqa: E402

from multi_train_utils.checkpoint import BestEpoch, TrainState
from conftest import full_flags  # noqa: E402

PROBE = os.path.join(REPO, "tests", "helpers", "probe.py")
CLASSES_AB = full_flags(classes=["a", "b"])  # the data, as far as RunRecorder reads it


def recipe_args(**changes):
    """The flags' defaults of train_single.py, with ``changes``."""
    from multi_train_utils.options import get_args_parser, parse_args

    args = parse_args(get_args_parser(distributed=False), ["--model", "resnet18"])
    for key, value in changes.items():
        setattr(args, key, value)
    return args


# --- MixUp and CutMix ------------------------------------------------------------------------

def batch(n=8, classes=5, size=16):
    g = torch.Generator().manual_seed(3)
    images = torch.randn(n, 3, size, size, generator=g)
    labels = torch.arange(n) % classes  # neighbours differ: a mixed row has two classes
    return images, labels


def test_mixup_targets_sum_to_one_and_match_the_mixing_of_the_images():
    from multi_train_utils.loaders import BatchMixer

    images, labels = batch()
    mixed, targets = BatchMixer(5, mixup_alpha=0.4, seed=1)(images, labels, epoch=2, step=3)
    assert targets.shape == (8, 5)
    torch.testing.assert_close(targets.sum(dim=1), torch.ones(8))
    lam = float(targets[0, labels[0]])  # the weight of each image's own class
    assert 0 < lam < 1
    partner = images.roll(1, 0)  # torchvision pairs each image with the one before it
    torch.testing.assert_close(mixed, lam * images + (1 - lam) * partner)
    for i in range(8):  # each row: lam on its class, 1 - lam on its partner's
        expected = torch.zeros(5)
        expected[labels[i]] += lam
        expected[labels[i - 1]] += 1 - lam
        torch.testing.assert_close(targets[i], expected)


def test_cutmix_targets_are_the_share_of_each_images_pixels():
    from multi_train_utils.loaders import BatchMixer

    images, labels = batch(size=20)
    mixer = BatchMixer(5, cutmix_alpha=1.0, seed=0)
    shares = set()
    for step in range(6):
        mixed, targets = mixer(images, labels, epoch=0, step=step)
        torch.testing.assert_close(targets.sum(dim=1), torch.ones(8))
        own = (mixed == images).all(dim=1).float().mean(dim=(1, 2))  # pixels still the image's own
        pasted = (mixed == images.roll(1, 0)).all(dim=1).float().mean(dim=(1, 2))
        torch.testing.assert_close(own + pasted, torch.ones(8))  # every pixel is one of the two
        torch.testing.assert_close(targets[torch.arange(8), labels], own)
        shares.add(round(float(own[0]), 4))
    assert len(shares) > 1  # the box changes from step to step


def test_mixing_is_seeded_by_seed_epoch_step_and_rank_and_leaves_the_global_generator_alone():
    from multi_train_utils.loaders import BatchMixer

    images, labels = batch()
    mix = BatchMixer(5, mixup_alpha=0.4, cutmix_alpha=1.0, seed=1)
    state = torch.get_rng_state()
    first = mix(images, labels, 1, 2)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(123)  # whatever the global generator holds
    again = mix(images, labels, 1, 2)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    others = [mix(images, labels, 1, 3), mix(images, labels, 2, 2), BatchMixer(5, 0.4, 1.0, seed=1, rank=1)(
        images, labels, 1, 2), BatchMixer(5, 0.4, 1.0, seed=2)(images, labels, 1, 2)]
    assert all(not torch.equal(first[1], other[1]) for other in others)


def test_mixing_is_off_unless_asked():
    from multi_train_utils.loaders import make_batch_mixer

    assert make_batch_mixer(recipe_args(), 5) is None
    assert make_batch_mixer(recipe_args(cutmix_alpha=1.0), 5) is not None


# --- The loss --------------------------------------------------------------------------------

def test_label_smoothing_and_class_weights_follow_their_formulas():
    from model import create_loss

    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3], [-0.5, 1.5, 0.0]])
    labels = torch.tensor([0, 2, 1])
    log_p = torch.log_softmax(logits, dim=1)
    s = 0.1
    # (1 - s) x -log p(true) + s x mean over the classes of -log p(c)
    smoothed = ((1 - s) * -log_p[range(3), labels] + s * -log_p.mean(dim=1)).mean()
    torch.testing.assert_close(create_loss(recipe_args(label_smoothing=s))(logits, labels), smoothed)
    weights = torch.tensor([0.5, 2.0, 1.0])
    weighted = (weights[labels] * -log_p[range(3), labels]).sum() / weights[labels].sum()
    torch.testing.assert_close(create_loss(recipe_args(), class_weights=weights)(logits, labels), weighted)
    plain = -log_p[range(3), labels].mean()
    torch.testing.assert_close(create_loss(recipe_args())(logits, labels), plain)
    soft = torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.2, 0.8], [0.5, 0.5, 0.0]])  # MixUp's targets
    torch.testing.assert_close(create_loss(recipe_args())(logits, soft), -(soft * log_p).sum(dim=1).mean())


def test_balanced_class_weights_come_from_the_training_counts():
    from multi_train_utils.loaders import loss_class_weights
    from multi_train_utils.datasets import MyDataSet

    train = MyDataSet(["x"] * 8, [0] * 6 + [1] * 2)
    from multi_train_utils.options import task_of

    def weights(args):
        return loss_class_weights(task_of(args), args.class_weights, train, 2)

    assert weights(recipe_args()) is None
    torch.testing.assert_close(weights(recipe_args(class_weights="balanced")),
                               torch.tensor([8 / (2 * 6), 8 / (2 * 2)]))


def test_the_loop_mixes_each_batch_and_updates_the_ema_after_each_optimizer_step():
    from multi_train_utils.model_setup import ModelEma
    from multi_train_utils.loaders import BatchMixer
    from multi_train_utils.train_eval_utils import LoopSettings, train_one_epoch

    class Loader(list):
        batch_sampler = full_flags(batch_size=4)

    g = torch.Generator().manual_seed(0)
    loader = Loader((torch.rand(4, 3, 8, 8, generator=g), torch.tensor([0, 1, 2, 0])) for _ in range(3))
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 64, 3))
    seen = []

    class RecordingLoss(nn.CrossEntropyLoss):
        def forward(self, logits, targets):
            seen.append(targets)
            return super().forward(logits, targets)

    ema = ModelEma(model, 0.5)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), ema=ema, loss_function=RecordingLoss(),
                       mixer=BatchMixer(3, mixup_alpha=1.0))
    train_one_epoch(state, loader, torch.device("cpu"), 0, LoopSettings(accum_steps=2))
    assert [t.shape for t in seen] == [(4, 3)] * 3  # soft targets for every batch
    assert ema.updates == 2  # 3 batches, accumulated 2 by 2: 2 optimizer steps


def test_the_built_in_datasets_take_the_augmentation_flags(tiny_data):
    from torchvision.transforms import v2

    from my_dataset import build_datasets

    args = recipe_args(data_path=tiny_data["train"], val_path=tiny_data["val"], img_size=32, auto_augment="augmix",
                       random_erase=0.5, val_resize_size=64)
    data = build_datasets(args)
    assert [type(t) for t in data.train.transform.transforms][2:] == [v2.AugMix, v2.RandomErasing]
    assert data.val.transform.transforms[0].size == [64] and data.val.keep_side == 64


# --- EMA -------------------------------------------------------------------------------------

def test_ema_equals_a_hand_computed_average_after_k_steps():
    from multi_train_utils.model_setup import ModelEma

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    ema = ModelEma(model, decay=0.3)
    expected = {k: v.clone().double() for k, v in model.state_dict().items()}
    for n in range(6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model.train()(torch.randn(4, 3))  # BatchNorm's running statistics move too
        ema.update(model)
        d = min(0.3, (1 + n) / (10 + n))  # warm-up: 0.1, 0.18, 0.25, then 0.3
        for key, value in model.state_dict().items():
            if value.is_floating_point():
                expected[key] = d * expected[key] + (1 - d) * value.double()
            else:
                expected[key] = value.clone()  # num_batches_tracked: copied
    assert ema.updates == 6
    for key, value in ema.module.state_dict().items():
        torch.testing.assert_close(value.double(), expected[key].double(), rtol=0, atol=1e-6, msg=key)
    assert not any(p.requires_grad for p in ema.module.parameters()) and not ema.module.training
    copy = ModelEma(model, decay=0.3)
    copy.load_state_dict(ema.state_dict())
    assert copy.updates == 6 and copy.current_decay() == ema.current_decay() == 0.3


# --- Optimizer and schedule ------------------------------------------------------------------

def test_adamw_and_no_decay_on_norm_and_bias():
    from model import create_optimizer

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    adamw = create_optimizer(model, recipe_args(lr=0.01, opt="adamw", weight_decay=0.05, norm_bias_decay=False))
    assert isinstance(adamw, torch.optim.AdamW)
    decayed, free = adamw.param_groups
    assert decayed["weight_decay"] == 0.05 and free["weight_decay"] == 0.0
    assert {id(p) for p in decayed["params"]} == {id(model[0].weight), id(model[3].weight)}
    assert {id(p) for p in free["params"]} == {id(model[0].bias), id(model[1].weight), id(model[1].bias),
                                                id(model[3].bias)}
    sgd = create_optimizer(model, recipe_args(lr=0.01))
    assert isinstance(sgd, torch.optim.SGD) and len(sgd.param_groups) == 1
    assert sgd.param_groups[0]["weight_decay"] == 0.005 and sgd.param_groups[0]["momentum"] == 0.9
    assert recipe_args(opt="adamw").weight_decay == 0.005  # set before: parse_args picks the default
    from multi_train_utils.options import get_args_parser, parse_args

    assert parse_args(get_args_parser(False), ["--opt", "adamw"]).weight_decay == 0.05
    assert parse_args(get_args_parser(False), ["--opt", "adamw", "--weight-decay", "0.1"]).weight_decay == 0.1


def test_step_schedule_multiplies_by_gamma_every_step_size_epochs_after_the_warmup():
    from model import create_lr_scheduler

    def rates(start_epoch=0):
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
        args = recipe_args(epochs=7, warmup_epochs=1, lr_scheduler="step", lr_step_size=2, lr_gamma=0.5)
        scheduler = create_lr_scheduler(optimizer, args, 2, start_epoch=start_epoch)
        seen = []
        for _ in range(start_epoch * 2, 14):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen

    expected = [0.5, 1.0] + [1.0] * 4 + [0.5] * 4 + [0.25] * 4  # warm-up of 2 steps, then 2-epoch periods
    assert rates() == pytest.approx(expected)
    assert rates(start_epoch=4) == pytest.approx(expected[8:])  # resume: the same rates


def test_resume_refuses_another_optimizer_parameter_groups_ema_or_best_metric():
    from multi_train_utils.checkpoint import check_resume_compatible
    from multi_train_utils.errors import UserError

    saved = {"classes": CLASSES, "epoch": 1, "args": {"model": "resnet18", "freeze_layers": False}}
    check_resume_compatible(saved, "ckpt", config_of(recipe_args()).flags, CLASSES, 4)  # an older checkpoint: SGD, one group
    cases = [({"opt": "adamw"}, "trained with --opt sgd, this run has --opt adamw"),
             ({"norm_bias_decay": False}, "trained with --norm-bias-decay, this run has --no-norm-bias-decay"),
             ({"model_ema": True}, "trained with no --model-ema, this run has --model-ema"),
             ({"best_metric": "loss"}, "trained with --best-metric accuracy, this run has --best-metric loss")]
    for change, message in cases:
        with pytest.raises(UserError) as error:
            check_resume_compatible(saved, "ckpt", config_of(recipe_args(**change)).flags, CLASSES, 4)
        assert str(error.value) == f"--resume ckpt: {message}; resume with the same, or start a new --output-dir"


@pytest.mark.parametrize("classes", [CLASSES[::-1], CLASSES[:-1] + ["zinnia"], CLASSES[:-1], CLASSES + ["zinnia"]])
def test_resume_refuses_other_classes_of_the_same_count_or_order_too(classes):
    from multi_train_utils.checkpoint import check_resume_compatible
    from multi_train_utils.errors import UserError

    saved = {"classes": CLASSES, "epoch": 1, "args": {"model": "resnet18", "freeze_layers": False}}
    with pytest.raises(UserError) as error:
        check_resume_compatible(saved, "ckpt", config_of(recipe_args()).flags, classes, 4)
    assert str(error.value).startswith(f"--resume ckpt: trained on classes {CLASSES}, but --data-path has {classes}")
    check_resume_compatible(saved, "ckpt", config_of(recipe_args()).flags, list(CLASSES), 4)


# --- Augmentation ----------------------------------------------------------------------------

def test_auto_augment_random_erase_and_val_resize_size_reach_the_transforms():
    from torchvision.transforms import v2

    from my_dataset import augment_settings
    from multi_train_utils.images import build_transforms

    train, val = build_transforms(32, **augment_settings(recipe_args(auto_augment="ta_wide", random_erase=1.0,
                                                                     val_resize_size=48)))
    kinds = [type(t) for t in train.transforms]
    assert kinds == [v2.RandomResizedCrop, v2.RandomHorizontalFlip, v2.TrivialAugmentWide, v2.RandomErasing]
    assert val.transforms[0].size == [48]
    plain, plain_val = build_transforms(32)
    assert [type(t) for t in plain.transforms] == [v2.RandomResizedCrop, v2.RandomHorizontalFlip]
    assert plain_val.transforms[0].size == [37]  # round(32 x 256 / 224)
    image = torch.full((3, 40, 40), 7, dtype=torch.uint8)
    torch.manual_seed(0)
    erased = train(image)
    # erased pixels hold ImageNet's mean colour, which the normalisation turns into 0
    hole = (erased == torch.tensor([124, 116, 104]).view(3, 1, 1)).all(dim=0)
    assert hole.any() and not hole.all()


def test_val_resize_size_reaches_predict_and_export_through_args_json(tmp_path):
    from multi_train_utils.run_files import read_val_resize_size

    (tmp_path / "args.json").write_text(json.dumps({"model": "resnet18", "img_size": 32, "val_resize_size": 44}))
    given = full_flags(weights=str(tmp_path / "model-best.pth"), val_resize_size=None)
    assert read_val_resize_size(given, 32) == 44
    given.val_resize_size = 50
    assert read_val_resize_size(given, 32) == 50
    (tmp_path / "args.json").write_text(json.dumps({"model": "resnet18", "img_size": 32}))  # an older run
    assert read_val_resize_size(full_flags(weights=given.weights, val_resize_size=None), 32) == 37


# --- Best metric, EMA's best and patience ----------------------------------------------------

def result_with(correct, total=10, loss=1.0):
    """An EvalResult of 2 classes with ``correct`` of ``total`` right, half of each class."""
    from multi_train_utils.single_label import EvalResult

    half = total // 2
    right0 = min(correct, half)
    right1 = correct - right0
    confusion = torch.tensor([[right0, half - right0], [half - right1, right1]])
    return EvalResult(confusion, None, loss * total)


def recorder(**changes):
    from conftest import run_recorder

    return run_recorder(recipe_args(**changes), CLASSES_AB, TrainState(None), enabled=False)


def train_stats():
    from multi_train_utils.train_eval_utils import TrainStats

    return TrainStats(1.0, 10, 1.0, 0.1, 10.0)


def test_best_is_the_better_of_model_and_ema_by_best_metric_and_patience_stops():
    runs = recorder(best_metric="loss", patience=2)
    for epoch, (model_loss, ema_loss) in enumerate([(0.9, 0.8), (0.7, 0.75), (0.72, 0.71), (0.8, 0.9)]):
        assert runs.state.stop_reason is None
        runs.end_epoch(epoch, train_stats(), result_with(5, loss=model_loss), result_with(5, loss=ema_loss))
    # lowest loss: the model's 0.7 at epoch 1; epochs 2 and 3 bring nothing better: stop after 3
    best = runs.state.best
    assert (best.epoch, best.source, best.value) == (1, "model", pytest.approx(0.7))
    assert runs.state.stop_reason is not None
    assert runs.state.stop_reason.startswith("stopped early after epoch 3: no better val loss for 2 epochs")
    accuracy = recorder()  # the default: accuracy, higher is better; no patience
    accuracy.end_epoch(0, train_stats(), result_with(6), result_with(8))
    accuracy.end_epoch(1, train_stats(), result_with(7), result_with(7))
    best = accuracy.state.best
    assert (best.epoch, best.source, best.accuracy) == (0, "ema", 0.8)
    assert accuracy.state.stop_reason is None


def test_best_source_of_each_row_is_whichever_scored_better_that_epoch(tmp_path):
    """outputs.md: `best_source`: `model` or `ema`, whichever scored better on --best-metric
    that epoch (not the source of the best epoch so far; a tie is the model's)."""
    from conftest import run_recorder

    model = nn.Linear(2, 2)
    args = recipe_args(output_dir=str(tmp_path / "out"), log_dir=str(tmp_path / "tb"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))
    runs = run_recorder(args, CLASSES_AB, state, enabled=True, world_size=1)
    for epoch, (model_right, ema_right) in enumerate([(8, 5), (6, 7), (9, 9)]):
        runs.end_epoch(epoch, train_stats(), result_with(model_right), result_with(ema_right))
    runs.writer.close()
    assert [r["best_source"] for r in read_metrics(args.output_dir)] == ["model", "ema", "model"]
    best = runs.state.best
    assert (best.epoch, best.source, best.accuracy) == (2, "model", 0.9)


def test_a_run_stopped_by_patience_is_complete_on_resume_unless_patience_is_raised():
    from conftest import run_recorder

    from multi_train_utils.checkpoint import complete_checkpoint

    checkpoint = complete_checkpoint({"epoch": 4, "best_epoch": 1, "best_value": 0.5, "best_accuracy": 0.5,
                                      "stopped_early": "stopped early after epoch 4"})
    args = recipe_args(patience=3, epochs=10)

    def resumed():
        state = TrainState(None, best=BestEpoch.from_checkpoint(checkpoint))
        return run_recorder(args, CLASSES_AB, state, enabled=False, checkpoint=checkpoint).state

    assert resumed().stop_reason
    args.patience = 5
    assert resumed().stop_reason is None


def test_metrics_csv_keeps_its_first_six_columns_and_appends_the_new_ones(tmp_path):
    from multi_train_utils.run_files import METRICS_HEADER, write_metrics

    assert METRICS_HEADER[:6] == ["epoch", "train_loss", "val_accuracy", "lr", "images_per_second", "epoch_seconds"]
    write_metrics(str(tmp_path), [[0, "1.0", "0.5", "0.1", "9.0", "2.0"]])  # a row of an older checkpoint
    row = read_metrics(str(tmp_path))[0]
    assert row["val_accuracy"] == "0.5" and row["val_macro_f1"] == "" and row["best_source"] == ""


def test_start_summary_warns_of_imbalance_and_names_the_two_flags(capsys):
    from multi_train_utils.recorder import print_data_summary
    from multi_train_utils.datasets import Datasets, MyDataSet

    train = MyDataSet(["x"] * 13, [0] * 10 + [1] * 3)  # 10 against 3: more than 3 times
    val = MyDataSet(["y"] * 2, [0, 1])
    data = Datasets(train, val, ["cats", "dogs"])
    print_data_summary(config_of(recipe_args(data_path="d")), data)
    assert ("warning: the classes are imbalanced: cats has 10 training images, dogs 3; consider --sampler balanced "
            "or --class-weights balanced") in capsys.readouterr().out
    print_data_summary(config_of(recipe_args(data_path="d", sampler="balanced")), data)  # already taken care of
    assert "imbalanced" not in capsys.readouterr().out
    balanced = Datasets(MyDataSet(["x"] * 12, [0] * 9 + [1] * 3), val, ["cats", "dogs"])  # 3 times: fine
    print_data_summary(config_of(recipe_args(data_path="d")), balanced)
    assert "imbalanced" not in capsys.readouterr().out


# --- Whole runs --------------------------------------------------------------------------------

RECIPE = ["--auto-augment", "ta_wide", "--random-erase", "0.25", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
          "--label-smoothing", "0.1", "--model-ema", "--model-ema-decay", "0.9", "--opt", "adamw",
          "--no-norm-bias-decay", "--sampler", "balanced", "--class-weights", "balanced", "--best-metric", "macro_f1",
          "--lr-scheduler", "step", "--lr-step-size", "2", "--val-resize-size", "40", "--lr", "0.002"]


def ddp(*flags):
    return [*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), PROBE, "multi", *flags]


def test_every_feature_at_once_kill_and_resume_equals_a_straight_run_with_ema_identical_on_ranks(tiny_data, tmp_path):
    from conftest import StartedJob

    epochs = ["--epochs", "3", "--workers", "0"]
    straight = tmp_path / "straight"
    # the straight run: 2 ranks as srun starts them; the killed one below runs under torchrun
    result = run_ranks(2, [PYTHON, PROBE, "multi", *train_args(tiny_data, straight, *epochs, *RECIPE)],
                       env={"PROBE_OUT": f"{straight}.probe", "PROBE_PERTURB": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    # the loss, the mixing and the balanced sampler reached the loop; the counts of the training
    # classes are 7 7 7 8 7 (6 of each, plus the other formats, one unreadable)
    from multi_train_utils.loaders import BalancedDistributedSampler
    from utils import read_split_data

    ranks = probe_records(f"{straight}.probe", 2)
    labels = read_split_data(tiny_data["train"], val_root=tiny_data["val"], check_images=True).train_images_label
    counts = [labels.count(c) for c in range(5)]
    for record in ranks:
        assert record["loss"]["label_smoothing"] == 0.1 and record["loss"]["soft_targets"]
        assert record["loss"]["class_weights"] == pytest.approx([len(labels) / (5 * n) for n in counts])
        sampler = BalancedDistributedSampler(labels, num_replicas=2, rank=record["rank"], seed=0)
        for epoch in range(3):
            sampler.set_epoch(epoch)
            assert record["orders"][str(epoch)] == list(sampler)[:len(record["orders"][str(epoch)])]
    # every evaluation (the model's, then the EMA's, each epoch) saw the same weights on both ranks,
    # although rank 1 started from other weights (PROBE_PERTURB): DDP's broadcast reached the EMA
    assert len(ranks[0]["eval_hashes"]) == 6 and ranks[0]["eval_hashes"] == ranks[1]["eval_hashes"]
    assert len(set(ranks[0]["eval_hashes"])) == 6  # model and EMA differ, and move every epoch

    out = tmp_path / "killed"
    flags = train_args(tiny_data, out, *epochs, *RECIPE)
    killed = StartedJob(ddp(*flags), {"PROBE_STEP_SLEEP": "0.3"})
    try:
        deadline = time.monotonic() + 150
        while True:  # until the second checkpoint (epoch 1) can be read
            assert killed.poll() is None and time.monotonic() < deadline, "no second checkpoint"
            try:
                if torch.load(out / "checkpoint.pth", weights_only=True)["epoch"] >= 1:
                    break
            except (OSError, RuntimeError, EOFError):
                pass
            time.sleep(0.05)
    finally:
        kill_tree(killed.pid)
        killed.wait()
    saved = torch.load(out / "checkpoint.pth", weights_only=True)
    assert saved["epoch"] == 1 and saved["model_ema"]["updates"] > 0  # stopped before the end
    resumed = run([*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), script("train_multi_gpu.py"),
                   *flags, "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert metrics_without_timing(out) == metrics_without_timing(straight)
    final, expected = (torch.load(d / "checkpoint.pth", weights_only=True) for d in (out, straight))
    for part in ("model", "ema"):
        mine = final["model"] if part == "model" else final["model_ema"]["weights"]
        theirs = expected["model"] if part == "model" else expected["model_ema"]["weights"]
        for key in theirs:
            torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=1e-5, msg=f"{part} {key}")
    steps = (36 // 2) // 4  # 36 training images over 2 ranks, batches of 4
    assert final["model_ema"]["updates"] == expected["model_ema"]["updates"] == 3 * steps
    # model-best.pth: the first epoch of the best macro-F1, of the model or (if strictly better) the EMA
    scores = []
    for r in read_metrics(straight):
        model_f1, ema_f1 = float(r["val_macro_f1"]), float(r["ema_val_macro_f1"])
        source = "ema" if ema_f1 > model_f1 else "model"
        assert r["best_source"] == source
        scores.append((max(model_f1, ema_f1), source))
    best_epoch = max(range(3), key=lambda e: (scores[e][0], -e))
    assert (expected["best_epoch"], expected["best_source"]) == (best_epoch, scores[best_epoch][1])
    best = torch.load(straight / "model-best.pth", weights_only=True)
    if scores[best_epoch][1] == "model":
        reference = torch.load(straight / f"model-{best_epoch}.pth", weights_only=True)
    elif best_epoch == 2:
        reference = expected["model_ema"]["weights"]
    else:
        reference = best  # an earlier epoch's EMA is kept nowhere else
    assert all(torch.equal(best[key], reference[key]) for key in reference)
    source = "the EMA of the weights (--model-ema)" if scores[best_epoch][1] == "ema" else "the model's weights"
    assert f"best weights: {straight / 'model-best.pth'} ({source}, epoch {best_epoch})" in result.stdout


@pytest.mark.parametrize("launch", ["single", "torchrun"])
def test_patience_stops_the_run_and_resume_auto_finds_it_complete(launch, tiny_data, tmp_path):
    """Both scripts: under DDP every rank leaves the loop after the same epoch."""
    out = tmp_path / "out"
    start = ([PYTHON, script("train_single.py")] if launch == "single" else
             [*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), script("train_multi_gpu.py")])
    # only the head trains (BatchNorm frozen too), at a rate too small to change any prediction:
    # no epoch after the first can be better
    flags = train_args(tiny_data, out, "--epochs", "5", "--workers", "0", "--patience", "1", "--lr", "1e-12",
                       "--opt", "adamw", "--freeze-layers")
    first = run([*start, *flags])
    assert first.returncode == 0, first.stdout + first.stderr
    assert [r["epoch"] for r in read_metrics(out)] == ["0", "1"]
    checkpoint = torch.load(out / "checkpoint.pth", weights_only=True)
    assert checkpoint["epoch"] == 1 and checkpoint["stopped_early"].startswith(
        "stopped early after epoch 1: no better val accuracy for 1 epochs")
    assert checkpoint["stopped_early"] in first.stdout
    if launch == "torchrun":
        start[start.index("--master_port") + 1] = str(free_port())
    again = run([*start, *flags, "--resume", "auto"])
    assert again.returncode == 0, again.stdout + again.stderr
    assert "the run is already complete (stopped early after epoch 1" in again.stdout
    assert "[train epoch" not in again.stdout and len(read_metrics(out)) == 2


def test_curves_show_the_emas_accuracy_only_when_there_is_one():
    from multi_train_utils.pictures import plot_training_curves

    rows = [{"epoch": "0", "train_loss": "2.0", "val_accuracy": "0.5", "lr": "0.1", "ema_val_accuracy": "0.6"},
            {"epoch": "1", "train_loss": "1.0", "val_accuracy": "0.7", "lr": "0.1", "ema_val_accuracy": "0.65"}]
    accuracy = plot_training_curves(rows).axes[1]
    assert [list(line.get_ydata()) for line in accuracy.lines] == [[0.5, 0.7], [0.6, 0.65]]
    without = [dict(r, ema_val_accuracy="") for r in rows]
    assert len(plot_training_curves(without).axes[1].lines) == 1
