"""--seed reaches every random choice the docs name, as documented: the split (class folders and
label files alike), both training samplers (the shuffle and --sampler balanced) at world sizes
1 and 2, and the draw within a class. The same seed gives the same choice, another seed
another; a draw depends on (seed, epoch) alone, never on the global generator. Expected orders
come from torch's own DistributedSampler recipe (a permutation seeded by seed + epoch)."""
import csv
import os

import pytest
import torch

from multi_train_utils.loaders import BalancedDistributedSampler, make_train_sampler
from my_dataset import build_datasets
from conftest import full_flags  # noqa: E402

N_IMAGES = 12  # per class, 3 classes


@pytest.fixture(scope="module")
def folders_and_label_file(tmp_path_factory):
    """3 class folders of 12 (empty, never opened) .jpg files, and a label file listing the same."""
    root = tmp_path_factory.mktemp("seeded")
    rows = []
    for name in ("a", "b", "c"):
        os.makedirs(root / "data" / name)
        for i in range(N_IMAGES):
            (root / "data" / name / f"{name}{i:02d}.jpg").write_bytes(b"")
            rows.append((f"data/{name}/{name}{i:02d}.jpg", name))
    with open(root / "train.csv", "w", newline="") as f:
        csv.writer(f).writerows([("path", "label"), *rows])
    return root


def data_args(root, seed, labels):
    return full_flags(data_path=str(root / "data"), val_path=None, train_list=str(root / "train.csv") if labels
                              else None, val_list=None, val_rate=0.25, seed=seed, img_size=32, check_images=False)


def validation_files(root, seed, labels):
    data = build_datasets(data_args(root, seed, labels))
    return sorted(os.path.realpath(p) for p in data.val.images_path)


def test_the_split_follows_the_seed_for_folders_and_label_files_alike(folders_and_label_file):
    root = folders_and_label_file
    splits = {(seed, labels): validation_files(root, seed, labels) for seed in (0, 3, 4) for labels in (False, True)}
    for seed in (0, 3, 4):
        assert len(splits[seed, False]) == 9  # round(12 x 0.25) of each class
        assert splits[seed, True] == splits[seed, False]  # a label file is split as folders are
        assert validation_files(root, seed, True) == splits[seed, True]  # the same seed, the same split
    assert len({tuple(split) for split in splits.values()}) == 3  # each seed its own


def shuffle_order(n, seed, epoch):
    """What torch's DistributedSampler (shuffle=True) draws: a permutation seeded by seed + epoch."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


class Labelled(list):
    def __init__(self, labels):
        super().__init__(range(len(labels)))
        self.targets = labels


@pytest.mark.parametrize("seed", [0, 5])
def test_the_shuffle_sampler_is_seeded_by_seed_and_epoch_on_every_rank(seed):
    dataset = Labelled([i % 3 for i in range(10)])  # 10 over 2 ranks: 5 each, no padding; 11 pads below
    args = full_flags(sampler="shuffle", seed=seed)
    for epoch in (0, 1):
        expected = shuffle_order(len(dataset), seed, epoch)
        single = make_train_sampler(args, dataset, num_replicas=1, rank=0)
        single.set_epoch(epoch)
        assert list(single) == expected
        ranks = []
        for rank in (0, 1):
            sampler = make_train_sampler(args, dataset, num_replicas=2, rank=rank)
            sampler.set_epoch(epoch)
            ranks.append(list(sampler))
        assert ranks == [expected[0::2], expected[1::2]]
    odd = Labelled([i % 3 for i in range(11)])
    last = make_train_sampler(args, odd, num_replicas=2, rank=1)
    expected = shuffle_order(11, seed, 0)
    assert list(last) == (expected + expected[:1])[1::2]  # padded with the draw's first index


def balanced_draws(labels, seed, epoch, world_size):
    draws = []
    for rank in range(world_size):
        sampler = make_train_sampler(full_flags(sampler="balanced", seed=seed), Labelled(labels),
                                     num_replicas=world_size, rank=rank)
        sampler.set_epoch(epoch)
        draws.append(list(sampler))
    return draws


def test_the_balanced_sampler_is_seeded_by_seed_and_epoch_alone():
    labels = [0] * 30 + [1] * 3 + [2] * 7  # imbalanced
    first = balanced_draws(labels, seed=0, epoch=0, world_size=1)[0]
    torch.manual_seed(123)  # the global generator changes nothing
    assert balanced_draws(labels, seed=0, epoch=0, world_size=1)[0] == first
    assert balanced_draws(labels, seed=7, epoch=0, world_size=1)[0] != first
    assert balanced_draws(labels, seed=0, epoch=1, world_size=1)[0] != first
    # two ranks: disjoint positions of the one draw of (seed, epoch), together all of it
    rank0, rank1 = balanced_draws(labels, seed=7, epoch=2, world_size=2)
    whole = BalancedDistributedSampler(labels, seed=7)
    whole.set_epoch(2)
    assert rank0 == list(whole)[0::2] and rank1 == list(whole)[1::2]


def test_the_balanced_draw_reaches_every_image_of_every_class_first_and_last_included():
    labels = [0] * 30 + [1] * 3 + [2] * 7
    seen, classes = set(), [0, 0, 0]
    for epoch in range(40):
        for index in balanced_draws(labels, seed=1, epoch=epoch, world_size=1)[0]:
            seen.add(index)
            classes[labels[index]] += 1
    assert seen == set(range(len(labels)))  # within a class, every image, the first and the last
    total = sum(classes)
    assert all(abs(count / total - 1 / 3) < 0.03 for count in classes), classes  # 1600 draws: sigma 0.012


def test_mixup_and_cutmix_follow_the_seed_of_the_flags():
    """make_batch_mixer (what both scripts call): the same --seed mixes a batch alike, another
    --seed otherwise; rank and (epoch, step) count too."""
    from multi_train_utils.loaders import make_batch_mixer

    images, labels = torch.rand(8, 3, 8, 8, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 4

    def mixed(seed, rank=0, epoch=0, step=0):
        args = full_flags(mixup_alpha=0.2, cutmix_alpha=1.0, seed=seed)
        return make_batch_mixer(args, 4, rank=rank)(images.clone(), labels, epoch, step)[1]

    assert torch.equal(mixed(3), mixed(3))
    assert not torch.equal(mixed(3), mixed(0))
    assert not torch.equal(mixed(3), mixed(3, rank=1))
    assert not torch.equal(mixed(3), mixed(3, epoch=1)) and not torch.equal(mixed(3), mixed(3, step=1))


def test_each_rank_mixes_with_its_own_draw_by_default(monkeypatch):
    """Without a rank given, make_batch_mixer takes this process's (rank 1 of a job here)."""
    from multi_train_utils import loaders as mixing

    images, labels = torch.rand(8, 3, 8, 8, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 4
    args = full_flags(mixup_alpha=0.2, cutmix_alpha=1.0, seed=3)

    def mixed(**rank):
        return mixing.make_batch_mixer(args, 4, **rank)(images.clone(), labels, 0, 0)[1]

    monkeypatch.setattr(mixing, "get_rank", lambda: 1)
    assert torch.equal(mixed(), mixed(rank=1)) and not torch.equal(mixed(), mixed(rank=0))


@pytest.mark.parametrize("mixup, cutmix, mixes", [(0.2, 0.0, True), (0.0, 1.0, True), (0.2, 1.0, True),
                                                  (0.0, 0.0, False)])
def test_mixup_or_cutmix_alone_mixes(mixup, cutmix, mixes):
    from multi_train_utils.loaders import make_batch_mixer

    mixer = make_batch_mixer(full_flags(mixup_alpha=mixup, cutmix_alpha=cutmix, seed=0), 4, rank=0)
    assert (mixer is not None) is mixes
