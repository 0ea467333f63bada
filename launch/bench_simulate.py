"""Benchmarks of the topology simulator (`dspark simulate`).

    python launch/bench_simulate.py speed [--requests 10000]      10k requests, DeepSeek-V3 decode at EP144
    python launch/bench_simulate.py deepseek [--no-overlap]       DeepSeek's published H800 decode figure
    python launch/bench_simulate.py deepseek-prefill              ... and its prefill figure (EP32, cache hits)
    python launch/bench_simulate.py study-eplb [--ep 32]          what redundant experts buy under Zipf loads
    python launch/bench_simulate.py study-spec                    speculation over concurrency on 2 x H200
    python launch/bench_simulate.py study-cost                    cost per million output tokens by topology
    python launch/bench_simulate.py aic                           the point compared with AIConfigurator
    python launch/bench_simulate.py fit-cpu [--write]             the catalog's "cpu" entry, fitted here
    python launch/bench_simulate.py validate-cpu [--fit --write]  simulated vs real `dspark run` here (fitted
                                                                  in the same rounds with --fit)

Each prints a markdown table. DeepSeek-V3 and Qwen3-30B-A3B come from tests/fixtures/hf-configs (config.json
only); the assumptions of each study are in its docstring.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEEPSEEK_V3 = REPO / "tests" / "fixtures" / "hf-configs" / "deepseek-v3"


def write_trace(path: Path, n: int, prompt_len, output_len, seed: int = 0, rate: float = 0.0) -> Path:
    """A JSONL trace of n requests, lengths uniform in the ranges, Poisson arrivals at `rate` (0: all at 0)."""
    rng = np.random.default_rng(seed)
    p = rng.integers(prompt_len[0], prompt_len[1] + 1, n)
    o = rng.integers(output_len[0], output_len[1] + 1, n)
    t = np.concatenate([[0.0], np.cumsum(rng.exponential(1 / rate, n - 1))]) if rate > 0 else np.zeros(n)
    with path.open("w") as f:
        for a, b, c in zip(t, p, o):
            f.write(json.dumps({"arrival_s": float(a), "prompt_len": int(b), "output_len": int(c)}) + "\n")
    return path


def ep144_decode_config(out_dir: str, max_num_seqs: int = 128, redundant: int = 32, batched: int = 8192,
                        data: int = 144) -> dict:
    """DeepSeek's decode deployment (inference system overview, open-infra-index day 6): DeepSeek-V3
    on 18 nodes x 8 H800, EP144, data-parallel attention (tensor 1, data 144), 32 redundant experts,
    the global policy (as DeepSeek in decode; 8 expert groups do not split over 18 nodes)."""
    return {"model": {"path": str(DEEPSEEK_V3), "dtype": "bfloat16"},
            "parallel": {"tensor": 1, "data": data, "executor": "ray"},
            "scheduler": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": batched, "block_size": 64,
                          "kv_cache_memory": 0.9, "max_model_len": 32768},
            "eplb": {"enabled": True, "num_redundant_experts": redundant, "window_steps": 100, "interval_steps": 200,
                     "policy": "global" if data == 144 else "hierarchical", "num_nodes": -(-data // 8)},
            "report": {"out_dir": out_dir}}


def cmd_speed(args) -> None:
    from dspark_cluster import load_config
    from dspark_cluster.simulate import SimOptions, simulate

    tmp = Path(tempfile.mkdtemp())
    trace = write_trace(tmp / "trace.jsonl", args.requests, (args.prompt_min, args.prompt_max),
                        (args.output_min, args.output_max), seed=1)
    cfg = load_config(ep144_decode_config(str(tmp)))
    opts = SimOptions(hardware="H800", precision="fp8", overlap=True, role="decode", host="per_group",
                      trace=str(trace), expert_load={"skew": 0.8}, record_steps=False)
    import os

    t, c = time.perf_counter(), time.process_time()
    report = simulate(cfg, opts, write=False)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    s = report["summary"]
    print("| requests | steps | output tokens | simulated s | wall s | CPU s | load avg | output tok/s per node |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {s['requests']} | {s['steps']} | {s['output_tokens']} | {s['duration_s']:.1f} | {wall:.1f} | {cpu:.1f} | "
          f"{os.getloadavg()[0]:.1f} | {s['output_tokens_per_s_per_node']:.0f} |")


def cmd_deepseek(args) -> None:
    """Decode at EP144 on H800, loaded to DeepSeek's per-user speed: concurrency per GPU swept; the
    row at 20-22 tokens/s per user is the one to compare with ~14.8k output tokens/s per node."""
    from dspark_cluster import load_config
    from dspark_cluster.simulate import SimOptions, simulate

    tmp = Path(tempfile.mkdtemp())
    print("| seqs/GPU | overlap | output tok/s per node | per user tok/s (1/TPOT p50) | mean KV per seq | "
          "step ms | balancedness | top terms |")
    print("|---|---|---|---|---|---|---|---|")
    for seqs in args.seqs:
        for overlap in ((True, False) if args.no_overlap else (True,)):
            n = seqs * 144
            # prompts ~U(3950, 5950), outputs ~U(60, 70): the decode rows hold ~4,989 tokens of KV on average.
            # Decode-only nodes: the prompts' KV arrives from the prefill nodes (no compute here), all at once
            trace = write_trace(tmp / f"t{seqs}.jsonl", n, (3950, 5950), (args.out_min, args.out_max), seed=2)
            cfg = load_config(ep144_decode_config(str(tmp), max_num_seqs=seqs, batched=seqs * 6000))
            opts = SimOptions(hardware="H800", precision="fp8", overlap=overlap, role="decode", host=args.host,
                              trace=str(trace), expert_load={"skew": args.skew}, record_steps=True,
                              eplb_initial="balanced")
            r = simulate(cfg, opts, write=False)
            s = r["summary"]
            steps = [x for x in r["steps"] if x["num_seqs"] >= 0.9 * n]  # the steady part: (nearly) every row decoding
            step_ms = 1e3 * statistics.median(x["step_time_s"] for x in steps) if steps else float("nan")
            out = sum(x["num_seqs"] for x in steps)
            tps_node = out / sum(x["step_time_s"] for x in steps) / 18 if steps else float("nan")
            kv = (statistics.mean(x["kv_blocks_used"] * 64 / max(1, x["num_seqs"]) for x in steps) if steps
                  else float("nan"))
            share = r["simulation"]["time_share_by_term"]
            top = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(share.items(), key=lambda kv: -abs(kv[1]))[:4])
            print(f"| {seqs} | {overlap} | {tps_node:.0f} | {1e3 / step_ms:.1f} | {kv:.0f} | {step_ms:.1f} | "
                  f"{s.get('balancedness_mean', float('nan')):.3f} | {top} |", flush=True)


def cmd_study_eplb(args) -> None:
    """What redundant experts buy at EP144 decode under Zipf loads, with this policy and the plain greedy
    one (DeepSeek's open-source EPLB without the refinement): placement fitted to the expected load."""
    from dspark_cluster import load_config
    from dspark_cluster.simulate import SimOptions, simulate

    tmp = Path(tempfile.mkdtemp())
    n = args.seqs * args.ep
    trace = write_trace(tmp / "t.jsonl", n, (3950, 5950), (60, 70), seed=3)
    print("| skew | redundant | policy | balancedness | output tok/s per node | per user tok/s | moe share | "
          "cost per M output |")
    print("|---|---|---|---|---|---|---|---|")
    for skew in args.skews:
        # slots come in multiples of the world: EP144 takes 288 (32 redundant) or 432 (176); EP32 256, 288, 320
        plan = (((32, "none"), (32, "greedy"), (32, "ours"), (176, "ours")) if args.ep == 144 else
                ((0, "none"), (0, "ours"), (32, "greedy"), (32, "ours"), (64, "ours")))
        for redundant, policy in plan:
            # (EP32 over 4 nodes: the hierarchical policy, 8 expert groups 2 a node)
            cfg = load_config(ep144_decode_config(str(tmp), max_num_seqs=args.seqs, redundant=redundant,
                                                  batched=args.seqs * 6000, data=args.ep))
            cfg.eplb.enabled = policy != "none"  # none: the engine's start placement (replicas of experts 0..31)
            opts = SimOptions(hardware="H800", precision="fp8", overlap=False, role="decode", host="per_group",
                              trace=str(trace), expert_load={"skew": skew},
                              eplb_initial="default" if policy == "none" else "balanced",
                              eplb_refine=policy == "ours", record_steps=True)
            r = simulate(cfg, opts, write=False)
            s, share = r["summary"], r["simulation"]["time_share_by_term"]
            print(f"| {skew} | {redundant} | {policy} | {s['balancedness_mean']:.3f} | "
                  f"{s['output_tokens_per_s_per_node']:.0f} | {s['output_tokens_per_s_per_user_p50']:.1f} | "
                  f"{100 * share['moe']:.0f}% | {r['cost']['cost_per_million_output_tokens']:.3g} |", flush=True)


def cmd_deepseek_prefill(args) -> None:
    """Prefill at EP32 on 4 x 8 H800 (32 redundant experts: 9 slots a rank), prompts with shared
    prefixes so that ~56% of input tokens are cache hits, one output token each (the decode nodes take
    over): input tokens per node per second, cache hits included, against DeepSeek's ~73.7k."""
    from dspark_cluster import load_config
    from dspark_cluster.simulate import SimOptions, simulate

    tmp = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(4)
    n, per_group = args.requests, 4
    # conversations of 4 turns sharing 75% of the prompt: the 3 later turns hit it, 0.75 x 3/4 = 56% of tokens
    plen = 0
    with (tmp / "t.jsonl").open("w") as f:
        for i in range(n):
            g = i // per_group
            if i % per_group == 0:  # a new conversation: its prompt length, kept by its later turns
                plen = int(rng.integers(args.prompt_min, args.prompt_max + 1))
            # turn t of every conversation arrives at t x turn_gap_s (after the turn before it was computed)
            f.write(json.dumps({"arrival_s": args.turn_gap * (i % per_group), "prompt_len": plen, "output_len": 1,
                                "prefix_group": g,
                                "prefix_len": int(0.75 * plen)}) + "\n")
    print("| overlap | input tok/s per node (incl. cache hits) | cache hit rate | TTFT p50 s | top terms |")
    print("|---|---|---|---|---|")
    for overlap in (True, False):
        cfg = load_config({"model": {"path": str(DEEPSEEK_V3), "dtype": "bfloat16"},
                           "parallel": {"tensor": 1, "data": 32, "executor": "ray"},
                           "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": args.chunk, "block_size": 64,
                                         "kv_cache_memory": 0.9, "max_model_len": 32768},
                           "eplb": {"enabled": True, "num_redundant_experts": 32, "window_steps": 50,
                                    "interval_steps": 100, "policy": "hierarchical", "num_nodes": 4},
                           "report": {"out_dir": str(tmp)}})
        opts = SimOptions(hardware="H800", precision="fp8", overlap=overlap, host="per_group",
                          trace=str(tmp / "t.jsonl"),
                          dispatch="per_node",
                          expert_load={"skew": args.skew}, eplb_initial="balanced", record_steps=True)
        r = simulate(cfg, opts, write=False)
        s, share = r["summary"], r["simulation"]["time_share_by_term"]
        top = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(share.items(), key=lambda kv: -abs(kv[1]))[:4])
        # throughput while the prefill nodes are busy: input tokens over the steps' own time (not the idle gaps)
        busy = sum(x["step_time_s"] for x in r["steps"])
        prompt = r["cost"]["tokens"]["prompt"]
        print(f"| {overlap} | {prompt / busy / 4:.0f} | {100 * s['prefix_cache_hit_rate']:.1f}% | "
              f"{s['ttft_p50_s']:.2f} | {top} |", flush=True)


def cmd_aic(args) -> None:
    """The configuration AIConfigurator 0.12 and this simulator can both express: DeepSeek-V3 decode on
    8 x H200 (one node), attention DP 8, EP 8 (256 experts, no redundant), fp8 GEMMs, bf16 KV, batch
    per GPU, ISL 4096 / OSL 1024 (mean context 4,608: prompts ~4,580, 56 outputs), no overlap.
    AIConfigurator's side: `aiconfigurator cli estimate --model-path tests/fixtures/hf-configs/deepseek-v3
    --system h200_sxm --backend sglang --estimate-mode static_gen --isl 4096 --osl 1024 --batch-size B
    --tp-size 1 --attention-dp-size 8 --moe-tp-size 1 --moe-ep-size 8 --gemm-quant-mode fp8_block
    --moe-quant-mode fp8_block --kvcache-quant-mode bfloat16`."""
    from dspark_cluster import load_config
    from dspark_cluster.simulate import SimOptions, simulate

    tmp = Path(tempfile.mkdtemp())
    print("| batch / GPU | TPOT ms | tok/s per GPU | top terms |")
    print("|---|---|---|---|")
    for bs in args.batch:
        trace = write_trace(tmp / f"a{bs}.jsonl", 8 * bs, (4560, 4600), (56, 56), seed=5)
        cfg = load_config({"model": {"path": str(DEEPSEEK_V3), "dtype": "bfloat16"},
                           "parallel": {"tensor": 1, "data": 8, "executor": "ray"},
                           "scheduler": {"max_num_seqs": bs, "max_num_batched_tokens": bs * 5000, "block_size": 64,
                                         "kv_cache_memory": 0.9, "max_model_len": 32768},
                           "eplb": {"enabled": False}, "report": {"out_dir": str(tmp)}})
        opts = SimOptions(hardware="H200", precision="fp8", overlap=False, role="decode", host="per_group",
                          trace=str(trace), expert_load={"skew": 0.0}, record_steps=True)
        r = simulate(cfg, opts, write=False)
        steps = [x for x in r["steps"] if x["num_seqs"] == 8 * bs]
        step = statistics.median(x["step_time_s"] for x in steps)
        share = r["simulation"]["time_share_by_term"]
        top = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(share.items(), key=lambda kv: -abs(kv[1]))[:5])
        print(f"| {bs} | {1e3 * step:.1f} | {bs / step:.0f} | {top} |", flush=True)


QWEN3_30B = REPO / "tests" / "fixtures" / "hf-configs" / "qwen3-30b-a3b"


def cmd_study_spec(args) -> None:
    """What the confidence schedule buys over fixed k and over no speculation, concurrency 1..256, on
    2 x H200 (configs/qwen3-30b-a3b-dspark.yaml's topology) with a DSpark drafter of assumed size
    (2 layers at the target's hidden size, 3 exported layers) and an assumed survival curve."""
    from dspark_cluster import load_config
    from dspark_cluster.simulate import SimOptions, simulate

    tmp = Path(tempfile.mkdtemp())
    drafter = tmp / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({
        "model_type": "dspark_drafter", "target_hidden_size": 2048, "vocab_size": 151936,
        "target_layer_ids": [1, 24, 46],
        "hidden_size": 2048, "num_layers": 2, "num_heads": 32, "intermediate_size": 6144, "block_size": 7,
        "markov_rank": 64}))
    survival = args.survival
    print(f"survival curve (assumed): {survival}")
    print("| concurrency | none tok/s | static k=6 tok/s | confidence tok/s | static / none | confidence / none | "
          "confidence TPOT p50 ms | drafts verified |")
    print("|---|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        row = {}
        for name, spec in (("none", {"method": "none", "draft_model": str(drafter)}),
                           ("static", {"method": "dspark", "draft_model": str(drafter), "num_tokens": 6,
                                       "schedule": "static"}),
                           ("confidence", {"method": "dspark", "draft_model": str(drafter), "num_tokens": 6,
                                           "schedule": "confidence"})):
            cfg = load_config(REPO / "configs" / "qwen3-30b-a3b-dspark.yaml", [
                f"model.path={QWEN3_30B}", f"scheduler.max_num_seqs={c}", f"workload.num_requests={4 * c}",
                "workload.kind=synthetic", "workload.prompt_len=[512,1024]", "workload.output_len=[128,256]",
                f"report.out_dir={tmp}", f"speculative={json.dumps(spec)}"])
            opts = SimOptions(hardware="H200", acceptance={"survival": survival}, record_steps=True)
            row[name] = simulate(cfg, opts, write=False)["summary"]
        n, st, co = (row[k]["output_tokens_per_s"] for k in ("none", "static", "confidence"))
        ver = (row["confidence"].get("speculative") or {}).get("verified_share", float("nan"))
        print(f"| {c} | {n:.0f} | {st:.0f} | {co:.0f} | {st / n:.2f} | {co / n:.2f} | "
              f"{1e3 * row['confidence']['tpot_p50_s']:.2f} | {100 * ver:.0f}% |", flush=True)


def cmd_study_cost(args) -> None:
    """Cost per million output tokens by topology, from the simulated run's cost ledger (every target
    device held for the run at the config's example price, `cost.price_per_device_hour.gpu`, 2.5 an
    hour unless set: scale the column by your price / 2.5). DeepSeek-V3 decode (decode-only nodes as in
    `deepseek`: fp8, no micro-batch overlap, 32 redundant experts placed for the expected load, Zipf 0.5,
    `--seqs` sequences a GPU, prompts ~U(3950, 5950) whose KV arrives from prefill nodes, outputs 60-70)
    at EP 16..144 on H800 and H200; Qwen3-30B-A3B (bf16, configs/qwen3-30b-a3b-*gpu.yaml's topologies,
    synthetic prompts 512-1024, outputs 128-512, `--qwen-requests` requests) on one and two H200s."""
    from dspark_cluster import load_config
    from dspark_cluster.simulate import SimOptions, simulate

    tmp = Path(tempfile.mkdtemp())
    print(f"price per GPU-hour: {load_config(None, []).cost.price_per_device_hour.gpu} (the config's example)")
    print("| model | hardware | topology | GPUs | peak rows per GPU | preemptions | output tok/s per GPU | "
          "TPOT p50 ms | cost per M output tokens |")
    print("|---|---|---|---|---|---|---|---|---|")

    def row(model, hw, topo, r):
        s, c = r["summary"], r["cost"]
        peak = max(x["num_seqs"] for x in r["steps"]) / s["devices"]  # the KV pool may hold fewer than asked
        print(f"| {model} | {hw} | {topo} | {s['devices']} | {peak:.0f} | {s['preemptions']} | "
              f"{s['output_tokens_per_s_per_device']:.0f} | {1e3 * s['tpot_p50_s']:.1f} | "
              f"{c['cost_per_million_output_tokens']:.3g} |", flush=True)

    for hw in args.hardware:
        for ep in args.ep:
            n = args.seqs * ep
            trace = write_trace(tmp / f"d{ep}.jsonl", n, (3950, 5950), (60, 70), seed=6)
            raw = ep144_decode_config(str(tmp), max_num_seqs=args.seqs, batched=args.seqs * 6000, data=ep)
            if 8 % -(-ep // 8):  # DeepSeek-V3's 8 expert groups do not split evenly over the nodes: global
                raw["eplb"]["policy"] = "global"
            opts = SimOptions(hardware=hw, precision="fp8", overlap=False, role="decode", host="per_group",
                              trace=str(trace), expert_load={"skew": 0.5}, eplb_initial="balanced")
            row("DeepSeek-V3 decode", hw, f"EP{ep} ({-(-ep // 8)} nodes), attention DP{ep}",
                simulate(load_config(raw), opts, write=False))
    for name, topo in (("1gpu", "TP1"), ("2gpu", "TP2, EP2"), ("1gpu", "DP2, EP2")):
        extra = ["parallel.data=2", "eplb.enabled=true", "eplb.num_redundant_experts=8"] if "DP2" in topo else []
        cfg = load_config(REPO / "configs" / f"qwen3-30b-a3b-{name}.yaml", [
            f"model.path={QWEN3_30B}", f"workload.num_requests={args.qwen_requests}", "workload.kind=synthetic",
            "workload.prompt_len=[512,1024]", "workload.output_len=[128,512]", f"report.out_dir={tmp}", *extra])
        row("Qwen3-30B-A3B", "H200", topo, simulate(cfg, SimOptions(hardware="H200"), write=False))


def _command(sub, name: str, func, **defaults):
    """A subcommand running func(args), with a --flag per default (a list default: nargs="+")."""
    p = sub.add_parser(name)
    p.set_defaults(func=func)
    for key, d in defaults.items():
        kind = {"nargs": "+", "type": type(d[0])} if isinstance(d, list) else {"type": type(d)}
        p.add_argument("--" + key.replace("_", "-"), default=d, **kind)
    return p


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    _command(sub, "speed", cmd_speed, requests=10_000, prompt_min=1000, prompt_max=4000, output_min=100,
             output_max=400)
    dp = _command(sub, "deepseek", cmd_deepseek, seqs=[64, 88, 128], skew=0.5, out_min=60, out_max=70)
    dp.add_argument("--no-overlap", action="store_true", help="also the rows without the dual micro-batch")
    dp.add_argument("--host", choices=["per_group", "router"], default="per_group",
                    help="router: this engine's one Router process schedules all 144 groups")
    ep = _command(sub, "study-eplb", cmd_study_eplb, seqs=32, skews=[0.5, 1.0])
    ep.add_argument("--ep", type=int, default=144, choices=[32, 144])
    _command(sub, "deepseek-prefill", cmd_deepseek_prefill, requests=4096, prompt_min=1000, prompt_max=7000,
             chunk=16384, skew=0.5, turn_gap=30.0)
    _command(sub, "aic", cmd_aic, batch=[16, 64])
    _command(sub, "study-spec", cmd_study_spec, concurrency=[1, 8, 32, 128, 256],
             survival=[0.85, 0.72, 0.61, 0.52, 0.44, 0.37])
    _command(sub, "study-cost", cmd_study_cost, hardware=["H800", "H200"], ep=[16, 32, 72, 144], seqs=64,
             qwen_requests=1024)
    fp = _command(sub, "fit-cpu", cmd_fit_cpu)
    fp.add_argument("--write", action="store_true", help="write the fitted figures into assets/hardware.yaml")
    fp.add_argument("--report", default=None, help="a real run's report.json to fit to (default: run one)")
    fp.add_argument("--source", choices=["run", "profile"], default="run",
                    help="run: each step of a real run (shapes replayed); profile: the engine's start-up "
                         "StepCost profile")
    vp = _command(sub, "validate-cpu", cmd_validate_cpu, points="all", repeats=3)
    vp.add_argument("--fit", action="store_true", help="fit the cpu entry first, its runs in the same rounds")
    vp.add_argument("--write", action="store_true", help="with --fit: write the fit into assets/hardware.yaml")
    args = p.parse_args(argv)
    args.func(args)


def cmd_fit_cpu(args) -> None:
    from dspark_cluster.simulate.fit import fit_cpu, write_cpu_entry

    fit = fit_cpu(args.report, source=args.source)
    print(json.dumps(fit, indent=1))
    if args.write:
        write_cpu_entry(fit)
        print("written: dspark_cluster/assets/hardware.yaml (devices.cpu)")


def cmd_validate_cpu(args) -> None:
    from dspark_cluster.simulate.fit import validate_cpu

    validate_cpu(args.points, args.repeats, args.fit, args.write)


if __name__ == "__main__":
    main()
