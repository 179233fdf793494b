"""The collective helpers on a real group of two processes (gloo): the tutorial's reduce_value
(the sum, or the mean, of each rank's tensor, returned on every rank, the caller's tensor left
as it was), and check_on_every_rank (a problem one rank finds stops every rank, each with a
line that says where to look)."""
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


def _check_on_rank(rank, init_file, failing, results):
    from multi_train_utils.distributed_utils import check_on_every_rank
    from multi_train_utils.errors import UserError

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        def check():
            if rank in failing:
                raise UserError(f"--data-path d: rank {rank} cannot read it")
            return f"fine on {rank}"

        try:
            results.put((rank, check_on_every_rank(check, torch.device("cpu"))))
        except UserError as e:
            results.put((rank, "error: " + str(e)))
    finally:
        dist.destroy_process_group()


def _exchange_on_rank(rank, init_file, results):
    from multi_train_utils.distributed_utils import columns_of_every_rank, gather_objects, row_counts

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        rows = [3, 5][rank]  # uneven rows, in two blocks on rank 1; uneven columns: rank 0 has 1 of 4
        mine = (torch.arange(rows * 4).reshape(rows, 4) + 100 * rank).float()
        blocks = [mine] if rank == 0 else [mine[:2], mine[2:]]
        try:
            got = columns_of_every_rank(blocks, [0, 1, 4])
            results.put((rank, row_counts(rows, torch.device("cpu")), [b.tolist() for b in got],
                         [b.tolist() for b in blocks], gather_objects(f"from {rank}")))
        except Exception as e:  # noqa: BLE001: the test says which collective broke
            results.put((rank, f"error: {e}"))
    finally:
        dist.destroy_process_group()


def run_two_ranks(target, *args):
    """What each of two spawned processes put on the queue, by rank."""
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(target, args=(*args, results), nprocs=2, start_method="spawn")
    return sorted(results.get() for _ in range(2))


def test_a_problem_on_one_rank_stops_both_and_the_other_says_where_to_look(tmp_path):
    assert run_two_ranks(_check_on_rank, str(tmp_path / "a"), (1,)) == [
        (0, "error: 1 other process(es) found a problem with the input; see their error"),
        (1, "error: --data-path d: rank 1 cannot read it")]
    assert run_two_ranks(_check_on_rank, str(tmp_path / "b"), ()) == [(0, "fine on 0"), (1, "fine on 1")]


def test_reduce_value_averages_or_sums_over_two_ranks_on_every_rank(tmp_path):
    got = run_two_ranks(_reduce_on_rank, str(tmp_path / "init"))
    assert got == [(0, [1.5, 15.0], [3.0, 30.0], [1.0, 10.0]), (1, [1.5, 15.0], [3.0, 30.0], [2.0, 20.0])]


def test_reduce_value_of_one_process_is_the_value_itself():
    from multi_train_utils.distributed_utils import reduce_value

    value = torch.tensor([3.0])
    assert reduce_value(value) is value and reduce_value(value, average=False).item() == 3.0
    assert not dist.is_initialized() and os.environ.get("WORLD_SIZE") in (None, "1")


def test_columns_of_every_rank_give_each_rank_its_columns_of_every_ranks_rows(tmp_path):
    """multi-label.md: "one all-to-all gives each rank every image's scores of its share of the
    classes"; "one gather brings every rank the few figures of every class": on two real
    processes with 3 and 5 rows (rank 1's in two blocks) and column bounds 0, 1, 4, each rank
    gets its columns of rank 0's rows then rank 1's, the row counts of both, every rank's
    object; the blocks it sent are emptied."""
    whole = [torch.arange(12).reshape(3, 4).float(), (torch.arange(20).reshape(5, 4) + 100).float()]
    got = run_two_ranks(_exchange_on_rank, str(tmp_path / "init"))
    objects = ["from 0", "from 1"]
    assert got[0] == (0, [3, 5], [w[:, 0:1].tolist() for w in whole], [], objects)
    assert got[1] == (1, [3, 5], [w[:, 1:4].tolist() for w in whole], [], objects)
