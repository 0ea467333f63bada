"""Continuous batching and `dspark run` (issue 5): serving throughput and latency under load.

    python launch/bench_serving.py [--model PATH] [--threads 1] [--num-requests 64] [--json OUT]

throughput  A mixed workload (synthetic prompts of 8-256 tokens, 8-256 output tokens each, all
            arriving at t=0) through `runner.run_experiment` with executor local and executor ray
            (tensor 1), against transformers `generate` with static batches of 16 over the same
            requests in arrival order (left-padded; each batch decodes to its longest requested
            output, and only the requested tokens count as output). Repeats are interleaved,
            rotating the order; medians are reported.
latency     TTFT and TPOT p50 / p99 under Poisson arrivals at four request rates (--rate-factors),
            fractions of the measured saturation rate (engine output tokens/s at t=0 arrivals / mean
            output length): below, near and past it; with the tokens delivered while arrivals
            continue, and the cost of decode-only steps against steps that carry a prefill chunk.
probe       one step in process: 22 decodes alone, one 256-token prefill alone, both in one step.

Ray is started once (`ray.init(address="local", num_cpus=8)`). Reports go under --out-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from dspark_cluster import load_config
from dspark_cluster.config import ASSETS_DIR
from dspark_cluster.model.spec import load_spec
from dspark_cluster.report import loadavg
from dspark_cluster.report import machine_info as machine
from dspark_cluster.runner import run_experiment
from dspark_cluster.workload import make_workload


def make_cfg(args, executor: str, rate: float, name: str, num_requests=None):
    return load_config(None, [
        f"model.path={args.model}",
        "model.dtype=float32",
        f"model.compile={args.compile}",
        f"parallel.executor={executor}",
        "parallel.tensor=1",
        f"parallel.threads_per_worker={args.threads}",
        "workload.kind=synthetic",
        f"workload.num_requests={num_requests or args.num_requests}",
        f"workload.prompt_len=[{args.prompt_len[0]},{args.prompt_len[1]}]",
        f"workload.output_len=[{args.output_len[0]},{args.output_len[1]}]",
        f"workload.request_rate={rate}",
        "workload.temperature=0.0",
        "workload.ignore_eos=true",
        f"workload.seed={args.seed}",
        f"report.out_dir={args.out_dir}",
        f"report.name={name}",
    ])


def run_engine(args, executor: str, rate: float, name: str, num_requests=None) -> dict:
    rep = run_experiment(make_cfg(args, executor, rate, name, num_requests), progress=False)
    s = rep["summary"]
    out = {k: s[k] for k in ("output_tokens_per_s", "output_tokens", "duration_s", "ttft_p50_s", "ttft_p99_s",
                             "tpot_p50_s", "tpot_p99_s", "e2e_p50_s", "e2e_p99_s", "mean_batch_size", "steps",
                             "preemptions", "requests")}
    # tokens delivered while requests were still arriving: the offered load when the engine keeps
    # up, its capacity when it does not (the tail after the last arrival is left out)
    reqs = rep["requests"]
    arrivals = sorted(r["arrival_time"] for r in reqs)
    if len(arrivals) > 1 and arrivals[-1] > arrivals[0]:
        a0, a1 = arrivals[0], arrivals[-1]
        n = 0
        for r in reqs:
            if r.get("ttft_s") is None:
                continue
            t = r["arrival_time"] + r["ttft_s"]
            n += a0 <= t <= a1
            for gap in r.get("itl_s") or ():
                t += gap
                n += a0 <= t <= a1
        out["tokens_per_s_during_arrivals"] = n / (a1 - a0)
    # step cost: pure decode steps against steps where prefill chunks ride along
    steps = rep["steps"]
    dec = [x["step_time_s"] for x in steps if x["num_tokens"] == x["num_seqs"]]
    mixed = [x for x in steps if x["num_tokens"] > x["num_seqs"]]
    out["decode_step_ms"] = statistics.median(dec) * 1e3 if dec else float("nan")
    out["decode_step_batch"] = statistics.median(x["num_seqs"] for x in steps if x["num_tokens"] == x["num_seqs"]) if dec else float("nan")
    out["mixed_step_ms"] = statistics.median(x["step_time_s"] for x in mixed) * 1e3 if mixed else float("nan")
    out["mixed_steps"] = len(mixed)
    out["mixed_time_share"] = sum(x["step_time_s"] for x in mixed) / max(1e-9, sum(x["step_time_s"] for x in steps))
    return out


def run_hf(model, requests, batch: int, pad_id: int = 0) -> dict:
    """Static batching: batches of `batch` requests in arrival order, left-padded, each decoding to
    the longest requested output of its batch."""
    useful = generated = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch):
            group = requests[i : i + batch]
            prompts = [r.prompt for r in group]
            new = max(r.params.max_tokens for r in group)
            width = max(len(p) for p in prompts)
            ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, p in enumerate(prompts):
                ids[j, width - len(p) :] = torch.tensor(p)
                mask[j, width - len(p) :] = 1
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad_id, eos_token_id=None)
            useful += sum(r.params.max_tokens for r in group)
            generated += new * len(group)
    dt = time.perf_counter() - t0
    return {"output_tokens_per_s": useful / dt, "output_tokens": useful, "generated_tokens": generated, "duration_s": dt}


def mixed_step_probe(model_path, threads: int, n_decodes: int = 22, ctx: int = 300, prefill: int = 256, repeats: int = 5) -> dict:
    """One step's cost, in process: `n_decodes` decode rows (context `ctx`) alone, one `prefill`-token
    prompt alone, and both in one step (what the scheduler does when a request arrives while others
    decode). Also counts the attention query rows the padded layout computes."""
    from dspark_cluster.kv_cache import BlockManager, allocate_kv_cache
    from dspark_cluster.model.attention import build_metadata
    from dspark_cluster.model.loader import load_model
    from dspark_cluster.sampling import SamplingParams
    from dspark_cluster.scheduler import ScheduledSeq
    from dspark_cluster.sequence import Sequence
    from dspark_cluster.step_builder import build_step_input
    from dspark_cluster.step_exec import execute_step

    torch.set_num_threads(threads)
    spec = load_spec(model_path, "float32")
    model = load_model(model_path, spec, device=torch.device("cpu"))
    block = 16
    blocks = (n_decodes + 1) * (-(-(ctx + prefill + 1) // block)) + 1
    allocate_kv_cache(model, blocks, block, torch.device("cpu"))
    bm = BlockManager(blocks, block)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=4, temperature=0)
    decodes = []
    for i in range(n_decodes):
        seq = Sequence(f"d{i}", torch.randint(3, spec.vocab_size, (ctx,), generator=g).tolist(), ctx - 1, params)
        seq.num_computed_tokens = ctx - 1
        bm.allocate(seq.seq_id, ctx)
        decodes.append(ScheduledSeq(seq, 1, start=ctx - 1, samples=True))
    new = Sequence("p", torch.randint(3, spec.vocab_size, (prefill,), generator=g).tolist(), prefill, params)
    bm.allocate(new.seq_id, prefill)
    pre = [ScheduledSeq(new, prefill, start=0, samples=True)]
    cases = {"decodes alone": decodes, "prefill alone": pre, "decodes + prefill in one step": decodes + pre}
    out = {}
    for name, sched in cases.items():
        step = build_step_input(sched, bm.block_tables, block)
        execute_step(model, step)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            execute_step(model, step)
            ts.append(time.perf_counter() - t0)
        _, meta = build_metadata(step.query_lens, step.context_lens, step.block_tables, block)
        out[name] = {"ms": statistics.median(ts) * 1e3,
                     "padded_query_rows": sum(b.num_seqs * b.max_q for b in meta.batches),
                     "real_query_rows": sum(x.num_new_tokens for x in sched)}
    print(f"mixed-step probe: {out}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ASSETS_DIR / "tiny-moe"))
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"), help="model.compile of the engines")
    ap.add_argument("--threads", type=int, default=1, help="torch threads: the engine (local), the shard worker (ray), transformers")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[8, 256])
    ap.add_argument("--output-len", type=int, nargs=2, default=[8, 256])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--executors", default="local,ray", help="engines in the throughput comparison")
    ap.add_argument("--sweep-executors", default="local", help="engines in the Poisson sweep")
    ap.add_argument("--rate-factors", default="0.25,0.5,0.75,1.25", help="request rates as fractions of the saturation rate")
    ap.add_argument("--sweep-requests", type=int, default=96, help="requests per Poisson run")
    ap.add_argument("--rates", default=None, help="explicit request rates (req/s), overrides --rate-factors")
    ap.add_argument("--out-dir", default="/tmp/dspark-bench/serving")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    executors = [e for e in args.executors.split(",") if e]
    sweep_executors = [e for e in args.sweep_executors.split(",") if e]
    if "ray" in executors + sweep_executors:
        import ray

        ray.init(address="local", num_cpus=8, log_to_driver=False)  # a fresh local instance, even beside another
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    spec = load_spec(args.model, "float32")
    requests = make_workload(make_cfg(args, "local", 0.0, "x").workload, spec.vocab_size)
    mean_out = statistics.mean(r.params.max_tokens for r in requests)
    res = {"machine": machine(), "loadavg_start": loadavg(), "args": vars(args), "mean_output_len": mean_out,
           "mean_prompt_len": statistics.mean(len(r.prompt) for r in requests)}

    # ---- throughput, t=0 arrivals -----------------------------------------------------------
    names = executors + ["transformers"]
    runs = {n: [] for n in names}
    run_engine(args, "local", 0.0, "warmup")  # warm-up (allocator, kernels)
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for n in order:
            r = run_hf(hf, requests, args.hf_batch) if n == "transformers" else run_engine(args, n, 0.0, f"tput-{n}-{rep}")
            runs[n].append(r)
            print(f"rep {rep} {n}: {r['output_tokens_per_s']:.0f} output tok/s ({r['duration_s']:.1f} s)", flush=True)
    tput = {n: statistics.median(r["output_tokens_per_s"] for r in runs[n]) for n in names}
    res["throughput"] = {"median_output_tokens_per_s": tput, "runs": runs,
                         "ratio_vs_transformers": {n: tput[n] / tput["transformers"] for n in executors},
                         "transformers_padding_waste": 1 - runs["transformers"][0]["output_tokens"] / runs["transformers"][0]["generated_tokens"]}

    # ---- Poisson sweep ----------------------------------------------------------------------
    sweep = []
    for ex in sweep_executors:
        sat_rate = tput.get(ex, tput[executors[0]]) / mean_out  # requests/s the engine can finish at best
        rates = [float(x) for x in args.rates.split(",")] if args.rates else \
            [round(f * sat_rate, 2) for f in (float(x) for x in args.rate_factors.split(","))]
        for rate in rates:
            r = run_engine(args, ex, rate, f"poisson-{ex}-{rate}", args.sweep_requests)
            r.update(executor=ex, request_rate=rate, saturation_rate=sat_rate, offered_tokens_per_s=rate * mean_out)
            sweep.append(r)
            print(f"poisson {ex} rate {rate}: ttft p50 {r['ttft_p50_s']*1e3:.0f} ms p99 {r['ttft_p99_s']*1e3:.0f} ms, "
                  f"tpot p50 {r['tpot_p50_s']*1e3:.1f} ms p99 {r['tpot_p99_s']*1e3:.1f} ms, {r['output_tokens_per_s']:.0f} tok/s", flush=True)
    res["sweep"] = sweep
    res["mixed_probe"] = mixed_step_probe(args.model, args.threads)
    if "ray" in executors + sweep_executors:
        import ray

        ray.shutdown()
    res["loadavg_end"] = loadavg()
    res["total_s"] = time.perf_counter() - t_start

    # ---- tables -----------------------------------------------------------------------------
    print(f"\n{res['machine']}; threads {args.threads}; load average at start {res['loadavg_start']}, end {res['loadavg_end']}")
    print(f"{args.num_requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens (mean {res['mean_prompt_len']:.0f}), "
          f"outputs {args.output_len[0]}-{args.output_len[1]} (mean {mean_out:.0f}), all at t=0; {args.repeats} interleaved repeats")
    print("| system | output tok/s (median) | runs | vs transformers | mean batch | steps | decode step ms (batch) | mixed step ms, count, share of time |")
    print("|---|---|---|---|---|---|---|---|")
    for n in names:
        rr = runs[n]
        extra = (f"{statistics.median(r['mean_batch_size'] for r in rr):.1f} | {statistics.median(r['steps'] for r in rr):.0f} | "
                 f"{statistics.median(r['decode_step_ms'] for r in rr):.1f} ({rr[0]['decode_step_batch']:.0f}) | "
                 f"{statistics.median(r['mixed_step_ms'] for r in rr):.1f}, {rr[0]['mixed_steps']}, "
                 f"{statistics.median(r['mixed_time_share'] for r in rr):.0%}"
                 if n != "transformers" else f"{args.hf_batch} (static) | - | - | -")
        runs_s = ", ".join(f"{r['output_tokens_per_s']:.0f}" for r in rr)
        print(f"| {n} | {tput[n]:.0f} | {runs_s} | "
              f"{tput[n] / tput['transformers']:.2f}x | {extra} |")
    print(f"transformers static batches: {res['throughput']['transformers_padding_waste']:.0%} of generated tokens past a request's own length")
    if sweep:
        print("\nPoisson arrivals (saturation rate = engine output tok/s at t=0 / mean output length)")
        print(f"{args.sweep_requests} requests per rate; delivered tok/s = output tokens made between the first and the last arrival / that span")
        print("| executor | rate (req/s) | x saturation | offered tok/s | delivered tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | mean batch | decode step ms (batch) | mixed step ms, count, share of time |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in sweep:
            print(f"| {r['executor']} | {r['request_rate']:.2f} | {r['request_rate'] / r['saturation_rate']:.2f} | "
                  f"{r['offered_tokens_per_s']:.0f} | {r.get('tokens_per_s_during_arrivals', float('nan')):.0f} | "
                  f"{r['ttft_p50_s']*1e3:.0f} / {r['ttft_p99_s']*1e3:.0f} | {r['tpot_p50_s']*1e3:.1f} / {r['tpot_p99_s']*1e3:.1f} | "
                  f"{r['mean_batch_size']:.1f} | {r['decode_step_ms']:.1f} ({r['decode_step_batch']:.0f}) | "
                  f"{r['mixed_step_ms']:.1f}, {r['mixed_steps']}, {r['mixed_time_share']:.0%} |")
    mp_ = res["mixed_probe"]
    print("\nOne step, in process (22 decodes at context 300; one 256-token prompt): query rows padded to the longest of their attention batch (decodes / longer queries)")
    print("| step | ms | query rows computed (padded) | query rows needed |")
    print("|---|---|---|---|")
    for name, r in mp_.items():
        print(f"| {name} | {r['ms']:.1f} | {r['padded_query_rows']} | {r['real_query_rows']} |")
    print(f"\ntotal time {res['total_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
