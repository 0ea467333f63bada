"""Tensor-parallel collectives for the core's layers (the `comm` object they call).

Eager, a collective is the c10d call. Inside a compiled forward (model.compile) the all-reduce is an op of its own,
`dspark::all_reduce`, opaque to the compiler as attention is: a tensor-parallel step then traces to one graph (each
collective a graph break before: two frames a layer, each checking dynamo's guards before it ran), which the runner
calls directly (`model/compiled.py` `DirectCalls`); on CUDA its CUDA graphs are cut around it as around attention.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist

from .state import ParallelState

# group key -> the comm whose group the compiled ops run on (a graph holds the key, a string, not the group)
_COMMS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_keys = itertools.count()


def _all_reduce_op(x: torch.Tensor, group_key: str) -> None:
    _COMMS[group_key].all_reduce_eager(x)


torch.library.custom_op("dspark::all_reduce", _all_reduce_op, mutates_args=("x",)).register_fake(
    lambda x, group_key: None)


class TensorParallelComm:
    """all-reduce / all-gather over this rank's TP group, counting the bytes each rank sends."""

    def __init__(self, state: ParallelState):
        self.state = state
        self.tp_rank = state.tp_rank
        self.tp_size = state.tp_size
        self.group_key = f"tp{next(_keys)}"
        _COMMS[self.group_key] = self

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        if torch.compiler.is_compiling():  # (one op in the graph; it runs the c10d call)
            torch.ops.dspark.all_reduce(x, self.group_key)
            return x
        return self.all_reduce_eager(x)

    def all_reduce_eager(self, x: torch.Tensor) -> torch.Tensor:
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
