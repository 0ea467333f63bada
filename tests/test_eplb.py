"""EPLB policy (dspark_cluster/eplb.py, eplb_packing.py): hand-checked cases, properties on seeded random and Zipf
loads for both policies, DeepSeek EPLB's README example, and the refinement against plain greedy."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from dspark_cluster import eplb_packing
from dspark_cluster.eplb import balancedness, imbalance, rank_load, rebalance

# DeepSeek EPLB README example: weight, 16 physical experts, 4 groups, 2 nodes, 8 GPUs, and the
# phy2log their README prints for it.
README_WEIGHT = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PHY2LOG = torch.tensor(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)


def contiguous(num_layers: int, num_experts: int, num_slots: int) -> torch.Tensor:
    """Slot s holds expert s mod E: experts in order, contiguous per rank (no rebalancing)."""
    return (torch.arange(num_slots) % num_experts).repeat(num_layers, 1)


def peak(load, phy2log, num_ranks) -> torch.Tensor:
    return rank_load(load, phy2log, num_ranks).max(-1).values


def zipf_load(num_layers, num_experts, exponent, seed, tokens=20000) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, num_experts + 1) ** exponent
    p /= p.sum()
    return torch.from_numpy(
        np.stack([rng.multinomial(tokens, p[rng.permutation(num_experts)]) for _ in range(num_layers)])
    )


def uniform_load(num_layers, num_experts, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(num_layers, num_experts, generator=g, dtype=torch.float64) * 100


def check_placement(load, out, num_slots, num_groups, num_nodes, num_ranks, policy):
    """Structural properties every placement must have."""
    phy2log, log2phy, count = out
    L, E = load.shape
    assert phy2log.dtype == log2phy.dtype == count.dtype == torch.long
    assert phy2log.shape == (L, num_slots)
    assert log2phy.shape[:2] == (L, E) and count.shape == (L, E)
    assert ((phy2log >= 0) & (phy2log < E)).all()
    # every expert keeps at least one replica; counts add up to the slots
    assert (count >= 1).all() and (count.sum(1) == num_slots).all()
    per_rank = phy2log.view(L, num_ranks, num_slots // num_ranks)  # exactly S/R slots per rank
    for layer in range(L):
        for r in range(num_ranks):
            experts = per_rank[layer, r].tolist()
            assert len(set(experts)) == len(experts), f"layer {layer} rank {r} holds an expert twice: {experts}"
    # log2phy / replica_count agree with phy2log
    for layer in range(L):
        for e in range(E):
            slots = torch.nonzero(phy2log[layer] == e).flatten()
            assert count[layer, e] == slots.numel()
            assert log2phy[layer, e, : slots.numel()].tolist() == slots.tolist()
            assert (log2phy[layer, e, slots.numel() :] == -1).all()
    if policy == "hierarchical":  # each group's replicas all on one node
        node = torch.arange(num_slots) // (num_slots // num_nodes)
        group = phy2log // (E // num_groups)
        for layer in range(L):
            for g in range(num_groups):
                assert node[group[layer] == g].unique().numel() == 1


# --------------------------------------------------------------------------------------------
# Hand-checked cases


def test_metrics_by_hand():
    load = torch.tensor([[10, 7, 1, 4]])
    p = torch.tensor([[0, 1, 2, 3]])
    assert rank_load(load, p, 2).tolist() == [[17.0, 5.0]]
    assert balancedness(load, p, 2).item() == pytest.approx(11 / 17)
    assert imbalance(load, p, 2).item() == pytest.approx(6 / 11)
    # a replicated expert's load is split evenly over its replicas
    assert rank_load(torch.tensor([[10, 2, 4]]), torch.tensor([[0, 1, 0, 2]]), 2).tolist() == [[7.0, 9.0]]
    # an idle layer counts as balanced
    assert balancedness(torch.zeros(1, 4), p, 2).item() == 1.0 and imbalance(torch.zeros(1, 4), p, 2).item() == 0.0
    with pytest.raises(ValueError):
        rank_load(load, torch.tensor([[0, 1, 2, 2]]), 2)  # expert 3 has load but no slot


def test_no_redundancy_greedy_by_hand():
    # sorted 10, 7, 4, 1: 10 -> r0, 7 -> r1, 4 -> r1 (lighter), 1 -> r0 (r1 full): 11 / 11
    load = torch.tensor([[10, 7, 1, 4]])
    for policy in ("global", "auto"):  # one group on one node: auto is hierarchical, same result
        phy2log, log2phy, count = rebalance(load, 4, 1, 1, 2, policy)
        assert phy2log.tolist() == [[0, 2, 1, 3]]
        assert log2phy.tolist() == [[[0], [2], [1], [3]]]
        assert count.tolist() == [[1, 1, 1, 1]]
        assert rank_load(load, phy2log, 2).tolist() == [[11.0, 11.0]]
    # two groups on two nodes of one rank each: the groups {0, 1} and {2, 3} cannot be split
    phy2log, _, _ = rebalance(load, 4, 2, 2, 2, "hierarchical")
    assert sorted(rank_load(load, phy2log, 2)[0].tolist()) == [5.0, 17.0]
    assert torch.equal(phy2log, rebalance(load, 4, 2, 2, 2)[0])  # auto: 2 groups % 2 nodes == 0


def test_redundant_slots_replicate_hottest_by_hand():
    # 2 redundant slots: 10 -> 2 x 5, then 7 -> 2 x 3.5; packed 12.5 / 9.5 (optimal: both ranks
    # need one replica of experts 0 and 1, and 4 and 1 cannot go together)
    load = torch.tensor([[10, 7, 1, 4]])
    phy2log, log2phy, count = rebalance(load, 6, 1, 1, 2, "global")
    assert count.tolist() == [[2, 2, 1, 1]]
    assert sorted(rank_load(load, phy2log, 2)[0].tolist()) == [9.5, 12.5]
    for r in range(2):
        assert {0, 1} <= set(phy2log[0, 3 * r : 3 * r + 3].tolist())
    check_placement(load, (phy2log, log2phy, count), 6, 1, 1, 2, "global")
    # one very hot expert: replicated, but at most once per rank (2 ranks), the rest spread evenly
    load = torch.tensor([[100, 1, 1, 1]])
    phy2log, _, count = rebalance(load, 6, 1, 1, 2, "global")
    assert count[0, 0] == 2 and count.sum() == 6
    assert rank_load(load, phy2log, 2).tolist() == [[51.5, 51.5]]


def test_invalid_inputs():
    load = torch.ones(2, 8)
    with pytest.raises(ValueError, match="two replicas"):
        rebalance(torch.ones(1, 2), 6, 1, 1, 2, "global")  # 3 slots per rank, 2 experts
    with pytest.raises(ValueError, match="two replicas"):
        rebalance(load, 24, 2, 2, 2, "hierarchical")  # 6 slots per rank, 4 experts per node
    with pytest.raises(ValueError):
        rebalance(load, 6, 1, 1, 2)  # fewer slots than experts
    with pytest.raises(ValueError):
        rebalance(load, 10, 1, 1, 4)  # 10 slots over 4 ranks
    with pytest.raises(ValueError):
        rebalance(load, 8, 1, 3, 4)  # 4 ranks over 3 nodes
    with pytest.raises(ValueError):
        rebalance(load, 8, 3, 1, 4)  # 8 experts in 3 groups
    with pytest.raises(ValueError, match="hierarchical"):
        rebalance(load, 8, 2, 4, 4, "hierarchical")  # 2 groups on 4 nodes
    with pytest.raises(ValueError, match="policy"):
        rebalance(load, 8, 1, 1, 4, "fancy")
    with pytest.raises(ValueError):
        rebalance(-load, 8, 1, 1, 4)
    with pytest.raises(ValueError):
        rebalance(torch.ones(8), 8, 1, 1, 4)  # not [L, E]


def test_unstick_moves_a_replica_when_every_open_rank_holds_the_expert(monkeypatch):
    # greedy fills ranks 1 and 2 with the 10s and 5s while rank 0 carries the 100; the two
    # replicas of expert 7 then find only rank 0 open: one replica must move out of a full rank
    calls = []
    real = eplb_packing._unstick
    monkeypatch.setattr(eplb_packing, "_unstick", lambda *a: (calls.append(1), real(*a))[1])
    w = np.array([[100, 10, 10, 10, 10, 5, 5, 1, 1.0]])
    items = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 7]])
    bins = eplb_packing._greedy_pack(w, items, 8, 3)
    assert calls
    assert np.bincount(bins[0], minlength=3).tolist() == [3, 3, 3]
    for b in range(3):
        held = items[0][bins[0] == b]
        assert len(set(held.tolist())) == held.size


# --------------------------------------------------------------------------------------------
# Properties on seeded random loads

# (E, num_slots, num_groups, num_nodes, num_ranks)
SHAPES = [
    (16, 16, 4, 2, 4),
    (16, 20, 4, 2, 4),
    (32, 40, 8, 4, 8),
    (32, 48, 4, 2, 8),
    (12, 24, 4, 2, 4),  # heavy redundancy: replica caps bind
    (64, 72, 8, 2, 8),
]


@pytest.mark.parametrize("policy", ["global", "hierarchical"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}-S{}-G{}-N{}-R{}".format(*s))
def test_properties_on_random_loads(policy, shape):
    E, S, G, N, R = shape
    loads = [uniform_load(3, E, 0), zipf_load(3, E, 1.0, 1), zipf_load(3, E, 1.5, 2), torch.zeros(1, E)]
    for load in loads:
        out = rebalance(load, S, G, N, R, policy)
        check_placement(load, out, S, G, N, R, policy)
        ours = peak(load, out[0], R)
        # never worse than the unreplicated contiguous placement (experts in order, E/R per rank),
        # with replicas or without
        assert (ours <= peak(load, contiguous(load.shape[0], E, E), R) * (1 + 1e-9)).all()
        if policy == "global":  # ... nor than the contiguous one with the redundant slots in order
            assert (ours <= peak(load, contiguous(load.shape[0], E, S), R) * (1 + 1e-9)).all()
        if S > E and load.sum() > 0:  # redundancy pays on skewed loads
            assert (ours < peak(load, contiguous(load.shape[0], E, E), R)).any()


@pytest.mark.parametrize("policy", ["global", "hierarchical"])
def test_int_and_float_loads_agree_and_auto_picks_policy(policy):
    load = zipf_load(4, 32, 1.2, 3)
    a = rebalance(load, 40, 8, 4, 8, policy)
    b = rebalance(load.double(), 40, 8, 4, 8, policy)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # auto: hierarchical when groups % nodes == 0 (8 groups on 4 nodes), else global (on 3 nodes)
    args = (40, 8, 4, 8) if policy == "hierarchical" else (48, 8, 3, 6)
    auto, explicit = rebalance(load, *args), rebalance(load, *args, policy)
    assert all(torch.equal(x, y) for x, y in zip(auto, explicit))


# --------------------------------------------------------------------------------------------
# DeepSeek EPLB README example


def test_readme_example_at_least_as_balanced_as_deepseek():
    theirs = balancedness(README_WEIGHT, README_PHY2LOG, 8)
    assert theirs.tolist() == pytest.approx([0.8277, 0.8050], abs=1e-4)
    for policy in ("hierarchical", "global"):
        out = rebalance(README_WEIGHT, 16, 4, 2, 8, policy)
        check_placement(README_WEIGHT, out, 16, 4, 2, 8, policy)
        ours = balancedness(README_WEIGHT, out[0], 8)
        print(f"README example, {policy}: ours {ours.tolist()} vs DeepSeek {theirs.tolist()}")
        assert (ours >= theirs - 1e-12).all(), (policy, ours, theirs)
    # auto = hierarchical here (4 groups % 2 nodes == 0)
    assert torch.equal(
        rebalance(README_WEIGHT, 16, 4, 2, 8)[0], rebalance(README_WEIGHT, 16, 4, 2, 8, "hierarchical")[0]
    )


# --------------------------------------------------------------------------------------------
# Refinement against plain greedy


def test_refinement_never_worse_than_greedy_and_sometimes_better():
    improved = 0
    for seed, (E, S, G, N, R) in enumerate(SHAPES * 2):
        load = zipf_load(4, E, 0.8 + 0.2 * (seed % 4), 100 + seed)
        for policy in ("global", "hierarchical"):
            greedy = peak(load, rebalance(load, S, G, N, R, policy, refine=False)[0], R)
            refined = peak(load, rebalance(load, S, G, N, R, policy)[0], R)
            assert (refined <= greedy * (1 + 1e-9)).all(), (seed, policy, refined, greedy)
            improved += int((refined < greedy * (1 - 1e-9)).sum())
    assert improved > 0


def test_deepseek_v3_scale_is_fast_and_valid():
    L, E, S, G, N, R = 58, 256, 288, 8, 8, 32
    load = zipf_load(L, E, 1.0, 7, tokens=8 * 65536)
    for policy in ("global", "hierarchical"):
        t = time.perf_counter()
        phy2log, _, count = rebalance(load, S, G, N, R, policy)
        elapsed = time.perf_counter() - t
        assert elapsed < 10, f"{policy}: {elapsed:.1f} s per call"
        per_rank = phy2log.view(L, R, S // R).sort(-1).values
        assert not (per_rank[..., 1:] == per_rank[..., :-1]).any()
        assert (count >= 1).all()
        assert (balancedness(load, phy2log, R) > balancedness(load, contiguous(L, E, S), R)).all()


# ---------------------------------------------------------------------------------------- migration

class _ExpertTable:
    """What Migration moves on a rank: an MoE layer's stacked expert weights and their expert ids."""

    def __init__(self, layer: int, expert_ids):
        self.w13 = torch.stack([_expert_weight(layer, e, (4, 3)) for e in expert_ids])
        self.w2 = torch.stack([_expert_weight(layer, e, (3, 2)) for e in expert_ids])
        self.expert_ids = list(expert_ids)

    def set_expert_ids(self, expert_ids):
        self.expert_ids = list(expert_ids)


def _expert_weight(layer: int, expert: int, shape) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).view(shape) + 1000 * layer + 100 * expert


def _migration_rank(rank, world, port, old, new, out_dir):
    """One rank of a gloo world: migrate from `old` to `new` one expert per step (the budget is one
    byte), as a worker would between its steps, with an all-reduce standing in for each step's
    collectives; write what it saw."""
    import torch.distributed as dist

    from dspark_cluster.placement import placement_from_phy2log
    from parallel.migration import Migration
    from parallel.state import ParallelState, join_rendezvous

    dist.init_process_group("gloo", store=join_rendezvous("127.0.0.1", port), rank=rank, world_size=world)
    try:
        E = int(old.max()) + 1
        old_p, new_p = placement_from_phy2log(old, E, world), placement_from_phy2log(new, E, world)
        layers = [_ExpertTable(layer, old_p.rank_experts(layer, rank)) for layer in range(old.shape[0])]
        before = [(t.w13.clone(), t.w2.clone(), t.w13.data_ptr()) for t in layers]
        state = ParallelState(rank, world, 1, 0, rank, None, dist.group.WORLD, [rank], torch.device("cpu"))

        class Dispatch:
            placement = old_p

        d = Dispatch()
        m = Migration(state, layers, old_p, new_p, bytes_per_step=1)
        steps = 0
        while not m.done():
            x = torch.ones(1)
            dist.all_reduce(x)  # the step's collectives, then its share of the transfers
            m.advance()
            steps += 1
        unchanged = all(torch.equal(t.w13, b[0]) and torch.equal(t.w2, b[1]) for t, b in zip(layers, before))
        staged = m.staged_bytes
        m.commit([d])
        torch.save({"steps": steps, "plan": len(m.plan), "unchanged_before_commit": unchanged, "staged": staged,
                    "peak": m.peak_staged_bytes, "sent": m.bytes_sent, "ids": [t.expert_ids for t in layers],
                    "w13": [t.w13 for t in layers], "w2": [t.w2 for t in layers],
                    "in_place": all(t.w13.data_ptr() == b[2] for t, b in zip(layers, before)),
                    "dispatch_new": d.placement is new_p}, f"{out_dir}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_migration_moves_experts_between_steps_and_stages_only_received_ones(tmp_path):
    """Three gloo ranks, two slots each, two layers: every rank runs the transfers after its steps
    (one expert a step), keeps serving the old weights until commit, stages only the experts it
    receives, and commits in place to exactly the new placement's experts."""
    import torch.multiprocessing as mp

    from parallel.migration import plan_transfers
    from parallel.state import open_rendezvous

    old = torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]])
    # layer 0: rank 0 swaps its experts locally and rank 2 receives 3; layer 1: transfers both ways
    new = torch.tensor([[1, 0, 2, 3, 0, 3], [3, 1, 0, 2, 1, 2]])
    plan = plan_transfers(old, new, 2)
    world = 3
    rendezvous = open_rendezvous()
    mp.spawn(_migration_rank, args=(world, rendezvous.port, old, new, str(tmp_path)), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    expert_bytes = (4 * 3 + 3 * 2) * 4
    for rank, res in enumerate(results):
        assert res["steps"] == len(plan) == res["plan"]  # one transfer a step, the same steps on every rank
        assert res["unchanged_before_commit"] and res["in_place"] and res["dispatch_new"]
        received = sum(1 for _, dst, _, _ in plan if dst // 2 == rank)
        assert res["staged"] == received * expert_bytes  # only what it receives, not every local expert
        assert res["peak"] <= 2 * 2 * expert_bytes
        assert res["sent"] == sum(1 for _, _, src, _ in plan if src == rank) * expert_bytes
        for layer in range(2):
            ids = new[layer, 2 * rank : 2 * rank + 2].tolist()
            assert res["ids"][layer] == ids
            for i, e in enumerate(ids):
                assert torch.equal(res["w13"][layer][i], _expert_weight(layer, e, (4, 3)))
                assert torch.equal(res["w2"][layer][i], _expert_weight(layer, e, (3, 2)))
    assert all(r["staged"] < 2 * 2 * expert_bytes for r in results)  # fewer than its local experts, on every rank
