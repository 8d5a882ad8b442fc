"""The process group of a training run: one process, or ``torchrun`` ranks (gloo on CPU,
nccl on GPU). Parameters are replicated; we all-reduce what DP-AdamW needs ourselves
(one flat buffer of clipped sums per logical step), which a DDP wrapper's reducer cannot
do: it would all-reduce unclipped gradients during backward."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from vip_hub.device import pick_device

__all__ = ["Dist"]


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @classmethod
    def from_env(cls, device: str = "auto") -> Dist:
        """Join the group ``torchrun`` describes in the environment, if any."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        dev = pick_device(device, local_rank)
        if world > 1 and not torch_dist.is_initialized():
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            torch_dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        rank = torch_dist.get_rank() if world > 1 else 0
        return cls(rank=rank, world=world, device=dev)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
        return t

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Make every rank hold rank 0's values."""
        if self.world > 1:
            for t in tensors:
                torch_dist.broadcast(t, src=0)

    def barrier(self) -> None:
        if self.world > 1:
            torch_dist.barrier()

    def close(self) -> None:
        if self.world > 1 and torch_dist.is_initialized():
            torch_dist.destroy_process_group()
