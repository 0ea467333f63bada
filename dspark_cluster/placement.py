"""Expert placement: logical expert -> physical slot -> rank, per MoE layer.

Slots are numbered rank after rank: rank r holds slots [r * S/R, (r + 1) * S/R). Redundant slots
hold extra replicas of (hot) experts; tokens of a replicated expert are spread over its replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertPlacement:
    phy2log: torch.Tensor  # [L, num_slots] logical expert held by each slot
    log2phy: torch.Tensor  # [L, E, max_replicas] slots of each expert, -1 padded
    replica_count: torch.Tensor  # [L, E]
    num_ranks: int

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    def rank_experts(self, layer: int, rank: int) -> list[int]:
        """Logical experts held by `rank`'s slots in `layer`, in slot order."""
        s = self.slots_per_rank
        return self.phy2log[layer, rank * s : (rank + 1) * s].tolist()

    def choose_slots(self, layer: int, experts: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
        """Physical slot for each (token, expert) assignment: replicas taken round-robin by `salt`
        (e.g. the token index), so a replicated expert's tokens split evenly. experts, salt [N]."""
        count = self.replica_count[layer][experts]
        replica = salt % count
        return self.log2phy[layer][experts, replica]


def placement_from_phy2log(phy2log: torch.Tensor, num_experts: int, num_ranks: int) -> ExpertPlacement:
    """Build the inverse maps from phy2log [L, num_slots]."""
    phy2log = phy2log.long()
    L, S = phy2log.shape
    if S % num_ranks:
        raise ValueError(f"{S} expert slots do not split over {num_ranks} ranks")
    replica_count = torch.zeros(L, num_experts, dtype=torch.long)
    replica_count.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    if (replica_count == 0).any():
        raise ValueError("every logical expert needs at least one slot")
    max_rep = int(replica_count.max())
    log2phy = torch.full((L, num_experts, max_rep), -1, dtype=torch.long)
    for layer in range(L):
        seen = [0] * num_experts
        for slot, e in enumerate(phy2log[layer].tolist()):
            log2phy[layer, e, seen[e]] = slot
            seen[e] += 1
    return ExpertPlacement(phy2log, log2phy, replica_count, num_ranks)


def default_placement(num_layers: int, num_experts: int, num_ranks: int, num_redundant: int = 0) -> ExpertPlacement:
    """Slot s holds expert s mod E: experts in order, contiguous per rank, and the redundant slots
    replicate experts 0, 1, ... (never twice on one rank while a rank has at most E slots).
    EPLB later moves the replicas to where the load is."""
    slots = torch.arange(num_experts + num_redundant) % num_experts
    return placement_from_phy2log(slots.repeat(num_layers, 1), num_experts, num_ranks)
