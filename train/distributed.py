"""The process group: set up from torchrun's variables, NCCL on GPUs, gloo on CPUs.

Every helper here is a collective: all ranks call it, in the same order, and get the same
answer. A single process (no torchrun) gets the same helpers as no-ops, so the trainer has one
code path and no ``if rank == 0:`` around work that needs every rank.
"""

from __future__ import annotations

import datetime
import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["Distributed", "init_distributed"]


@dataclass
class Distributed:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, *tensors: torch.Tensor) -> None:
        """Sum each tensor over the ranks, in place."""
        if self.enabled:
            for tensor in tensors:
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (small, picklable, over the process group only)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def average_buffers(self, model: nn.Module) -> None:
        """Make BatchNorm statistics (and other buffers) equal on all ranks before eval/save.

        Float buffers are averaged (timm's ``--dist-bn reduce``), others taken from rank 0.
        """
        if not self.enabled:
            return
        for buffer in model.buffers():
            if buffer.is_floating_point():
                dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
                buffer.div_(self.world_size)
            else:
                dist.broadcast(buffer, src=0)

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP around `model` when there are several ranks (the model itself otherwise)."""
        if not self.enabled:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        # no buffer broadcast in forward: a rank that backs off after an out-of-memory error
        # must not leave the others waiting in it; buffers are averaged before eval instead
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        if "forward_sync_buffers" in params:  # the newer name of the option
            return DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)
        return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed() -> Distributed:
    """Join the job torchrun started (RANK, WORLD_SIZE, LOCAL_RANK), or run as one process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=30),
            device_id=device if device.type == "cuda" else None,
        )
    return Distributed(rank, world_size, local_rank, device)
