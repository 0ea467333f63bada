"""Expert weight migration for a new placement, off the step path.

Every rank derives the same transfer plan from the old and new phy2log. A slot whose expert the
rank already holds is filled by a local copy; any other slot receives the expert's weights from a
rank that holds it, over a process group used only for migration, in a background thread, while
steps keep running on the old placement. `commit()` swaps the new weights and mapping in at a
step boundary, once every rank has finished (the router sends the commit in a later StepInput).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from dspark_cluster.placement import ExpertPlacement

from .state import ParallelState


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


class Migration:
    """One placement change on one rank: staging weights filled locally and by P2P receives."""

    def __init__(self, state: ParallelState, group, moe_layers, old: ExpertPlacement, new: ExpertPlacement):
        self.state, self.group, self.moe_layers, self.old, self.new = state, group, moe_layers, old, new
        spr, rank = new.slots_per_rank, state.rank
        self.staging = []
        for layer, moe in enumerate(moe_layers):
            w13 = torch.empty_like(moe.w13)
            w2 = torch.empty_like(moe.w2)
            mine_old = old.rank_experts(layer, rank)
            for i, e in enumerate(new.rank_experts(layer, rank)):
                if e in mine_old:
                    j = mine_old.index(e)
                    w13[i].copy_(moe.w13[j])
                    w2[i].copy_(moe.w2[j])
            self.staging.append((w13, w2))
        self.plan = plan_transfers(old.phy2log, new.phy2log, spr)
        self.bytes_sent = 0
        self.error = None
        self._thread = threading.Thread(target=self._transfer, daemon=True)
        self._thread.start()

    def _transfer(self) -> None:
        try:
            spr, rank = self.new.slots_per_rank, self.state.rank
            ops = []
            for n, (layer, dst_slot, src_rank, src_slot) in enumerate(self.plan):
                dst_rank = dst_slot // spr
                moe = self.moe_layers[layer]
                if src_rank == rank:
                    for k, w in enumerate((moe.w13, moe.w2)):
                        t = w[src_slot % spr].contiguous()
                        ops.append(dist.P2POp(dist.isend, t, dst_rank, self.group, tag=2 * n + k))
                        self.bytes_sent += t.numel() * t.element_size()
                elif dst_rank == rank:
                    for k, w in enumerate(self.staging[layer]):
                        ops.append(dist.P2POp(dist.irecv, w[dst_slot % spr], src_rank, self.group, tag=2 * n + k))
            for req in (dist.batch_isend_irecv(ops) if ops else []):
                req.wait()
        except BaseException as e:  # surfaced by done()/commit(); the old placement stays in use
            self.error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def commit(self, dispatchers) -> None:
        """Switch weights and mapping atomically (call between steps, after every rank is done)."""
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"expert migration failed: {self.error}") from self.error
        for layer, (moe, (w13, w2)) in enumerate(zip(self.moe_layers, self.staging)):
            moe.w13.data = w13
            moe.w2.data = w2
            moe.set_expert_ids(self.new.rank_experts(layer, self.state.rank))
        for d in dispatchers:
            d.placement = self.new
