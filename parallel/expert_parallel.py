"""Expert-parallel MoE: dispatch tokens to the ranks holding their experts, combine the results.

Per MoE layer, on every rank (gating already ran on every rank over the full token set):
  1. this rank takes its share of the tokens: ranks of one TP group hold the same tokens, so
     TP rank i takes chunk i;
  2. each (token, expert) assignment goes to a physical slot (replicas round-robin) and so to a
     rank; `all_to_all_single` with uneven splits sends the hidden states and slot ids there;
  3. each rank runs its experts over what it received, grouped per slot;
  4. the inverse all-to-all brings the outputs back, and a weighted sum combines each token's k;
  5. an all-gather over the TP group restores the full token set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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


class ExpertParallelDispatch:
    """Callable installed as `MoE.dispatch` for MoE layer `layer` of the placement."""

    def __init__(self, state: ParallelState, placement: "ExpertPlacement", layer: int):
        self.state = state
        self.placement = placement
        self.layer = layer

    def __call__(self, moe, x, ids, weights):
        st = self.state
        T, k = ids.shape
        chunk = -(-T // st.tp_size)
        lo, hi = min(T, st.tp_rank * chunk), min(T, (st.tp_rank + 1) * chunk)
        token_of = torch.arange(lo, hi, device=x.device).repeat_interleave(k)  # [n] token of each assignment
        experts = ids[lo:hi].flatten()
        slots = self.placement.choose_slots(self.layer, experts.cpu(), token_of.cpu()).to(x.device)
        spr = self.placement.slots_per_rank
        dest = slots // spr
        order = torch.argsort(dest, stable=True)
        send_counts_t = torch.bincount(dest, minlength=st.world_size)
        recv_counts_t = torch.empty_like(send_counts_t)
        dist.all_to_all_single(recv_counts_t, send_counts_t, group=st.ep_group)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()
        recv_x = _all_to_all(st, x[token_of[order]], send_counts, recv_counts)
        recv_slot = _all_to_all(st, (slots[order] % spr), send_counts, recv_counts)
        ys, moe.last_slot_load = moe.run_local(recv_x, recv_slot)
        back = _all_to_all(st, ys, recv_counts, send_counts)  # outputs return to their senders
        w = weights[lo:hi].flatten()[order].to(back.dtype)
        part = torch.zeros(chunk, x.shape[1], dtype=x.dtype, device=x.device)
        part.index_add_(0, token_of[order] - lo, back * w[:, None])
        if st.tp_size == 1:
            return part[: hi - lo]
        parts = [torch.empty_like(part) for _ in range(st.tp_size)]
        st.stats.add("all_gather", part.numel() * part.element_size() * (st.tp_size - 1))
        dist.all_gather(parts, part, group=st.tp_group)
        return torch.cat(parts)[:T]
