"""Expert weight migration for a new placement, between steps.

Every rank derives the same transfer plan from the old and new phy2log. A slot whose expert the
rank already holds is filled from its own weights at commit; any other slot receives the expert's
weights from a rank that holds it. The transfers run on the worker's step thread, after a step's
forward and before the next step, over the expert-parallel group: every rank gets the same steps,
so every rank issues the same point-to-point batch at the same point among the step's collectives
(nothing runs beside a collective, which on NCCL could deadlock). A large plan is spread over
several steps (`MIGRATION_BYTES_PER_STEP` a step), so a step is held up by at most that much
traffic; steps keep serving with the old placement meanwhile. Only the received experts are staged;
`commit()` moves the local ones within the expert tensors and writes the received ones in, in place,
at a step boundary once every rank has finished (the router sends the commit in a later StepInput).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .state import ParallelState

if TYPE_CHECKING:  # parallel/ never imports the core at run time: the core hands its objects in
    from dspark_cluster.placement import ExpertPlacement

# the experts' bytes (over all ranks) one step's transfers move at most (at least one expert a step)
MIGRATION_BYTES_PER_STEP = 256 * 2**20


def plan_transfers(old: torch.Tensor, new: torch.Tensor, slots_per_rank: int) -> list[tuple[int, int, int, int]]:
    """old, new [L, S] phy2log -> [(layer, dst_slot, src_rank, src_slot)] for the slots that need
    weights from another rank. The source is the holder that has sent the least so far."""
    L, S = new.shape
    num_ranks = S // slots_per_rank
    sent = [0] * num_ranks
    plan = []
    for layer in range(L):
        holders: dict[int, list[int]] = {}
        for slot, e in enumerate(old[layer].tolist()):
            holders.setdefault(e, []).append(slot)
        for slot, e in enumerate(new[layer].tolist()):
            rank = slot // slots_per_rank
            if any(h // slots_per_rank == rank for h in holders[e]):
                continue  # a local copy
            src_slot = min(holders[e], key=lambda h: sent[h // slots_per_rank])
            sent[src_slot // slots_per_rank] += 1
            plan.append((layer, slot, src_slot // slots_per_rank, src_slot))
    return plan


def _expert_bytes(moe) -> int:
    return sum(w[0].numel() * w.element_size() for w in (moe.w13, moe.w2))


class Migration:
    """One placement change on one rank. `advance()` after each step (every rank, the same steps)
    runs that step's share of the transfers; `done()` once all have run; `commit()` switches."""

    def __init__(self, state: ParallelState, moe_layers, old: "ExpertPlacement", new: "ExpertPlacement", group=None,
                 bytes_per_step: int = MIGRATION_BYTES_PER_STEP):
        if old.slots_per_rank != new.slots_per_rank:
            raise ValueError(f"a migration keeps the slots per rank: {old.slots_per_rank} -> {new.slots_per_rank}")
        self.state, self.moe_layers, self.old, self.new = state, moe_layers, old, new
        self.group = group if group is not None else state.ep_group
        self.plan = plan_transfers(old.phy2log, new.phy2log, new.slots_per_rank)
        # the plan in steps: consecutive entries up to bytes_per_step (the same split on every rank)
        self._chunks: deque = deque()
        chunk, size = [], 0
        for n, entry in enumerate(self.plan):
            b = _expert_bytes(moe_layers[entry[0]])
            if chunk and size + b > bytes_per_step:
                self._chunks.append(chunk)
                chunk, size = [], 0
            chunk.append((n, entry))
            size += b
        if chunk:
            self._chunks.append(chunk)
        self.received: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (layer, local slot) -> w13, w2
        self.bytes_sent = 0
        self.staged_bytes = 0  # the received experts held until commit
        self.peak_staged_bytes = 0  # and, at commit, the local experts that change slot (copied once)

    def advance(self) -> None:
        """This step's transfers (collective over the group: every rank calls it after the same step)."""
        if not self._chunks:
            return
        spr, rank = self.new.slots_per_rank, self.state.rank
        ops = []
        for n, (layer, dst_slot, src_rank, src_slot) in self._chunks.popleft():
            dst_rank = dst_slot // spr
            moe = self.moe_layers[layer]
            if src_rank == rank:  # the old weights stay untouched until commit: send them as they are
                for k, w in enumerate((moe.w13, moe.w2)):
                    t = w[src_slot % spr].contiguous()
                    ops.append(dist.P2POp(dist.isend, t, dst_rank, self.group, tag=2 * n + k))
                    self.bytes_sent += t.numel() * t.element_size()
            elif dst_rank == rank:
                bufs = tuple(torch.empty(w.shape[1:], dtype=w.dtype, device=w.device) for w in (moe.w13, moe.w2))
                self.received[(layer, dst_slot % spr)] = bufs
                self.staged_bytes += _expert_bytes(moe)
                for k, buf in enumerate(bufs):
                    ops.append(dist.P2POp(dist.irecv, buf, src_rank, self.group, tag=2 * n + k))
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)
        if ops:
            try:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            except Exception as e:  # noqa: BLE001 -- name what failed; the old placement stays in use
                raise RuntimeError(f"expert migration failed on rank {rank}: {e}") from e

    def done(self) -> bool:
        return not self._chunks

    @torch.no_grad()
    def commit(self, dispatchers) -> None:
        """Switch weights and mapping (call between steps, after every rank is done), in place: the
        expert tensors keep their storage."""
        if not self.done():
            raise RuntimeError("expert migration: commit before every transfer ran")
        rank = self.state.rank
        for layer, moe in enumerate(self.moe_layers):
            old_ids, new_ids = self.old.rank_experts(layer, rank), self.new.rank_experts(layer, rank)
            dst, src = [], []
            for i, e in enumerate(new_ids):
                if (layer, i) in self.received:
                    continue
                if e not in old_ids:
                    raise RuntimeError(f"expert migration: layer {layer} slot {i} (expert {e}) has no source here")
                j = i if i < len(old_ids) and old_ids[i] == e else old_ids.index(e)
                if j != i:
                    dst.append(i)
                    src.append(j)
            for w in (moe.w13, moe.w2):  # the moving rows are copied before any is written: a permutation in place
                rows = [w[j].clone() for j in src]
                for i, row in zip(dst, rows):
                    w[i].copy_(row)
            if dst:
                self.peak_staged_bytes = max(self.peak_staged_bytes,
                                             self.staged_bytes + len(dst) * max(moe.w13[0].nbytes, moe.w2[0].nbytes))
            for i in range(len(new_ids)):
                if (layer, i) in self.received:
                    w13, w2 = self.received.pop((layer, i))
                    moe.w13[i].copy_(w13)
                    moe.w2[i].copy_(w2)
                    self.staged_bytes -= w13.nbytes + w2.nbytes
            moe.set_expert_ids(new_ids)
        for d in dispatchers:
            d.placement = self.new
