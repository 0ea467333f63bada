"""Tensor-parallel collectives for the core's layers (the `comm` object they call)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .state import ParallelState


class TensorParallelComm:
    """all-reduce / all-gather over this rank's TP group, counting the bytes each rank sends."""

    def __init__(self, state: ParallelState):
        self.state = state
        self.tp_rank = state.tp_rank
        self.tp_size = state.tp_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        # ring all-reduce: each rank sends 2 (n-1)/n of the tensor
        self.state.stats.add("all_reduce", x.numel() * x.element_size() * 2 * (self.tp_size - 1) / self.tp_size)
        dist.all_reduce(x, group=self.state.tp_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        self.state.stats.add("all_gather", x.numel() * x.element_size() * (self.tp_size - 1))
        dist.all_gather(parts, x, group=self.state.tp_group)
        return torch.cat(parts, dim=dim)
