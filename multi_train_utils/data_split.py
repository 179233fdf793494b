"""Which files, with which labels: class folders or CSV label files, and their train/val split.

The first steps of a file's way (utils.py's ``read_split_data`` and ``read_label_files`` are
these); then ``datasets`` makes datasets of them, and ``images`` decodes and transforms."""
import csv
import os
import random
from collections import Counter
from functools import partial
from typing import Dict, List, NamedTuple

from multi_train_utils.errors import UserError, printable
from multi_train_utils.images import IMG_EXTENSIONS, find_image_files, list_entries, no_file_at, unreadable_reason


MAX_NOTES = 5  # beyond this many classes without validation images, one line names a few

# The tutorial's data: 5 class folders, 3670 JPEGs (--download fetches and checks it).
FLOWER_PHOTOS_URL = "https://storage.googleapis.com/download.tensorflow.org/example_images/flower_photos.tgz"


class DataSplit(NamedTuple):
    """What ``split_class_folders`` found: the two splits, the class names and skipped files."""

    train_images_path: List[str]
    train_images_label: List[int]
    val_images_path: List[str]
    val_images_label: List[int]
    classes: List[str]
    skipped: List[str]  # files and folders left out: not readable as images, or symlink loops
    skip_reasons: Dict[str, str] = {}  # {skipped path: why}, e.g. "not a readable image: too many pixels ..."
    notes: List[str] = []  # other warnings: a class that gets no validation image
    several_labels: bool = False  # labels are lists of class indices (an image of several classes, or none)


def find_classes(root, flag="--data-path"):
    """Sorted class names: the visible sub-folders of ``root``."""
    return _class_folders(root, flag)[0]


def _class_folders(root, flag):
    """(sorted class names, {path: why} of the entries of ``root`` that cannot be followed)."""
    if not os.path.exists(root):
        raise UserError(
            f"{flag} {root}: no such folder. Put one sub-folder of images per class there, "
            f"e.g. flower_photos from {FLOWER_PHOTOS_URL} extracted to data/, or try --demo"
        )
    if not os.path.isdir(root):
        raise UserError(f"{flag} {root}: not a folder; give a folder with one sub-folder of images per class")
    try:
        entries = list_entries(root)
    except OSError as e:
        raise UserError(f"{flag} {root}: cannot be read ({e.strerror})") from None
    classes = [os.path.basename(path) for path in entries.folders]
    if not classes:
        raise UserError(f"{flag} {root}: no class folders inside; put the images of each class in a sub-folder")
    return classes, entries.problems


def list_images(folder):
    """Image files in ``folder`` and its sub-folders (see ``images.find_image_files``), sorted."""
    return sorted(find_image_files(folder).paths)


def readable_images(paths, reasons):
    """The files of ``paths`` that PIL opens as images (each is opened: slow on large data);
    why each other one is left out goes into ``reasons``."""
    readable = []
    for path in paths:
        reason = unreadable_reason(path)
        if reason is None:
            readable.append(path)
        else:
            reasons[path] = reason
    return readable


def _scan_class_folders(root, classes, flag, check_images=False):
    """Images (by extension; with ``check_images`` only those PIL opens) and labels of every
    class folder, sub-folders included; the skipped files with the reason of each. Fails on a
    class with no images."""
    images, labels, reasons = [], [], {}
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            raise UserError(f"{flag} {root}: class folder {name!r} is missing (the training data has it)")
        found = find_image_files(folder)
        reasons.update(found.problems)
        readable = sorted(found.paths)
        if check_images:
            readable = readable_images(readable, reasons)
        if not readable:
            raise UserError(
                f"{flag} {root}: class folder {name!r} has no images "
                f"({', '.join(IMG_EXTENSIONS)}); add images or remove the folder"
            )
        images += readable
        labels += [label] * len(readable)
    return images, labels, reasons


def split_class_folders(root, val_rate=0.2, seed=0, val_root=None, check_images=False):
    """Find the images of each class folder of ``root`` and split them into train and val.

    The split is stratified (``round(n * val_rate)`` images of each class go to val) and
    deterministic: files are sorted and shuffled with ``random.Random(seed)``, so it depends
    neither on ``os.listdir`` order nor on global random state. With ``val_root`` (same class
    folders) nothing is split: all of ``root`` trains and all of ``val_root`` validates.
    Images in sub-folders of a class folder belong to the class, as in torchvision's
    ImageFolder (symlinks followed, each real file once). No image is opened: files are found
    by their extension, as ImageFolder finds them, and a file that turns out unreadable is
    handled when the loader meets it (``datasets.MyDataSet``). With ``check_images`` every
    file is opened first and those PIL cannot open are skipped. Skipped files, and entries
    that cannot be followed (a symlink loop), are listed in ``skipped``, with the reason of
    each in ``skip_reasons``.
    """
    classes, skipped = _class_folders(root, "--data-path")
    if val_root is not None:
        val_classes, val_skipped = _class_folders(val_root, "--val-path")
        if val_classes != classes:
            raise UserError(
                f"--val-path {val_root}: class folders {val_classes} differ from --data-path's {classes}; "
                "use the same class folder names"
            )
        train_images, train_labels, reasons = _scan_class_folders(root, classes, "--data-path", check_images)
        val_images, val_labels, val_reasons = _scan_class_folders(val_root, classes, "--val-path", check_images)
        skipped.update({**reasons, **val_skipped, **val_reasons})
    else:
        images, labels, reasons = _scan_class_folders(root, classes, "--data-path", check_images)
        skipped.update(reasons)
        train_images, train_labels, val_images, val_labels = split_by_class(images, labels, classes, val_rate, seed)
    if len(classes) < 2:
        raise UserError(f"--data-path {root}: found 1 class folder ({classes[0]}); a classifier needs at least 2")
    if not val_images:
        raise UserError(
            f"--val-rate {val_rate}: the validation split of {len(train_images)} images is empty; "
            "raise --val-rate or give --val-path"
        )
    return _nonempty_split((train_images, train_labels), (val_images, val_labels), classes, skipped, val_rate)


def _nonempty_split(train, val, classes, skipped, val_rate, val_list=None):
    """The DataSplit of ``train`` and ``val`` (each: image paths, labels), unless --val-rate
    left no training images; a note for each class that gets no validation image.
    ``skipped``: {path: why}."""
    (train_images, train_labels), (val_images, val_labels) = train, val
    if not train_images:
        raise UserError(f"--val-rate {val_rate}: no images left for training; lower --val-rate")
    as_lists = lambda labels: [y if isinstance(y, list) else [y] for y in labels]  # noqa: E731 (multi-label: lists)
    train_counts = Counter(c for y in as_lists(train_labels) for c in y)
    notes, measured = [], "AP" if val_labels and isinstance(val_labels[0], list) else "accuracy"
    missing = sorted(set(range(len(classes))) - {c for y in as_lists(val_labels) for c in y})
    if len(missing) > MAX_NOTES:  # a thousand classes: one line, not one a class
        named = ", ".join(repr(classes[c]) for c in missing[:3])
        notes = [f"{len(missing)} classes get no validation image ({named}, ...): their {measured} is never measured; "
                 + ("list some of their images in --val-list" if val_list else "add images or raise --val-rate")]
        missing = []
    for label in missing:
        count = train_counts[label]
        why, fix = ((f"--val-list {val_list} lists none of its {count}", "list some of them there") if val_list else
                    (f"{count} image(s), round({count} x --val-rate {val_rate}) = 0", "add images or raise --val-rate"))
        notes.append(f"class {classes[label]!r} gets no validation image ({why}): its {measured} is never measured; "
                     f"{fix}")
    return DataSplit(train_images_path=train_images, train_images_label=train_labels, val_images_path=val_images,
                     val_images_label=val_labels, classes=classes, skipped=list(skipped), skip_reasons=dict(skipped),
                     notes=notes)


def split_by_class(images, labels, classes, val_rate, seed):
    """(train images, train labels, val images, val labels): ``round(n * val_rate)`` images of
    each class to val, chosen by ``random.Random(seed)`` among the sorted paths."""
    if not 0.0 <= val_rate < 1.0:
        raise UserError(f"--val-rate {val_rate}: must be at least 0 and below 1 (e.g. 0.2)")
    rng = random.Random(seed)
    train_images, train_labels, val_images, val_labels = [], [], [], []
    by_class = [[] for _ in classes]
    for path, label in zip(images, labels):
        by_class[label].append(path)
    for label, members in enumerate(by_class):
        rng.shuffle(members)
        n_val = int(round(len(members) * val_rate))
        if n_val and n_val == len(members):
            raise UserError(
                f"--val-rate {val_rate}: class {classes[label]!r} has only {len(members)} image(s), all of "
                "them would go to validation; lower --val-rate or add images"
            )
        val_set = set(members[:n_val])
        for path in sorted(members):
            if path in val_set:
                val_images.append(path)
                val_labels.append(label)
            else:
                train_images.append(path)
                train_labels.append(label)
    return train_images, train_labels, val_images, val_labels


def _label_names(cell, header, several_labels, where):
    """The class names of one row's label cell: the cell itself under the header path,label;
    under path,labels (or with --multi-label) its space-separated names, each once. Without
    --multi-label a row must name exactly one class."""
    if header == "label" and not several_labels:
        return (cell.strip(),) if cell.strip() else ()
    names = tuple(cell.split())
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UserError(f"{where}: the label {twice[0]!r} is there twice; list each of an image's classes once")
    if len(names) > 1 and not several_labels:
        raise UserError(f"{where}: {len(names)} labels ({cell.strip()!r}): an image of several classes needs "
                        "--multi-label")
    return names


def check_utf8_text(path, flag, what):
    """A text file saved as UTF-16 or UTF-32 (a spreadsheet's "Unicode text": NUL bytes in
    every line) is refused in one line, before its bytes are read as UTF-8."""
    try:
        with open(path, "rb") as f:
            start = f.read(4096)
    except OSError:
        return  # the reader that follows says what is wrong
    if b"\x00" in start:
        kind = "UTF-16" if start[:2] in (b"\xff\xfe", b"\xfe\xff") else "UTF-16 or UTF-32"
        raise UserError(f"{flag} {printable(path)}: saved as {kind} text (NUL bytes); save it as UTF-8, {what}")


def _read_label_file(path, flag, several_labels=False):
    """[(image path, class names, line number)] of a CSV with a header ``path,label`` or
    ``path,labels`` (see ``_label_names``); image paths relative to the CSV's folder. A missing
    CSV, a wrong header or row, and a listed file that does not exist are errors naming the line."""
    header_text = "path,labels" if several_labels else "path,label"
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: no such file; give a CSV file with the header {header_text}")
    check_utf8_text(path, flag, f"a CSV file with the header {header_text}")
    folder = os.path.dirname(os.path.abspath(path))
    rows, seen = [], {}
    try:
        # surrogateescape: a listed name that is not UTF-8 is read as the file system holds it
        with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as f:
            reader = csv.reader(f)
            header = [h.strip() for h in next(reader, [])]
            if header not in (["path", "label"], ["path", "labels"]):
                raise UserError(f"{flag} {path}: the first line must be the header {header_text} "
                                f"(found {','.join(header) or 'an empty file'})")
            for row in reader:
                if not any(field.strip() for field in row):
                    continue  # a blank line
                where = f"{flag} {path}, line {reader.line_num}"
                names = _label_names(row[1], header[1], several_labels, where) if len(row) == 2 else None
                if names is None or not row[0].strip() or not (names or several_labels):
                    raise UserError(f"{where}: expected {header_text}; found {','.join(row)!r}")
                image = os.path.normpath(os.path.join(folder, row[0].strip()))
                if image in seen:
                    raise UserError(f"{where}: {image} is listed already on line {seen[image]}; list each image once")
                seen[image] = reader.line_num
                if no_file_at(image):
                    raise UserError(f"{where}: {image}: no such file; fix the path (relative to the CSV's folder) or "
                                    "remove the line")
                rows.append((image, names, reader.line_num))
    except (UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{flag} {path}: not a readable CSV file ({e})") from None
    if not rows:
        raise UserError(f"{flag} {path}: lists no images; add lines {header_text}")
    return rows


def _readable_rows(rows, classes, path, flag, check_images=False):
    """Images and labels (a list of class indices per image) of the rows (with
    ``check_images``, of those whose file opens as an image), and {skipped file: why}."""
    images, labels, skipped, label_of = [], [], {}, {name: label for label, name in enumerate(classes)}
    for image, names, line in rows:
        for name in names:
            if name not in label_of:
                raise UserError(f"{flag} {path}, line {line}: class {name!r} is not one of the training classes "
                                f"{classes}; fix the label or add the class to --train-list")
        if check_images and image not in readable_images([image], skipped):
            continue
        images.append(image)
        labels.append([label_of[name] for name in names])
    return images, labels, skipped


def split_at_random(images, labels, val_rate, seed):
    """(train images, train labels, val images, val labels): ``round(n * val_rate)`` of the
    images to val, chosen by ``random.Random(seed)``; each split in the listed order. For
    multi-label lists, where classes cannot each be split by themselves."""
    if not 0.0 <= val_rate < 1.0:
        raise UserError(f"--val-rate {val_rate}: must be at least 0 and below 1 (e.g. 0.2)")
    chosen = set(random.Random(seed).sample(range(len(images)), int(round(len(images) * val_rate))))
    parts = ([i for i in range(len(images)) if i not in chosen], sorted(chosen))
    return tuple(values for part in parts for values in ([images[i] for i in part], [labels[i] for i in part]))


def split_label_files(train_list, val_list=None, val_rate=0.2, seed=0, check_images=False, several_labels=False):
    """Images and labels listed in CSV files (header ``path,label``, the label a class name,
    paths relative to the CSV), as ``split_class_folders`` returns them for folders.

    The classes are the sorted labels of ``train_list``. Without ``val_list`` the training
    list is split as folders are (stratified, seeded). No image is opened, unless
    ``check_images``: then listed files that PIL cannot open are skipped (and listed in
    ``skipped``). A class of ``train_list`` left without images, a
    class in ``val_list`` that ``train_list`` lacks, and a missing file are errors.

    ``several_labels``: the header ``path,labels``, each row's classes separated by spaces (none:
    an image of no class); the classes are the sorted union of the training rows' classes, the
    labels lists of class indices, and without ``val_list`` the split is ``split_at_random``.
    """
    rows = _read_label_file(train_list, "--train-list", several_labels)
    classes = sorted({name for _, names, _ in rows for name in names})
    if len(classes) < 2:
        raise UserError(f"--train-list {train_list}: found {len(classes)} class{'es' * (len(classes) != 1)} "
                        f"({', '.join(classes) or 'no labels'}); a classifier needs at least 2")
    images, labels, skipped = _readable_rows(rows, classes, train_list, "--train-list", check_images)
    present = {label for image_labels in labels for label in image_labels}
    for label, name in enumerate(classes):
        if label not in present:
            raise UserError(f"--train-list {train_list}: class {name!r} has no readable images; "
                            "add images or remove its lines")
    if not several_labels:
        labels = [image_labels[0] for image_labels in labels]
    if val_list is None:
        split = split_at_random if several_labels else partial(split_by_class, classes=classes)
        train_images, train_labels, val_images, val_labels = split(images, labels, val_rate=val_rate, seed=seed)
    else:
        train_images, train_labels = images, labels
        val_rows = _read_label_file(val_list, "--val-list", several_labels)
        in_train = {image: line for image, _, line in rows}
        for image, _, line in val_rows:
            if image in in_train:
                raise UserError(f"--val-list {val_list}, line {line}: {image} is in --train-list too (line "
                                f"{in_train[image]}); validate on images the model does not train on")
        val_images, val_labels, val_skipped = _readable_rows(val_rows, classes, val_list, "--val-list", check_images)
        val_labels = val_labels if several_labels else [image_labels[0] for image_labels in val_labels]
        skipped.update(val_skipped)
    if not val_images:
        raise UserError(f"--val-rate {val_rate}: the validation split of {len(train_images)} images is empty; "
                        "raise --val-rate or give --val-list" if val_list is None else
                        f"--val-list {val_list}: none of its images can be read")
    return _nonempty_split((train_images, train_labels), (val_images, val_labels), classes, skipped,
                           val_rate=val_rate, val_list=val_list)._replace(several_labels=several_labels)
