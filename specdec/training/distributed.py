"""Process-group setup shared by ``train`` and ``distill``.

Works unchanged as a plain process (world size 1) and under ``torchrun``, which
sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``. Backend: nccl on CUDA, gloo
on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def mean(self, value: float) -> float:
        """Average a scalar over ranks (identity on one process)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world_size

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            t = t.to(self.device)
            dist.all_reduce(t)
        return t


def setup(device: str = "auto") -> Dist:
    """Initialise the process group when launched by torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank=rank, local_rank=local_rank, world_size=world_size, device=dev)


def teardown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()
