"""The engine's seams besides the task (docs/layout.md): the one config of frozen sections, the
step hook that train_one_epoch calls after each step, and the epoch's end split between the
EpochDecider, which decides, and the RunRecorder, which writes. In one process."""
import dataclasses
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from conftest import SCRIPTS, full_flags, parse_flags
from multi_train_utils import train_eval_utils
from multi_train_utils.checkpoint import BestEpoch, TrainState
from multi_train_utils.loaders import EpochBatchSampler
from multi_train_utils.options import SECTIONS, config_of, get_args_parser
from multi_train_utils.single_label import EvalResult
from multi_train_utils.train_eval_utils import LoopSettings, StepHook, train_one_epoch

# The --help group of each flag of the "common" group, as docs/flags.md lists them by topic.
COMMON = {"data_path": "data", "demo": "data", "model": "recipe", "weights": "recipe", "epochs": "recipe",
          "batch_size": "recipe", "lr": "recipe", "device": "speed", "output_dir": "run", "resume": "run",
          "eval_only": "run"}


@pytest.mark.parametrize("distributed", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_every_flag_is_in_the_config_section_of_its_help_group_once_and_frozen(distributed, tmp_path):
    args = parse_flags(distributed, "--data-path", "d", "--model", "resnet18", "--lr", "0.03", "--patience", "4",
                       "--accum-steps", "2", "--output-dir", str(tmp_path / "out"))
    config = config_of(args)
    expected = dict(COMMON)
    for group in get_args_parser(distributed)._action_groups:
        title = group.title.split(":")[0]
        section = "distributed" if title in ("distributed", "multi-GPU") else title
        if section in SECTIONS:
            expected.update({action.dest: section for action in group._group_actions})
    found = {}
    for section in SECTIONS:
        for field in dataclasses.fields(getattr(config, section)):
            assert field.name not in found, (field.name, found.get(field.name), section)
            found[field.name] = section
            assert getattr(getattr(config, section), field.name) == getattr(args, field.name), field.name
    assert set(found) == set(vars(args))  # every setting, the other script's included
    assert {name: found[name] for name in expected} == expected
    assert (config.recipe.lr, config.run.patience, config.speed.accum_steps) == (0.03, 4, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.recipe.lr = 1.0
    assert config.flags["data_path"] == os.path.abspath("d") and config.flags["lr"] == 0.03
    args.lr = 9.0  # the config was taken once: a later change of the flags does not reach it
    assert config.recipe.lr == 0.03 and config.flags["lr"] == 0.03


class Recording(StepHook):
    """A hook of one's own: what train_one_epoch tells it, step by step."""

    def __init__(self):
        self.calls, self.asked = [], 0

    def wishes(self):
        self.asked += 1
        return [0.0, 0.5]

    def start_epoch(self):
        self.calls.append("start")

    def after_step(self, step, agreed, *, group_end, last_step, loss_sum, position):
        where = position()
        self.calls.append((step, agreed and list(agreed), group_end, last_step, where.step, where.done,
                           float(loss_sum) > 0))


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_step_hook_of_ones_own_is_told_every_step_and_the_wishes_agreed_where_the_loss_is_read(monkeypatch,
                                                                                                  world_size):
    """7 steps of 2 images, --accum-steps 2, --print-freq 3: the hook starts once, then after
    each step learns its accumulation group's last step (1, 1, 3, 3, 5, 5, 6), the epoch's last
    (6) and where the epoch stands (steps done, images done); the wishes come back agreed at
    every step of a single process (its own), and of two only where the loss is read (steps 2,
    5, 6), summed with the other rank's (this one's [0, 0.5], the other's [1, 0.25])."""
    def with_the_other_rank(value, average=True):  # the all-reduce: the other rank's loss as this one's
        other = torch.cat([value[:1], torch.zeros(1, dtype=value.dtype), torch.tensor([1.0, 0.25], dtype=value.dtype)])
        return (value + other) / (2 if average else 1)

    monkeypatch.setattr(train_eval_utils, "get_world_size", lambda: world_size)
    if world_size == 2:
        monkeypatch.setattr(train_eval_utils, "reduce_value", with_the_other_rank)
    generator = torch.Generator().manual_seed(3)
    images = [(torch.randint(0, 256, (3, 4, 4), dtype=torch.uint8, generator=generator), i % 2) for i in range(14)]
    batches = EpochBatchSampler(DistributedSampler(images, num_replicas=1, rank=0, shuffle=False), 2)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 2))
    hook = Recording()
    by_epoch_and_index = {(0, i): item for i, item in enumerate(images)}  # what EpochBatchSampler asks for
    train_one_epoch(TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                    DataLoader(by_epoch_and_index, batch_sampler=batches), torch.device("cpu"), 0,
                    LoopSettings(accum_steps=2, print_freq=3), hook=hook)
    read = {2, 5, 6}
    agreed = [0.0, 0.5] if world_size == 1 else [1.0, 0.75]
    assert hook.calls == ["start"] + [(step, agreed if world_size == 1 or step in read else None,
                                       [1, 1, 3, 3, 5, 5, 6][step], 6, step + 1, 2 * (step + 1), True)
                                      for step in range(7)]
    assert hook.asked == 7  # once a step: no collective of its own


def test_the_decider_decides_and_writes_nothing_and_the_recorder_writes_and_decides_nothing(tmp_path):
    from multi_train_utils.recorder import EpochDecider, RunRecorder

    args = full_flags(output_dir=str(tmp_path / "out"), log_dir=str(tmp_path / "tb"), plots=False, keep_last=0,
                      patience=1, best_metric="accuracy", epochs=5)
    config = config_of(args)
    state = TrainState(None)
    decider = EpochDecider(state, None, config.run)
    better, worse = EvalResult(torch.tensor([[3, 1], [0, 4]])), EvalResult(torch.tensor([[2, 2], [1, 3]]))
    assert decider.end_epoch(0, worse, better) == "ema"  # the EMA scored better this epoch
    assert (state.best.epoch, state.best.source, state.best.value, state.epoch) == (0, "ema", 0.875, 1)
    assert decider.end_epoch(1, worse, worse) == "model"  # a tie is the model's
    assert state.stop_reason.startswith("stopped early after epoch 1: no better val accuracy for 1 epochs")
    assert not os.path.exists(tmp_path / "out")  # deciding wrote nothing

    model = nn.Linear(2, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       best=BestEpoch(value=0.5, accuracy=0.5, epoch=3, source="model"))
    recorder = RunRecorder(config, full_flags(classes=["a", "b"]), state, enabled=True, world_size=1)
    recorder.end_epoch(4, train_eval_utils.TrainStats(1.0, 8, 1.0, 0.1, 8.0), better, worse, source="ema")
    recorder.close()
    assert (state.best.epoch, state.best.value, state.stop_reason) == (3, 0.5, None)  # as the decider left them
    row = open(tmp_path / "out" / "metrics.csv").read().splitlines()[-1].split(",")
    header = open(tmp_path / "out" / "metrics.csv").read().splitlines()[0].split(",")
    assert dict(zip(header, row))["best_source"] == "ema" and dict(zip(header, row))["val_accuracy"] == "0.875000"
    assert not os.path.exists(tmp_path / "out" / "model-best.pth")  # epoch 4 is not the best the state holds


# --- Round 16's survivors, each with its test ------------------------------------------------

def test_an_epoch_that_improves_is_the_best_before_patience_is_judged():
    """layout.md: "EpochDecider decides ... the best epoch ..., whether --patience ran out":
    with --patience 1, an epoch better than the one before is the new best and does not stop
    the run; the next epoch that brings nothing better does."""
    from multi_train_utils.recorder import EpochDecider

    state = TrainState(None)
    decider = EpochDecider(state, None, config_of(full_flags(patience=1, best_metric="accuracy")).run)
    low, high = EvalResult(torch.tensor([[2, 2], [2, 2]])), EvalResult(torch.tensor([[4, 0], [1, 3]]))
    decider.end_epoch(0, low)
    decider.end_epoch(1, high)
    assert (state.best.epoch, state.stop_reason) == (1, None)
    decider.end_epoch(2, low)
    assert state.stop_reason.startswith("stopped early after epoch 2: no better val accuracy for 1 epochs")


def test_the_epochs_checkpoint_restarts_the_clock_of_checkpoint_every(monkeypatch, tmp_path):
    """guarantees.md: checkpoint.pth inside the epoch "once MINUTES have passed since the last
    checkpoint": an epoch's checkpoint is one, on every rank (rank 1 here, which writes nothing)."""
    from conftest import run_recorder

    now = [1000.0]
    monkeypatch.setattr(train_eval_utils.time, "monotonic", lambda: now[0])
    recorder = run_recorder(full_flags(output_dir=str(tmp_path / "out"), log_dir=str(tmp_path / "tb"),
                                       checkpoint_every=1.0, epochs=3, best_metric="accuracy"),
                            full_flags(classes=["a", "b"]),
                            enabled=False)
    now[0] += 61.0
    assert recorder.checkpoints.wishes() == [1.0, 0.0]  # a minute since the start: due
    recorder.end_epoch(0, train_eval_utils.TrainStats(1.0, 8, 1.0, 0.1, 8.0), EvalResult(torch.eye(2, dtype=torch.int64)))
    assert recorder.checkpoints.wishes() == [0.0, 0.0]  # the epoch's checkpoint: the clock starts again
    now[0] += 60.0
    assert recorder.checkpoints.wishes() == [1.0, 0.0]


def test_a_notice_after_the_last_epoch_neither_stops_nor_requeues(monkeypatch):
    """guarantees.md: a notice is answered after the epoch's checkpoint unless the run ends
    there ("a run that ends is not requeued"): ``after_epoch_save`` with notices off (the last
    epoch, or --patience ran out) returns; with notices on it stops."""
    from multi_train_utils.errors import Preempted

    monkeypatch.setattr(train_eval_utils, "notice_received", lambda: 15)
    requeued = []
    monkeypatch.setattr(train_eval_utils, "requeue_job", lambda: requeued.append(1) or "requeued")
    checkpoints = train_eval_utils.MidEpochCheckpoints(0, lambda position: None, hint="resume", requeue=True)
    try:  # Preempted is a BaseException, as a stop is: caught here to be asserted on
        checkpoints.after_epoch_save(None, None, notices=False)
        stopped = False
    except Preempted:
        stopped = True
    assert not stopped and requeued == []
    with pytest.raises(Preempted):
        checkpoints.after_epoch_save(None, None, notices=True)
    assert requeued == [1]


def test_a_save_inside_the_epoch_keeps_every_ranks_generators_in_rank_order(monkeypatch):
    """guarantees.md: the checkpoint inside the epoch "holds ... each rank's running loss sum
    and random-generator states": with two ranks, both, rank 0's first."""
    from multi_train_utils.loaders import EpochPosition

    from multi_train_utils import distributed_utils

    for module in (train_eval_utils, distributed_utils):  # gather_objects is distributed_utils'
        monkeypatch.setattr(module, "get_world_size", lambda: 2)
    monkeypatch.setattr(train_eval_utils, "rng_state", lambda: {"rank": 0})
    monkeypatch.setattr(train_eval_utils.dist, "all_gather_object",
                        lambda parts, obj: parts.__setitem__(slice(None), [obj, {"rank": 1}]))
    monkeypatch.setattr(train_eval_utils, "all_gather_rows", lambda rows: torch.cat([rows, rows + 1]))
    monkeypatch.setattr(train_eval_utils, "all_reduce_sum", lambda tensor: tensor)
    written = []
    checkpoints = train_eval_utils.MidEpochCheckpoints(1.0, written.append)
    position = EpochPosition(epoch=0, done=8, end=36, order_world_size=2, step=2, train_images=36)
    assert checkpoints.save(position, torch.tensor(2.5), notice=False)
    assert written == [position]
    assert position.rng == [{"rank": 0}, {"rank": 1}] and position.loss_sums == [2.5, 3.5]


def test_tensorboard_gets_a_figure_of_zero():
    """outputs.md: TensorBoard logs accuracy, balanced_accuracy, macro_f1, val_loss: a model
    that is always wrong logs them as 0, not leaves them out."""
    from multi_train_utils.single_label import SingleLabel

    wrong = EvalResult(torch.tensor([[0, 2], [3, 0]]), loss_sum=5.0)
    scalars = SingleLabel().scalars(wrong)
    assert {k: scalars.get(k) for k in ("accuracy", "balanced_accuracy", "macro_f1")} == {
        "accuracy": 0.0, "balanced_accuracy": 0.0, "macro_f1": 0.0}
    assert scalars["val_loss"] == pytest.approx(1.0)


def test_model_best_holds_the_emas_weights_when_the_ema_scored_better(tmp_path):
    """outputs.md: "model-best.pth holds the weights of the best epoch ..., of the model or of
    its EMA, whichever was better": the EMA's, in a file of its own, when it was."""
    from conftest import run_recorder
    from multi_train_utils.model_setup import ModelEma

    model = nn.Linear(2, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), ema=ModelEma(model, 0.5))
    with torch.no_grad():
        state.ema.module.weight.fill_(7.0)  # told apart from the model's
    recorder = run_recorder(full_flags(output_dir=str(tmp_path / "out"), log_dir=str(tmp_path / "tb"), plots=False,
                                       keep_last=0, model_ema=True, best_metric="accuracy"),
                            full_flags(classes=["a", "b"]), state,
                            enabled=True, world_size=1)
    recorder.end_epoch(0, train_eval_utils.TrainStats(1.0, 8, 1.0, 0.1, 8.0), EvalResult(torch.tensor([[1, 1], [1, 1]])),
                       EvalResult(torch.tensor([[2, 0], [0, 2]])))
    recorder.close()
    best = torch.load(tmp_path / "out" / "model-best.pth", weights_only=True)
    assert state.best.source == "ema" and torch.equal(best["weight"], torch.full((2, 2), 7.0))
    assert not torch.equal(best["weight"], model.weight.detach())


# --- Round 17's sweep: survivors, each with its test ------------------------------------------

def tiny_epoch(hook, state=None, accum_steps=2, print_freq=3):
    """One epoch of 7 steps of 2 images (as the hook test above) through ``hook``; the state."""
    generator = torch.Generator().manual_seed(3)
    images = [(torch.randint(0, 256, (3, 4, 4), dtype=torch.uint8, generator=generator), i % 2) for i in range(14)]
    batches = EpochBatchSampler(DistributedSampler(images, num_replicas=1, rank=0, shuffle=False), 2)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 2))
    state = state or TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state.model, state.optimizer = model, torch.optim.SGD(model.parameters(), lr=0.1)
    by_epoch_and_index = {(0, i): item for i, item in enumerate(images)}
    train_one_epoch(state, DataLoader(by_epoch_and_index, batch_sampler=batches), torch.device("cpu"), 0,
                    LoopSettings(accum_steps=accum_steps, print_freq=print_freq), hook=hook)
    return state


def test_saves_inside_the_epoch_come_at_group_ends_and_never_at_its_last_step(monkeypatch):
    """train_eval_utils.SavePlan: a save inside the epoch comes "at the end of the accumulation
    group in which every rank decided to (never the epoch's last step: its end saves anyway)":
    with a save due at every step, 7 steps and --accum-steps 2 save after steps 1, 3 and 5
    (positions of 2, 4 and 6 steps done), not after step 6, the last."""
    now = [0.0]

    def monotonic():  # 100 s pass at each look at the clock: a save is always due
        now[0] += 100.0
        return now[0]

    monkeypatch.setattr(train_eval_utils.time, "monotonic", monotonic)
    written = []
    tiny_epoch(train_eval_utils.MidEpochCheckpoints(1.0, written.append))
    assert [(p.step, p.done, p.end) for p in written] == [(2, 4, 14), (4, 8, 14), (6, 12, 14)]


def test_the_position_a_hook_is_given_holds_the_runs_and_the_epochs_seconds_apart():
    """layout.md: after_step gets ``position()``, "where the epoch stands": its run_seconds are
    the run's clock (here 1000 s from the sessions before), its epoch_seconds this epoch's."""
    from multi_train_utils.checkpoint import RunClock

    class Positions(StepHook):
        def __init__(self):
            self.seen = []

        def after_step(self, step, agreed, *, group_end, last_step, loss_sum, position):
            self.seen.append(position())

    hook = Positions()
    tiny_epoch(hook, TrainState(None, clock=RunClock(earlier=1000.0)))
    assert len(hook.seen) == 7
    assert all(1000.0 <= p.run_seconds < 1060.0 and 0.0 <= p.epoch_seconds < 60.0 for p in hook.seen), \
        [(p.run_seconds, p.epoch_seconds) for p in hook.seen]


def test_a_resumed_epoch_gives_each_rank_its_own_saved_loss_sum_and_generators(monkeypatch):
    """train_eval_utils.start_epoch: "The saved loss sums go back to their ranks at the
    checkpoint's world size", and resume_epoch puts "this rank's generators back as they were":
    rank 1 of 2 resuming inside epoch 0 takes loss sum 5.0 (rank 0's is 1.0) and its own
    generator states."""
    import random

    from multi_train_utils.checkpoint import rng_state
    from multi_train_utils.loaders import EpochPosition

    monkeypatch.setattr(train_eval_utils, "get_world_size", lambda: 2)
    monkeypatch.setattr(train_eval_utils, "get_rank", lambda: 1)
    saved_torch, saved_python = torch.get_rng_state(), random.getstate()
    try:
        generators = []
        for seed in (10, 11):  # rank 0's, rank 1's
            torch.manual_seed(seed)
            random.seed(seed)
            generators.append(rng_state())
        torch.manual_seed(11)
        random.seed(11)
        expected = (torch.rand(3), random.random())  # what rank 1 draws next
        torch.manual_seed(99)
        random.seed(99)
        images = list(range(14))
        batches = EpochBatchSampler(DistributedSampler(images, num_replicas=2, rank=1, shuffle=False), 2,
                                    world_size=2, rank=1)
        state = TrainState(None, position=EpochPosition(epoch=0, done=8, end=12, order_world_size=2, step=2,
                                                        train_images=14, loss_sums=[1.0, 5.0], loss_count=4,
                                                        rng=generators))
        loader = DataLoader({(0, i): i for i in images}, batch_sampler=batches)
        first_step, loss_sum, _, _ = train_eval_utils.start_epoch(state, loader, 0, LoopSettings(),
                                                                  torch.device("cpu"))
        drawn = (torch.rand(3), random.random())
    finally:
        torch.set_rng_state(saved_torch)
        random.setstate(saved_python)
    assert (first_step, float(loss_sum)) == (2, 5.0)
    assert torch.equal(drawn[0], expected[0]) and drawn[1] == expected[1]


def test_eval_only_keeps_the_defaults_of_settings_an_older_args_json_lacks(tmp_path):
    """options.take_run_settings: --eval-only takes the run's settings "unless given"; an
    args.json of an earlier version that lacks some of them (seed, val_rate, amp,
    val_resize_size, task) leaves those at their defaults, not empty."""
    from conftest import parse_flags
    from multi_train_utils.run_files import ARGS_FILE

    (tmp_path / ARGS_FILE).write_text('{"model": "resnet18", "img_size": 32, "data_path": "%s"}' % tmp_path)
    args = parse_flags(False, "--eval-only", "--weights", str(tmp_path / "model-best.pth"))
    assert (args.model, args.img_size, args.data_path) == ("resnet18", 32, str(tmp_path))
    assert (args.seed, args.val_rate, args.amp, args.val_resize_size, args.task, args.multi_label) == \
        (0, 0.2, "auto", None, "single-label", False)


# --- Round 17's survivors, each with its test ---------------------------------------------------

def test_checkpoints_inside_the_epoch_come_every_10_minutes_by_default():
    """flags.md: "`--checkpoint-every MINUTES` (10; 0: only at epoch ends ...)", both scripts."""
    assert parse_flags(False).checkpoint_every == parse_flags(True).checkpoint_every == 10.0


@pytest.mark.parametrize("top_k, shown", [(3, 3), (4, 4), (9, 4)])
def test_predict_shows_top_k_classes_and_every_class_when_top_k_reaches_their_count(top_k, shown):
    """outputs.md: predict prints "the top `--top-k` (3) classes with their probabilities": of 4
    classes, --top-k 3 shows 3, --top-k 4 and 9 all 4, most probable first."""
    from multi_train_utils.single_label import SingleLabel

    line = SingleLabel().describe(torch.tensor([0.1, 0.4, 0.2, 0.3]), ["a", "b", "c", "d"], top_k)
    assert line == ", ".join(["b 0.400", "d 0.300", "c 0.200", "a 0.100"][:shown])


def test_multi_label_tensorboard_scalars_are_every_figure_of_the_page():
    """multi-label.md: TensorBoard gets "the scalars `map`, `micro_f1`, `micro_precision`,
    `micro_recall`, `macro_f1`, `accuracy`, `val_loss`", each the result's own value."""
    from types import SimpleNamespace

    from multi_train_utils.multi_label import MultiLabel

    result = SimpleNamespace(accuracy=0.1, macro_f1=0.2, map=0.3, micro_f1=0.4, micro_precision=0.5, micro_recall=0.6,
                             loss=0.7)
    assert MultiLabel().scalars(result) == {"map": 0.3, "micro_f1": 0.4, "micro_precision": 0.5, "micro_recall": 0.6,
                                            "macro_f1": 0.2, "accuracy": 0.1, "val_loss": 0.7}


def test_single_label_ema_cells_are_the_emas_own_figures():
    """outputs.md: "the EMA's `ema_val_accuracy`, `ema_val_loss`, `ema_val_balanced_accuracy`,
    `ema_val_macro_f1`": the model all right on 6 images (loss 0.6 summed), the EMA 4 of 6
    (recall and precision 2/3 in both classes, loss 3.0 summed)."""
    from multi_train_utils.single_label import SingleLabel

    model = EvalResult(torch.tensor([[3, 0], [0, 3]]), loss_sum=0.6)
    ema = EvalResult(torch.tensor([[2, 1], [1, 2]]), loss_sum=3.0)
    cells = SingleLabel().cells(model, ema)
    assert (cells["val_accuracy"], cells["val_loss"], cells["val_macro_f1"]) == ("1.000000", "0.100000", "1.000000")
    assert (cells["ema_val_accuracy"], cells["ema_val_loss"], cells["ema_val_balanced_accuracy"],
            cells["ema_val_macro_f1"]) == ("0.666667", "0.500000", "0.666667", "0.666667")


@pytest.mark.parametrize("done_steps, accum_steps, scheduler_steps", [(3, 2, 2), (4, 2, 2), (5, 1, 5)])
def test_a_resume_inside_an_epoch_counts_a_partial_accumulation_group_as_a_step_of_the_schedule(
        done_steps, accum_steps, scheduler_steps):
    """guarantees.md: a resume puts "the schedule at the step those images make": 3 batches done
    at --accum-steps 2 made 2 optimizer steps (the last group of one batch steps too, as the
    epoch's last group does), so the schedule stands at 2; 4 batches at 2; 5 at 5 without
    accumulation."""
    from multi_train_utils.loaders import EpochPosition

    images = list(range(14))
    batches = EpochBatchSampler(DistributedSampler(images, num_replicas=1, rank=0, shuffle=False), 2)
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = TrainState(model, optimizer, scheduler, position=EpochPosition(
        epoch=0, done=2 * done_steps, end=14, order_world_size=1, step=done_steps, train_images=14,
        loss_sums=[1.0], loss_count=done_steps))
    loader = DataLoader({(0, i): i for i in images}, batch_sampler=batches)
    train_eval_utils.start_epoch(state, loader, 0, LoopSettings(accum_steps=accum_steps), torch.device("cpu"))
    assert scheduler.last_epoch == scheduler_steps


@pytest.mark.parametrize("count, listed", [(20, list(range(20))), (21, [20, 19, 18, 17, 16, 15, 14, 13, 12, 11])])
def test_a_multi_label_report_lists_every_class_up_to_20_and_the_10_of_lowest_ap_from_21(count, listed):
    """multi-label.md: the end summary lists each class's figures "(beyond 20 classes the 10 of
    lowest AP)": exactly 20 classes are all listed; of 21, AP falling with the index, the last 10."""
    from multi_train_utils.multi_label import listed_classes

    report = {"ap": [1.0 - c / 100 for c in range(count)]}
    assert listed_classes(report, [f"c{c}" for c in range(count)]) == listed


@pytest.mark.parametrize("ema_column", [True, False])
def test_the_time_to_target_follows_a_tasks_own_headline_lower_is_better_with_or_without_ema_cells(ema_column):
    """Round 17's reviewer: a task whose headline is its own metric (``mae``, lower is better)
    crashed --target-accuracy's line (no ``ema_val_mae`` column) and took "reached" as "at least".
    MAE 0.9, 0.4, 0.3 at 10, 20, 30 s: 0.5 is first reached at epoch 1 (20 s); 0.2 never."""
    from multi_train_utils.recorder import time_to_target
    from multi_train_utils.task import Task

    class Grades(Task):
        metrics, lower_is_better, headline = ("mae",), ("mae",), ("mae", "mean absolute error")

    header = ["epoch", "run_seconds", "val_mae"] + (["ema_val_mae"] if ema_column else [])
    rows = [[str(e), str(s), str(m)] + ([""] if ema_column else []) for e, s, m in ((0, 10, 0.9), (1, 20, 0.4),
                                                                                   (2, 30, 0.3))]
    assert time_to_target(0.5, rows, 2, Grades(), header) == (
        "run clock: the best epoch (2) after 0m30s of training; val mean absolute error 0.5 first reached at epoch 1, "
        "after 0m20s")
    assert time_to_target(0.2, rows, 2, Grades(), header).endswith(
        "; val mean absolute error never reached --target-accuracy 0.2")


def test_metrics_csv_holds_a_tasks_own_columns_after_the_common_ones_with_its_cells(tmp_path):
    """layout.md: "`columns` | metrics.csv columns of its own, after the common ones": a task's
    own column and its cell reach metrics.csv (round 17: the common header alone was written)."""
    import csv

    from conftest import run_recorder
    from multi_train_utils.single_label import SingleLabel

    class Graded(SingleLabel):
        columns = ("val_grade",)

        def cells(self, result, ema_result=None):
            return {**super().cells(result, ema_result), "val_grade": f"{result.accuracy / 2:.6f}"}

    model = nn.Linear(2, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    recorder = run_recorder(full_flags(output_dir=str(tmp_path / "out"), log_dir=str(tmp_path / "tb"), plots=False,
                                       keep_last=0, best_metric="accuracy"), full_flags(classes=["a", "b"]), state,
                            task=Graded(),
                            enabled=True, world_size=1)
    recorder.end_epoch(0, train_eval_utils.TrainStats(1.0, 8, 1.0, 0.1, 8.0), EvalResult(torch.tensor([[3, 1], [0, 4]])))
    recorder.close()
    with open(tmp_path / "out" / "metrics.csv", newline="") as f:
        header, row = list(csv.reader(f))
    assert header[-1] == "val_grade" and header.index("val_accuracy") < header.index("val_grade")
    assert dict(zip(header, row))["val_grade"] == "0.437500" and dict(zip(header, row))["val_accuracy"] == "0.875000"
