"""Expert-parallel load balancing (EPLB): the policy that decides where each expert's replicas go.

Pure functions on CPU tensors, no process groups and no state; the mechanism (moving expert weights
between workers, swapping the placement in while requests keep flowing) lives elsewhere. Layers are
independent. Shapes: L layers, E logical experts, S physical slots (E + redundant), R ranks,
N nodes, G expert groups. Slots are numbered rank after rank: rank r holds slots
[r * S/R, (r + 1) * S/R); node n holds ranks [n * R/N, (n + 1) * R/N).

    phy2log, log2phy, replica_count = rebalance(load, num_slots, num_groups, num_nodes, num_ranks)

Policy (after DeepSeek's open-source EPLB, with two changes: never two replicas of one expert on
one rank, and refinement after the greedy steps):

1. Replication: the S - E redundant slots go one at a time to the expert with the highest load per
   replica (load / replica count), among experts that have fewer replicas than there are ranks to
   hold them (a rank never holds two replicas of one expert, so more would be useless).
2. Packing: each replica carries load / replica_count of its expert. Replicas sorted heaviest first,
   each goes to the lightest rank that still has a free slot and does not hold that expert yet
   (ranks hold exactly S/R slots). Should no rank qualify, one replica is first moved from a full
   rank to a rank with room (always possible, see `_unstick`).
3. Refinement (refine=True, the default), each step only ever accepting a strictly lighter
   busiest rank, so never worse than the greedy placement of 1-2:
   a. swaps: repeatedly swap a replica of the heaviest rank with a lighter replica of another rank,
      taking the swap that leaves the pair's heavier side lightest, while that is lighter than
      the heaviest rank was (slot counts and the no-duplicate rule kept), a bounded number of times;
   b. replica counts: with one replica per rank at most, water-filling can force two hot experts
      onto one rank (their replica counts add up to more than the ranks); moving one or two
      replicas between experts of the busiest rank and the others, re-packed, often fixes that
      (`_search_counts`).

"global" runs 1-3 over all slots and ranks. "hierarchical" (DeepSeek-V3's group-limited routing)
first packs whole expert groups onto nodes (2 and 3a with groups as items and nodes as bins, so
that node loads are balanced, then swaps of groups between nodes scored by the busiest rank they
lead to, `_search_groups`), then runs 1-3 inside each node with its S/N slots and R/N ranks, so
every expert's replicas stay on the node of its group. "auto" is hierarchical when G % N == 0.

Per layer the best (lightest busiest rank) of these candidates is kept: the placements from the
greedy, refined and searched group packings, and the contiguous placement (slot s holds expert
s mod E) when it obeys the policy's rules, so `rebalance` is never worse than not rebalancing.

Here: the metrics, the checks, the policies' outline and the choice per layer; the replication,
packing, refinement and searches of 1-3 are in `eplb_packing.py` (numpy, row-vectorised).

Cost at DeepSeek-V3 scale (58 layers, 256 experts, 288-320 slots, 32-64 ranks): well under a
second per call on one CPU core (see BENCHMARKS.md).
"""

from __future__ import annotations

import numpy as np
import torch

from .eplb_packing import _greedy_pack, _obeys, _refine, _replicate_and_pack, _search_groups
from .placement import placement_from_phy2log

POLICIES = ("auto", "global", "hierarchical")


# --------------------------------------------------------------------------------------------
# Metrics


def rank_load(load: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Tokens per rank: load [L, E], phy2log [L, S] -> [L, R] float64, each expert's load split
    evenly over its replicas. Raises ValueError when an expert with load has no slot."""
    load = _as_load(load)
    phy2log = torch.as_tensor(phy2log).long()
    L, E = load.shape
    if phy2log.dim() != 2 or phy2log.shape[0] != L:
        raise ValueError(f"phy2log must be [L={L}, num_slots], got {tuple(phy2log.shape)}")
    S = phy2log.shape[1]
    if num_ranks <= 0 or S % num_ranks:
        raise ValueError(f"{S} slots do not split over {num_ranks} ranks")
    if phy2log.numel() and (phy2log.min() < 0 or phy2log.max() >= E):
        raise ValueError(f"phy2log holds expert ids outside [0, {E})")
    count = torch.zeros(L, E, dtype=torch.float64).scatter_add_(
        1, phy2log, torch.ones_like(phy2log, dtype=torch.float64)
    )
    if ((count == 0) & (load > 0)).any():
        raise ValueError("an expert with load has no slot in phy2log")
    per_replica = load / count.clamp(min=1)
    return per_replica.gather(1, phy2log).view(L, num_ranks, S // num_ranks).sum(-1)


def balancedness(load: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Mean / max tokens per rank for each layer: load [L, E], phy2log [L, S] -> [L] float64 in
    (0, 1], 1 = perfectly balanced (and for a layer without load)."""
    per_rank = rank_load(load, phy2log, num_ranks)
    peak = per_rank.max(-1).values
    return torch.where(peak > 0, per_rank.mean(-1) / peak.clamp(min=1e-300), torch.ones_like(peak))


def imbalance(load: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """(max - mean) / mean tokens per rank for each layer: load [L, E], phy2log [L, S] -> [L]
    float64 >= 0, 0 = perfectly balanced (and for a layer without load)."""
    per_rank = rank_load(load, phy2log, num_ranks)
    mean = per_rank.mean(-1)
    return torch.where(mean > 0, (per_rank.max(-1).values - mean) / mean.clamp(min=1e-300), torch.zeros_like(mean))


# --------------------------------------------------------------------------------------------
# Policy


def rebalance(
    load: torch.Tensor,
    num_slots: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    policy: str = "auto",
    *,
    refine: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """New expert placement from a window of load.

    load [L, E] (float or int): tokens per (layer, logical expert). num_slots: S >= E physical
    slots, divisible by num_ranks. num_groups: G expert groups (DeepSeek-V3 n_group, contiguous
    expert ids, E % G == 0), used by the hierarchical policy. num_nodes: N. num_ranks: R, divisible
    by N. policy: "global", "hierarchical" (needs G % N == 0 and S % N == 0) or "auto"
    (hierarchical when G % N == 0, else global). refine=False skips the refinement (swap pass and
    replica-count search): the plain greedy placement, for comparisons.

    Returns phy2log [L, S] long (logical expert of each slot), log2phy [L, E, max_replicas] long
    (slots of each expert in increasing order, -1 padded) and replica_count [L, E] long.
    Raises ValueError on inconsistent sizes, negative load, or when a rank would have to hold two
    replicas of one expert (more slots per rank than experts to fill them, per node for
    hierarchical).
    """
    return _rebalance(load, num_slots, num_groups, num_nodes, num_ranks, policy, swaps=refine, recount=refine)


def _rebalance(load, num_slots, num_groups, num_nodes, num_ranks, policy="auto", *, swaps=True, recount=True):
    """`rebalance` with the two refinement steps switched separately (for benchmarks)."""
    load = _as_load(load)
    L, E = load.shape
    for name, v in (
        ("num_slots", num_slots),
        ("num_groups", num_groups),
        ("num_nodes", num_nodes),
        ("num_ranks", num_ranks),
    ):
        if isinstance(v, bool) or int(v) != v or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    num_slots, num_groups, num_nodes, num_ranks = int(num_slots), int(num_groups), int(num_nodes), int(num_ranks)
    if L == 0 or E == 0:
        raise ValueError(f"load must have at least one layer and one expert, got shape {tuple(load.shape)}")
    if num_slots < E:
        raise ValueError(f"num_slots={num_slots} < {E} experts: every expert needs a slot")
    if num_slots % num_ranks:
        raise ValueError(f"num_slots={num_slots} does not split over num_ranks={num_ranks}")
    if num_ranks % num_nodes:
        raise ValueError(f"num_ranks={num_ranks} does not split over num_nodes={num_nodes}")
    if E % num_groups:
        raise ValueError(f"{E} experts do not split into num_groups={num_groups} groups")
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}: use one of {POLICIES}")
    if policy == "auto":
        policy = "hierarchical" if num_groups % num_nodes == 0 else "global"

    w = load.numpy()
    if policy == "global":
        if num_slots // num_ranks > E:
            raise ValueError(
                f"{num_slots // num_ranks} slots per rank but {E} experts: a rank would hold two replicas of one expert"
            )
        candidates = [_replicate_and_pack(w, num_slots, num_ranks, swaps, recount)]
    else:
        candidates = _hierarchical(w, num_slots, num_groups, num_nodes, num_ranks, swaps, recount)
    contiguous = np.broadcast_to(np.arange(num_slots) % E, (L, num_slots))
    if _obeys(contiguous, num_ranks, num_nodes, num_groups, E, hierarchical=policy == "hierarchical"):
        candidates.append(contiguous)
    phy2log = _best_per_layer(load, candidates, num_ranks)
    placement = placement_from_phy2log(phy2log, E, num_ranks)
    return placement.phy2log, placement.log2phy, placement.replica_count


def _hierarchical(
    w: np.ndarray, num_slots: int, num_groups: int, num_nodes: int, num_ranks: int, swaps: bool, recount: bool
):
    """Groups -> nodes, then replicate and pack inside each node. w [L, E] float64 -> list of
    candidate phy2log [L, S]: from the greedy group packing and, when refining, from the refined
    one and from a group-swap search on top of it (each where it differs)."""
    L, E = w.shape
    if num_groups % num_nodes:
        raise ValueError(
            f"hierarchical policy needs num_groups % num_nodes == 0, got {num_groups} groups on {num_nodes} nodes"
        )
    if num_slots % num_nodes:
        raise ValueError(f"num_slots={num_slots} does not split over num_nodes={num_nodes}")
    group_size, epn, spn, rpn = E // num_groups, E // num_nodes, num_slots // num_nodes, num_ranks // num_nodes
    if spn // rpn > epn:
        raise ValueError(
            f"{spn // rpn} slots per rank but {epn} experts per node: a rank would hold two replicas of one expert"
        )
    group_load = w.reshape(L, num_groups, group_size).sum(-1)  # [L, G]
    group_ids = np.broadcast_to(np.arange(num_groups), (L, num_groups))
    packings = [_greedy_pack(group_load, group_ids, num_groups, num_nodes)]
    if swaps:
        refined = _refine(group_load, group_ids, packings[0], num_groups, num_nodes)
        searched = _search_groups(w, refined, group_size, num_nodes, spn, rpn)
        for p in (refined, searched):
            if not any(np.array_equal(p, q) for q in packings):
                packings.append(p)
    candidates = []
    for node_of_group in packings:
        groups_by_node = np.lexsort((group_ids, node_of_group), axis=-1)  # [L, G], node after node
        experts = (groups_by_node[..., None] * group_size + np.arange(group_size)).reshape(L * num_nodes, epn)
        node_load = np.take_along_axis(w, experts.reshape(L, E), axis=1).reshape(L * num_nodes, epn)
        layer = np.repeat(np.arange(L), num_nodes)
        local = _replicate_and_pack(node_load, spn, rpn, swaps, recount, layer)  # [L*N, spn], ids in [0, epn)
        candidates.append(np.take_along_axis(experts, local, axis=1).reshape(L, num_slots))
    return candidates


def _best_per_layer(load: torch.Tensor, candidates: list[np.ndarray], num_ranks: int) -> torch.Tensor:
    """Per layer, the candidate phy2log [L, S] with the lightest busiest rank (first on ties)."""
    if len(candidates) == 1:
        return torch.from_numpy(np.ascontiguousarray(candidates[0])).long()
    stack = torch.from_numpy(np.stack([np.ascontiguousarray(c) for c in candidates])).long()  # [C, L, S]
    peaks = torch.stack([rank_load(load, c, num_ranks).max(-1).values for c in stack])  # [C, L]
    best = peaks.argmin(0)  # first minimum: our placement wins ties
    return stack[best, torch.arange(stack.shape[1])]


def _as_load(load) -> torch.Tensor:
    load = torch.as_tensor(load)
    if load.dim() != 2:
        raise ValueError(f"load must be [L, E] tokens per (layer, expert), got shape {tuple(load.shape)}")
    load = load.detach().to("cpu", torch.float64)
    if not torch.isfinite(load).all() or (load < 0).any():
        raise ValueError("load must be finite and non-negative")
    return load
