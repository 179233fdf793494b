"""What a resume restores besides the weights: the best epoch so far (its value for every
--best-metric, its accuracy, its epoch, whether the model or its EMA scored it), --patience,
and every counter (epoch, EMA updates, optimizer steps, the fp16 loss scale). After a resume
at any epoch, every later decision ("best", "stop") and every file is the one of a run never
stopped. In-process: RunRecorder writes its real checkpoint.pth, which the resumed run reads
back as the scripts do (find_resume_checkpoint, restore_training_state)."""
import random

import pytest
import torch
from torch import nn

from conftest import read_metrics, full_flags
from multi_train_utils.checkpoint import TrainState, find_resume_checkpoint, restore_training_state
from multi_train_utils.model_setup import ModelEma
from conftest import run_recorder
from multi_train_utils.single_label import EvalResult
from multi_train_utils.train_eval_utils import TrainStats

DATA = full_flags(classes=["a", "b"])  # as far as RunRecorder reads the data
EPOCHS = 10


def recipe_args(tmp_path, best_metric, patience, epochs=EPOCHS):
    from multi_train_utils.options import get_args_parser, parse_args

    return parse_args(get_args_parser(distributed=False), [
        "--model", "resnet18", "--model-ema", "--opt", "adamw", "--best-metric", best_metric,
        "--patience", str(patience), "--epochs", str(epochs), "--keep-last", "0", "--no-plots",
        "--output-dir", str(tmp_path / "run"), "--log-dir", str(tmp_path / "tb")])


def evaluation(correct_a, correct_b, loss, per_class=5):
    """An EvalResult of 2 classes, ``per_class`` images each, ``correct_*`` right."""
    confusion = torch.tensor([[correct_a, per_class - correct_a], [per_class - correct_b, correct_b]])
    return EvalResult(confusion, None, loss * 2 * per_class)


def scripted_epochs(seed):
    """EPOCHS (model result, EMA result) pairs that improve with noise, then level off, so that the best moves
    on, between the model and the EMA, with ties (equal counts or losses) and epochs a little
    better or worse than the best."""
    rng = random.Random(seed)
    results = []
    for epoch in range(EPOCHS):
        pair = []
        for _ in range(2):
            level = min(epoch, 5)  # then a plateau, where --patience may run out
            a, b = (min(5, rng.randint(1, 3) + level // 2) for _ in range(2))
            pair.append(evaluation(a, b, loss=round(0.9 - 0.05 * level + 0.05 * rng.randint(0, 2), 2)))
        results.append(pair)
    return results


class Run:
    """One process's worth of a training run: a tiny model whose weights after epoch e are
    e (and its EMA's, updated once per epoch, different), AdamW, an fp16 GradScaler."""

    def __init__(self, args, resume=None):
        torch.manual_seed(0)
        self.model = nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
        self.state = TrainState(self.model, optimizer, scaler=scaler, ema=ModelEma(self.model, 0.9))
        path, checkpoint = find_resume_checkpoint(resume, args.output_dir)
        if checkpoint is not None:
            self.model.load_state_dict(checkpoint["model"])
        restore_training_state(self.state, checkpoint)
        self.state.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 1.0)
        self.recorder = run_recorder(args, DATA, self.state, checkpoint=checkpoint, resume_path=path, enabled=True,
                                    world_size=1)

    def train(self, epoch, results):
        """Epochs from ``epoch`` on until --epochs or --patience: what each decided."""
        decided = {}
        state = self.state
        for e in range(epoch, self.recorder.epochs):
            if state.stop_reason:
                break
            self.model.weight.grad = torch.ones_like(self.model.weight)
            self.model.bias.grad = torch.ones_like(self.model.bias)
            state.optimizer.step()  # AdamW's step counter
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(float(e))
            state.scaler.scale(torch.ones(()))  # (the scaler then knows its scale)
            state.scaler.update(state.scaler.get_scale() * 0.5)  # a loss scale that changes each epoch
            state.ema.update(self.model)
            model_result, ema_result = results[e]
            self.recorder.end_epoch(e, TrainStats(1.0, 10, 1.0, 0.1, 10.0), model_result, ema_result)
            best = state.best
            decided[e] = (best.value, best.accuracy, best.epoch, best.source, state.stop_reason,
                          state.ema.updates, state.scaler.get_scale(),
                          state.optimizer.state_dict()["state"][0]["step"].item())
        self.recorder.close()
        return decided


@pytest.mark.parametrize("best_metric", ["accuracy", "balanced_accuracy", "macro_f1", "loss"])
def test_a_resume_at_any_epoch_decides_every_later_best_and_stop_as_a_run_never_stopped(tmp_path, best_metric):
    for seed in range(3):
        results = scripted_epochs(seed)
        straight_dir = tmp_path / f"straight-{seed}"
        straight = Run(recipe_args(straight_dir, best_metric, patience=3))
        expected = straight.train(0, results)
        last = max(expected)
        expected_best = torch.load(straight_dir / "run" / "model-best.pth", weights_only=True)
        expected_rows = read_metrics(str(straight_dir / "run"))
        sources = {expected[e][3] for e in expected}
        for stop_after in range(0, last):
            folder = tmp_path / f"resumed-{seed}-{stop_after}"
            # the first run ends (is killed) after this epoch
            first = Run(recipe_args(folder, best_metric, patience=3, epochs=stop_after + 1))
            first_decided = first.train(0, results[:stop_after + 1])
            resumed = Run(recipe_args(folder, best_metric, patience=3), resume="auto")
            assert resumed.state.epoch == stop_after + 1
            decided = {**first_decided, **resumed.train(resumed.state.epoch, results)}
            assert decided == expected, (seed, stop_after)
            best = torch.load(folder / "run" / "model-best.pth", weights_only=True)
            assert all(torch.equal(best[k], expected_best[k]) for k in expected_best), (seed, stop_after)
            assert read_metrics(str(folder / "run")) == expected_rows, (seed, stop_after)
        print(best_metric, seed, "stopped after", last, "best sources", sorted(sources))


def test_the_scripted_epochs_cover_what_a_resume_must_restore(tmp_path):
    """The cases above are not vacuous: over the seeds, the best comes from the EMA and from the
    model, --patience stops a run before --epochs, and best epochs lie before resume points."""
    seen_sources, stopped_early, best_epochs = set(), 0, set()
    for best_metric in ("accuracy", "loss"):
        for seed in range(3):
            decided = Run(recipe_args(tmp_path / f"{best_metric}-{seed}", best_metric, patience=3)).train(
                0, scripted_epochs(seed))
            seen_sources |= {d[3] for d in decided.values()}
            best_epochs |= {d[2] for d in decided.values()}
            stopped_early += max(decided) < EPOCHS - 1
    assert seen_sources == {"model", "ema"}
    assert stopped_early >= 1
    assert len(best_epochs) >= 3


def test_a_resume_restores_each_counter_and_the_best_by_hand(tmp_path):
    """Hand-made: after 3 epochs (best: the EMA's val loss 0.40 at epoch 1, accuracy 0.7), a
    resume has epoch 3 next, 3 EMA updates, 3 AdamW steps, the loss scale 2^10 / 2^3, and that
    best; epoch 3 with loss 0.41 is no better, epoch 4 with 0.41 neither: --patience 3 stops
    after epoch 4 (epochs 2, 3, 4 without a better loss)."""
    args = recipe_args(tmp_path, "loss", patience=3)
    results = [(evaluation(3, 3, 0.60), evaluation(3, 3, 0.61)),
               (evaluation(4, 4, 0.45), evaluation(4, 3, 0.40)),
               (evaluation(5, 5, 0.40), evaluation(5, 5, 0.40)),  # a tie with the best is not better
               (evaluation(5, 5, 0.41), evaluation(5, 5, 0.41)),
               (evaluation(5, 5, 0.41), evaluation(5, 5, 0.41))] + [(evaluation(5, 5, 0.1),) * 2] * 3
    args.epochs = 3
    Run(args).train(0, results)
    args.epochs = EPOCHS
    resumed = Run(args, resume="auto")
    state = resumed.state
    assert state.epoch == 3
    assert (state.best.value, state.best.accuracy, state.best.epoch, state.best.source) == \
        (pytest.approx(0.40), pytest.approx(0.7), 1, "ema")
    assert state.best.confusion is not None  # for the confusion matrix at the end
    assert torch.equal(state.best.confusion, results[1][1].confusion)
    assert state.ema.updates == 3
    assert state.scaler.get_scale() == 2.0 ** 10 / 2 ** 3
    assert state.optimizer.state_dict()["state"][0]["step"].item() == 3
    assert state.stop_reason is None
    decided = resumed.train(3, results)
    assert sorted(decided) == [3, 4]
    # TensorBoard goes on with the same run: one loss point per epoch, none lost, none twice
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(resumed.recorder.log_dir)
    events.Reload()
    assert [point.step for point in events.Scalars("loss")] == [0, 1, 2, 3, 4]
    assert decided[4][4].startswith("stopped early after epoch 4: no better val loss for 3 epochs")
    # model-best.pth holds the EMA's weights after epoch 1 (2 updates towards the weights 0, then
    # 1, with the warm-up decays min(0.9, 1/10) and min(0.9, 2/11)), from the initial weights
    torch.manual_seed(0)
    initial = nn.Linear(2, 2).weight.detach()
    after_0 = (1 / 10) * initial + (1 - 1 / 10) * 0.0
    after_1 = (2 / 11) * after_0 + (1 - 2 / 11) * 1.0
    best = torch.load(tmp_path / "run" / "model-best.pth", weights_only=True)
    torch.testing.assert_close(best["weight"], after_1, rtol=0, atol=1e-6)


@pytest.mark.parametrize("accum_steps, batches", [(1, 8), (2, 8), (3, 8)])
def test_a_resumed_schedule_goes_on_at_the_rate_of_a_run_never_stopped(accum_steps, batches):
    """The schedule counts optimizer steps (ceil(batches / --accum-steps) an epoch): resumed at
    epoch 2, its rates are those a straight run steps through from there, warm-up and cosine
    alike."""
    from model import create_lr_scheduler

    args = full_flags(epochs=5, warmup_epochs=1, lrf=0.1, lr_scheduler="cosine", lr_step_size=30,
                              lr_gamma=0.1, accum_steps=accum_steps)

    def rates(start_epoch, steps):
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
        scheduler = create_lr_scheduler(optimizer, args, batches, start_epoch=start_epoch)
        seen = []
        for _ in range(steps):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen

    per_epoch = -(-batches // accum_steps)
    straight = rates(0, 5 * per_epoch)
    assert rates(2, 3 * per_epoch) == pytest.approx(straight[2 * per_epoch:], rel=1e-12)
    assert straight[0] == pytest.approx(0.5 / per_epoch)  # the first warm-up step
    assert straight[per_epoch] == pytest.approx(0.5)  # the cosine's start, after 1 epoch of warm-up
