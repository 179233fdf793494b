"""The task contract (multi_train_utils/task.py, docs/layout.md "A task of your own") held
for both built-in tasks and a task of your own, in one process: each rank's tally combined
exactly, the EMA's figures where they belong, the best epoch's kept figures of the weights it
keeps, older files read as the task they were, --task's names and paths, the refusals that
follow a task's several_labels. Round 15's survivors, each with its test."""
import io
import json
import os
import shutil
import textwrap
import threading

import pytest
import torch

from conftest import REPO, full_flags, outcome
from multi_train_utils.options import config_of  # noqa: E402

TASK_FILE = os.path.join(REPO, "tests", "helpers", "ordinal_task.py")


class TwoRanks:
    """The collectives of a 2-process job, played in one process: rank 1's tally gives its
    tensors first (recorded, in call order), then rank 0's result sums or gathers with them."""

    def __init__(self, monkeypatch, *modules):
        self.monkeypatch, self.modules, self.recorded = monkeypatch, modules, []

    def _patch(self, reduce, gather):
        for module in self.modules:
            self.monkeypatch.setattr(module, "all_reduce_sum", reduce, raising=False)
            self.monkeypatch.setattr(module, "all_gather_rows", gather, raising=False)

    def result(self, rank0, rank1):
        def record(tensor):
            self.recorded.append(tensor.clone())
            return tensor

        self._patch(record, record)
        rank1.result()
        others = iter(self.recorded)

        def reduce(tensor):
            tensor += next(others)
            return tensor

        self._patch(reduce, lambda rows: torch.cat([rows, next(others)]))
        return rank0.result()


class ThreadRanks:
    """The collectives of a job of ``world`` processes, played by threads of one process (a
    thread a rank): multi_label's all-reduce, all-to-all of columns and gather of objects meet
    at a barrier and give each rank what the real ones would."""

    def __init__(self, monkeypatch, world):
        from multi_train_utils import multi_label

        self.world, self.barrier, self.slots, self.me = world, threading.Barrier(world), [None] * world, threading.local()
        for name, function in (("get_rank", lambda: self.me.rank), ("get_world_size", lambda: world),
                               ("all_reduce_sum", self.all_reduce_sum), ("gather_objects", self.share),
                               ("columns_of_every_rank", self.columns)):
            monkeypatch.setattr(multi_label, name, function)

    def share(self, value):
        self.slots[self.me.rank] = value
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()
        return everyone

    def all_reduce_sum(self, tensor):
        return tensor.copy_(sum(self.share(tensor.clone())))

    def columns(self, blocks, bounds):
        lo, hi = bounds[self.me.rank], bounds[self.me.rank + 1]
        return [rows[:, lo:hi] for rows in self.share(torch.cat(blocks))]

    def results(self, tallies):
        out = [None] * self.world

        def run(rank):
            self.me.rank = rank
            out[rank] = tallies[rank].result()

        threads = [threading.Thread(target=run, args=(rank,)) for rank in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        return out


def batches(num_classes, multi_hot=False, seed=0):
    """Four batches of (logits, labels, weights): the last one padded (2 rows of weight 0), one
    image left out (label -1)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for b in range(4):
        logits = torch.randn(4, num_classes, generator=generator)
        if multi_hot:
            labels = (torch.rand(4, num_classes, generator=generator) > 0.5).float()
        else:
            labels = torch.randint(0, num_classes, (4,), generator=generator)
        weights = torch.ones(4, dtype=torch.int64)
        if b == 3:
            weights[2:] = 0
        if b == 1:
            labels[0] = -1
        out.append((logits, labels, weights))
    return out


@pytest.mark.parametrize("kind", ["single-label", "multi-label"])
def test_each_ranks_tally_is_combined_exactly_loss_included(monkeypatch, kind):
    """task.py: ``result()`` "combines all ranks exactly (each image once)": two ranks' shards
    give the figures of one process over every image, the summed loss among them; the loss is
    the plain one, computed here from the logits."""
    from multi_train_utils import single_label
    from multi_train_utils.options import make_task

    task, classes = make_task(kind), 7
    data = batches(classes, multi_hot=kind == "multi-label")
    whole = task.evaluation(classes, torch.device("cpu"))
    for batch in data:
        whole.add(*batch)
    expected = whole.result()
    shards = [task.evaluation(classes, torch.device("cpu")) for _ in range(2)]
    for i, batch in enumerate(data):
        shards[i % 2].add(*batch)
    if kind == "single-label":
        combined = TwoRanks(monkeypatch, single_label).result(*shards)
    else:
        combined = ThreadRanks(monkeypatch, 2).results(shards)[0]
    kept = [(logits[w > 0], labels[w > 0]) for logits, labels, w in data]
    logits = torch.cat([lo for lo, la in kept])
    labels = torch.cat([la for lo, la in kept])
    read = (labels >= 0) if kind == "single-label" else (labels[:, 0] >= 0)
    logits, labels = logits[read], labels[read]
    if kind == "single-label":
        loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        assert combined.loss_sum == pytest.approx(float(loss), rel=1e-6)
        assert torch.equal(combined.confusion, expected.confusion) and combined.left_out == 1
    else:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        assert combined.loss_sum == pytest.approx(float(loss), rel=1e-6)
        assert combined.map == pytest.approx(expected.map, abs=1e-12) and combined.left_out == 1
    assert combined.total == expected.total == 13 and combined.loss == pytest.approx(expected.loss, rel=1e-6)


@pytest.mark.parametrize("world", [2, 3])
def test_each_class_is_counted_at_its_own_threshold_across_ranks_and_chunks(monkeypatch, world):
    """multi-label.md: --eval-only "uses the run's thresholds.json" and each rank "takes every
    per-class figure", the counts "at the thresholds in use" among them: with a threshold of
    its own for each of 5 classes, split across ranks and ranked one class a chunk, every
    class's TP and FP and the exact matches are those of its threshold, counted here."""
    from multi_train_utils import multi_label
    from multi_train_utils.options import make_task

    monkeypatch.setattr(multi_label, "CHUNK", 1)  # one class a chunk: a table of several chunks
    thresholds, classes = [0.2, 0.45, 0.5, 0.7, 0.9], 5
    task = type(make_task("multi-label"))(thresholds)
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(18, classes, generator=generator)
    labels = (torch.rand(18, classes, generator=generator) > 0.5).float()
    shards = [task.evaluation(classes, torch.device("cpu")) for _ in range(world)]
    for i in range(0, 18, 3):
        shards[(i // 3) % world].add(logits[i:i + 3], labels[i:i + 3], torch.ones(3, dtype=torch.int64))
    scores, positives = torch.sigmoid(logits), labels > 0.5
    predicted = scores >= torch.tensor(thresholds)
    for result in ThreadRanks(monkeypatch, world).results(shards):
        assert result.thresholds.tolist() == pytest.approx(thresholds)
        assert result.counts[0].tolist() == (predicted & positives).sum(dim=0).tolist()
        assert result.counts[1].tolist() == (predicted & ~positives).sum(dim=0).tolist()
        assert result.correct == int((predicted == positives).all(dim=1).sum())


@pytest.mark.parametrize("world", [2, 3, 5])
def test_every_multi_label_figure_is_the_same_with_the_classes_split_across_ranks(monkeypatch, world):
    """multi-label.md: each rank ranks its share of the classes and the figures are gathered:
    at world 2, 3 and 5 (more ranks than some shares have classes: 4 classes) every rank's
    result holds the figures of one process over every image, to 1e-12: AP, counts, tuned
    thresholds, curves, exact match; and those equal the definitions computed here."""
    from multi_train_utils.multi_label import MultiLabelResult
    from multi_train_utils.options import make_task

    task, classes = make_task("multi-label"), 4
    generator = torch.Generator().manual_seed(world)
    data = []
    for b in range(5):
        logits = torch.randint(-3, 4, (6, classes), generator=generator).float() / 2  # ties within a class
        labels = (torch.rand(6, classes, generator=generator) > 0.6).float()
        weights = torch.ones(6, dtype=torch.int64)
        weights[5:] = 0 if b == 4 else 1
        data.append((logits, labels, weights))
    data[2][1][0] = -1  # an image left out
    shards = [task.evaluation(classes, torch.device("cpu")) for _ in range(world)]
    for i, batch in enumerate(data):
        shards[i % world].add(*batch)  # at world 5 each rank one batch; more ranks than classes at 5
    results = ThreadRanks(monkeypatch, world).results(shards)
    kept = torch.cat([(w > 0) & (la[:, 0] >= 0) for _, la, w in data])
    scores = torch.sigmoid(torch.cat([lo for lo, _, _ in data]))[kept]
    targets = torch.cat([la for _, la, _ in data])[kept]
    whole = MultiLabelResult.from_scores(scores, targets)
    exact = int(((scores >= 0.5) == (targets > 0.5)).all(dim=1).sum())
    for result in results:
        assert (result.total, result.correct, result.left_out) == (28, exact, 1) == (whole.total, whole.correct, 1)
        assert result.ap == pytest.approx(whole.ap, abs=1e-12, nan_ok=True)
        assert result.tuned_thresholds() == whole.tuned_thresholds()
        assert [c.tolist() for c in result.counts] == [c.tolist() for c in whole.counts]
        assert [c.tolist() for c in result.tuned().counts] == [c.tolist() for c in whole.tuned().counts]
        assert str(result.report()) == str(whole.report())  # str: nan equals nan
        bce = torch.nn.functional.binary_cross_entropy_with_logits(torch.cat([lo for lo, _, _ in data])[kept], targets,
                                                                   reduction="sum")
        assert result.loss_sum == pytest.approx(float(bce), rel=1e-6)  # float32 terms
    for c in range(classes):  # TP at 0.5 counted here
        predicted, positive = scores[:, c] >= 0.5, targets[:, c] > 0.5
        assert int(whole.counts[0][c]) == int((predicted & positive).sum())



def test_rank_r_of_w_ranks_classes_r_c_over_w_to_r_plus_1_c_over_w_minus_1():
    """multi-label.md: rank r of W ranks "class r·C/W to (r+1)·C/W − 1" (whole classes, so the
    floors): the shares differ by one class at most, never the remainder heaped on the last
    rank; more ranks than classes leave some ranks none. Worked by hand."""
    from multi_train_utils.multi_label import class_bounds

    assert class_bounds(10, 4) == [0, 2, 5, 7, 10]  # 2.5 -> 2, 5, 7.5 -> 7: shares 2, 3, 2, 3
    assert class_bounds(4, 5) == [0, 0, 1, 2, 3, 4]  # 0.8 -> 0: rank 0 has none
    assert class_bounds(600, 7) == [0, 85, 171, 257, 342, 428, 514, 600]
    assert class_bounds(7, 1) == [0, 7] and class_bounds(5, 3) == [0, 1, 3, 5]


def test_the_report_keeps_the_curves_of_the_six_lowest_aps_of_every_rank(monkeypatch):
    """multi-label.md: each rank draws "the precision-recall curves of its classes of lowest AP"
    and the report keeps those of the 6 lowest of all: 14 classes on 2 ranks (7 each, so each
    offers 6 curves) keep the curves of the 6 classes of lowest AP by the definition computed
    here, whichever rank ranked them, on every rank."""
    from test_multi_label import ap_by_definition

    from multi_train_utils.options import make_task

    task, classes = make_task("multi-label"), 14
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(40, classes, generator=generator)
    labels = (torch.rand(40, classes, generator=generator) > 0.5).float()
    labels[0] = 1  # every class has a positive
    shards = [task.evaluation(classes, torch.device("cpu")) for _ in range(2)]
    for i in range(0, 40, 4):
        shards[(i // 4) % 2].add(logits[i:i + 4], labels[i:i + 4], torch.ones(4, dtype=torch.int64))
    scores = torch.sigmoid(logits).tolist()
    aps = [ap_by_definition([row[c] for row in scores], [int(row[c]) for row in labels.tolist()])
           for c in range(classes)]
    lowest = sorted(range(classes), key=lambda c: (aps[c], c))[:6]
    assert not set(lowest) <= set(range(7)) and not set(lowest) <= set(range(7, 14))  # both ranks' classes
    for result in ThreadRanks(monkeypatch, 2).results(shards):
        assert sorted(result.report()["curves"], key=int) == [str(c) for c in sorted(lowest)]


def test_the_tally_keeps_float32_probabilities_of_bf16_logits():
    """multi-label.md: "Each rank keeps its images' probabilities (float32)": under bf16 autocast
    the logits come in bf16 (5.0, 5.125, 5.25, 5.375 are exact there), whose sigmoids in bf16
    would be two values (0.9922, 0.9961: two ties). In float32 they are four: AP by hand over
    negative, positive, negative, positive from the lowest: 1/2 x 1 + 1/2 x 2/3; the best-F1
    threshold is sigmoid(5.125) (F1 2 x 2 / (3 + 2) = 0.8)."""
    from multi_train_utils.options import make_task

    tally = make_task("multi-label").evaluation(1, torch.device("cpu"))
    logits = torch.tensor([[5.0], [5.125], [5.25], [5.375]]).bfloat16()
    tally.add(logits, torch.tensor([[0.0], [1.0], [0.0], [1.0]]), torch.ones(4, dtype=torch.int64))
    result = tally.result()
    assert result.ap[0] == pytest.approx(0.5 * 1 + 0.5 * 2 / 3, abs=1e-12)
    assert result.tuned_thresholds() == [float(torch.sigmoid(torch.tensor(5.125)))]


def test_an_image_scored_exactly_at_its_thresholds_is_an_exact_match():
    """multi-label.md: "a class is predicted when its probability is at least its threshold":
    an image whose every score is its class's threshold (logit 0: exactly 0.5; and a tuned 0.25
    of logit log(1/3)) is predicted positive for each: two such images of labels 1, 1 are exact
    matches, one of labels 0, 0 is not; a score just below is not predicted (2 of 4)."""
    import math

    from multi_train_utils.options import make_task

    quarter = math.log(1 / 3)  # sigmoid: 0.25 in float32
    thresholds = [0.5, float(torch.sigmoid(torch.tensor(quarter)))]
    tally = type(make_task("multi-label"))(thresholds).evaluation(2, torch.device("cpu"))
    logits = torch.tensor([[0.0, quarter], [0.0, quarter], [0.0, quarter], [-1e-3, quarter]])
    labels = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    tally.add(logits, labels, torch.ones(4, dtype=torch.int64))
    result = tally.result()
    assert (result.correct, result.total) == (2, 4)


class Figures:
    """A result with the figures every task reads, each of its own value."""

    def __init__(self, base):
        self.accuracy, self.loss, self.total, self.correct, self.left_out = base, base + 1, 10, int(base * 10), 0
        self.mae, self.map, self.micro_f1, self.macro_f1 = base + 2, base + 0.03, base + 0.04, base + 0.05
        self.micro_precision, self.micro_recall, self.top5_accuracy, self.balanced_accuracy = base, base, None, base


def test_the_emas_cells_and_epoch_line_are_the_emas():
    """metrics.csv's ema_ cells and the epoch line's EMA figure are the EMA's, for the two
    built-in tasks and a task of yours (the contract's own cells)."""
    from multi_train_utils.options import make_task
    from multi_train_utils.recorder import epoch_line
    from multi_train_utils.train_eval_utils import TrainStats

    model, ema = Figures(0.5), Figures(0.75)
    own = make_task(TASK_FILE + ":Ordinal")
    cells = own.cells(model, ema)
    assert (cells["ema_val_accuracy"], cells["ema_val_loss"], cells["ema_val_mae"]) == ("0.750000", "1.750000", "2.750000")
    assert cells["val_accuracy"] == "0.500000"
    cells = make_task("multi-label").cells(model, ema)
    assert (cells["ema_val_accuracy"], cells["ema_val_map"]) == ("0.750000", "0.780000")
    assert (cells["ema_val_macro_f1"], cells["val_macro_f1"]) == ("0.800000", "0.550000")  # round 16
    stats = TrainStats(0.5, 100, 1.0, 0.01, 50.0)
    assert "ema_val_map: 0.7800" in epoch_line(0, stats, model, ema, make_task("multi-label"))
    assert "ema_val_accuracy: 0.7500" in epoch_line(0, stats, model, ema, own)
    assert "ema_val_accuracy: 0.7500" in epoch_line(0, stats, model, ema, make_task("single-label"))


@pytest.mark.parametrize("kind", ["single-label", "multi-label"])
def test_the_best_epoch_keeps_the_figures_of_the_weights_it_keeps(tmp_path, kind):
    """When the EMA scores better, model-best.pth holds the EMA's weights, and what the run keeps
    for its end report (the confusion matrix; multi-label: per-class figures and thresholds) is
    the EMA's too."""
    from multi_train_utils.checkpoint import TrainState
    from multi_train_utils.multi_label import MultiLabelResult
    from multi_train_utils.options import make_task
    from conftest import run_recorder
    from multi_train_utils.single_label import EvalResult

    args = full_flags(output_dir=str(tmp_path / "out"), log_dir=str(tmp_path / "runs"), epochs=3,
                      best_metric="accuracy", model_ema=True, multi_label=kind == "multi-label",
                      task=kind)
    recorder = run_recorder(args, full_flags(classes=["a", "b"]), TrainState(None), enabled=False, task=make_task(kind))
    if kind == "single-label":
        model, ema = EvalResult(torch.tensor([[2, 2], [2, 2]])), EvalResult(torch.tensor([[4, 0], [1, 3]]))
    else:
        targets = torch.tensor([[1, 0], [0, 1], [1, 1], [0, 0]])
        model = MultiLabelResult.from_scores(torch.tensor([[0.4, 0.6], [0.6, 0.4], [0.4, 0.4], [0.6, 0.6]]), targets)
        ema = MultiLabelResult.from_scores(torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.7, 0.6], [0.1, 0.2]]), targets)
    recorder.end_epoch(0, None, model, ema)
    best = recorder.state.best
    assert best.source == "ema" and best.accuracy == ema.accuracy > model.accuracy
    if kind == "single-label":
        assert torch.equal(best.confusion, ema.confusion)
    else:
        assert best.report["ap"] == pytest.approx(ema.ap) and best.report["map"] == pytest.approx(ema.map) != model.map


def test_the_imbalance_warning_names_the_remedy_of_the_task(capsys):
    """multi-label.md: "--sampler balanced is refused" for rows: an imbalanced multi-label
    training set is pointed to --class-weights balanced alone; single-label to both."""
    import numpy as np

    from multi_train_utils.options import make_task
    from multi_train_utils.recorder import print_data_summary

    class Rows(torch.utils.data.Dataset):
        def __init__(self, targets):
            self.targets = np.asarray(targets, dtype=np.uint8)

        def __len__(self):
            return len(self.targets)

    class Labels(list):
        @property
        def targets(self):
            return list(self)

    args = full_flags(demo=False, train_list="t.csv", val_list=None, data_path="d", val_path=None,
                      sampler="shuffle", class_weights="none")
    rows = Rows([[1, 0]] * 30 + [[0, 1]] * 2)
    print_data_summary(config_of(args), full_flags(classes=["a", "b"], train=rows, val=Rows([[1, 1]]), skipped=[]),
                       make_task("multi-label"))
    warning = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and warning[0].endswith("--class-weights balanced") and "--sampler" not in warning[0]
    print_data_summary(config_of(args), full_flags(classes=["a", "b"], train=Labels([0] * 30 + [1] * 2), val=Labels([0]),
                                        skipped=[]), make_task("single-label"))
    assert "--sampler balanced or --class-weights balanced" in capsys.readouterr().out


def test_a_best_of_zero_is_a_best_not_nothing_yet():
    """task.py: is_better's ``best`` None is "nothing yet"; a best of 0 (a mean error of 0, an
    accuracy of 0) is a value to beat."""
    from multi_train_utils.options import make_task

    own, single = make_task(TASK_FILE + ":Ordinal"), make_task("single-label")
    assert not own.is_better("mae", 0.25, 0.0) and not single.is_better("loss", 0.25, 0.0)
    assert not single.is_better("accuracy", 0.0, 0.0) and single.is_better("accuracy", 0.25, 0.0)
    assert own.is_better("mae", 0.25, None)


def test_older_run_files_are_read_as_the_task_they_were(tmp_path):
    """An args.json or a .pt2 written before "task" was: "multi_label": true reads as the
    multi-label task (sigmoids at thresholds), else single-label."""
    from multi_train_utils.run_files import load_program, run_json
    from multi_train_utils.files import write_bytes_atomic
    from multi_train_utils.run_files import task_of_run

    assert task_of_run({"model": "m", "multi_label": True}) == "multi-label"
    assert task_of_run({"model": "m", "multi_label": False}) == task_of_run(None) == "single-label"
    assert task_of_run({"task": "x.py:Y", "multi_label": False}) == "x.py:Y"
    program = torch.export.export(torch.nn.Linear(4, 2), (torch.zeros(2, 4),))
    run = {"model": "linear", "img_size": 2, "val_resize_size": 2, "mean": None, "std": None, "classes": ["a", "b"],
           "multi_label": True, "thresholds": [0.3, 0.7]}
    old = json.loads(run_json(run))
    del old["task"]  # as an export.py before tasks wrote it
    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files={"run.json": json.dumps(old)})
    write_bytes_atomic(buffer.getvalue(), str(tmp_path / "old.pt2"))
    _, read = load_program(str(tmp_path / "old.pt2"))
    assert task_of_run(read) == "multi-label" and read["thresholds"] == [0.3, 0.7]


def test_a_resume_with_another_task_is_refused_older_checkpoints_included():
    """guarantees.md: "A checkpoint of ... another task ... is refused": a checkpoint of a multi-label run
    from before "task" was saved ("multi_label": true) is refused to a single-label run, and
    a run of a task of yours to --multi-label, each naming the task it was trained with; the
    same task resumes."""
    from multi_train_utils.checkpoint import complete_checkpoint
    from multi_train_utils.errors import UserError
    from multi_train_utils.run_files import _check_resume_and_weights

    data = full_flags(classes=["a", "b"])
    single, multi = (config_of(full_flags(task=task, multi_label=task == "multi-label", epochs=3))
                     for task in ("single-label", "multi-label"))
    flags = {key: single.flags[key] for key in ("model", "freeze_layers", "opt", "norm_bias_decay", "model_ema",
                                                "best_metric")}
    older = complete_checkpoint({"epoch": 0, "model": {}, "classes": ["a", "b"],
                                 "args": {**flags, "multi_label": True}})  # no "task": before tasks
    with pytest.raises(UserError, match="trained with --task multi-label, this run has --task single-label"):
        _check_resume_and_weights(single, data, "ckpt", older)
    assert _check_resume_and_weights(multi, data, "ckpt", older) is None  # the same task goes on
    own = complete_checkpoint({"epoch": 0, "model": {}, "classes": ["a", "b"],
                               "args": {**flags, "task": "grades.py:Ordinal", "multi_label": False}})
    with pytest.raises(UserError, match="trained with --task grades.py:Ordinal, this run has --task multi-label"):
        _check_resume_and_weights(multi, data, "ckpt", own)


def test_a_probability_at_its_threshold_is_predicted():
    """predict.py: "the classes at or above their thresholds, most probable first"."""
    from multi_train_utils.options import make_task

    task = make_task("multi-label", thresholds=[0.5, 0.25, 0.75])
    line = task.describe(torch.tensor([0.5, 0.25, 0.7]), ["a", "b", "c"], 5)
    assert line == "a 0.500, b 0.250"
    table = task.prediction_table([("x.png", torch.tensor([0.5, 0.25, 0.7]))], ["a", "b", "c"])
    assert table[1][:2] == ["x.png", "a b"]


def test_names_and_paths_of_a_task(tmp_path):
    """--task multi-label is --multi-label (its lists read as rows, args.json's multi_label);
    a task's path may hold a colon (the class is after the last one); a task file may define a
    dataclass (its module is registered before it runs); a task of yours with rows
    (several_labels) refuses --sampler balanced and --demo as --multi-label does."""
    from multi_train_utils.errors import UserError
    from multi_train_utils.options import get_args_parser, make_task, parse_args

    args = parse_args(get_args_parser(distributed=False), ["--task", "multi-label"])
    assert args.multi_label is True and args.task == "multi-label" and args.best_metric == "map"
    return_path = os.path.join(str(tmp_path), "a:b")
    os.makedirs(return_path)
    shutil.copy(TASK_FILE, os.path.join(return_path, "graded.py"))
    graded = outcome(lambda: make_task(os.path.join(return_path, "graded.py") + ":Ordinal"))
    assert not isinstance(graded, Exception) and graded.metrics[0] == "mae", graded
    with open(os.path.join(return_path, "tagged.py"), "w") as f:
        f.write(textwrap.dedent('''
            from __future__ import annotations  # a dataclass then looks its module up while the file runs
            from dataclasses import dataclass
            from multi_train_utils.multi_label import MultiLabel

            @dataclass
            class Setting:
                weight: float = 1.0

            class Tags(MultiLabel):
                setting = Setting()
            '''))
    spec = os.path.join(return_path, "tagged.py") + ":Tags"
    tags = outcome(lambda: make_task(spec))
    assert not isinstance(tags, Exception) and tags.several_labels, tags
    assert tags.setting.weight == 1.0
    from PIL import Image

    from my_dataset import build_datasets

    for name in ("a", "b", "c"):
        Image.new("RGB", (8, 8)).save(tmp_path / f"{name}.png")
    (tmp_path / "train.csv").write_text("path,labels\na.png,red blue\nb.png,\n")
    (tmp_path / "val.csv").write_text("path,labels\nc.png,blue\n")
    listed = ["--task", spec, "--train-list", str(tmp_path / "train.csv"), "--val-list", str(tmp_path / "val.csv")]
    data = outcome(lambda: build_datasets(parse_args(get_args_parser(distributed=False), listed)))
    assert not isinstance(data, Exception), data  # read as rows, as for --multi-label
    assert data.classes == ["blue", "red"] and data.train.targets.tolist() == [[1, 1], [0, 0]]
    for flags, message in ((["--sampler", "balanced"], "--sampler balanced with --task "),
                           (["--demo"], " with --demo: those make class folders")):
        with pytest.raises(UserError, match=message):
            parse_args(get_args_parser(distributed=False), ["--task", spec, *flags])


def test_thresholds_json_says_whether_they_were_tuned(tmp_path):
    """multi-label.md: thresholds.json's "tuned" is whether --tune-thresholds chose them."""
    from multi_train_utils.checkpoint import BestEpoch
    from multi_train_utils.options import make_task

    best = BestEpoch(value=0.5, epoch=3, report={"thresholds": [0.5, 0.5]})
    for tune in (False, True):
        make_task("multi-label", tune_thresholds=tune).write_best_files(str(tmp_path), ["a", "b"], best)
        written = json.loads((tmp_path / "thresholds.json").read_text())
        assert written == {"classes": {"a": 0.5, "b": 0.5}, "tuned": tune, "epoch": 3}


# --- Round 17's sweep: survivors, each with its test -------------------------------------------

@pytest.mark.parametrize("kind", ["single-label", "multi-label"])
def test_a_short_last_batch_whose_first_image_is_unreadable_leaves_it_out_once(kind):
    """task.py: in ``add``, weight 0 is "a padded row" and a label below 0 "an image that could
    not be read, counted in ``left_out``": evaluate pads a short last batch with copies of its
    first image (pad_batch), so an unreadable first image is copied into the padding; it is
    left out once, not once a copy."""
    from multi_train_utils.options import make_task
    from multi_train_utils.train_eval_utils import pad_batch

    classes = 7
    tally = make_task(kind).evaluation(classes, torch.device("cpu"))
    logits = torch.randn(2, classes, generator=torch.Generator().manual_seed(0))
    if kind == "single-label":
        labels = torch.tensor([-1, 3])
    else:  # LEFT_OUT: every target -1
        labels = torch.tensor([[-1.0] * classes, [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    tally.add(*pad_batch(logits, labels, 4))  # the 2 images, then 2 copies of the unreadable one
    result = tally.result()
    assert (result.left_out, result.total) == (1, 1)


def test_a_task_of_your_own_is_named_by_its_task_value_which_args_json_and_the_pt2_carry():
    """layout.md: "args.json keeps --task, so --eval-only, predict.py and export.py (its .pt2
    carries the name) take it from the run": the task's name is the --task value itself (the
    path and class), which makes the same task again; the built-in ones are named as --task
    names them."""
    from multi_train_utils.options import make_task

    own = make_task(TASK_FILE + ":Ordinal")
    assert own.name == TASK_FILE + ":Ordinal"
    assert type(make_task(own.name)) is type(own)
    assert (make_task("single-label").name, make_task("multi-label").name) == ("single-label", "multi-label")


def test_two_task_files_of_one_name_are_two_tasks(tmp_path):
    """A task file is known by its whole path, not its name: one/tasks.py and two/tasks.py in
    one process give each its own class (a folder's name need not be UTF-8); the same file
    named again another way (two/../one/tasks.py) is loaded once."""
    from multi_train_utils.options import make_task

    two = os.fsdecode(b"two\xff")  # a byte that is not UTF-8, as Linux allows
    for folder in ("one", two):
        os.makedirs(tmp_path / folder)
        (tmp_path / folder / "tasks.py").write_text(textwrap.dedent(f'''
            from multi_train_utils.single_label import SingleLabel

            class Mine(SingleLabel):
                folder = {folder!r}
            '''))
    tasks = [outcome(lambda f=f: make_task(str(tmp_path / f / "tasks.py") + ":Mine"))
             for f in ("one", two, os.path.join(two, "..", "one"))]
    assert not any(isinstance(task, Exception) for task in tasks), tasks
    first, second, again = tasks
    assert (first.folder, second.folder, again.folder) == ("one", two, "one")
    assert type(again) is type(first)
