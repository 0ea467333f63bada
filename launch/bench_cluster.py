"""Sharded execution on Ray (issue 4): collective bytes per decode step, Ray overhead, TP scaling.

    python launch/bench_cluster.py [--model PATH] [--parts comm,overhead,scaling,noray] [--json OUT]
    python launch/bench_cluster.py --parts scaling,noray --big-model /tmp/dspark-bench/qwen3moe-h2048 \
        --big-hidden 2048 --big-moe-inter 2048      # the same scaling with 4x the FLOPs per token

comm      bytes each rank sends per decode step (all-reduce / all-gather / all-to-all), read from the
          workers' own counters (`Router.comm_stats`), at tensor = 2 and 4, against an analytic count.
          Decode-only bytes = counters(prefill + N decode steps) - counters(the same prefill alone),
          divided by N. The analytic all-to-all count replays the same tokens through the
          in-process model and records each token's top-k experts, so it is exact, not an expectation.
overhead  decode step time (RequestOutput.metrics["tpot_s"], 128-token greedy generation, batch 1)
          through the cluster at tensor = 1 (Router actor + one ShardWorker over a Ray compiled
          graph; with async scheduling, the default, and without) against the in-process engine
          (executor local), one thread each, interleaved; then
          where the difference goes: both executors behind the same AsyncEngine (engine step time vs
          the period between steps), a pickle round trip of a decode StepInput / StepOutput, and the
          compiled graph's own round trip over a do-nothing actor with those payloads.
scaling   prefill throughput (prompt tokens/s; 8 prompts x 256 tokens, max_tokens=1) at tensor = 2
          vs tensor = 1, one thread per worker, on a random Qwen3-MoE checkpoint with hidden 1024
          (built once under /tmp), configurations alternated A B B A.
noray     the same prefill step as plain processes (torch.distributed + gloo, the same shards and
          execute_step, no Router, no compiled graph), with the time each rank spends inside each
          collective, and gloo's own bandwidth on this machine.

Ray is started once (`ray.init(address="local", num_cpus=8)`); each LLM is shut down before the next starts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from dspark_cluster import LLM, SamplingParams
from dspark_cluster.config import ASSETS_DIR
from dspark_cluster.model.spec import load_spec
from dspark_cluster.report import loadavg
from dspark_cluster.report import machine_info as machine

KINDS = ("all_reduce", "all_gather", "all_to_all")






def random_prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def ray_llm(path, tp, threads=1, **sched):
    cfg = {"model": {"dtype": "float32"},
           "parallel": {"executor": "ray", "tensor": tp, "threads_per_worker": threads}}
    if sched:
        cfg["scheduler"] = sched
    return LLM(path, config=cfg)


def comm_stats(llm) -> list[dict]:
    import ray

    return ray.get(llm.router.comm_stats.remote())


def diff(a: list[dict], b: list[dict]) -> list[dict]:
    """Per rank: b - a, bytes and calls."""
    return [{f: {k: rb[f][k] - ra[f][k] for k in KINDS} for f in ("bytes", "calls")} for ra, rb in zip(a, b)]


# ---- (a) bytes per decode step -----------------------------------------------------------------
def record_routing(path, seqs):
    """Top-k expert ids of every token of every sequence, per MoE layer, from the in-process model
    (teacher-forced: the same tokens the sharded run decoded). Returns [seq][layer] -> ids [len, k]."""
    from dspark_cluster.model import layers

    captured = []
    orig = layers.route

    def spy(logits, spec, bias=None):
        w, ids = orig(logits, spec, bias)
        captured.append(ids.clone())
        return w, ids

    layers.route = spy
    llm = LLM(path, config={"model": {"dtype": "float32"}, "parallel": {"executor": "local", "threads_per_worker": 1}})
    try:
        out = []
        for s in seqs:  # one request at a time: one prefill step, in order, no chunking for these lengths
            captured.clear()
            llm.generate([s], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            out.append(list(captured))
    finally:
        layers.route = orig
        llm.shutdown()
    return out


def analytic_decode_bytes(spec, tp, routing, prompt_lens, n_steps):
    """Bytes each rank sends per decode step, averaged over the n_steps decode steps, counted the
    way parallel/comm.py and parallel/expert_parallel.py count them. Returns (per-rank list of
    {kind: bytes}, per-rank calls)."""
    H, V, f32 = spec.hidden_size, spec.vocab_size, 4
    n_moe = sum(spec.moe_layers)
    n_layers = spec.num_layers
    has_shared = bool(spec.shared_intermediate_size)
    B = len(prompt_lens)
    E = spec.num_experts
    spr = E // tp  # default placement: slot = expert, rank r holds experts [r*spr, (r+1)*spr)
    chunk = -(-B // tp)
    vocab_shard = -(-V // tp)
    ring = 2 * (tp - 1) / tp
    # all-reduces per step: embedding + attention per layer + dense MLP / shared expert per layer
    n_ar = 1 + n_layers + (n_layers - n_moe) + (n_moe if has_shared else 0)
    ar = n_ar * B * H * f32 * ring
    ag = n_moe * chunk * H * f32 * (tp - 1) + B * vocab_shard * f32 * (tp - 1)
    a2a = [0.0] * tp
    for step in range(n_steps):
        for layer in range(n_moe):
            # the step's tokens in schedule order: sequence b's input at position prompt_len + step
            ids = torch.stack([routing[b][layer][prompt_lens[b] + step] for b in range(B)])  # [B, k]
            sent = [[0] * tp for _ in range(tp)]  # sent[src][dst] assignments
            for r in range(tp):
                for t in range(min(B, r * chunk), min(B, (r + 1) * chunk)):
                    for e in ids[t].tolist():
                        sent[r][e // spr] += 1
            for r in range(tp):
                out_rows = sum(sent[r][d] for d in range(tp) if d != r)
                back_rows = sum(sent[s][r] for s in range(tp) if s != r)
                # hidden rows + int64 slot ids out; expert outputs back to their senders
                a2a[r] += out_rows * (H * f32 + 8) + back_rows * H * f32
    per_rank = [{"all_reduce": ar, "all_gather": ag, "all_to_all": a2a[r] / n_steps} for r in range(tp)]
    calls = {"all_reduce": n_ar, "all_gather": n_moe + 1, "all_to_all": 3 * n_moe}
    return per_rank, calls


def bench_comm(path, tps, batches, prompt_len, n_steps):
    spec = load_spec(path, "float32")
    rows = []
    for B in batches:
        prompts = random_prompts([prompt_len + 8 * (b % 3) for b in range(B)], spec.vocab_size, seed=B)
        for tp in tps:
            llm = ray_llm(path, tp)
            try:
                s0 = comm_stats(llm)
                llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
                s1 = comm_stats(llm)
                outs = llm.generate(prompts, SamplingParams(max_tokens=n_steps + 1, temperature=0, ignore_eos=True))
                s2 = comm_stats(llm)
            finally:
                llm.shutdown()
            prefill, both = diff(s0, s1), diff(s1, s2)
            measured = [{f: {k: (both[r][f][k] - prefill[r][f][k]) / n_steps for k in KINDS} for f in ("bytes", "calls")}
                        for r in range(tp)]
            seqs = [p + o.token_ids[:n_steps] for p, o in zip(prompts, outs)]
            routing = record_routing(path, seqs)
            expect, calls = analytic_decode_bytes(spec, tp, routing, [len(p) for p in prompts], n_steps)
            rows.append({"batch": B, "tensor": tp, "measured": measured, "analytic": expect, "analytic_calls": calls,
                             "prefill_tokens": sum(len(p) for p in prompts),
                             "prefill_bytes_rank0": {k: prefill[0]["bytes"][k] for k in KINDS}})
            print(f"comm B={B} tp={tp}: measured rank0 {measured[0]['bytes']} analytic rank0 {expect[0]}", flush=True)
    return rows


# ---- (b) Ray overhead at tensor = 1 -----------------------------------------------------------
def proc_cpu() -> dict:
    """CPU seconds used so far by this driver, the Router actor, the ShardWorkers, and the whole
    machine (all processes), read from /proc."""
    tck = os.sysconf("SC_CLK_TCK")
    out = {"driver": 0.0, "router": 0.0, "workers": 0.0}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        t = (int(st[11]) + int(st[12])) / tck
        if int(pid) == os.getpid():
            out["driver"] += t
        elif cmd.startswith("ray::Router"):
            out["router"] += t
        elif cmd.startswith("ray::ShardWorker"):
            out["workers"] += t
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    out["machine"] = (sum(cpu) - cpu[3] - cpu[4]) / tck  # all but idle and iowait
    return out


def cpu_delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a}


OVERHEAD_ARMS = ("local", "ray", "ray_sync")  # ray: async scheduling (the default); ray_sync: switched off


def bench_overhead(path, repeats, new_tokens, prompt_len):
    """The Ray cluster is started and shut down around each of its measurements: an idle compiled
    graph keeps its reader polling, which would steal a core from the in-process run. The arms are
    interleaved, their order rotated every repeat."""
    spec = load_spec(path, "float32")
    prompt = random_prompts([prompt_len], spec.vocab_size, seed=1)[0]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    torch.set_num_threads(1)
    local = LLM(path, config={"model": {"dtype": "float32"}, "parallel": {"executor": "local", "threads_per_worker": 1}})
    res = {name: [] for name in OVERHEAD_ARMS}
    cpu = {name: [] for name in OVERHEAD_ARMS}
    outs = {}
    try:
        local.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
        for i in range(repeats):
            for name in OVERHEAD_ARMS[i % 3:] + OVERHEAD_ARMS[: i % 3]:
                if name != "local":
                    llm = ray_llm(path, 1, async_scheduling=name == "ray")
                    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
                else:
                    llm = local
                try:
                    c0 = proc_cpu()
                    t0 = time.perf_counter()
                    o = llm.generate([prompt], params)[0]
                    wall = time.perf_counter() - t0
                    cpu[name].append({k: v / wall for k, v in cpu_delta(c0, proc_cpu()).items()})
                finally:
                    if name != "local":
                        llm.shutdown()
                        time.sleep(1.0)  # let the actors exit
                outs[name] = o.token_ids
                res[name].append((o.metrics["tpot_s"], o.metrics["ttft_s"]))
    finally:
        local.shutdown()
    tpot = {name: statistics.median(t for t, _ in res[name]) for name in OVERHEAD_ARMS}
    out = {"repeats": repeats, "identical_outputs": outs["local"] == outs["ray"] == outs["ray_sync"], "raw": res,
           "cores_busy": {name: {k: statistics.median(c[k] for c in cpu[name]) for k in cpu[name][0]} for name in cpu}}
    for name in OVERHEAD_ARMS:
        out[f"{name}_tpot_ms"] = tpot[name] * 1e3
        out[f"{name}_ttft_ms"] = statistics.median(t for _, t in res[name]) * 1e3
        if name != "local":
            out[f"{name}_ratio"] = tpot[name] / tpot["local"]
            out[f"{name}_ratio_of_pairs_median"] = statistics.median(r[0] / l[0] for l, r in zip(res["local"], res[name]))
    print("overhead: " + "  ".join(f"{n} {tpot[n]*1e3:.2f} ms" for n in OVERHEAD_ARMS) +
          f"  ratios {out['ray_ratio']:.2f}x (sync {out['ray_sync_ratio']:.2f}x)", flush=True)
    return out


def overhead_breakdown(path, repeats, new_tokens, prompt_len, out_dir="/tmp/dspark-bench/overhead"):
    """Both executors behind the same AsyncEngine (runner.run_experiment, one request): the
    engine's own step timer (`step_time_s`: schedule + execute + update; for ray the execute is the
    compiled-graph round trip) against the period between steps, decode steps only."""
    from dspark_cluster import load_config
    from dspark_cluster.runner import run_experiment

    rows = {name: [] for name in OVERHEAD_ARMS}
    for i in range(repeats):
        for ex in OVERHEAD_ARMS[i % 3:] + OVERHEAD_ARMS[: i % 3]:
            executor = "local" if ex == "local" else "ray"
            cfg = load_config(None, [f"model.path={path}", "model.dtype=float32", f"parallel.executor={executor}",
                                     f"scheduler.async_scheduling={ex == 'ray'}",
                                     "parallel.threads_per_worker=1", "workload.kind=synthetic", "workload.num_requests=1",
                                     f"workload.prompt_len=[{prompt_len},{prompt_len}]",
                                     f"workload.output_len=[{new_tokens},{new_tokens}]", f"report.out_dir={out_dir}",
                                     f"report.name={ex}-{i}"])
            rep = run_experiment(cfg, progress=False)
            steps = [s for s in rep["steps"] if s["num_tokens"] == 1]
            periods = sorted(b["time"] - a["time"] for a, b in itertools.pairwise(steps))
            period = statistics.median(periods)
            rows[ex].append({"step_ms": statistics.median(s["step_time_s"] for s in steps) * 1e3,
                             "execute_ms": statistics.median(s["execute_s"] for s in steps) * 1e3,
                             "forward_ms": statistics.median(s["forward_s"] for s in steps) * 1e3,
                             "wire_ms": statistics.median(s.get("wire_s", 0.0) for s in steps) * 1e3,
                             "worker_extra_ms": statistics.median(s["worker_s"] - s["forward_s"] for s in steps) * 1e3
                             if ex != "local" else 0.0,
                             "worker_between_ms": statistics.median(s["worker_between_s"] for s in steps) * 1e3,
                             "period_ms": period * 1e3, "tpot_ms": rep["summary"]["tpot_p50_s"] * 1e3,
                             # the tail a mean TPOT feels and a median period does not
                             "period_p99_ms": periods[int(0.99 * (len(periods) - 1))] * 1e3,
                             "slow_period_share": sum(p > 2 * period for p in periods) / len(periods)})
            if ex != "local":
                time.sleep(1.0)
    out = {ex: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for ex, rs in rows.items()}
    print(f"overhead breakdown (AsyncEngine both): {out}", flush=True)
    return out


def decode_step_payloads(path):
    """A batch-1 decode step's StepInput (128-token context) and a StepOutput as a worker returns it."""
    from dspark_cluster.kv_cache import BlockManager
    from dspark_cluster.scheduler import Scheduler
    from dspark_cluster.sequence import Sequence
    from dspark_cluster.step import StepOutput
    from dspark_cluster.step_builder import build_step_input

    bm = BlockManager(64, 16)
    sc = Scheduler(bm, 4, 2048, 4096)
    sc.add(Sequence("a", list(range(3, 131)), 128, SamplingParams(max_tokens=4, temperature=0)))
    prefill = sc.schedule().scheduled
    sc.update(prefill, {prefill[0].seq.seq_id: [5]})  # the prompt's KV is computed, one token out
    step = build_step_input(sc.schedule().scheduled, bm.block_tables, 16)
    spec = load_spec(path, "float32")
    load = torch.zeros(sum(spec.moe_layers), spec.num_experts, dtype=torch.long)
    return step, StepOutput(sampled=torch.tensor([[5]]), num_tokens=torch.tensor([1]), expert_load=load)


def as_numpy_fields(obj) -> dict:
    """A dataclass's fields, tensors as numpy arrays."""
    import dataclasses

    return {f.name: (getattr(obj, f.name).numpy() if isinstance(getattr(obj, f.name), torch.Tensor)
                     else getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def serialization_cost(path) -> dict:
    """Pickle round trip of a batch-1 decode StepInput and its StepOutput (their tensors pickled as
    numpy by `__getstate__`), against the same fields as a plain dict of numpy arrays."""
    import pickle

    step, out = decode_step_payloads(path)

    def rt(obj, n=200):
        t0 = time.perf_counter()
        for _ in range(n):
            b = pickle.dumps(obj, protocol=5)
        t1 = time.perf_counter()
        for _ in range(n):
            pickle.loads(b)
        return (t1 - t0) / n * 1e6, (time.perf_counter() - t1) / n * 1e6, len(b)

    n_tensors = sum(isinstance(v, torch.Tensor) for v in vars(step).values())
    res = {"step_input_tensors": n_tensors, "step_input_torch_us": rt(step),
           "step_input_numpy_us": rt(as_numpy_fields(step)), "step_output_torch_us": rt(out)}
    print(f"serialization: {res}", flush=True)
    return res


class _Echo:
    """A do-nothing shard worker: returns a fixed reply, for the compiled graph's own round trip."""

    def __init__(self, reply, busy_ms: float = 0.0):
        self.reply, self.busy_s = reply, busy_ms / 1e3

    def step(self, step_input):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.busy_s:  # stands in for a forward that keeps its core busy
            pass
        return self.reply


def compiled_graph_roundtrip(path, n=300) -> dict:
    """Round trip of a Ray compiled graph over one do-nothing actor (as Cluster builds it), with the
    payloads a batch-1 decode step carries: the StepInput / StepOutput objects, the same fields as
    numpy dicts, the pickled bytes Cluster sends, a bare int, and the bytes again with a worker that
    keeps its core busy for 4 ms per call (reported minus the 4 ms)."""
    import ray
    from ray.dag import InputNode, MultiOutputNode

    from dspark_cluster.step import to_wire

    step, reply = decode_step_payloads(path)
    cases = {"StepInput -> StepOutput objects": (step, reply),
             "numpy field dicts": (as_numpy_fields(step), as_numpy_fields(reply)),
             "to_wire bytes (what Cluster sends)": (to_wire(step), to_wire(reply)), "int -> int": (1, 1),
             "to_wire bytes, worker busy 4 ms (minus the 4 ms)": (to_wire(step), to_wire(reply))}
    out = {}
    for name, (payload, rep) in cases.items():
        busy_ms = 4.0 if "busy" in name else 0.0
        actor = ray.remote(_Echo).options(num_cpus=1).remote(rep, busy_ms)
        with InputNode() as inp:
            dag = MultiOutputNode([actor.step.bind(inp)])
        cdag = dag.experimental_compile()
        try:
            for _ in range(20):
                ray.get(cdag.execute(payload))
            t0 = time.perf_counter()
            for _ in range(n):
                ray.get(cdag.execute(payload))
            out[name] = (time.perf_counter() - t0) / n * 1e3 - busy_ms
        finally:
            cdag.teardown()
            ray.kill(actor)
        time.sleep(0.5)
    print(f"compiled graph round trip (ms): {out}", flush=True)
    return out


# ---- (c) TP scaling on a compute-heavy checkpoint ---------------------------------------------
def build_big_checkpoint(path: Path, hidden: int, layers: int, vocab: int, experts: int, moe_inter: int) -> Path:
    if (path / "config.json").is_file():
        return path
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=moe_inter,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, head_dim=hidden // 16,
        num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
        max_position_embeddings=2048, initializer_range=0.02, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    return path


def bench_scaling(path, cycles, repeats, n_prompts, prompt_len):
    spec = load_spec(path, "float32")
    prompts = random_prompts([prompt_len] * n_prompts, spec.vocab_size, seed=2)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ntok = n_prompts * prompt_len
    times = {1: [], 2: []}
    comm, cores = {}, {}
    for c in range(cycles):
        for tp in ((1, 2) if c % 2 == 0 else (2, 1)):
            llm = ray_llm(path, tp, max_num_batched_tokens=max(2048, ntok))
            try:
                llm.generate(prompts[:2], params)  # warm-up
                s0 = comm_stats(llm)
                c0 = proc_cpu()
                t_all = time.perf_counter()
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    llm.generate(prompts, params)
                    times[tp].append(time.perf_counter() - t0)
                t_all = time.perf_counter() - t_all
                cores.setdefault(tp, []).append({k: v / t_all for k, v in cpu_delta(c0, proc_cpu()).items()})
                s1 = comm_stats(llm)
                comm[tp] = {k: diff(s0, s1)[0]["bytes"][k] / repeats for k in KINDS}
            finally:
                llm.shutdown()
            print(f"scaling cycle {c} tp={tp}: {[f'{ntok / t:.0f}' for t in times[tp][-repeats:]]} tok/s", flush=True)
    t1, t2 = statistics.median(times[1]), statistics.median(times[2])
    H, I, E, L = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts, spec.num_layers
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    attn_proj = 2 * H * (q_out + 2 * kv_out) + 2 * q_out * H  # FLOPs per token
    attn_sdpa = 2 * 2 * spec.num_heads * spec.head_dim * (prompt_len + 1) / 2  # causal QK^T + PV, per token
    experts = spec.top_k * 2 * 3 * H * I
    gate = 2 * H * E
    flops = ntok * L * (attn_proj + attn_sdpa + experts + gate) + n_prompts * 2 * H * spec.vocab_size
    out = {"tp1_tok_s": ntok / t1, "tp2_tok_s": ntok / t2, "speedup": t1 / t2, "tp1_s": t1, "tp2_s": t2, "prompt_tokens": ntok,
               "flops_per_prefill": flops, "tp1_gflops": flops / t1 / 1e9, "tp2_gflops": flops / t2 / 1e9,
               "comm_bytes_per_prefill_rank0": comm,
               "cores_busy": {tp: {k: statistics.median(c[k] for c in v) for k in v[0]} for tp, v in cores.items()}, "raw": {str(k): v for k, v in times.items()},
               "model": {"hidden": H, "layers": L, "vocab": spec.vocab_size, "experts": E, "moe_intermediate": I,
                          "heads": spec.num_heads, "kv_heads": spec.num_kv_heads}}
    print(f"scaling: tp1 {ntok/t1:.0f} tok/s, tp2 {ntok/t2:.0f} tok/s, speedup {t1/t2:.2f}x", flush=True)
    return out


def _spmd_worker(rank, world, port, path, n_prompts, prompt_len, repeats, q):
    """One process of the Ray-free diagnostic: the same shard, collectives and execute_step as a
    ShardWorker, driven by a plain loop (no Router, no compiled graph)."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from dspark_cluster.config import load_config
    from dspark_cluster.kv_cache import BlockManager
    from dspark_cluster.sampling import SamplingParams as SP
    from dspark_cluster.scheduler import Scheduler
    from dspark_cluster.sequence import Sequence
    from dspark_cluster.step_builder import build_step_input
    from dspark_cluster.worker import Worker, WorkerConfig
    from parallel.state import init_parallel, shutdown_parallel

    comm_time = {"all_reduce": 0.0, "all_gather": 0.0, "all_to_all_single": 0.0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                comm_time[name] += time.perf_counter() - t0
        return wrapper

    for name in comm_time:  # time spent inside each collective (waiting for the peer included)
        setattr(dist, name, timed(name, getattr(dist, name)))
    state = init_parallel(rank, world, world, "127.0.0.1", port, "gloo", torch.device("cpu"))
    spec = load_spec(path, "float32")
    block = 16
    cfg = load_config({"model": {"path": path, "dtype": "float32"}, "scheduler": {"block_size": block}})
    # the ShardWorker's own worker (shard, expert slots, dispatch), only not behind Ray
    worker = Worker(WorkerConfig.of(cfg), spec, "cpu", rank, world, state)
    blocks = n_prompts * (-(-(prompt_len + 1) // block)) + 4
    worker.allocate_kv(blocks)
    prompts = random_prompts([prompt_len] * n_prompts, spec.vocab_size, seed=2)
    times, comms = [], []
    for _ in range(repeats + 1):  # the first is a warm-up
        bm = BlockManager(blocks, block)
        sched = Scheduler(bm, n_prompts, n_prompts * prompt_len, 4 * prompt_len)
        for i, p in enumerate(prompts):
            sched.add(Sequence(f"r{i}", list(p), len(p), SP(max_tokens=1, temperature=0)))
        out = sched.schedule()
        step = build_step_input(out.scheduled, bm.block_tables, block)
        dist.barrier()
        c0 = dict(comm_time)
        t0 = time.perf_counter()
        worker.execute(step)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        comms.append({k: comm_time[k] - c0[k] for k in comm_time})
    q.put((rank, times[1:], comms[1:], os.times().user + os.times().system))
    shutdown_parallel()


def _gloo_worker(rank, world, port, q):
    import torch.distributed as dist

    torch.set_num_threads(1)
    from parallel.state import join_rendezvous

    dist.init_process_group("gloo", store=join_rendezvous("127.0.0.1", port), rank=rank, world_size=world)
    res = {}
    n = 8 * 2**20 // 4  # 8 MiB of fp32
    x = torch.randn(n)
    ops = {"all_reduce": (lambda: dist.all_reduce(x), n * 4 * 2 * (world - 1) / world),
           "all_gather": (lambda: dist.all_gather([torch.empty(n // world) for _ in range(world)], x[: n // world]),
                          n // world * 4 * (world - 1)),
           "all_to_all": (lambda: dist.all_to_all_single(torch.empty(n), x), n * 4 * (world - 1) / world)}
    for name, (fn, sent) in ops.items():
        fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        dist.barrier()
        dt = (time.perf_counter() - t0) / 10
        res[name] = {"ms": dt * 1e3, "sent_MB_per_s": sent / dt / 1e6}
    if rank == 0:
        q.put(res)
    dist.destroy_process_group()


def gloo_bandwidth(world=2) -> dict:
    """gloo collectives over loopback between `world` 1-thread processes, 8 MiB tensors; bytes sent
    per rank counted the way parallel/comm.py counts them."""
    import torch.multiprocessing as mp

    from parallel.state import open_rendezvous

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    rendezvous = open_rendezvous()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, rendezvous.port, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    print(f"gloo bandwidth: {res}", flush=True)
    return res


def bench_scaling_noray(path, repeats, n_prompts, prompt_len, rounds=2):
    """Prefill step time of the same sharded forward at tensor 1 and 2 in plain processes."""
    import torch.multiprocessing as mp

    from parallel.state import open_rendezvous

    ctx = mp.get_context("spawn")
    times = {1: [], 2: []}
    comm = {1: [], 2: []}
    for r in range(rounds):
        for world in ((1, 2) if r % 2 == 0 else (2, 1)):
            q = ctx.Queue()
            rendezvous = open_rendezvous()
            args = (world, rendezvous.port, path, n_prompts, prompt_len, repeats, q)
            procs = [ctx.Process(target=_spmd_worker, args=(rank, *args)) for rank in range(world)]
            for p in procs:
                p.start()
            got = sorted(q.get(timeout=600) for _ in range(world))
            times[world] += got[0][1]
            comm[world] += [{k: v for k, v in c.items()} | {"rank": rank} for rank, _, cs, _ in got for c in cs]
            for p in procs:
                p.join(timeout=60)
            print(f"no-Ray round {r} tensor {world}: {[f'{t:.3f}' for t in times[world][-repeats:]]} s", flush=True)
    ntok = n_prompts * prompt_len
    t1, t2 = statistics.median(times[1]), statistics.median(times[2])
    in_comm = {rank: {k: statistics.median(c[k] for c in comm[2] if c["rank"] == rank)
                      for k in ("all_reduce", "all_gather", "all_to_all_single")} for rank in (0, 1)}
    for rank, c in in_comm.items():
        print(f"no-Ray tensor 2 rank {rank}: seconds inside collectives per prefill " +
              ", ".join(f"{k} {v:.3f}" for k, v in c.items()), flush=True)
    return {"tp1_s": t1, "tp2_s": t2, "tp1_tok_s": ntok / t1, "tp2_tok_s": ntok / t2, "speedup": t1 / t2, "raw": times,
                "tp2_seconds_in_collectives": in_comm}


def fmt_b(x: float) -> str:
    return f"{x:,.0f}"


def print_tables(res):
    print(f"\n{res['machine']}; load average at start {res['loadavg_start']}, end {res['loadavg_end']}")
    if "comm" in res:
        print("\nBytes sent per rank per decode step (rank 0 / mean over ranks), measured vs analytic")
        print("| batch | tensor | all-reduce measured | analytic | all-gather measured | analytic | all-to-all rank 0 measured | analytic | all-to-all mean/rank measured | analytic | calls/step AR/AG/A2A measured | analytic |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in res["comm"]:
            m, a = r["measured"], r["analytic"]
            tp = r["tensor"]
            mean_m = sum(x["bytes"]["all_to_all"] for x in m) / tp
            mean_a = sum(x["all_to_all"] for x in a) / tp
            calls = "/".join(f"{m[0]['calls'][k]:g}" for k in KINDS)
            acalls = "/".join(str(r["analytic_calls"][k]) for k in KINDS)
            print(f"| {r['batch']} | {tp} | {fmt_b(m[0]['bytes']['all_reduce'])} | {fmt_b(a[0]['all_reduce'])} | "
                  f"{fmt_b(m[0]['bytes']['all_gather'])} | {fmt_b(a[0]['all_gather'])} | "
                  f"{fmt_b(m[0]['bytes']['all_to_all'])} | {fmt_b(a[0]['all_to_all'])} | "
                  f"{fmt_b(mean_m)} | {fmt_b(mean_a)} | {calls} | {acalls} |")
    if "overhead" in res:
        o = res["overhead"]
        print(f"\nRay overhead, tensor = 1, batch 1, {o['repeats']} interleaved repeats (medians)")
        print("| executor | TPOT (ms) | TTFT (ms) | TPOT ray / local | median of paired ratios |")
        print("|---|---|---|---|---|")
        labels = {"local": "local (in-process)", "ray": "ray, async scheduling (default)",
                  "ray_sync": "ray, async_scheduling: false"}
        for name in OVERHEAD_ARMS:
            ratio = "" if name == "local" else f"{o[name + '_ratio']:.2f}x | {o[name + '_ratio_of_pairs_median']:.2f}x"
            print(f"| {labels[name]} | {o[name + '_tpot_ms']:.2f} | {o[name + '_ttft_ms']:.1f} | {ratio or ' | '} |")
        print(f"same tokens: {o['identical_outputs']}")
        for name, c in o["cores_busy"].items():
            print(f"cores busy during the {name} generation: " + ", ".join(f"{k} {v:.2f}" for k, v in c.items()))
        if "breakdown" in o:
            print("Both executors behind the same AsyncEngine (run_experiment, 1 request), decode steps, medians:")
            print("| executor | engine step_time_s (ms) | submit + wait for the round (ms) | forward on the driver rank (ms) | "
                  "pickling in the Router (ms) | channel hops + worker pickling (ms) | worker: unpickling + dispatch (ms) | "
                  "worker: from its last output to this input (ms) | period between steps (ms) | TPOT (ms) | "
                  "period p99 (ms) | periods over 2x the median |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|")
            for ex, b in o["breakdown"].items():
                # with async scheduling the round overlaps the Router's work: its parts no longer add up
                rest = "overlapped" if ex == "ray" else f"{b['execute_ms'] - b['forward_ms'] - b.get('wire_ms', 0.0):.2f}"
                print(f"| {ex} | {b['step_ms']:.2f} | {b['execute_ms']:.2f} | {b['forward_ms']:.2f} | "
                      f"{b.get('wire_ms', 0.0):.2f} | {rest} | {b['worker_extra_ms']:.2f} | {b['worker_between_ms']:.2f} | "
                      f"{b['period_ms']:.2f} | {b['tpot_ms']:.2f} | {b['period_p99_ms']:.2f} | {b['slow_period_share']:.0%} |")
        if "serialization" in o:
            z = o["serialization"]
            print(f"pickle round trip (dumps + loads, us / bytes): StepInput ({z['step_input_tensors']} tensors, pickled as numpy) "
                  f"{z['step_input_torch_us'][0]:.0f} + {z['step_input_torch_us'][1]:.0f} us / {z['step_input_torch_us'][2]} B; "
                  f"the same fields as a numpy dict {z['step_input_numpy_us'][0]:.0f} + {z['step_input_numpy_us'][1]:.0f} us / {z['step_input_numpy_us'][2]} B; "
                  f"StepOutput {z['step_output_torch_us'][0]:.0f} + {z['step_output_torch_us'][1]:.0f} us / {z['step_output_torch_us'][2]} B")
        if "roundtrip_ms" in o:
            print("compiled graph round trip over a do-nothing actor (ms): " +
                  "; ".join(f"{k} {v:.2f}" for k, v in o["roundtrip_ms"].items()))
    if "scaling" in res:
        s = res["scaling"]
        print(f"\nTP scaling, prefill {s['prompt_tokens']} prompt tokens, model {s['model']}")
        print("| tensor | prompt tok/s | s per prefill | GFLOP/s | bytes sent by rank 0 (AR / AG / A2A) |")
        print("|---|---|---|---|---|")
        for tp in (1, 2):
            c = s["comm_bytes_per_prefill_rank0"].get(tp, {})
            print(f"| {tp} | {s[f'tp{tp}_tok_s']:.0f} | {s[f'tp{tp}_s']:.3f} | {s[f'tp{tp}_gflops']:.1f} | "
                  f"{' / '.join(fmt_b(c.get(k, 0)) for k in KINDS)} |")
        print(f"speedup tensor 2 / tensor 1: {s['speedup']:.2f}x")
        for tp, c in s["cores_busy"].items():
            print(f"cores busy during tensor {tp} prefills: " + ", ".join(f"{k} {v:.2f}" for k, v in c.items()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ASSETS_DIR / "tiny-moe"))
    ap.add_argument("--parts", default="comm,overhead,scaling,noray",
                    help="noray: the scaling prefill as plain processes (torch.distributed, no Router / compiled graph)")
    ap.add_argument("--tensors", default="2,4")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--comm-prompt-len", type=int, default=32)
    ap.add_argument("--overhead-repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--big-model", default="/tmp/dspark-bench/qwen3moe-h1024")
    ap.add_argument("--big-hidden", type=int, default=1024)
    ap.add_argument("--big-layers", type=int, default=2)
    ap.add_argument("--big-vocab", type=int, default=4096)
    ap.add_argument("--big-moe-inter", type=int, default=1024)
    ap.add_argument("--scaling-cycles", type=int, default=2)
    ap.add_argument("--scaling-repeats", type=int, default=3)
    ap.add_argument("--scaling-prompts", type=int, default=8)
    ap.add_argument("--scaling-prompt-len", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    import ray

    t_start = time.perf_counter()
    os.environ.setdefault("RAY_worker_niceness", "0")  # as the engine's own private instance (ensure_ray)
    ray.init(address="local", num_cpus=8, log_to_driver=False)  # a fresh local instance, even beside another
    res = {"machine": machine(), "loadavg_start": loadavg(), "args": vars(args)}
    try:
        if "comm" in parts:
            res["comm"] = bench_comm(args.model, [int(x) for x in args.tensors.split(",")],
                                     [int(x) for x in args.batches.split(",")], args.comm_prompt_len, args.decode_steps)
        if "overhead" in parts:
            res["overhead"] = bench_overhead(args.model, args.overhead_repeats, args.new_tokens, args.prompt_len)
            res["overhead"]["breakdown"] = overhead_breakdown(args.model, 3, args.new_tokens, args.prompt_len)
            res["overhead"]["serialization"] = serialization_cost(args.model)
            res["overhead"]["roundtrip_ms"] = compiled_graph_roundtrip(args.model)
        if "scaling" in parts:
            big = build_big_checkpoint(Path(args.big_model), args.big_hidden, args.big_layers, args.big_vocab, 8,
                                       args.big_moe_inter)
            res["scaling"] = bench_scaling(str(big), args.scaling_cycles, args.scaling_repeats, args.scaling_prompts,
                                           args.scaling_prompt_len)
        if "noray" in parts:
            big = build_big_checkpoint(Path(args.big_model), args.big_hidden, args.big_layers, args.big_vocab, 8,
                                       args.big_moe_inter)
            res["noray"] = bench_scaling_noray(str(big), args.scaling_repeats, args.scaling_prompts, args.scaling_prompt_len)
            res["noray"]["gloo"] = gloo_bandwidth(2)
    finally:
        ray.shutdown()
    res["loadavg_end"] = loadavg()
    res["total_s"] = time.perf_counter() - t_start
    print_tables(res)
    if "noray" in res:
        n = res["noray"]
        print(f"\nSame prefill step without Ray (plain processes, gloo, execute_step timed between barriers): "
              f"tensor 1 {n['tp1_s']:.3f} s ({n['tp1_tok_s']:.0f} tok/s), tensor 2 {n['tp2_s']:.3f} s ({n['tp2_tok_s']:.0f} tok/s), "
              f"speedup {n['speedup']:.2f}x")
        for rank, c in n["tp2_seconds_in_collectives"].items():
            print(f"  tensor 2, rank {rank}: s inside collectives per prefill (waiting included): " +
                  ", ".join(f"{k} {v:.3f}" for k, v in c.items()))
        if "gloo" in n:
            print("  gloo on this machine, 2 processes, 8 MiB fp32: " +
                  "; ".join(f"{k} {v['ms']:.1f} ms = {v['sent_MB_per_s']:.0f} MB/s sent per rank" for k, v in n["gloo"].items()))
    print(f"\ntotal time {res['total_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
