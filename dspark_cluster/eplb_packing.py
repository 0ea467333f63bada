"""The machinery of the EPLB policy (`eplb.py`): replication, greedy packing, swap refinement and
the local searches over replica counts and over which node holds which group. Numpy on CPU, no
state; vectorised over rows (a row is a layer, or one node of a layer). Shapes: B rows, n experts
of a row, M (or S) entries (replicas) of a row, bins = ranks (or nodes when packing groups), L
layers, E experts, G groups.
"""

from __future__ import annotations

import numpy as np


def _search_groups(
    w: np.ndarray,
    node_of_group: np.ndarray,
    group_size: int,
    num_nodes: int,
    slots_per_node: int,
    ranks_per_node: int,
    max_rounds: int = 8,
) -> np.ndarray:
    """Local search over which node holds which group, on the real objective rather than node load.

    Balanced node loads do not make the busiest rank lightest when a few experts dominate (how a
    node's experts split over its ranks matters too). Each round, per layer: every swap of a group
    on the node with the busiest rank for a group on another node, the two nodes scored by greedy
    replication + packing (no refinement, cheap); the best swap is kept if it lowers the layer's
    busiest rank. w [L, E], node_of_group [L, G] -> [L, G]."""
    L, G = node_of_group.shape
    gpn = G // num_nodes
    if gpn < 2 or num_nodes < 2:
        return node_of_group  # one group per node: swaps only relabel nodes
    arange_g = np.arange(group_size)
    node_of_group = node_of_group.copy()
    group_ids = np.broadcast_to(np.arange(G), (L, G))

    def peaks_of(layers: np.ndarray, groups: np.ndarray) -> np.ndarray:
        """layers [B], groups [B, gpn] -> busiest rank of each such node [B] (greedy)."""
        experts = (groups[..., None] * group_size + arange_g).reshape(len(layers), -1)
        rows = np.take_along_axis(w[layers], experts, axis=1)
        count = _replicate(rows, slots_per_node, ranks_per_node)
        return _pack_counts(rows, count, ranks_per_node, swaps=False)[3]

    for _ in range(max_rounds):
        by_node = np.lexsort((group_ids, node_of_group), axis=-1).reshape(L, num_nodes, gpn)
        peaks = peaks_of(np.repeat(np.arange(L), num_nodes), by_node.reshape(L * num_nodes, gpn)).reshape(L, num_nodes)
        worst = peaks.argmax(1)
        current = peaks.max(1)
        # candidates (layer, other node, slot on the busiest node, slot on the other node)
        li, oi, i1, i2 = (
            a.reshape(-1)
            for a in np.meshgrid(np.arange(L), np.arange(num_nodes), np.arange(gpn), np.arange(gpn), indexing="ij")
        )
        keep = oi != worst[li]
        li, oi, i1, i2 = li[keep], oi[keep], i1[keep], i2[keep]
        hi = worst[li]
        c = np.arange(li.size)
        new_h, new_o = by_node[li, hi].copy(), by_node[li, oi].copy()
        new_h[c, i1], new_o[c, i2] = by_node[li, oi, i2], by_node[li, hi, i1]
        pair = peaks_of(np.concatenate([li, li]), np.concatenate([new_h, new_o])).reshape(2, -1).max(0)
        rest = peaks[li].copy()
        rest[c, hi] = -np.inf
        rest[c, oi] = -np.inf
        score = np.maximum(pair, rest.max(1))
        order = np.lexsort((score, li))  # by layer, best first
        first = order[np.r_[True, li[order][1:] != li[order][:-1]]]
        better = first[score[first] < current[li[first]] * (1 - 1e-12)]
        if better.size == 0:
            break
        l, g1, g2 = li[better], by_node[li[better], hi[better], i1[better]], by_node[li[better], oi[better], i2[better]]
        node_of_group[l, g1], node_of_group[l, g2] = oi[better], hi[better]
    return node_of_group


def _replicate_and_pack(
    w: np.ndarray, num_slots: int, num_bins: int, swaps: bool, recount: bool, layer: np.ndarray | None = None
) -> np.ndarray:
    """w [B, n] load per expert of each row (a layer, or a layer's node) -> [B, num_slots] expert
    of each slot, bins (ranks) of num_slots / num_bins slots in order, experts ascending in a bin.
    layer [B]: the layer of each row (rows of one layer compete for its busiest rank; default:
    one row per layer)."""
    B = w.shape[0]
    count = _replicate(w, num_slots, cap=num_bins)  # [B, n]
    experts, weight, bins, peak = _pack_counts(w, count, num_bins, swaps)
    if recount:
        layer = np.arange(B) if layer is None else layer
        experts, bins = _search_counts(w, count, experts, weight, bins, peak, num_bins, layer, swaps)
    order = np.lexsort((experts, bins), axis=-1)
    return np.take_along_axis(experts, order, axis=1)


def _pack_counts(w: np.ndarray, count: np.ndarray, num_bins: int, swaps: bool):
    """Pack the replicas given replica counts: w, count [B, n] -> experts, weight, bins [B, S]
    (expert, load and bin of each replica) and peak [B] (load of the busiest bin)."""
    B, n = w.shape
    S = int(count[0].sum())
    experts = np.repeat(np.tile(np.arange(n), B), count.reshape(-1)).reshape(B, S)
    weight = np.take_along_axis(w / count, experts, axis=1)
    bins = _greedy_pack(weight, experts, n, num_bins)
    if swaps:
        bins = _refine(weight, experts, bins, n, num_bins)
    return experts, weight, bins, _bin_loads(weight, bins, num_bins).max(1)


def _bin_loads(weight: np.ndarray, bins: np.ndarray, num_bins: int) -> np.ndarray:
    """weight, bins [B, S] -> load of each bin [B, num_bins]."""
    B, S = weight.shape
    loads = np.zeros((B, num_bins))
    np.add.at(loads, (np.repeat(np.arange(B), S), bins.reshape(-1)), weight.reshape(-1))
    return loads


def _search_counts(w, count, experts, weight, bins, peak, num_bins, layer, swaps, max_rounds: int = 8):
    """Local search over replica counts for the rows that hold their layer's busiest rank.

    Water-filling minimises the largest load per replica, but with at most one replica of an
    expert per rank it can force two hot experts onto one rank (their replica counts add up to
    more than the ranks there are). Each round, for each such row: moves of one replica between
    two experts, one of them on the busiest bin (add a replica to an expert there, taken from the
    expert that loses least by it; or take one from an expert there, or one from each of two
    experts there whose replicas cannot all sit on separate bins, and give them by water-filling),
    each re-packed; the best is kept if it lowers the row's busiest bin, else the row is done.
    Rows already within 0.1% of a lower bound are skipped.
    w, count [B, n]; experts, weight, bins [B, S]; peak, layer [B] -> experts, bins [B, S]."""
    B, S = experts.shape
    per_bin, cap = S // num_bins, num_bins
    num_layers = int(layer.max()) + 1
    total = w.sum(1)
    tol = 1e-12 * np.maximum(peak, 1.0)
    open_rows = np.ones(B, dtype=bool)
    count, experts, weight, bins, peak = count.copy(), experts.copy(), weight.copy(), bins.copy(), peak.copy()
    for _ in range(max_rounds):
        layer_peak = np.full(num_layers, -np.inf)
        np.maximum.at(layer_peak, layer, peak)
        smallest = np.sort(weight, axis=1)[:, : per_bin - 1].sum(1)
        bound = np.maximum(total / num_bins, weight.max(1) + smallest)
        rows = np.flatnonzero(open_rows & (peak >= layer_peak[layer] - tol) & (peak > bound * (1 + 1e-3)))
        if rows.size == 0:
            break
        loads = _bin_loads(weight[rows], bins[rows], num_bins)
        owner, moves = [], []
        for i, r in enumerate(rows):
            on_h = np.unique(experts[r][bins[r] == loads[i].argmax()])
            for c in _count_moves(w[r], count[r], on_h, cap):
                owner.append(r)
                moves.append(c)
        if not moves:
            open_rows[rows] = False
            continue
        owner = np.array(owner)
        new_count = np.stack(moves)
        e2, w2, b2, p2 = _pack_counts(w[owner], new_count, num_bins, swaps)
        for r in rows:
            mine = np.flatnonzero(owner == r)
            if mine.size == 0:
                open_rows[r] = False
                continue
            best = mine[p2[mine].argmin()]
            if p2[best] < peak[r] - tol[r]:
                count[r], experts[r], weight[r], bins[r], peak[r] = (
                    new_count[best],
                    e2[best],
                    w2[best],
                    b2[best],
                    p2[best],
                )
            else:
                open_rows[r] = False
    return experts, bins


def _count_moves(w: np.ndarray, count: np.ndarray, on_busiest: np.ndarray, cap: int) -> list[np.ndarray]:
    """Candidate replica counts near count [n] (see `_search_counts`); w [n] expert loads,
    on_busiest: the experts on the busiest bin."""
    busy = np.zeros(w.size, dtype=bool)
    busy[on_busiest] = True
    out: dict[bytes, np.ndarray] = {}

    def add(c: np.ndarray | None) -> None:
        if c is not None:
            out.setdefault(c.tobytes(), c)

    donor_cost = np.where(count >= 2, w / np.maximum(count - 1, 1), np.inf)  # per-replica load after giving one
    for e in on_busiest.tolist():
        if count[e] < cap:  # one more replica for e, from the expert that loses least by it
            cost = donor_cost.copy()
            cost[e] = np.inf
            a = int(cost.argmin())
            if np.isfinite(cost[a]):
                c = count.copy()
                c[a] -= 1
                c[e] += 1
                add(c)
    # one replica less for e (or for two experts of the busiest bin that have more replicas than
    # there are bins, so that some bin must hold both), handed on by water-filling, to any other
    # expert or to one off the busiest bin
    givers = [[e] for e in on_busiest.tolist() if count[e] >= 2]
    givers += [[a, b] for i, (a,) in enumerate(givers) for (b,) in givers[i + 1 :] if count[a] + count[b] > cap]
    for g in givers:
        for exclude_busy in (False, True):
            c = count.copy()
            c[g] -= 1
            blocked = busy.copy() if exclude_busy else np.zeros(w.size, dtype=bool)
            blocked[g] = True
            add(_water_fill(w, c, len(g), cap, blocked))
    return list(out.values())


def _water_fill(w: np.ndarray, count: np.ndarray, extra: int, cap: int, blocked: np.ndarray) -> np.ndarray | None:
    """Give `extra` more replicas, each to the unblocked expert below cap with the highest load per
    replica; None when there is none. w, count, blocked [n]."""
    count = count.copy()
    for _ in range(extra):
        need = np.where((count < cap) & ~blocked, w / count, -np.inf)
        e = int(need.argmax())
        if not np.isfinite(need[e]):
            return None
        count[e] += 1
    return count


def _replicate(w: np.ndarray, num_slots: int, cap: int) -> np.ndarray:
    """Replica count per expert: w [B, n] -> [B, n] int64 >= 1, each row summing to num_slots.
    Each extra slot goes to the expert with the highest load per replica among those below `cap`
    replicas (first such expert on ties)."""
    B, n = w.shape
    if num_slots > n * cap:
        raise ValueError(
            f"{num_slots} slots for {n} experts on {cap} ranks: a rank would hold two replicas of one expert"
        )
    count = np.ones((B, n), dtype=np.int64)
    rows = np.arange(B)
    for _ in range(num_slots - n):
        per_replica = np.where(count < cap, w / count, -1.0)  # load >= 0, so -1 marks "full"
        count[rows, per_replica.argmax(1)] += 1
    return count


def _greedy_pack(w: np.ndarray, items: np.ndarray, num_items: int, num_bins: int) -> np.ndarray:
    """Heaviest first into the lightest bin with room that does not hold the same item id.

    w [B, M] weight of each entry, items [B, M] item id in [0, num_items) (an expert; its replicas
    share the id and are never put in one bin; each id appears at most num_bins times) -> bin of
    each entry [B, M] int64, every bin receiving exactly M / num_bins entries. Vectorised over rows.
    """
    B, M = w.shape
    per_bin = M // num_bins
    order = np.lexsort((items, -w), axis=-1)  # heaviest first; replicas of one expert adjacent
    rows = np.arange(B)
    loads = np.zeros((B, num_bins))
    counts = np.zeros((B, num_bins), dtype=np.int64)
    holds = np.zeros((B, num_bins, num_items), dtype=bool)
    bins = np.full((B, M), -1, dtype=np.int64)
    for i in range(M):
        entry = order[:, i]
        item = items[rows, entry]
        ok = (counts < per_bin) & ~holds[rows, :, item]
        for b in np.flatnonzero(~ok.any(1)):
            _unstick(w[b], items[b], bins[b], loads[b], counts[b], holds[b], item[b], per_bin)
            ok[b] = (counts[b] < per_bin) & ~holds[b, :, item[b]]
        target = np.where(ok, loads, np.inf).argmin(1)
        bins[rows, entry] = target
        loads[rows, target] += w[rows, entry]
        counts[rows, target] += 1
        holds[rows, target, item] = True
    return bins


def _unstick(w, items, bins, loads, counts, holds, item, per_bin) -> None:
    """Every bin with room already holds `item`: move the lightest movable entry from a full bin
    without `item` to a bin with room, in place (one row's state).

    Such a move always exists: fewer than num_bins replicas of `item` are placed, so some bin lacks
    it, and that bin is full; a bin with room holds `item` and at most per_bin - 2 others, while the
    full bin holds per_bin distinct ids other than `item`, so at least two of them can move there."""
    best = None
    for src in np.flatnonzero((counts == per_bin) & ~holds[:, item]):
        entries = np.flatnonzero(bins == src)
        for dst in np.flatnonzero(counts < per_bin):
            movable = entries[~holds[dst, items[entries]]]
            if movable.size:
                e = movable[np.argmin(w[movable])]
                if best is None or w[e] < w[best[0]]:
                    best = (e, src, dst)
    if best is None:  # cannot happen when every id appears at most num_bins times
        raise ValueError("cannot place replicas without putting two replicas of one expert on a rank")
    e, src, dst = best
    bins[e] = dst
    loads[src] -= w[e]
    loads[dst] += w[e]
    counts[src] -= 1
    counts[dst] += 1
    holds[src, items[e]] = False
    holds[dst, items[e]] = True


def _refine(
    w: np.ndarray, items: np.ndarray, bins: np.ndarray, num_items: int, num_bins: int, max_swaps: int | None = None
) -> np.ndarray:
    """Swap refinement of a packing: w, items, bins [B, M] as in `_greedy_pack` -> new bins [B, M].

    Per row: take the heaviest bin h; among swaps of an entry a in h with a lighter entry b in
    another bin o (b's id not in h, a's id not in o), pick the one minimising max(load_h - d,
    load_o + d), d = w_a - w_b; apply it if that is below load_h, else the row is done. Each swap
    makes a pair of bins strictly more even (sum of squared loads falls), so this ends; at most
    max_swaps (default 2 M) swaps per row. The heaviest bin never gets heavier. Vectorised over
    rows (all rows step together; finished rows drop out)."""
    B, M = w.shape
    per_bin = M // num_bins
    max_swaps = 2 * M if max_swaps is None else max_swaps
    bins = bins.copy()
    rows_all = np.arange(B)
    loads = np.zeros((B, num_bins))
    np.add.at(loads, (np.repeat(rows_all, M), bins.reshape(-1)), w.reshape(-1))
    holds = np.zeros((B, num_bins, num_items), dtype=bool)
    holds[np.repeat(rows_all, M), bins.reshape(-1), items.reshape(-1)] = True
    tol = 1e-12 * np.maximum(loads.max(1), 1.0)
    active = rows_all
    for _ in range(max_swaps):
        if active.size == 0:
            break
        r = active
        n = r.size
        wr, ir, br, lr = w[r], items[r], bins[r], loads[r]
        h = lr.argmax(1)  # [n]
        on_h = br == h[:, None]  # [n, M], exactly per_bin per row
        a_idx = (np.flatnonzero(on_h) % M).reshape(n, per_bin)
        wa = np.take_along_axis(wr, a_idx, 1)
        ia = np.take_along_axis(ir, a_idx, 1)
        d = wa[:, :, None] - wr[:, None, :]  # [n, k, M]
        rr = r[:, None, None]
        ok = (d > 0) & ~on_h[:, None, :]
        ok &= ~holds[rr, br[:, None, :], ia[:, :, None]]  # a's expert not yet in b's bin
        ok &= ~holds[r[:, None], h[:, None], ir][:, None, :]  # b's expert not yet in h
        load_h = lr[np.arange(n), h]
        new_max = np.maximum(load_h[:, None, None] - d, np.take_along_axis(lr, br, 1)[:, None, :] + d)
        new_max = np.where(ok, new_max, np.inf).reshape(n, -1)
        k = new_max.argmin(1)
        better = new_max[np.arange(n), k] < load_h - tol[r]
        if not better.any():
            break
        r, k, h, n_sel = r[better], k[better], h[better], np.flatnonzero(better)
        i, j = np.divmod(k, M)
        a = a_idx[n_sel, i]
        dst = br[n_sel, j]
        ea, eb = items[r, a], items[r, j]
        delta = w[r, a] - w[r, j]
        bins[r, a], bins[r, j] = dst, h
        loads[r, h] -= delta
        loads[r, dst] += delta
        holds[r, h, ea] = False
        holds[r, dst, eb] = False
        holds[r, h, eb] = True
        holds[r, dst, ea] = True
        active = r
    return bins


def _obeys(
    phy2log: np.ndarray, num_ranks: int, num_nodes: int, num_groups: int, num_experts: int, hierarchical: bool
) -> bool:
    """Whether phy2log [L, S] follows the policy's rules: no expert twice on one rank, and for
    hierarchical every expert group's slots on a single node."""
    L, S = phy2log.shape
    per_rank = np.sort(phy2log.reshape(L, num_ranks, S // num_ranks), axis=-1)
    if (per_rank[..., 1:] == per_rank[..., :-1]).any():
        return False
    if hierarchical:
        group = phy2log // (num_experts // num_groups)
        node = np.broadcast_to(np.arange(S) // (S // num_nodes), phy2log.shape)
        lo = np.full((L, num_groups), S)
        hi = np.full((L, num_groups), -1)
        index = (np.repeat(np.arange(L), S), group.reshape(-1))
        np.minimum.at(lo, index, node.reshape(-1))
        np.maximum.at(hi, index, node.reshape(-1))
        if (lo != hi).any():
            return False
    return True
