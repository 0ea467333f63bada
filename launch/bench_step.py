"""The decode step, counted and timed in process (issue 27): tensor operations and host
synchronisations per layer, the forward's time at batch 1 and 64 (and of a verify step: 7 new tokens a
sequence, at 1 and 8 sequences; and of prompt steps: 8 prompts of 128 tokens, one of 512), and the LLM's TPOT at batch 1
with the tree's default config and with model.compile off and on (where the tree has it), with the compile warm-up.

    python launch/bench_step.py [--model PATH] [--json OUT]
    python launch/bench_step.py --gemm      # only: one linear's time by rows and dtype, torch's and oneDNN's
    python launch/bench_step.py --experts   # only: a MoE layer's experts by rows a slot, grouped matmul or by slot
    python launch/bench_step.py --compiled  # only: model.compile's runner against eager, decode and verify steps
    python launch/ab.py --script-here --trees 10172c6,. --keys b1.forward_ms,b1.ops_per_layer \
        -- launch/bench_step.py --json {json}

Self-contained (its own op counter), so that it runs against an older tree's package too
(`--script-here` in ab.py): operations are aten ops as dispatched (views included); host syncs are
`.item()` and friends (aten._local_scalar_dense), `.tolist()`, `.numpy()` and device-to-host copies.
One thread, float32, context 128 tokens in 16-token blocks.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dspark_cluster.config import ASSETS_DIR, Config
from dspark_cluster.kv_cache import allocate_kv_cache
from dspark_cluster.model.attention import build_metadata
from dspark_cluster.model.loader import load_model
from dspark_cluster.model.spec import load_spec


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.syncs = collections.Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        self.syncs += func.overloadpacket.__name__ in ("item", "_local_scalar_dense", "is_nonzero")
        return func(*args, **(kwargs or {}))


def count(fn):
    c = _Count()
    originals = {n: getattr(torch.Tensor, n) for n in ("tolist", "numpy")}
    for n, f in originals.items():
        def wrap(self, *a, _f=f, **kw):
            c.syncs += 1
            return _f(self, *a, **kw)
        setattr(torch.Tensor, n, wrap)
    try:
        with c:
            fn()
    finally:
        for n, f in originals.items():
            setattr(torch.Tensor, n, f)
    return c


def decode_forward(model, batch: int, context: int, block_size: int = 16, query: int = 1):
    """A step of `batch` sequences at `context` tokens, each with `query` new tokens (1: decode; k + 1: a
    verify step of k drafts), the logits of every new token (a verify step samples them all)."""
    blocks = -(-context // block_size)
    cache = model.attention_layers[0].kv_cache
    if cache is None or cache[0].shape[0] < batch * blocks:  # (a larger one stays: the compiled steps' graphs read it)
        allocate_kv_cache(model, batch * blocks, block_size, torch.device("cpu"))
    tables = torch.arange(batch * blocks).view(batch, blocks)
    ids = torch.randint(0, model.spec.vocab_size, (batch * query,))
    q, ctx = torch.full((batch,), query), torch.full((batch,), context)

    @torch.inference_mode()
    def run():  # metadata and forward, as a worker runs a step (sampling aside)
        positions, meta = build_metadata(q, ctx, tables, block_size)
        return model.compute_logits(model(ids, positions, meta.to("cpu", torch.float32))[-batch * query:])

    @torch.inference_mode()
    def metadata():  # the metadata alone: its share of the counted ops
        build_metadata(q, ctx, tables, block_size)[1].to("cpu", torch.float32)
    run.metadata = metadata
    return run


def compiled_forward(model, runner, batch: int, context: int, block_size: int = 16, query: int = 1):
    """`decode_forward`'s step through model.compile's runner (`CompiledSteps`: padded to its token bucket, attention
    eager between the graphs), with the logits of every new token."""
    from types import SimpleNamespace

    blocks = -(-context // block_size)
    tables = torch.arange(batch * blocks).view(batch, blocks)
    step = SimpleNamespace(input_ids=torch.randint(0, model.spec.vocab_size, (batch * query,)),
                           query_lens=torch.full((batch,), query), context_lens=torch.full((batch,), context),
                           block_tables=tables, block_size=block_size,
                           num_draft=torch.full((batch,), query - 1) if query > 1 else None)

    @torch.inference_mode()
    def run():
        return model.compute_logits(runner(step))
    return run


COMPILED_ROWS = ((1, 1), (64, 1), (1, 7), (8, 7), (64, 7), (1, 128))


def compiled_rows(path: str, spec, steps: int, rows=COMPILED_ROWS) -> dict:
    """Compiled against eager forwards of the same steps (rows: (batch, new tokens a sequence)), one model (where the
    tree has `CompiledSteps`)."""
    try:
        from dspark_cluster.model.compiled import CompiledSteps, step_buckets
    except ImportError:
        return {}
    bad = [(b, q) for b, q in rows if q > 128 or b * q > 512]
    if bad:
        raise SystemExit(f"--rows {bad}: a step here is at most 128 new tokens a sequence (context 128) and 512 in all "
                         "(the largest bucket)")
    model = load_model(path, spec)
    # the pool every row's step reads (the graphs read the cache they were compiled with: never reallocated after)
    allocate_kv_cache(model, max(64, *(b for b, _ in rows)) * 9, 16, torch.device("cpu"))
    runner = CompiledSteps(model, step_buckets(512), "cpu")
    runner.warm_up()
    out = {}
    for batch, query in rows:
        key = f"b{batch}" if query == 1 else f"verify_b{batch}_q{query}" if query < 128 else \
            f"prefill_b{batch}_q{query}"
        n = steps if batch * query < 8 else steps // 4 if batch * query <= 64 else steps // 10
        compiled = timed(compiled_forward(model, runner, batch, 128, query=query), n)
        eager = timed(decode_forward(model, batch, 128, query=query), n)
        out[key] = {"compiled_ms": compiled, "eager_ms": eager, "ratio": compiled / eager}
        print(f"{key}: compiled {compiled:.3f} ms, eager {eager:.3f} ms ({compiled / eager:.3f}x)", flush=True)
    out["stats"] = runner.stats()
    return out


def timed(fn, n: int) -> float:
    for _ in range(10):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def llm_tpot(path: str, compile_mode, repeats: int = 5, batch: int = 1) -> dict:
    """The LLM's TPOT (ms) decoding `batch` 128-token prompts together, 128 greedy tokens each, median of `repeats`
    batches (each batch's median request)."""
    from dspark_cluster import LLM, SamplingParams

    model = {"dtype": "float32"} | ({"compile": compile_mode} if compile_mode else {})
    t0 = time.perf_counter()
    llm = LLM(path, config={"model": model, "parallel": {"executor": "local", "threads_per_worker": 1}})
    start_s = time.perf_counter() - t0
    try:
        prompts = [list(range(5 + i, 133 + i)) for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        tpots = [statistics.median(o.metrics["tpot_s"] * 1e3 for o in llm.generate(
            prompts, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))) for _ in range(repeats)]
        out = {"tpot_ms": statistics.median(tpots), "raw": tpots, "start_s": start_s}
        worker = getattr(llm.engine.executor, "worker", None)
        compiled = getattr(worker, "compiled", None)
        if compiled is not None:
            out["compile"] = compiled.stats()
        return out
    finally:
        llm.shutdown()


def gemm(rows=(1, 2, 4, 6, 8, 16, 64), k: int = 256, n: int = 768) -> dict:
    """us for one [rows, k] x [k, n] linear, fp32 and bf16, one thread: how the cost grows with the rows
    (a verify step's extra tokens, a batch's) on this CPU."""
    out = {}
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(n, k, dtype=dtype)
        # oneDNN's matmul over the weight reordered once (what model/gemm.py runs on the CPU from a few rows on)
        w_onednn = None  # (bf16 only where oneDNN has its bf16 path: AVX-512 BW/VL/DQ)
        if onednn and (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            w_onednn = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        for m in rows:
            x = torch.randn(m, k, dtype=dtype)
            name = str(dtype).removeprefix('torch.')
            out[f"{name}_{m}"] = 1e3 * timed(lambda: torch.nn.functional.linear(x, w), 2000)
            if w_onednn is not None:
                out[f"{name}_onednn_{m}"] = 1e3 * timed(
                    lambda: torch.ops.mkldnn._linear_pointwise(x, w_onednn, None, "none", [], ""), 2000)
    return out


def experts(per_slot=(2, 8, 16, 24, 32, 48, 64, 128, 445), slots: int = 8, hidden: int = 256, inter: int = 128) -> dict:
    """One MoE layer's experts (the bundled model's shapes: 8 slots, 256 -> 2 x 128 -> 256), rows sorted by slot, by
    average rows a slot: torch's grouped matmul, and slot by slot with oneDNN's matmul over the plain weights (what
    model/layers.py runs on the CPU from gemm.ONEDNN_EXPERT_MIN_ROWS) and over reordered copies, us."""
    import torch.nn.functional as F

    def by_slot(xs, counts, w13, w2, product):
        out, start = torch.empty_like(xs), 0
        for e, n in enumerate(counts.tolist()):
            if n:
                gate, up = product(xs[start:start + n], w13[e]).chunk(2, dim=-1)
                out[start:start + n] = product(F.silu(gate) * up, w2[e])
                start += n
        return out

    def grouped(xs, counts, w13t, w2t):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(xs, w13t, offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2t, offs=offs)

    def onednn(x, w):  # w plain, or reordered into oneDNN's blocked layout
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    w13, w2 = torch.randn(slots, 2 * inter, hidden) * 0.05, torch.randn(slots, hidden, inter) * 0.05
    w13r, w2r = ([torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws] for ws in (w13, w2))
    out, gen = {}, torch.Generator().manual_seed(0)
    for m in per_slot:
        counts = torch.bincount(torch.randint(0, slots, (m * slots,), generator=gen), minlength=slots)
        xs = torch.randn(m * slots, hidden)
        n = max(20, 4000 // m)
        out[f"grouped_{m}"] = 1e3 * timed(lambda: grouped(xs, counts, w13.transpose(1, 2), w2.transpose(1, 2)), n)
        out[f"plain_{m}"] = 1e3 * timed(lambda: by_slot(xs, counts, w13, w2, onednn), n)
        out[f"reordered_{m}"] = 1e3 * timed(lambda: by_slot(xs, counts, w13r, w2r, onednn), n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ASSETS_DIR / "tiny-moe"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--gemm", action="store_true", help="only one linear's time by rows and dtype")
    ap.add_argument("--experts", action="store_true", help="only a MoE layer's experts by rows a slot")
    ap.add_argument("--compiled", action="store_true", help="only: compiled against eager forwards of the same steps")
    ap.add_argument("--rows", default=None, help="--compiled: the steps, as batch x new tokens a sequence "
                    "(e.g. 1x1,2x1,4x1,8x1,16x1,1x5); default " + ",".join(f"{b}x{q}" for b, q in COMPILED_ROWS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.gemm or args.experts:
        res = gemm() if args.gemm else experts()
        what = "a 256 -> 768 linear" if args.gemm else "a MoE layer's experts (8 slots, by rows a slot)"
        print(f"{what}, us: " + ", ".join(f"{key} {us:.1f}" for key, us in res.items()), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    spec = load_spec(args.model, "float32")
    if args.compiled:
        rows = COMPILED_ROWS if args.rows is None else [tuple(int(x) for x in r.split("x")) for r in args.rows.split(",")]
        res = compiled_rows(args.model, spec, args.steps, rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
        return
    res = {"layers": spec.num_layers}
    for batch, query in ((1, 1), (64, 1), (1, 7), (8, 7), (8, 128), (1, 512)):
        model = load_model(args.model, spec)
        run = decode_forward(model, batch, max(128, query), query=query)
        ms = timed(run, args.steps if batch == 1 else args.steps // 4 if query < 128 else args.steps // 10)
        c = count(run)
        meta_ops = sum(count(run.metadata).ops.values()) if hasattr(run, "metadata") else None
        # query >= 128 at context = query: whole prompts in one step
        key = f"b{batch}" if query == 1 else f"verify_b{batch}_q{query}" if query < 128 else f"prefill_b{batch}_q{query}"
        res[key] = {"forward_ms": ms, "ops": sum(c.ops.values()), "ops_per_layer": sum(c.ops.values()) / spec.num_layers,
                            "metadata_ops": meta_ops, "host_syncs": c.syncs, "top_ops": c.ops.most_common(12)}
        print(f"{key}: forward {ms:.3f} ms, {sum(c.ops.values())} ops "
              f"({sum(c.ops.values()) / spec.num_layers:.1f} per layer; {meta_ops} of them the metadata's), "
              f"{c.syncs} host syncs", flush=True)
    has_compile = "compile" in Config.model_fields["model"].annotation.model_fields
    res["tpot_default"] = llm_tpot(args.model, None)  # the tree's default (model.compile auto where it has it)
    print(f"LLM TPOT, the default config {res['tpot_default']['tpot_ms']:.3f} ms", flush=True)
    res["tpot_eager"] = llm_tpot(args.model, "off" if has_compile else None)
    print(f"LLM TPOT eager {res['tpot_eager']['tpot_ms']:.3f} ms", flush=True)
    if has_compile:
        res["tpot_compiled"] = llm_tpot(args.model, "on")
        c = res["tpot_compiled"]["compile"]
        print(f"LLM TPOT compiled {res['tpot_compiled']['tpot_ms']:.3f} ms (warm-up {c['compile_warm_up_s']:.1f} s for "
              f"{len(c['compile_buckets'])} buckets; recompiles after it {c['compile_recompiles_after_warm_up']})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
