"""Decode throughput of the in-process engine against transformers `generate`, same checkpoint,
same thread count, measured in the same run.

    python launch/bench_engine.py [--model PATH] [--threads 1] [--repeats 3] [--profile]

Cases: batch 1 with a 128-token prompt, and batch 16 with prompt lengths mixed around 128; 128 new
tokens each, greedy, EOS ignored. Decode tokens/s excludes the prefill (time to first token),
measured separately for both sides.

--profile: after the timings, one generation per side and batch under torch.profiler (top operators
by self CPU time, per decode step) and cProfile (Python functions by cumulative time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from dspark_cluster import LLM, SamplingParams
from dspark_cluster.config import ASSETS_DIR
from dspark_cluster.report import machine_info as machine


def prompts_for(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    if batch == 1:
        lengths = [128]
    else:
        lengths = torch.randint(64, 193, (batch,), generator=g).tolist()  # mixed, mean ~128
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def time_ours(llm: LLM, prompts, new_tokens: int):
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    total = time.perf_counter() - t0
    prefill = max(o.metrics["ttft_s"] for o in outs)
    return total, prefill, [o.token_ids for o in outs]


def time_hf(model, prompts, new_tokens: int, pad_id: int):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kw = {"attention_mask": mask, "do_sample": False, "pad_token_id": pad_id, "eos_token_id": None}
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        total = time.perf_counter() - t0
    return total, prefill, [row[width:].tolist() for row in out]




def cpu_now() -> tuple[float, float, float]:
    """(wall, CPU seconds of the whole machine, CPU seconds of this process) so far."""
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    t = os.times()
    return time.perf_counter(), (sum(cpu) - cpu[3] - cpu[4]) / os.sysconf("SC_CLK_TCK"), t.user + t.system


def others_cores(start) -> float:
    """Average cores other processes kept busy since `start` (the CPU was shared when this is > ~0.1)."""
    w, m, own = cpu_now()
    return ((m - start[1]) - (own - start[2])) / (w - start[0])


def profile(llm, hf, batch: int, vocab: int, new_tokens: int, top: int = 20):
    """Where a decode step's time goes, both sides. torch.profiler by operator: (a generation of
    `new_tokens`) - (a generation of 2 tokens), divided by the `new_tokens - 2` steps between, so
    the numbers are per pure decode step: the prefill, and the one step where the batch-16 prefill's
    last chunk runs beside the first decodes, are taken out. cProfile by Python function (cumulative, whole run)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    prompts = prompts_for(batch, vocab)
    steps = new_tokens - 2
    sides = (("ours", lambda n: time_ours(llm, prompts, n)), ("transformers", lambda n: time_hf(hf, prompts, n, 0)))
    for name, fn in sides:
        fn(new_tokens)  # warm
        per = {}
        for n in (2, new_tokens):
            with tprofile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                fn(n)
                wall = time.perf_counter() - t0
            per[n] = ({e.key: (e.count, e.self_cpu_time_total) for e in prof.key_averages()}, wall)
        (short, w1), (long, wn) = per[2], per[new_tokens]
        diff = {k: (c - short.get(k, (0, 0))[0], t - short.get(k, (0, 0))[1]) for k, (c, t) in long.items()}
        total = sum(t for _, t in diff.values())
        print(f"\n### torch.profiler, {name}, batch {batch}: per decode step (generations of {new_tokens} - 2 tokens): "
              f"wall {(wn - w1) / steps * 1e3:.2f} ms under the profiler, ops' self CPU {total / steps / 1e3:.2f} ms")
        print("| op | calls/step | self us/step | share |")
        print("|---|---|---|---|")
        for k, (c, t) in sorted(diff.items(), key=lambda kv: kv[1][1], reverse=True)[:top]:
            print(f"| {k} | {c / steps:.1f} | {t / steps:.0f} | {t / total:.1%} |")
        stats = {}
        for n in (2, new_tokens):
            pr = cProfile.Profile()
            pr.enable()
            fn(n)
            pr.disable()
            stats[n] = pstats.Stats(pr).stats  # {(file, line, func): (cc, ncalls, tottime, cumtime, callers)}
        rows = []
        for key, (_, nc, tt, ct, _) in stats[new_tokens].items():
            _, nc0, tt0, ct0, _ = stats[2].get(key, (0, 0, 0.0, 0.0, None))
            rows.append((ct - ct0, tt - tt0, nc - nc0, key))
        rows.sort(reverse=True)
        print(f"\n### cProfile, {name}, batch {batch}: per decode step (generations of {new_tokens} - 2 tokens)")
        print("| function | calls/step | cumulative us/step | own us/step |")
        print("|---|---|---|---|")
        for ct, tt, nc, (file, line, func) in rows[:top + 10]:
            where = f"{os.path.relpath(file, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}:{line}" if file != "~" else ""
            if where.startswith(".."):
                where = "/".join(file.split("/")[-2:]) + f":{line}"
            print(f"| {where}({func}) | {nc / steps:.1f} | {ct / steps * 1e6:.0f} | {tt / steps * 1e6:.0f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ASSETS_DIR / "tiny-moe"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--profile", action="store_true", help="also profile one generation per side and batch")
    ap.add_argument("--profile-tokens", type=int, default=64)
    args = ap.parse_args()
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    cpu_start = cpu_now()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    llm = LLM(args.model, config={"model": {"dtype": "float32"}, "parallel": {"threads_per_worker": args.threads}})
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    vocab = llm.engine.spec.vocab_size
    results = []
    for batch in (1, 16):
        prompts = prompts_for(batch, vocab)
        time_ours(llm, prompts, 8)  # warm-up both sides
        time_hf(hf, prompts, 8, 0)
        ours, theirs = [], []
        for _ in range(args.repeats):  # interleaved so drift hits both alike
            ours.append(time_ours(llm, prompts, args.new_tokens))
            theirs.append(time_hf(hf, prompts, args.new_tokens, 0))
        n_dec = batch * (args.new_tokens - 1)
        ours_dec = statistics.median(n_dec / (t - p) for t, p, _ in ours)
        hf_dec = statistics.median(n_dec / (t - p) for t, p, _ in theirs)
        ours_e2e = statistics.median(batch * args.new_tokens / t for t, _, _ in ours)
        hf_e2e = statistics.median(batch * args.new_tokens / t for t, _, _ in theirs)
        same = sum(a == b for a, b in zip(ours[0][2], theirs[0][2]))
        results.append({"batch": batch, "prompt_lens": [len(p) for p in prompts], "ours_decode_tok_s": ours_dec,
                            "hf_decode_tok_s": hf_dec, "decode_ratio": ours_dec / hf_dec, "ours_e2e_tok_s": ours_e2e,
                            "hf_e2e_tok_s": hf_e2e, "e2e_ratio": ours_e2e / hf_e2e, "identical_outputs": f"{same}/{batch}"})
    print(f"model {args.model}, threads {args.threads}, torch {torch.__version__}, {machine()}; "
          f"load average at start {load_start}, end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"other processes kept {others_cores(cpu_start):.2f} cores busy on average")
    print("| batch | ours decode tok/s | transformers decode tok/s | ratio | ours e2e tok/s | transformers e2e tok/s | ratio | same greedy output |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['batch']} | {r['ours_decode_tok_s']:.0f} | {r['hf_decode_tok_s']:.0f} | {r['decode_ratio']:.2f}x | "
              f"{r['ours_e2e_tok_s']:.0f} | {r['hf_e2e_tok_s']:.0f} | {r['e2e_ratio']:.2f}x | {r['identical_outputs']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.profile:
        for batch in (1, 16):
            profile(llm, hf, batch, vocab, args.profile_tokens)


if __name__ == "__main__":
    main()
