"""Decodes of different contexts: one padded attention batch against groups of similar context (`attention.decode_groups`
with `DECODE_PAD`, or the rules given), the bundled model's decode forward (metadata, forward, logits) in process.

    OMP_WAIT_POLICY=PASSIVE python launch/bench_decode_groups.py --batches 8,16,32,64,128 --rounds 3 \
        --rules 1.05:2048,1.05:1024,1.25:4096 [--json out.json]

Each batch size draws its contexts uniformly from [--min-context, --max-context] (seeded); the arms run alternating,
rotated each round; medians of --steps steps. Prints the groups each rule makes, the padded key pairs against the
sequences' own, and each arm's time over the one-batch arm's.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch
from bench_step import timed  # (launch/: the script's own folder is first on sys.path)

from dspark_cluster.config import ASSETS_DIR
from dspark_cluster.kv_cache import allocate_kv_cache
from dspark_cluster.model import attention
from dspark_cluster.model.attention import build_metadata, pad_groups
from dspark_cluster.model.loader import load_model
from dspark_cluster.model.spec import load_spec


def step_fn(model, ids, q, ctx, tables, block_size, rule):
    """A decode step with the decodes grouped by `rule` ((slack, min_pairs); None: one batch)."""
    @torch.inference_mode()
    def run():
        if rule is not None:
            attention.DECODE_PAD = rule
        positions, meta = build_metadata(q, ctx, tables, block_size, group_decodes=rule is not None)
        return model.compute_logits(model(ids, positions, meta.to("cpu", torch.float32)))
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ASSETS_DIR / "tiny-moe"))
    ap.add_argument("--batches", default="8,16,32,64,128")
    ap.add_argument("--rules", default="1.05:2048", help="slack:min_pairs, comma-separated (1.05:2048: DECODE_PAD)")
    ap.add_argument("--min-context", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rules = {r: (float(r.split(":")[0]), int(r.split(":")[1])) for r in args.rules.split(",")}
    spec = load_spec(args.model, "float32")
    model = load_model(args.model, spec)
    default = attention.DECODE_PAD
    bs, out = args.block_size, {}
    for B in (int(b) for b in args.batches.split(",")):
        rng = np.random.default_rng(B)
        ctx = torch.tensor(rng.integers(args.min_context, args.max_context + 1, B))
        nb = -(-int(ctx.max()) // bs)
        allocate_kv_cache(model, B * nb, bs, torch.device("cpu"))
        tables = torch.arange(B * nb).view(B, nb)
        ids = torch.randint(0, spec.vocab_size, (B,))
        q = torch.ones(B, dtype=torch.long)
        spans = -(-ctx.numpy() // bs) * bs
        arms = {"one batch": None} | rules
        ref = step_fn(model, ids, q, ctx, tables, bs, None)()
        row = {"own_pairs": int(spans.sum()), "one_batch_pairs": int(B * spans.max()), "arms": {}}
        for name, rule in arms.items():
            if rule is None:
                continue
            groups = pad_groups(np.arange(B), q.numpy(), ctx.numpy(), bs, *rule)
            logits = step_fn(model, ids, q, ctx, tables, bs, rule)()
            row["arms"][name] = {"groups": [len(g) for g in groups],
                                 "pairs": int(sum(len(g) * spans[g].max() for g in groups)),
                                 "max_abs_diff": float((logits - ref).abs().max())}
        times = {name: [] for name in arms}
        for r in range(args.rounds):
            names = list(arms)
            names = names[r % len(names):] + names[: r % len(names)]
            for name in names:
                times[name].append(timed(step_fn(model, ids, q, ctx, tables, bs, arms[name]), args.steps))
        base = statistics.median(times["one batch"])
        row["one_batch_ms"] = base
        line = f"batch {B}: own pairs {row['own_pairs']}, one batch {row['one_batch_pairs']} pairs {base:.3f} ms"
        for name in rules:
            a = row["arms"][name]
            a["ms"] = statistics.median(times[name])
            a["ratio"] = statistics.median(t / b for t, b in zip(times[name], times["one batch"]))
            line += (f"; {name}: groups {a['groups']} pairs {a['pairs']} {a['ms']:.3f} ms ({a['ratio']:.3f}x, "
                     f"max |diff| {a['max_abs_diff']:.1e})")
        print(line, flush=True)
        out[B] = row
    attention.DECODE_PAD = default
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
