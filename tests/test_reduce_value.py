"""The tutorial's reduce_value, on a real group of two processes (gloo): the sum, or the mean,
of each rank's tensor, returned on every rank, the caller's tensor left as it was."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _reduce_on_rank(rank, init_file, results):
    from multi_train_utils.distributed_utils import reduce_value

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mine = torch.tensor([1.0 + rank, 10.0 * (rank + 1)])  # rank 0: [1, 10], rank 1: [2, 20]
        mean, total = reduce_value(mine), reduce_value(mine, average=False)
        results.put((rank, mean.tolist(), total.tolist(), mine.tolist()))
    finally:
        dist.destroy_process_group()


def test_reduce_value_averages_or_sums_over_two_ranks_on_every_rank(tmp_path):
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_reduce_on_rank, args=(str(tmp_path / "init"), results), nprocs=2, start_method="spawn")
    got = sorted(results.get() for _ in range(2))
    assert got == [(0, [1.5, 15.0], [3.0, 30.0], [1.0, 10.0]), (1, [1.5, 15.0], [3.0, 30.0], [2.0, 20.0])]


def test_reduce_value_of_one_process_is_the_value_itself():
    from multi_train_utils.distributed_utils import reduce_value

    value = torch.tensor([3.0])
    assert reduce_value(value) is value and reduce_value(value, average=False).item() == 3.0
    assert not dist.is_initialized() and os.environ.get("WORLD_SIZE") in (None, "1")
