"""Image files in a folder tree, found as torchvision's ImageFolder finds them, and what was left out.

Sub-folders are searched, symbolic links followed (each real file and folder once, a link
back to a folder above skipped as a loop), hidden files and folders ignored; an entry that
cannot be resolved (a symlink loop, a broken link, no permission) is named, not fatal.
"""
import os
import stat
from typing import Dict, List, NamedTuple, Set

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


class Entries(NamedTuple):
    """What ``list_entries`` found in one folder."""

    folders: List[str]  # paths of the visible sub-folders (symlinks to folders included), sorted
    files: List[str]  # paths of the visible files, sorted
    links: Set[str]  # those of the files that are symbolic links
    problems: Dict[str, str]  # {path: why it cannot be followed}: symlink loops, broken links


class FoundFiles(NamedTuple):
    """What ``find_image_files`` found."""

    paths: List[str]  # image files by extension, in sorted walk order, each real file once
    problems: Dict[str, str]  # {path: why it was left out} for entries that could not be followed


def is_hidden(name):
    """Names starting with a dot are hidden (.cache, .DS_Store, editors' temporary files)."""
    return name.startswith(".")


def has_image_extension(name):
    """An image file by its extension, any case."""
    return os.path.splitext(name)[1].lower() in IMG_EXTENSIONS


def no_file_at(path):
    """True where no file is (a listed image that is missing); one that exists but cannot be
    opened (a symlink loop, no permission) is there: it is skipped later, with the reason."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return True
    except OSError:
        return False


def find_image_files(folder):
    """Image files (by extension) in ``folder`` and all its sub-folders."""
    found = FoundFiles([], {})
    seen_files, seen_folders = set(), set()
    # depth first, in sorted order; each entry: (path, real paths of the folders above it)
    todo = [(folder, frozenset())]
    while todo:
        path, above = todo.pop()
        real, parent = os.path.realpath(path), os.path.realpath(os.path.dirname(path))
        if real in above or parent == real or parent.startswith(real.rstrip(os.sep) + os.sep):
            found.problems[path] = f"a symbolic link loop (it leads back to {real}, a folder above it)"
            continue
        if real in seen_folders:
            continue  # reached before through another link: its files are in already
        seen_folders.add(real)
        try:
            entries = list_entries(path)
        except OSError as e:
            found.problems[path] = f"cannot be read ({e.strerror})"
            continue
        found.problems.update(entries.problems)
        for file in filter(has_image_extension, entries.files):
            # resolving every file would cost a dozen system calls each: only links need it
            real_file = os.path.realpath(file) if file in entries.links else os.path.join(real, os.path.basename(file))
            if real_file not in seen_files:
                seen_files.add(real_file)
                found.paths.append(file)
        todo += [(sub, above | {real}) for sub in reversed(entries.folders)]
    return found


def list_entries(folder):
    """The visible entries of ``folder`` (symlinks followed), sorted by name; OSError if it cannot be listed."""
    entries = Entries([], [], set(), {})
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if is_hidden(entry.name):
            continue
        kind = _kind(entry)
        if kind == "folder":
            entries.folders.append(entry.path)
        elif kind == "file":
            entries.files.append(entry.path)
            if entry.is_symlink():
                entries.links.add(entry.path)
        elif kind != "other":
            entries.problems[entry.path] = kind
    return entries


def _kind(entry):
    """"folder", "file", "other" (a device, a socket), or why the entry cannot be followed."""
    try:
        if entry.is_dir():
            return "folder"
        if entry.is_file():
            return "file"
        if entry.is_symlink():
            os.stat(entry.path)  # raises: is_dir and is_file say False for a broken link
        return "other"
    except FileNotFoundError:
        return "cannot be read (a broken symbolic link)"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
