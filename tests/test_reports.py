"""Reports at their edges: exactly 20 classes (every class listed) and 21 ("more than 20": the
extremes), classes without validation images, ties, the first and the last class, a matrix
without a single confusion. The expected lines are worked out by hand from made-up confusion
matrices."""
import csv
import io
import math

import pytest
import torch

from multi_train_utils.single_label import evaluation_metrics_csv, print_evaluation
from multi_train_utils.recorder import print_data_summary
from multi_train_utils.single_label import EvalResult
from multi_train_utils.pictures import most_confused_pairs
from conftest import full_flags  # noqa: E402
from multi_train_utils.options import config_of  # noqa: E402


def names(n):
    return [f"class{i:02d}" for i in range(n)]


def diagonal(n, per_class=4):
    return EvalResult(torch.eye(n, dtype=torch.long) * per_class)


@pytest.mark.parametrize("n, listed", [(20, True), (21, False)])
def test_every_class_is_listed_up_to_20_classes_and_the_extremes_from_21(capsys, n, listed):
    print_evaluation(diagonal(n), names(n))
    out = capsys.readouterr().out
    assert out.count("1.000000 (4/4)") == (n if listed else min(n, 10))
    assert ("classes of lowest recall" in out) is not listed
    assert out.strip().splitlines()[-1] == f"top1 accuracy: 1.000000 ({4 * n}/{4 * n})"


class Split(list):
    """A dataset as print_data_summary reads it: its length and its targets."""

    def __init__(self, targets):
        super().__init__(targets)
        self.targets = list(targets)


@pytest.mark.parametrize("n", [20, 21])
def test_the_data_summary_names_every_class_up_to_20_and_the_extremes_from_21(capsys, n):
    counts = [10 + c for c in range(n)]  # class00 the smallest, the last the largest
    train = Split([c for c, k in enumerate(counts) for _ in range(k)])
    args = full_flags(demo=False, train_list=None, data_path="d", val_path=None, sampler="shuffle",
                              class_weights="none")
    print_data_summary(config_of(args), full_flags(classes=names(n), train=train, val=Split([]), skipped=[]))
    out = capsys.readouterr().out
    if n == 20:
        assert "data: d: " + ", ".join(f"{10 + c} class{c:02d}" for c in range(20)) + "\n" in out
    else:
        assert (f"data: d: 21 classes, {sum(counts)} images; smallest class00 (10), class01 (11), class02 (12); "
                "largest class20 (30), class19 (29), class18 (28); median 20 images a class\n") in out


def confusion_of_21_classes():
    """21 classes, 10 validation images each, except class00 with none (recall nan). Recalls:
    class20 (the last) 0.1, class03 and class07 0.5 (a tie: label order), class11 0.6,
    every other 1.0. Confusions: class20 -> class19 9 images (most), class03 -> class00 and
    class07 -> class01 5 each (a tie: row order), class11 -> class20 4."""
    c = torch.zeros(21, 21, dtype=torch.long)
    for i in range(1, 21):
        c[i, i] = 10
    c[20, 20], c[20, 19] = 1, 9
    c[3, 3], c[3, 0] = 5, 5
    c[7, 7], c[7, 1] = 5, 5
    c[11, 11], c[11, 20] = 6, 4
    return c


def test_the_worst_classes_leave_out_classes_without_images_and_break_ties_in_label_order(capsys):
    result = EvalResult(confusion_of_21_classes())
    print_evaluation(result, names(21))
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if "classes of lowest recall" in line)
    assert lines[start].startswith("the 10 classes of lowest recall (of 21;")
    worst = [line.split()[0] for line in lines[start + 1:start + 11]]
    assert worst == ["class20", "class03", "class07", "class11", "class01", "class02", "class04", "class05",
                     "class06", "class08"]  # class00 has no images: never among them
    assert lines[start + 1].split()[1:3] == ["0.100000", "(1/10)"]
    pairs_at = lines.index("most confused (true -> predicted: images):")
    assert lines[pairs_at + 1:pairs_at + 5] == ["  class20 -> class19: 9", "  class03 -> class00: 5",
                                                "  class07 -> class01: 5", "  class11 -> class20: 4"]
    assert all(not line.startswith("  ") for line in lines[pairs_at + 5:])  # no pair of 0 images


def test_most_confused_pairs_are_the_largest_cells_ties_in_cell_order_and_never_a_zero():
    confusion = confusion_of_21_classes()
    assert most_confused_pairs(confusion, 3) == [(20, 19, 9), (3, 0, 5), (7, 1, 5)]
    assert most_confused_pairs(confusion, 50) == [(20, 19, 9), (3, 0, 5), (7, 1, 5), (11, 20, 4)]
    assert most_confused_pairs(torch.eye(4, dtype=torch.long) * 3) == []
    corners = torch.zeros(3, 3, dtype=torch.long)
    corners[0, 2], corners[2, 0] = 2, 2  # the first and the last cell off the diagonal
    assert most_confused_pairs(corners) == [(0, 2, 2), (2, 0, 2)]


def test_the_per_class_csv_has_every_class_with_nan_where_there_is_nothing_to_divide():
    confusion = confusion_of_21_classes()
    overall, per_class = evaluation_metrics_csv(EvalResult(confusion, None, 0.0), names(21))
    rows = list(csv.reader(io.StringIO(per_class)))
    assert rows[0] == ["class", "images", "predicted", "correct", "precision", "recall", "f1"]
    assert [r[0] for r in rows[1:]] == names(21)  # the first and the last class included
    first, last = rows[1], rows[-1]
    assert first[:4] == ["class00", "0", "5", "0"] and math.isnan(float(first[5]))  # no images: recall nan
    assert float(first[4]) == 0.0 and float(first[6]) == 0.0  # predicted 5 times, never right
    assert last[:4] == ["class20", "10", "5", "1"]
    assert float(last[4]) == pytest.approx(1 / 5) and float(last[5]) == pytest.approx(1 / 10)
    assert float(last[6]) == pytest.approx(2 * 1 / (2 * 1 + 4 + 9))
    values = dict(list(csv.reader(io.StringIO(overall)))[1:])
    # balanced accuracy: the mean recall of the 20 classes with images
    recalls = [1.0] * 16 + [0.1, 0.5, 0.5, 0.6]
    assert float(values["balanced_accuracy"]) == pytest.approx(sum(recalls) / 20)
    assert int(values["images"]) == 200


@pytest.mark.parametrize("counts, warning", [
    ([9, 9, 3, 2, 2], ("class00", 9, "class03", 2)),  # ties: the first in label order, largest and smallest
    ([2, 7, 7, 7, 2], ("class01", 7, "class00", 2)),
    ([9, 3, 3], None),  # 3 times exactly: not "more than 3 times"
    ([10, 3, 3], ("class00", 10, "class01", 3)),
    ([5, 0, 1], ("class00", 5, "class01", 0))])  # a class without images is the smallest
def test_the_imbalance_warning_names_the_first_of_tied_classes_beyond_three_times(counts, warning):
    from multi_train_utils.loaders import find_imbalance_in_counts

    found = find_imbalance_in_counts(counts, names(len(counts)))
    assert (tuple(found) if found else None) == warning


def test_a_report_without_a_single_confusion_prints_no_empty_pairs_heading(capsys):
    print_evaluation(diagonal(21), names(21))
    out = capsys.readouterr().out
    assert "classes of lowest recall" in out and "most confused" not in out


def test_only_rank_0_prints_and_writes_the_evaluation(tmp_path, monkeypatch, capsys):
    """--eval-only with several processes: rank 0 reports, the others neither print nor write."""
    from multi_train_utils import recorder as summary

    args = full_flags(demo=False, train_list=None, data_path="d", val_path=None, sampler="shuffle",
                              class_weights="none", eval_output=str(tmp_path / "eval"), weights="w.pth")
    data = full_flags(classes=names(3), train=Split([0, 1, 2]), val=Split([0, 1, 2]), skipped=[])
    monkeypatch.setattr(summary, "is_main_process", lambda: False)
    summary.report_evaluation(lambda: diagonal(3), data, config_of(args))
    assert capsys.readouterr().out == "" and not (tmp_path / "eval").exists()
    monkeypatch.setattr(summary, "is_main_process", lambda: True)
    summary.report_evaluation(lambda: diagonal(3), data, config_of(args))
    assert capsys.readouterr().out.strip().splitlines()[-1] == "top1 accuracy: 1.000000 (12/12)"
    assert (tmp_path / "eval" / "per_class_metrics.csv").is_file()


@pytest.mark.parametrize("sampler, class_weights, warned", [("shuffle", "none", True), ("balanced", "none", False),
                                                            ("shuffle", "balanced", False),
                                                            ("balanced", "balanced", False)])
def test_the_imbalance_warning_is_left_out_once_either_remedy_is_given(sampler, class_weights, warned):
    from multi_train_utils.loaders import imbalance_warning

    args = full_flags(sampler=sampler, class_weights=class_weights)
    assert (imbalance_warning(args, [10, 3], ["a", "b"]) is not None) is warned


def test_datasets_without_targets_get_their_class_count_and_the_split(capsys):
    args = full_flags(demo=False, train_list=None, data_path="d", val_path="v", sampler="shuffle",
                              class_weights="none")
    print_data_summary(config_of(args), full_flags(classes=names(3), train=[0] * 5, val=[0, 0], skipped=[]))
    out = capsys.readouterr().out
    assert "data: d + v (validation): 3 classes (images per class: give the datasets .targets)\n" in out
    assert "split: 5 train, 2 val images\n" in out


@pytest.mark.parametrize("left_out", [0, 1, 3])
def test_validation_images_left_out_are_counted_once_before_the_last_line(capsys, left_out):
    print_evaluation(EvalResult(torch.eye(2, dtype=torch.long) * 3, left_out=left_out), names(2))
    lines = capsys.readouterr().out.strip().splitlines()
    noted = [line for line in lines if line.startswith("left out:")]
    assert noted == ([f"left out: {left_out} validation image(s) that could not be read (see the warnings)"]
                     if left_out else [])
    assert lines[-1] == "top1 accuracy: 1.000000 (6/6)"


@pytest.mark.parametrize("n, named, counted", [(30, True, True), (31, True, False), (50, True, False),
                                               (51, False, False)])
def test_the_confusion_matrix_names_classes_up_to_50_and_writes_counts_up_to_30(n, named, counted):
    """docs/outputs.md: beyond 30 classes no numbers in the cells; beyond 50 no class names."""
    from multi_train_utils.pictures import plot_confusion_matrix

    fig = plot_confusion_matrix(torch.eye(n, dtype=torch.long) * 3, names(n))
    ax = fig.axes[0]
    x_names = [t.get_text() for t in ax.get_xticklabels()]
    y_names = [t.get_text() for t in ax.get_yticklabels()]
    if named:
        assert x_names == names(n) and y_names == names(n)
    else:
        assert not set(names(n)) & set(x_names + y_names)
    assert len(ax.texts) == (n * n if counted else 0)


def test_more_than_20_classes_print_the_10_most_confused_pairs_largest_first(capsys):
    n = 25
    c = torch.eye(n, dtype=torch.long) * 20
    for k in range(1, 16):  # 15 confused pairs: class k -> class 0, k images
        c[k, 0] = k
    print_evaluation(EvalResult(c), names(n))
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("most confused (true -> predicted: images):")
    pairs = [line for line in lines[start + 1:] if "->" in line]
    assert len(pairs) == 10
    assert [line.split()[0] for line in pairs] == [f"class{k:02d}" for k in range(15, 5, -1)]
    assert pairs[0].split()[-1] == "15" and pairs[-1].split()[-1] == "6"


def test_most_confused_png_shows_the_20_largest_cells(tmp_path):
    """docs/outputs.md: most_confused.png holds the 20 largest off-diagonal cells (the printed
    report, 10); 25 confused pairs here, the 20 largest drawn, largest first."""
    from multi_train_utils.pictures import plot_most_confused

    n = 26
    c = torch.eye(n, dtype=torch.long) * 50
    for k in range(1, 26):
        c[k, 0] = k
    assert len(most_confused_pairs(c)) == 20
    ax = plot_most_confused(c, names(n)).axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [f"class{k:02d} -> class00" for k in range(25, 5, -1)]
    assert ax.get_title().endswith("the 20 most-confused pairs of classes")


def test_the_device_is_described_with_its_gpu_name_or_its_threads(monkeypatch):
    from multi_train_utils.recorder import describe_device

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"NVIDIA H200 #{torch.device(device).index}")
    assert describe_device(torch.device("cuda", 1)) == "cuda:1 (NVIDIA H200 #1)"
    threads = torch.get_num_threads()
    assert describe_device(torch.device("cpu")) == f"cpu ({threads} thread{'s' * (threads != 1)})"
    assert describe_device(torch.device("mps")) == "mps"


@pytest.mark.parametrize("n, bars", [(30, True), (31, False)])
def test_the_class_distribution_is_a_bar_per_class_up_to_30_classes_then_a_curve(n, bars):
    from multi_train_utils.pictures import plot_class_distribution

    train, val = [10 + c for c in range(n)], [2] * n
    ax = plot_class_distribution(names(n), train, val).axes[0]
    named = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    if bars:
        assert named == names(n) and len(ax.patches) == 2 * n  # train and val bars of every class
    else:
        assert len(ax.patches) == 0 and not set(names(n)) <= set(named)
