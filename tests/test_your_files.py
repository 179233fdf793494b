"""A user's files beside ours in --output-dir: names such as model-3-finetuned.pth,
checkpoint-old.pth or train.log.bak. Pruning (--keep-last), --overwrite, --resume auto's fresh
start and the check for an earlier run touch our exact names only; --keep-last K keeps exactly
the last K epochs' weights."""
import os

import pytest

from multi_train_utils.errors import UserError
from multi_train_utils.recorder import RunRecorder
from multi_train_utils.run_files import check_output_dir, clear_earlier_run, earlier_run_files
from conftest import full_flags  # noqa: E402

OURS = ["checkpoint.pth", "checkpoint-prev.pth", "checkpoint.pth.damaged", "model-best.pth", "metrics.csv",
        "args.json", "class_indices.json", "train.log", "confusion_matrix.csv", "curves.png", "most_confused.png"]
THEIRS = ["model-3-finetuned.pth", "model-03.pth", "model-3.pth.bak", "model-best-old.pth", "mymodel-3.pth",
          "model-3.pt", "checkpoint-old.pth", "checkpoint.pth.orig", "old-checkpoint.pth", "train.log.bak",
          "metrics.csv.old", "args.json~", "notes.txt", "model-.pth", "model--1.pth"]


def folder_with(tmp_path, epochs, ours=True):
    for name in (OURS if ours else []) + [f"model-{e}.pth" for e in epochs] + THEIRS:
        (tmp_path / name).write_text(name)
    return tmp_path


def listing(folder):
    return sorted(os.listdir(folder))


def test_an_earlier_run_is_our_exact_names_only(tmp_path):
    folder = folder_with(tmp_path, epochs=[0, 1, 10])
    found = sorted(os.path.basename(p) for p in earlier_run_files(str(folder)))
    assert found == sorted(OURS + ["model-0.pth", "model-1.pth", "model-10.pth"])


def test_overwrite_removes_our_files_and_leaves_theirs(tmp_path):
    folder = folder_with(tmp_path, epochs=[0, 7])
    clear_earlier_run(full_flags(output_dir=str(folder), overwrite=True, resume=None), None)
    assert listing(folder) == sorted(THEIRS)
    for name in THEIRS:
        assert (folder / name).read_text() == name


def test_a_fresh_start_of_resume_auto_removes_our_files_only(tmp_path):
    folder = folder_with(tmp_path, epochs=[2])
    clear_earlier_run(full_flags(output_dir=str(folder), overwrite=False, resume="auto"), None)
    assert listing(folder) == sorted(THEIRS)


def test_their_files_alone_are_no_earlier_run(tmp_path):
    folder = folder_with(tmp_path, epochs=[], ours=False)
    check_output_dir(str(folder), overwrite=False)  # no error: nothing of ours there
    (folder / "model-0.pth").write_text("ours")
    with pytest.raises(UserError, match=r"holds checkpoints of an earlier run \(model-0\.pth\)"):
        check_output_dir(str(folder), overwrite=False)


@pytest.mark.parametrize("keep_last, kept", [(1, [5]), (2, [4, 5]), (3, [3, 4, 5]), (6, [0, 1, 2, 3, 4, 5]),
                                             (0, [0, 1, 2, 3, 4, 5])])
def test_keep_last_keeps_exactly_the_last_k_epochs_and_none_of_theirs_is_pruned(tmp_path, keep_last, kept):
    folder = folder_with(tmp_path, epochs=range(6))
    recorder = RunRecorder.__new__(RunRecorder)  # only what pruning reads
    recorder.run, recorder.output_dir = full_flags(keep_last=keep_last), str(folder)
    recorder._prune(5)
    assert listing(folder) == sorted(OURS + THEIRS + [f"model-{e}.pth" for e in kept])


def test_a_checkpoint_elsewhere_is_never_taken_for_one_here(tmp_path):
    """--resume PATH continues in --output-dir only when PATH lies right in it: a folder whose
    name starts alike (weights-old), a sub-folder, or a parent is elsewhere."""
    from multi_train_utils.checkpoint import resumes_in

    weights = str(tmp_path / "weights")
    assert resumes_in(str(tmp_path / "weights" / "checkpoint.pth"), weights)
    assert resumes_in(str(tmp_path / "weights" / "checkpoint-prev.pth"), weights + "/")
    assert not resumes_in(str(tmp_path / "weights-old" / "checkpoint.pth"), weights)
    assert not resumes_in(str(tmp_path / "weights" / "old" / "checkpoint.pth"), weights)
    assert not resumes_in(str(tmp_path / "checkpoint.pth"), weights)
    assert not resumes_in(None, weights)


def test_bad_input_leaves_the_empty_output_folder_you_made(tmp_path):
    """The lock's clean-up removes only what taking the lock created: a folder the run made, yes;
    an empty one you made for it, no."""
    from multi_train_utils.files import lock_output_dir

    yours = tmp_path / "yours"
    yours.mkdir()
    lock_output_dir(str(yours)).discard()
    assert yours.is_dir() and os.listdir(yours) == []
    made = tmp_path / "made"
    lock_output_dir(str(made)).discard()
    assert not made.exists()


def test_the_clean_up_removes_our_temporary_files_only(tmp_path):
    """A killed write leaves .NAME.XXXXXXXX.tmp of one of our names; a hidden .tmp of yours stays."""
    ours = [".checkpoint.pth.a1b2c3d4.tmp", ".model-3.pth.x1y2z3w4.tmp", ".metrics.csv.q1w2e3r4.tmp"]
    theirs = [".model-3.pth.orig.1234.tmp", ".model-3-finetuned.pth.abcd.tmp", ".notes.txt.abcd1234.tmp",
              ".checkpoint-old.pth.abcd1234.tmp"]
    for name in ours + theirs:
        (tmp_path / name).write_text(name)
    clear_earlier_run(full_flags(output_dir=str(tmp_path), overwrite=False, resume=None), None)
    assert listing(tmp_path) == sorted(theirs)
