"""The DSpark drafter's proposal alone, in process: the time of one `DSparkProposer.draft` by batch size and
block passes (context rows ingested from random target states, so no target runs), one thread.

    python launch/bench_drafter.py [--batches 1,8,32] [--passes 1,2] [--k 6] [--device auto] [--dtypes float32]
        [--compile] [--temperature T] [--context-growth ROWS] [--json OUT]
    python launch/ab.py --script-here --trees HEAD~1,. --rounds 4 --keys b32_p2.draft_ms \
        -- launch/bench_drafter.py --json {json}

Each sequence's context is 40-400 rows (drawn once, seed 0), the drafter the bundled tiny-dspark (or
--drafter), greedy (or at --temperature, unseeded), k = --k; median of --iters proposals after 5 warm-up ones (on CUDA each timed to the
device's end). --dtypes: the target's model.dtype, which the drafter serves in (keys b<B>_p<P>[_<dtype>], no
suffix for float32); ops_a_round: the tensor operations of a serving round (4 new context rows a sequence, then
a proposal). --compile: also the same proposals through a drafter whose greedy rounds are compiled
(`speculative/compiled_draft.py`, model.compile on: CUDA graphs on CUDA), timed alternating with the eager one
(keys ...compiled_ms, compiled_over_eager). `launch/bench_dspark.py` has
the drafter's cost inside a serving engine at batch 1 (its c); this one isolates the proposal by batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# after PYTHONPATH: `launch/ab.py --script-here` runs this script on older trees
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dspark_cluster.config import ASSETS_DIR  # noqa: E402
from dspark_cluster.model.spec import load_spec  # noqa: E402
from dspark_cluster.speculative.dspark_proposer import DSparkProposer  # noqa: E402
from dspark_cluster.speculative.proposers import DraftRequest  # noqa: E402
from dspark_cluster.speculative.records import ContextRows  # noqa: E402


def ops_a_round(prop, reqs, g, new_rows: int = 4) -> int:
    """Tensor operations of one serving round (aten ops as dispatched, `model.op_count`): `new_rows` committed
    rows' states arrive for each sequence, then a proposal (their keys/values, the block forward, the Markov
    steps). What a GPU would launch."""
    from dspark_cluster.model.op_count import count_ops

    nxt = []
    for r in reqs:
        rows = torch.randn(new_rows, prop.model.fc.in_features, generator=g).to(prop.device)
        prop.ingest(ContextRows(torch.tensor([r.seq_id]), torch.tensor([r.length - 1]), torch.tensor([new_rows]),
                                rows))
        nxt.append(DraftRequest(r.seq_id, r.token_ids + [2] * new_rows, r.k))
    with count_ops() as c:
        prop.draft(nxt)
    return sum(c.ops.values())


def context_growth(prop, rows: int, g, k: int, new_rows: int = 4) -> dict:
    """One sequence growing `new_rows` committed rows a round to `rows`, a proposal each round: the drafter's context
    bytes (`memory_report()["context_kv_bytes"]`) at 512, 1,024, 2,048, ... rows, and ms a round (ingest + draft)."""
    width, V = prop.model.fc.in_features, prop.model.c.vocab_size
    hidden = torch.randn(rows, width, generator=g).to(prop.device)
    tokens = torch.randint(2, V, (rows + 1,), generator=g).tolist()
    n, sid, out, t0, rounds = 128, 10**9, {}, time.perf_counter(), 0
    prop.ingest(ContextRows(torch.tensor([sid]), torch.tensor([0]), torch.tensor([n]), hidden[:n]))
    while n < rows:
        prop.ingest(ContextRows(torch.tensor([sid]), torch.tensor([n]), torch.tensor([new_rows]),
                                hidden[n:n + new_rows]))
        n += new_rows
        prop.draft([DraftRequest(sid, tokens[:n + 1], k)])
        rounds += 1
        if n >= 512 and n & (n - 1) == 0:  # (powers of two)
            out[str(n)] = prop.memory_report()["context_kv_bytes"]
    prop.free([sid])
    return {"context_kv_bytes": out, "ms_a_round": (time.perf_counter() - t0) / rounds * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(ASSETS_DIR / "tiny-moe"))
    ap.add_argument("--drafter", default=str(ASSETS_DIR / "tiny-dspark"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--passes", default="1,2")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--device", default="auto", help="auto: cuda where available, else cpu")
    ap.add_argument("--dtypes", default="float32", help="model.dtype: the drafter serves in the target's dtype")
    ap.add_argument("--compile", action="store_true", help="also a compiled drafter's rounds (compiled_draft)")
    ap.add_argument("--temperature", type=float, default=0.0, help="the rows' temperature (0: greedy; unseeded)")
    ap.add_argument("--context-growth", type=int, default=0, metavar="ROWS",
                    help="also one sequence grown to ROWS rows 4 at a time, drafting each round: its context bytes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    res = {"device": device}
    runs = [(int(p), d) for d in args.dtypes.split(",") for p in args.passes.split(",")]
    for passes, dtype in runs:
        spec = load_spec(args.target, dtype)  # the drafter serves in the target's dtype
        prop = DSparkProposer(args.drafter, args.target, spec, device=device, num_tokens=args.k, draft_passes=passes)
        props = [prop]
        if args.compile:
            from dspark_cluster.speculative.compiled_draft import draft_buckets

            t0 = time.perf_counter()
            props.append(DSparkProposer(args.drafter, args.target, spec, device=device, num_tokens=args.k,
                                        draft_passes=passes, compile_buckets=draft_buckets(max(
                                            int(b) for b in args.batches.split(",")))))
            print(f"compiled drafter: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
        tag = f"_p{passes}" + ("" if dtype == "float32" else f"_{dtype}")
        g = torch.Generator().manual_seed(0)
        for B in (int(b) for b in args.batches.split(",")):
            reqs = []
            for i in range(B):
                sid, n = 1000 * B + i, int(torch.randint(40, 400, (1,), generator=g))
                rows = torch.randn(n, prop.model.fc.in_features, generator=g).to(device)
                for p in props:
                    p.ingest(ContextRows(torch.tensor([sid]), torch.tensor([0]), torch.tensor([n]), rows))
                reqs.append(DraftRequest(sid, torch.randint(2, spec.vocab_size, (n + 1,), generator=g).tolist(), args.k,
                                         args.temperature))
            sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
            for _ in range(5):
                for p in props:
                    p.draft(reqs)
            ts = [[] for _ in props]
            for _ in range(args.iters):  # (alternating: the machine's drift falls on both alike)
                for p, times in zip(props, ts):
                    sync()
                    t = time.perf_counter()
                    p.draft(reqs)
                    sync()
                    times.append(time.perf_counter() - t)
            r = res[f"b{B}{tag}"] = {"draft_ms": statistics.median(ts[0]) * 1e3}
            if args.compile:
                r["compiled_ms"] = statistics.median(ts[1]) * 1e3
                r["compiled_over_eager"] = r["compiled_ms"] / r["draft_ms"]
                r["compile"] = props[1].compiled.stats()
            r["ops_a_round"] = ops_a_round(prop, reqs, g)  # (last: it ingests rows into the eager drafter only)
            ms, ops = r["draft_ms"], r["ops_a_round"]
            print(f"batch {B}, {passes} pass(es), {dtype}: {ms:.3f} ms a proposal; {ops} ops a round"
                  + (f"; compiled {r['compiled_ms']:.3f} ms ({r['compiled_over_eager']:.2f}x), "
                     f"{r['compile']['draft_compile_recompiles_after_warm_up']} recompiles" if args.compile else ""),
                  flush=True)
        if args.context_growth:
            fresh = DSparkProposer(args.drafter, args.target, spec, device=device, num_tokens=args.k,
                                   draft_passes=passes)  # (no other sequence's context in its bytes)
            grown = res[f"growth{tag}"] = context_growth(fresh, args.context_growth, g, args.k)
            print(f"{passes} pass(es), {dtype}: one sequence's context bytes by rows "
                  f"{ {n: f'{b / 1e6:.2f} MB' for n, b in grown['context_kv_bytes'].items()} }, "
                  f"{grown['ms_a_round']:.3f} ms a round (4 rows in, a proposal)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
