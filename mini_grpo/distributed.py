"""The only module that calls torch.distributed.

`init()` reads torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE); without it the process
runs alone and every collective here is a no-op, so the trainer has one code path.
Backend: NCCL on CUDA, gloo on CPU. Collectives time out instead of hanging forever.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init(timeout_s: float = 600.0, use_cuda: bool | None = None) -> DistInfo:
    if "RANK" not in os.environ or dist.is_initialized():
        if dist.is_initialized():
            return DistInfo(dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0)),
                            dist.get_world_size(),
                            int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)),
                    int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s))
    return info


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; returns t."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
