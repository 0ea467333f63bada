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

    # a compiled forward (model.compile) calls the collectives eagerly, between its graphs: the
    # in-place c10d calls and the byte counting are not traceable
    @torch.compiler.disable
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        # ring all-reduce: each rank sends 2 (n-1)/n of the tensor
        self.state.stats.add("all_reduce", x.numel() * x.element_size() * 2 * (self.tp_size - 1) / self.tp_size)
        dist.all_reduce(x, group=self.state.tp_group)
        return x

    @torch.compiler.disable
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        self.state.stats.add("all_gather", x.numel() * x.element_size() * (self.tp_size - 1))
        dist.all_gather(parts, x, group=self.state.tp_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src_tp_rank: int = 0) -> torch.Tensor:
        """TP rank `src_tp_rank`'s `x` on every rank of the group. Every rank passes a tensor of the
        same shape and dtype (the others' values are ignored); the result is on this rank's device.
        The drafter uses it to make the tokens its TP rank 0 sampled the tokens of the whole group."""
        if self.tp_size == 1:
            return x
        x = x.to(self.state.device).contiguous()  # NCCL needs device tensors
        src = self.state.tp_ranks[src_tp_rank]
        # the source sends the payload to each other rank (a flat broadcast); the others send nothing
        sent = x.numel() * x.element_size() * (self.tp_size - 1) if self.tp_rank == src_tp_rank else 0
        self.state.stats.add("broadcast", sent)
        dist.broadcast(x, src=src, group=self.state.tp_group)
        return x
