"""How images are found (docs/data.md): by extension in any case, in sub-folders too, symbolic
links followed, each real file once, a link back to a folder above skipped as a loop, and
entries that cannot be followed (a broken link) named with why. In-process, on small trees
of links built here."""
import os

from multi_train_utils.images import find_image_files


def touch(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"x")


def relative(paths, root):
    return [os.path.relpath(p, root) for p in paths]


def test_a_folder_reached_through_a_link_and_directly_counts_once_where_first_reached(tmp_path):
    cls = tmp_path / "cat"
    touch(str(cls / "sub" / "x.jpg"))
    touch(str(cls / "sub" / "y.PNG"))
    touch(str(cls / "z.jpeg"))
    os.symlink(cls / "sub", cls / "a_link")  # sorted before its target
    found = find_image_files(str(cls))
    assert relative(found.paths, cls) == ["z.jpeg", "a_link/x.jpg", "a_link/y.PNG"]
    assert found.problems == {}
    # the same through a relative path (the form a --data-path often has)
    os.chdir(tmp_path)
    assert relative(find_image_files("cat").paths, "cat") == ["z.jpeg", "a_link/x.jpg", "a_link/y.PNG"]


def test_a_linked_file_beside_its_target_counts_once(tmp_path):
    cls = tmp_path / "cat"
    touch(str(cls / "b.jpg"))
    os.symlink(cls / "b.jpg", cls / "a.jpg")
    assert relative(find_image_files(str(cls)).paths, cls) == ["a.jpg"]


def test_broken_links_and_loops_are_named_with_why_and_left_out(tmp_path):
    cls = tmp_path / "cat"
    touch(str(cls / "ok.jpg"))
    os.symlink(tmp_path / "gone.jpg", cls / "broken.jpg")
    os.symlink(tmp_path / "gone", cls / "broken_folder")
    os.symlink(cls, cls / "loop")
    found = find_image_files(str(cls))
    assert relative(found.paths, cls) == ["ok.jpg"]
    assert found.problems.get(str(cls / "broken.jpg")) == "cannot be read (a broken symbolic link)"
    assert found.problems.get(str(cls / "broken_folder")) == "cannot be read (a broken symbolic link)"
    assert found.problems.get(str(cls / "loop"), "").startswith("a symbolic link loop (it leads back to")
    assert len(found.problems) == 3


def test_entries_of_the_validation_folder_that_cannot_be_followed_are_named_too(tmp_path):
    """read_split_data with --val-path: a broken link at the top of either folder is skipped
    with why, as one inside a class folder is."""
    from utils import read_split_data

    for root in ("train", "val"):
        for name in ("cat", "dog"):
            touch(str(tmp_path / root / name / "a.jpg"))
            touch(str(tmp_path / root / name / "b.jpg"))
    os.symlink(tmp_path / "gone", tmp_path / "val" / "broken")
    os.symlink(tmp_path / "gone", tmp_path / "train" / "dog" / "broken.jpg")
    split = read_split_data(str(tmp_path / "train"), val_root=str(tmp_path / "val"))
    assert split.classes == ["cat", "dog"] and len(split.val_images_path) == 4
    assert split.skip_reasons == {str(tmp_path / "val" / "broken"): "cannot be read (a broken symbolic link)",
                                  str(tmp_path / "train" / "dog" / "broken.jpg"): "cannot be read (a broken symbolic link)"}
