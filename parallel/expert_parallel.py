"""Expert-parallel MoE: dispatch tokens to the ranks holding their experts, combine the results.

Per MoE layer, on every rank (gating already ran on every rank over the full token set):
  1. this rank takes its share of the tokens: ranks of one TP group hold the same tokens, so
     TP rank i takes chunk i;
  2. each (token, expert) assignment goes to a physical slot (replicas round-robin, chosen on the
     device) and so to a rank;
  3. the rows travel by `all_to_all_single`, in one of two layouts:
     - padded (`capacity` > 0, small steps: decodes): every rank sends every other rank a buffer
       of exactly `capacity` rows, padding marked by slot -1, so the split sizes are known before
       the step and nothing waits for the host (DeepEP's low-latency layout). The step's builder
       chooses the capacity, the same on every rank: the most assignments any rank can send;
     - exact (prefill): the counts are exchanged first and read on the host for uneven splits
       (one host synchronisation per layer, where a step's compute dwarfs it);
  4. each rank runs its experts over what it received, grouped per slot;
  5. the inverse all-to-all brings the outputs back, and a weighted sum combines each token's k;
  6. an all-gather over the TP group restores the full token set.

Inside a compiled forward (model.compile) the whole dispatch is one op, `dspark::expert_dispatch`, opaque to the
compiler as attention is: a step then traces to one graph (its collectives were graph breaks before, cutting a
step into several frames, each checking dynamo's guards), which the runner calls directly (`model/compiled.py`
`DirectCalls`); on CUDA its CUDA graphs are cut around it.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from .state import ParallelState

if TYPE_CHECKING:  # parallel/ never imports the core at run time: the core hands its objects in
    from dspark_cluster.placement import ExpertPlacement


def _all_to_all(state: ParallelState, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    row = x.element_size() * (x.shape[1:].numel() if x.dim() > 1 else 1)
    state.stats.add("all_to_all", row * (sum(send_counts) - send_counts[state.rank]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=state.ep_group)
    return out


def _all_to_all_equal(state: ParallelState, x: torch.Tensor) -> torch.Tensor:
    """x [world * C, ...]: block r goes to rank r; returns the blocks received, in rank order."""
    out = torch.empty_like(x)
    row = x.element_size() * (x.shape[1:].numel() if x.dim() > 1 else 1)
    state.stats.add("all_to_all", row * x.shape[0] * (state.world_size - 1) // state.world_size)
    dist.all_to_all_single(out, x.contiguous(), group=state.ep_group)
    return out


# dispatch key -> the dispatcher a compiled op runs (a graph holds the key, a string, not the object)
_DISPATCHES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_keys = itertools.count()


def _expert_dispatch_op(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, real: Optional[torch.Tensor],
                        dispatch_key: str) -> torch.Tensor:
    dispatch = _DISPATCHES[dispatch_key]
    return dispatch.run(dispatch.moe, x, ids, weights, real)


torch.library.custom_op("dspark::expert_dispatch", _expert_dispatch_op, mutates_args=()).register_fake(
    lambda x, ids, weights, real, dispatch_key: x.new_empty(x.shape))


class ExpertParallelDispatch:
    """Callable installed as `moe.dispatch` for MoE layer `layer` of the placement (the MoE module `moe`, whose
    experts it runs). `capacity`: the padded layout's rows per rank pair for the step about to run (0: the exact
    layout); the worker sets it from the StepInput before each forward."""

    def __init__(self, state: ParallelState, placement: "ExpertPlacement", layer: int, moe):
        self.state = state
        self.layer = layer
        self.capacity = 0
        self.placement = placement
        self.moe = moe
        self.dispatch_key = f"ep{next(_keys)}"
        _DISPATCHES[self.dispatch_key] = self

    @property
    def placement(self) -> "ExpertPlacement":
        return self._placement

    @placement.setter
    def placement(self, placement: "ExpertPlacement") -> None:
        self._placement = placement
        self._tables = None  # this layer's log2phy / replica counts, moved to the device on first use

    def _choose_slots(self, experts: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
        """The physical slot of each assignment, on the rows' device (replicas round-robin by salt)."""
        if self._tables is None or self._tables[0].device != experts.device:
            p = self._placement
            self._tables = (p.log2phy[self.layer].to(experts.device), p.replica_count[self.layer].to(experts.device))
        log2phy, count = self._tables
        return log2phy[experts, salt % count[experts]]

    def __call__(self, moe, x, ids, weights, real=None):
        """x [T, H], ids / weights [T, k] -> the routed output [T, H]. real: [T] bool, the real tokens of a compiled
        step padded to its bucket (None: all); a padding token's assignments travel as padding rows (no expert
        computes or counts them) and its routed output is zero."""
        if torch.compiler.is_compiling():  # (one op in the graph; it runs `run`)
            return torch.ops.dspark.expert_dispatch(x, ids, weights, real, self.dispatch_key)
        return self.run(moe, x, ids, weights, real)

    def run(self, moe, x, ids, weights, real=None):
        st = self.state
        T, k = ids.shape
        chunk = -(-T // st.tp_size)
        lo, hi = min(T, st.tp_rank * chunk), min(T, (st.tp_rank + 1) * chunk)
        token_of = torch.arange(lo, hi, device=x.device).repeat_interleave(k)  # [n] token of each assignment
        slots = self._choose_slots(ids[lo:hi].flatten(), token_of)
        spr = self._placement.slots_per_rank
        dest = slots // spr
        local_slot = slots % spr
        pad = None if real is None else ~real[lo:hi].repeat_interleave(k)
        if pad is not None:  # slot n_slots: the padding marker both layouts skip
            local_slot = torch.where(pad, moe.w13.shape[0], local_slot)
        order = torch.argsort(dest, stable=True)
        send_counts_t = torch.bincount(dest, minlength=st.world_size)
        if self.capacity:
            back_rows = self._padded(moe, x, token_of, local_slot, order, dest, send_counts_t)
        else:
            back_rows = self._exact(moe, x, token_of, local_slot, order, send_counts_t)
        w = weights[lo:hi].flatten()[order].to(back_rows.dtype)
        rows = back_rows * w[:, None]
        if pad is not None:  # (a padding row's output is unspecified: a where, not a product, keeps it out)
            rows = torch.where(pad[order][:, None], 0, rows)
        part = torch.zeros(chunk, x.shape[1], dtype=x.dtype, device=x.device)
        part.index_add_(0, token_of[order] - lo, rows)
        if st.tp_size == 1:
            return part[: hi - lo]
        parts = [torch.empty_like(part) for _ in range(st.tp_size)]
        st.stats.add("all_gather", part.numel() * part.element_size() * (st.tp_size - 1))
        dist.all_gather(parts, part, group=st.tp_group)
        return torch.cat(parts)[:T]

    def _exact(self, moe, x, token_of, local_slot, order, send_counts_t):
        """Uneven splits: the counts cross first and are read on the host. Returns each sent row's
        output, in `order`."""
        st = self.state
        recv_counts_t = torch.empty_like(send_counts_t)
        dist.all_to_all_single(recv_counts_t, send_counts_t, group=st.ep_group)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()
        recv_x = _all_to_all(st, x[token_of[order]], send_counts, recv_counts)
        recv_slot = _all_to_all(st, local_slot[order], send_counts, recv_counts)
        ys, moe.last_slot_load = moe.run_local(recv_x, recv_slot)
        return _all_to_all(st, ys, recv_counts, send_counts)  # outputs return to their senders

    def _padded(self, moe, x, token_of, local_slot, order, dest, send_counts_t):
        """Fixed splits of `capacity` rows per rank pair; row i of the block for rank r is the i-th
        assignment this rank sends there. Returns each sent row's output, in `order`."""
        st, C = self.state, self.capacity
        d = dest[order]
        start = torch.cumsum(send_counts_t, 0) - send_counts_t
        idx = d * C + (torch.arange(d.numel(), device=x.device) - start[d])  # row in the [world * C] buffer
        send_x = x.new_zeros(st.world_size * C, x.shape[1]).index_copy_(0, idx, x[token_of[order]])
        n_slots = moe.w13.shape[0]
        send_slot = torch.full((st.world_size * C,), n_slots, dtype=torch.long, device=x.device)
        send_slot.index_copy_(0, idx, local_slot[order])  # padding: slot n_slots, which no expert computes
        recv_x, recv_slot = _all_to_all_equal(st, send_x), _all_to_all_equal(st, send_slot)
        ys, moe.last_slot_load = moe.run_local(recv_x, recv_slot)
        back = _all_to_all_equal(st, ys)
        return back.index_select(0, idx)
