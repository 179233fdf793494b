"""Where this process sits in the job: its rank and the world size (0 of 1 without a process group)."""
import torch.distributed as dist


def is_dist_avail_and_initialized():
    """True inside an initialised process group."""
    return dist.is_available() and dist.is_initialized()


def get_world_size():
    """Number of processes in the job (1 without a process group)."""
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def get_rank():
    """Global rank of this process (0 without a process group)."""
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def is_main_process():
    """Only global rank 0 prints, logs and writes files."""
    return get_rank() == 0
