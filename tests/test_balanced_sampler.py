"""In-process checks of multi_train_utils/loaders.py: the class-balanced sampler, class weights, the imbalance warning."""
import math

import pytest
import torch
from torch.utils.data import DistributedSampler

from multi_train_utils.loaders import (BalancedDistributedSampler, class_weights, find_imbalance,
                                       training_labels)
from multi_train_utils.errors import UserError
from multi_train_utils.loaders import EpochBatchSampler
from multi_train_utils.loaders import SeededSamples

# 10:1 imbalanced: 200 images of class 0, 20 of class 1, 20 of class 2 (interleaved, as a
from multi_train_utils.datasets import MyDataSet

# 10:1 imbalanced: 200 images of class 0, 20 of class 1, 20 of class 2 (interleaved, as a
# dataset's order would be).
IMBALANCED = [0] * 200 + [1] * 20 + [2] * 20
IMBALANCED = IMBALANCED[::2] + IMBALANCED[1::2]


def test_classes_are_drawn_uniformly_from_an_imbalanced_set():
    sampler = BalancedDistributedSampler(IMBALANCED, num_replicas=1, rank=0, seed=3)
    drawn = []
    for epoch in range(40):  # 40 x 240 = 9,600 draws: a class's share is 1/3 +- 0.015 (3 sigma)
        sampler.set_epoch(epoch)
        drawn += [IMBALANCED[i] for i in sampler]
    shares = [drawn.count(c) / len(drawn) for c in range(3)]
    assert all(abs(share - 1 / 3) < 0.03 for share in shares), shares
    # within a class, every image is drawn (not the same few): the rare classes' 20 images each
    # come up about 160 times
    rare = [i for i, y in enumerate(IMBALANCED) if y == 2]
    counts = [0] * len(IMBALANCED)
    for epoch in range(40):
        sampler.set_epoch(epoch)
        for i in sampler:
            counts[i] += 1
    assert all(counts[i] > 80 for i in rare), [counts[i] for i in rare]


def test_ranks_take_disjoint_positions_of_one_global_draw():
    labels = IMBALANCED[:237]  # not a multiple of 2, 3 or 4: padding needed
    for world in (2, 3, 4):
        samplers = [BalancedDistributedSampler(labels, world, rank, seed=5) for rank in range(world)]
        for s in samplers:
            s.set_epoch(2)
        per_rank = [list(s) for s in samplers]
        draw = samplers[0].global_draw()
        total = math.ceil(len(labels) / world) * world
        padded = draw + draw[:total - len(draw)]
        # position p of the padded draw goes to rank p % world: disjoint, and together exactly the draw
        for rank in range(world):
            assert per_rank[rank] == padded[rank::world]
        interleaved = [per_rank[p % world][p // world] for p in range(total)]
        assert interleaved == padded
        assert all(s.global_draw() == draw for s in samplers[1:])  # every rank draws the same


def test_same_seed_and_epoch_give_the_same_draw_and_another_epoch_or_seed_another():
    a = BalancedDistributedSampler(IMBALANCED, 1, 0, seed=7)
    b = BalancedDistributedSampler(IMBALANCED, 1, 0, seed=7)
    a.set_epoch(4)
    b.set_epoch(4)
    assert list(a) == list(b)
    assert list(a) == list(a)  # iterating again repeats the epoch (resume re-creates it)
    first = list(a)
    a.set_epoch(5)
    assert list(a) != first
    c = BalancedDistributedSampler(IMBALANCED, 1, 0, seed=8)
    c.set_epoch(4)
    assert list(c) != first
    # DistributedSampler's seed + epoch would make (seed 7, epoch 5) equal (seed 8, epoch 4)
    c.set_epoch(4)
    a.set_epoch(5)
    assert list(a) != list(c)


@pytest.mark.parametrize("n", [1, 7, 12, 13])
def test_lengths_at_world_sizes_one_to_four(n):
    labels = [i % 3 for i in range(n)]
    for world in (1, 2, 3, 4):
        expected = -(-n // world)  # ceil, as DistributedSampler with drop_last=False
        for rank in range(world):
            sampler = BalancedDistributedSampler(labels, world, rank, seed=0)
            assert len(sampler) == expected
            assert len(list(sampler)) == expected
            assert len(sampler) == len(DistributedSampler(range(n), world, rank))
            assert all(0 <= i < n for i in sampler)


def test_it_plugs_in_where_distributed_sampler_does():
    sampler = BalancedDistributedSampler(IMBALANCED, 2, 1, seed=0)
    sampler.set_epoch(3)
    batches = list(EpochBatchSampler(sampler, 4, world_size=2, rank=1))
    assert len(batches) == len(sampler) // 4
    assert all(epoch == 3 for batch in batches for epoch, _ in batch)
    assert [i for batch in batches for _, i in batch] == list(sampler)[:len(batches) * 4]


def test_labels_come_from_the_targets_without_reading_images():
    dataset = MyDataSet(["/no/such/file.jpg"] * 4, [1, 0, 2, 1])  # the images do not exist
    assert training_labels(SeededSamples(dataset, 0)) == [1, 0, 2, 1]
    assert training_labels(torch.utils.data.TensorDataset(torch.zeros(3))) is None  # no targets
    dataset.images_class = [1, 0]
    with pytest.raises(UserError, match="targets"):
        training_labels(dataset)


def test_class_weights_are_sklearns_balanced():
    labels = [0] * 6 + [1] * 3 + [2] * 1 + [3] * 0
    # by hand: 10 images, 4 classes -> 10 / (4 * count)
    expected = [10 / 24, 10 / 12, 10 / 4, 0.0]  # 0.41666, 0.83333, 2.5, and 0 for the empty class
    assert class_weights(labels, 4).tolist() == pytest.approx(expected)
    assert class_weights([0, 1, 1, 0], 2).tolist() == [1.0, 1.0]
    assert class_weights(labels, 4).dtype == torch.float32
    with pytest.raises(ValueError):
        class_weights([0, 5], 3)


def test_imbalance_names_the_largest_and_smallest_class_beyond_three_times():
    names = ["cat", "dog", "fox"]
    found = find_imbalance([0] * 5 + [1] * 31 + [2] * 10, names)
    assert (found.largest, found.largest_count, found.smallest, found.smallest_count) == ("dog", 31, "cat", 5)
    assert "--sampler balanced" in found.warning() and "--class-weights balanced" in found.warning()
    assert find_imbalance([0] * 10 + [1] * 30 + [2] * 20, names) is None  # exactly 3x: no warning
    assert find_imbalance([0] * 10 + [1] * 31 + [2] * 20, names).largest_count == 31  # just over
    assert find_imbalance([0] * 4 + [1] * 4, names).smallest == "fox"  # no images at all
