"""The list of image files and labels: held compactly, and listed once per job.

Loader workers are forked copies of their process. A Python list of a million path strings
is copied into each worker page by page as the worker reads it (reading an object writes its
reference count: pytorch/pytorch#13246). Here the paths are one byte array and one array of
offsets, the labels one integer array (NumPy): what a worker reads has no reference count of
its own, so its private memory stays flat over an epoch.

``listed_once`` makes rank 0 the only process that lists the folders: it sends the list to
the other ranks as three tensors, so a job of 8 GPUs lists its data once, not 8 times at
once on the same file system.
"""
import os
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from multi_train_utils.errors import UserError
from multi_train_utils.process import get_rank, get_world_size, is_dist_avail_and_initialized


class PathList(Sequence):
    """A read-only sequence of paths (str) kept as one shared prefix, one uint8 array of the
    rest of every path and an int64 array of offsets into it."""

    def __init__(self, paths=()):
        paths = paths if isinstance(paths, list) else list(paths)
        if not paths:
            self._set(b"", np.zeros(0, dtype=np.uint8), np.zeros(1, dtype=np.int64))
            return
        prefix = os.path.commonprefix([min(paths), max(paths)])
        # the rest of every path in one string, separated by NUL (which no path holds), encoded
        # as the file system names them (surrogateescape: names that are not UTF-8 round-trip)
        joined = np.frombuffer(os.fsencode("\0".join([p[len(prefix):] for p in paths]) + "\0"), dtype=np.uint8)
        ends = np.flatnonzero(joined == 0)
        lengths = np.diff(ends, prepend=-1) - 1
        self._set(os.fsencode(prefix), joined[joined != 0], np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))

    def _set(self, prefix, data, offsets):
        self.prefix, self.data, self.offsets = prefix, data, offsets

    @classmethod
    def from_arrays(cls, prefix, data, offsets):
        """A PathList of arrays made by another one (``arrays()``)."""
        paths = cls.__new__(cls)
        paths._set(prefix, data, offsets)
        return paths

    def arrays(self):
        """(prefix bytes, uint8 data, int64 offsets): what ``from_arrays`` takes."""
        return self.prefix, self.data, self.offsets

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"path {index} of {len(self)}")
        return os.fsdecode(self.prefix + self.data[self.offsets[index]:self.offsets[index + 1]].tobytes())

    def __eq__(self, other):
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self):
        return f"PathList({len(self)} paths)"


def compact_labels(labels):
    """Labels as one int64 array (no Python int per item); multi-hot rows (a 2-D array) as they are."""
    if isinstance(labels, np.ndarray) and labels.ndim == 2:
        return labels
    return np.asarray(labels, dtype=np.int64).reshape(-1)


def multi_hot(labels, num_classes):
    """Lists of class indices as one uint8 array of multi-hot rows (images x classes)."""
    rows = np.zeros((len(labels), num_classes), dtype=np.uint8)
    for row, image_labels in zip(rows, labels):
        row[list(image_labels)] = 1
    return rows


def compact_split(split):
    """``split`` (utils.DataSplit) with its paths as PathLists and its labels as arrays (a
    multi-label split's as multi-hot rows)."""
    if split.several_labels:
        labels = [multi_hot(split.train_images_label, len(split.classes)),
                  multi_hot(split.val_images_label, len(split.classes))]
    else:
        labels = [compact_labels(split.train_images_label), compact_labels(split.val_images_label)]
    return split._replace(train_images_path=PathList(split.train_images_path), train_images_label=labels[0],
                          val_images_path=PathList(split.val_images_path), val_images_label=labels[1])


_ARRAYS = ("train_images_path", "train_images_label", "val_images_path", "val_images_label")


def listed_once(read_split):
    """``read_split()`` (which lists the data: ``read_split_data`` or ``read_label_files``) run
    by rank 0 alone, its DataSplit sent to every other rank; compact on every rank.

    A UserError on rank 0 reaches the others as a UserError that points to it. Nodes that do
    not share a file system get rank 0's list too: the data must be at the same path on each.
    """
    if not is_dist_avail_and_initialized() or get_world_size() == 1:
        return compact_split(read_split())
    error, split = None, None
    if get_rank() == 0:
        try:
            split = compact_split(read_split())
        except UserError as e:
            error = str(e)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    arrays = None if split is None else _arrays(split)
    # first the small part (error or class names, skipped files, array sizes), then the arrays
    header = [error, None if split is None else (split._replace(**dict.fromkeys(_ARRAYS)),
                                                 [(a.shape, a.dtype) for a in arrays])]
    dist.broadcast_object_list(header, src=0, device=device)
    error, rest = header
    if error is not None:
        raise UserError(error if get_rank() == 0 else "rank 0 could not list the data; see its error")
    small, sizes = rest
    arrays = arrays or [np.empty(shape, dtype=dtype) for shape, dtype in sizes]
    for array in arrays:
        tensor = torch.from_numpy(array)
        moved = tensor.to(device) if device is not None else tensor
        dist.broadcast(moved, src=0)
        if moved is not tensor:
            tensor.copy_(moved.cpu())
    return split if split is not None else _assemble(small, arrays)


def _arrays(split):
    """The seven arrays of a compact split, in a fixed order."""
    train_prefix, train_data, train_offsets = split.train_images_path.arrays()
    val_prefix, val_data, val_offsets = split.val_images_path.arrays()
    prefixes = np.frombuffer(len(train_prefix).to_bytes(8, "little") + train_prefix + val_prefix, dtype=np.uint8)
    return [prefixes.copy(), train_data, train_offsets, split.train_images_label, val_data, val_offsets,
            split.val_images_label]


def _assemble(small, arrays):
    prefixes, train_data, train_offsets, train_labels, val_data, val_offsets, val_labels = arrays
    cut = int.from_bytes(prefixes[:8].tobytes(), "little")
    train_prefix, val_prefix = prefixes[8:8 + cut].tobytes(), prefixes[8 + cut:].tobytes()
    return small._replace(train_images_path=PathList.from_arrays(train_prefix, train_data, train_offsets),
                          train_images_label=train_labels,
                          val_images_path=PathList.from_arrays(val_prefix, val_data, val_offsets),
                          val_images_label=val_labels)
