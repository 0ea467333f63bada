"""EPLB policy benchmark: balancedness (mean / max tokens per rank) of `dspark_cluster.eplb.rebalance`
against no rebalancing and against DeepSeek's EPLB algorithm, and the time per call.

    python launch/bench_eplb.py [--layers 58] [--seed 0] [--no-write]

Cases: DeepSeek EPLB's README example (their printed placement vs ours), and DeepSeek-V3-scale Zipf
loads (E=256 experts, 8 expert groups; 8 nodes with 32 ranks x 9 slots = 288 slots and 64 ranks x 5
slots = 320 slots, since 288 does not split over 64 ranks; and 4 nodes x 8 ranks x 9 slots, where
the hierarchical policy has two groups per node to place). Prints a markdown table and writes it
to the section "## EPLB policy (issue 7)" of BENCHMARKS.md at the repository root (other sections
are left alone).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dspark_cluster.eplb import _rebalance, balancedness, rebalance  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## EPLB policy (issue 7)"

README_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
# phy2log printed in DeepSeek EPLB's README for README_WEIGHT, 16 slots, 4 groups, 2 nodes, 8 GPUs.
README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


def _deepseek_reference(
    load: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int, num_ranks: int
) -> torch.Tensor:
    """DeepSeek EPLB's published algorithm (github deepseek-ai/eplb), re-implemented here as a
    baseline: load [L, E] -> phy2log [L, S].

    - balanced packing: items sorted by weight, heaviest first, each into the lightest pack that
      has room (equal item counts per pack); no rule against two replicas of one expert in a pack;
    - replication: each redundant slot to argmax(load / replica count), no cap;
    - hierarchical: pack expert groups onto nodes by group load, replicate inside each node over
      its S/N slots, pack the node's replicas onto its R/N GPUs; used when G % N == 0, otherwise
      the same with one group and one node (their global policy);
    - slots inside a GPU in packing order; a node's experts in the order their groups were packed.
    """
    w = load.double().numpy()
    L, E = w.shape
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    group_size, spn, rpn = E // num_groups, num_slots // num_nodes, num_ranks // num_nodes

    def packing(weights: np.ndarray, num_packs: int) -> list[list[int]]:
        """weights [n] -> items of each pack, in the order they were put there."""
        per_pack = weights.size // num_packs
        packs: list[list[int]] = [[] for _ in range(num_packs)]
        totals = [0.0] * num_packs
        for item in np.argsort(-weights, kind="stable").tolist():
            p = min((p for p in range(num_packs) if len(packs[p]) < per_pack), key=totals.__getitem__)
            packs[p].append(item)
            totals[p] += float(weights[item])
        return packs

    def replicate(weights: np.ndarray, slots: int) -> tuple[list[int], np.ndarray]:
        """weights [n] -> (expert of each physical replica: the n originals then the redundant
        ones in the order they were added, replica count [n])."""
        count = np.ones(weights.size)
        phys = list(range(weights.size))
        for _ in range(slots - weights.size):
            e = int(np.argmax(weights / count))
            phys.append(e)
            count[e] += 1
        return phys, count

    out = np.empty((L, num_slots), dtype=np.int64)
    for layer in range(L):
        group_load = w[layer].reshape(num_groups, group_size).sum(-1)
        row = []
        for groups in packing(group_load, num_nodes):
            experts = np.concatenate([np.arange(g * group_size, (g + 1) * group_size) for g in groups])
            phys, count = replicate(w[layer, experts], spn)
            per_phys = (w[layer, experts] / count)[phys]
            for gpu in packing(per_phys, rpn):
                row.extend(int(experts[phys[p]]) for p in gpu)
        out[layer] = row
    return torch.from_numpy(out)


def contiguous(num_layers: int, num_experts: int, num_slots: int) -> torch.Tensor:
    """No rebalancing: slot s holds expert s mod E (experts in order, redundant slots in order)."""
    return (torch.arange(num_slots) % num_experts).repeat(num_layers, 1)


def zipf_load(num_layers: int, num_experts: int, exponent: float, seed: int, tokens: int = 8 * 65536) -> torch.Tensor:
    """[L, E] int64: per layer, `tokens` expert assignments drawn from a Zipf(exponent) popularity
    over a random permutation of the experts."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, num_experts + 1) ** exponent
    p /= p.sum()
    rows = [rng.multinomial(tokens, p[rng.permutation(num_experts)]) for _ in range(num_layers)]
    return torch.from_numpy(np.stack(rows))


def dup_layers(phy2log: torch.Tensor, num_ranks: int) -> int:
    """Layers where some rank holds two replicas of one expert."""
    L, S = phy2log.shape
    per_rank = phy2log.view(L, num_ranks, S // num_ranks).sort(-1).values
    return int((per_rank[..., 1:] == per_rank[..., :-1]).any(-1).any(-1).sum())


def timed(fn, *args, **kwargs):
    """(fn(*args, **kwargs), seconds it took)."""
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def fmt(b: torch.Tensor) -> str:
    return f"{b.mean():.4f} / {b.min():.4f}"


def machine() -> str:
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model = platform.processor() or "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.CalledProcessError):
        pass
    return f"nproc={nproc}, CPU: {model}, torch {torch.__version__}, numpy {np.__version__}, Python {platform.python_version()}"


def readme_table() -> list[str]:
    w = torch.tensor(README_WEIGHT)
    S, G, N, R = 16, 4, 2, 8
    rows = [("DeepSeek EPLB, printed in its README", torch.tensor(README_PHY2LOG))]
    rows.append(("DeepSeek EPLB, our re-implementation (`_deepseek_reference`)", _deepseek_reference(w, S, G, N, R)))
    for policy in ("hierarchical", "global"):
        rows.append((f"ours, {policy}, greedy", rebalance(w, S, G, N, R, policy, refine=False)[0]))
        rows.append((f"ours, {policy}, greedy + refinement", rebalance(w, S, G, N, R, policy)[0]))
    out = [
        "README example (12 experts, 16 slots, 4 groups, 2 nodes, 8 GPUs): balancedness = mean / max tokens per rank",
        "",
        "| placement | layer 0 | layer 1 | ranks with a duplicate expert |",
        "|---|---|---|---|",
    ]
    for name, p in rows:
        b = balancedness(w, p, R)
        out.append(f"| {name} | {b[0]:.4f} | {b[1]:.4f} | {dup_layers(p, R)} layers |")
    same = torch.equal(rows[1][1], rows[0][1])
    out += ["", f"Our re-implementation of DeepSeek's algorithm reproduces their printed phy2log exactly: {same}."]
    return out


def scale_table(num_layers: int, seed: int) -> list[str]:
    E, G = 256, 8
    out = [
        (
            f"DeepSeek-V3 scale: {num_layers} layers, E={E} experts, {G} expert groups, Zipf loads (8 x 65536 token-expert"
            " assignments per layer, popularity rank k gets weight k^-s, over a fresh random permutation of the experts per"
            ' layer). Cells: balancedness mean / min over the layers (1 = perfect). "< DS": layers where ours is below'
            " DeepSeek's. Time: seconds per call for all layers."
        ),
        "",
        (
            "| Zipf s | nodes x ranks x slots/rank | policy | no rebalancing | DeepSeek EPLB | ours greedy | ours + swaps"
            " | ours + swaps + replica counts (default) | < DS | DS dup layers | time DS / greedy / default (s) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    configs = [
        (8, 32, 288, ("global", "hierarchical")),
        (8, 64, 320, ("global", "hierarchical")),
        (4, 32, 288, ("hierarchical",)),
    ]
    for i, s in enumerate((0.8, 1.0, 1.2)):
        load = zipf_load(num_layers, E, s, seed + i)
        for N, R, S, policies in configs:
            none = balancedness(load, contiguous(num_layers, E, S), R)
            for policy in policies:
                ds_groups, ds_nodes = (G, N) if policy == "hierarchical" else (1, 1)  # their global: 1 group, 1 node
                ds, t_ds = timed(_deepseek_reference, load, S, ds_groups, ds_nodes, R)
                (greedy, _, _), t_g = timed(rebalance, load, S, G, N, R, policy, refine=False)
                swaps = _rebalance(load, S, G, N, R, policy, swaps=True, recount=False)[0]
                (refined, _, _), t_r = timed(rebalance, load, S, G, N, R, policy)
                b_ds, b_g, b_s, b_r = (balancedness(load, p, R) for p in (ds, greedy, swaps, refined))
                assert (b_r >= b_g - 1e-12).all(), "refinement made a layer worse"
                out.append(
                    f"| {s} | {N} x {R} x {S // R} | {policy} | {fmt(none)} | {fmt(b_ds)} | {fmt(b_g)} | {fmt(b_s)} | {fmt(b_r)} "
                    f"| {int((b_r < b_ds - 1e-12).sum())} | {dup_layers(ds, R)} | {t_ds:.2f} / {t_g:.2f} / {t_r:.2f} |"
                )
                print(out[-1], flush=True)
    return out


def write_section(lines: list[str], path: str) -> None:
    body = SECTION + "\n\n" + "\n".join(lines).rstrip() + "\n"
    text = "# Benchmarks\n"
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    if pattern.search(text):
        text = pattern.sub(lambda _: body + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + body
    with open(path, "w") as f:
        f.write(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true", help="print only, do not touch BENCHMARKS.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    lines = [
        f"Command: `python launch/bench_eplb.py --layers {args.layers} --seed {args.seed}`",
        f"Machine: {machine()} (torch threads: 1; the CPU was shared with other jobs, so times are upper bounds).",
        "",
    ]
    lines += readme_table()
    print("\n".join(lines), flush=True)
    lines += [""] + scale_table(args.layers, args.seed)
    lines += [
        "",
        "- no rebalancing: slot s holds expert s mod E (the 32 / 64 redundant slots replicate experts 0, 1, ... in order).",
        (
            "- DeepSeek EPLB: `_deepseek_reference` in this script, their published algorithm in our code (it reproduces"
            ' their README output exactly). "DS dup layers": layers where it puts two replicas of one expert on one rank,'
            " which gives that rank a double share of the expert's tokens; ours never does (the task's rule), so on a few"
            " layers DeepSeek's placement is outside what ours may choose."
        ),
        "- ours: `rebalance(..., refine=False)` (greedy), `_rebalance(..., swaps=True, recount=False)`, `rebalance(...)`.",
        (
            "- hierarchical with 8 groups on 8 nodes: each node must take exactly one group, so the node holding the"
            " hottest group bounds the balancedness whatever the policy does inside nodes; global has no such bound."
        ),
        f"- total benchmark time: {time.perf_counter() - started:.0f} s.",
    ]
    print("\n".join(lines[-5:]))
    if not args.no_write:
        write_section(lines, os.path.join(ROOT, "BENCHMARKS.md"))
        print(f"wrote section {SECTION!r} of {os.path.join(ROOT, 'BENCHMARKS.md')}")


if __name__ == "__main__":
    main()
