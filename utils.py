"""The tutorial's functions that find the images and labels of a dataset and split them.

``read_split_data`` (class folders) and ``read_label_files`` (CSV label files), which
my_dataset.build_datasets calls; their machinery (stratified, seeded split, unreadable files,
symbolic links, checks) is multi_train_utils/datasets.py."""
from multi_train_utils.datasets import split_class_folders, split_label_files
from multi_train_utils.images import build_transforms  # noqa: F401 (the tutorial's scripts import it from here)


def read_split_data(root, val_rate=0.2, seed=0, val_root=None, check_images=False):
    """The images of each class folder of ``root`` (a sub-folder per class, sorted names), split
    into train and val: ``round(n * val_rate)`` images of each class to val, chosen with
    ``random.Random(seed)``; with ``val_root`` (the same class folders) nothing is split. Returns
    a DataSplit: train_images_path, train_images_label, val_images_path, val_images_label,
    classes, and the files skipped (``check_images``: every file opened first) with why."""
    return split_class_folders(root, val_rate, seed, val_root, check_images)


def read_label_files(train_list, val_list=None, val_rate=0.2, seed=0, check_images=False, multi_label=False):
    """The images listed in CSV files with the header ``path,label`` (paths relative to the CSV,
    labels class names; the classes are the sorted labels of ``train_list``), as
    ``read_split_data`` returns them; without ``val_list`` the training list is split as
    folders are. ``multi_label``: the header ``path,labels``, each row's classes separated by
    spaces, and each image's labels a list of class indices."""
    return split_label_files(train_list, val_list, val_rate, seed, check_images, several_labels=multi_label)
