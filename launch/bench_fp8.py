"""FP8 checkpoints, measured: load time and bytes read per worker against the bf16 twin, and the
logit error against transformers.

    python launch/bench_fp8.py [--repeats 5] [--prompts 32] [--tokens 32] [--block 128]

The bundled tiny-moe (a DeepSeek-V3-style MoE, fp32) is written as DeepSeek ships V3: projections
in e4m3 with `--block` x `--block` scales, the rest (embedding, LM head, norms, router) in bf16
(`dspark_cluster.model.fp8.write_fp8_checkpoint`), plus
two twins of the same weights: the dequantized model in fp32 (the function the fp8 checkpoint
encodes: transformers' reference) and in bf16 (as a bf16 release would ship it). For each
checkpoint and each worker layout (tensor 1; tensor 2 ranks 0 and 1, with half the experts each),
a worker's shard is loaded into bf16 `--repeats` times (median wall time, bytes read). Then the
fp8 checkpoint serves `--prompts` held-out prompts greedily, in process, in fp32: its prompt
log-probabilities against transformers on the dequantized twin (should be float noise), and its
greedy tokens and next-token law against the original unquantized model (the quantisation error).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark_cluster import LLM, SamplingParams
from dspark_cluster.config import ASSETS_DIR
from dspark_cluster.model.fp8 import write_fp8_checkpoint
from dspark_cluster.model.loader import load_model
from dspark_cluster.model.spec import load_spec
from dspark_cluster.report import machine_info
from dspark_cluster.workload import DEFAULT_PROMPTS, read_prompts


class Shard:
    def __init__(self, rank, size):
        self.tp_rank, self.tp_size = rank, size


def bf16_twin(src: Path, dst: Path) -> None:
    import shutil

    shutil.copytree(src, dst)
    t = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in t.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def load_times(paths: dict, repeats: int) -> dict:
    """{label: rows}: each checkpoint's worker layouts loaded into bf16, the arms interleaved
    repeat by repeat (this machine is shared: noise hits both alike)."""
    times: dict = {}
    read: dict = {}
    for _ in range(repeats):
        for label, path in paths.items():
            spec = load_spec(path, "bfloat16")  # bf16 parameters, as a GPU worker would hold them
            E, moe = spec.num_experts, sum(spec.moe_layers)
            layouts = [("tensor 1", None, None), ("tensor 2 rank 0", Shard(0, 2), list(range(E // 2))),
                       ("tensor 2 rank 1", Shard(1, 2), list(range(E // 2, E)))]
            for name, comm, experts in layouts:
                t0 = time.perf_counter()
                m = load_model(path, spec, comm, None if experts is None else [experts] * moe)
                times.setdefault((label, name), []).append(time.perf_counter() - t0)
                read[(label, name)] = (m.bytes_read, sum(p.numel() * p.element_size() for p in m.parameters()))
    out: dict = {}
    for (label, name), ts in times.items():
        out.setdefault(label, []).append({"layout": name, "load_s": statistics.median(ts), "bytes_read": read[(label, name)][0],
                                          "param_bytes": read[(label, name)][1]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--block", type=int, default=128)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix="bench_fp8_"))
    src = ASSETS_DIR / "tiny-moe"
    sizes = write_fp8_checkpoint(src, tmp / "fp8", (args.block, args.block), dequantized=tmp / "twin32",
                                 rest_dtype=torch.bfloat16)
    bf16_twin(tmp / "twin32", tmp / "twin16")
    print(f"machine: {machine_info()}")
    print(f"tiny-moe as fp8 ({args.block} x {args.block} blocks): {sizes['fp8_bytes']:,} B on disk; "
          f"fp32 twin {sizes['dequantized_bytes']:,} B; bf16 twin {(tmp / 'twin16' / 'model.safetensors').stat().st_size:,} B")
    print(f"\n{'checkpoint':<10} {'worker':<16} {'load ms':>8} {'bytes read':>12} {'params B':>12}")
    results = {"machine": machine_info(), "block": args.block, "sizes": sizes, "load": {}}
    results["load"] = load_times({"fp8": tmp / "fp8", "bf16": tmp / "twin16"}, args.repeats)
    for label, rows in results["load"].items():
        for r in rows:
            print(f"{label:<10} {r['layout']:<16} {1e3 * r['load_s']:>8.1f} {r['bytes_read']:>12,} {r['param_bytes']:>12,}")
    for a, b in zip(results["load"]["fp8"], results["load"]["bf16"]):
        print(f"fp8 / bf16, {a['layout']}: load time {a['load_s'] / b['load_s']:.2f}x, "
              f"bytes read {a['bytes_read'] / b['bytes_read']:.2f}x")

    # accuracy, in process, fp32
    tok_src = LLM(src, config={"model": {"dtype": "float32"}})
    prompts = [tok_src.tokenizer.encode(p)[:96] for p in read_prompts(DEFAULT_PROMPTS)[: args.prompts]]
    tok_src.shutdown()
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, prompt_logprobs=1)
    llm = LLM(tmp / "fp8", config={"model": {"dtype": "float32"}})
    outs = llm.generate(prompts, params)
    llm.shutdown()
    ref = AutoModelForCausalLM.from_pretrained(str(tmp / "twin32"), dtype=torch.float32).eval()
    orig = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    lp_err, tv, agree, total = 0.0, [], 0, 0
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p])
            lp = torch.log_softmax(ref(ids).logits[0].float(), -1)
            lp_err = max(lp_err, max(abs(e.logprob - float(lp[i - 1, p[i]])) for i, e in
                                     enumerate(o.prompt_logprobs[1:], start=1)))
            pa = torch.softmax(ref(ids).logits[0, -1], -1)
            pb = torch.softmax(orig(ids).logits[0, -1], -1)
            tv.append(0.5 * float((pa - pb).abs().sum()))
            greedy = orig.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            n = next((i for i, (x, y) in enumerate(zip(o.token_ids, greedy)) if x != y), len(greedy))
            agree += n
            total += len(greedy)
    results["accuracy"] = {"prompt_logprob_max_abs_err_vs_transformers_on_dequantized": lp_err,
                           "next_token_tv_vs_unquantized_mean": statistics.mean(tv),
                           "next_token_tv_vs_unquantized_max": max(tv),
                           "greedy_tokens_before_first_divergence_vs_unquantized": agree / total}
    print(f"\nprompt log-prob error vs transformers on the dequantized weights: max {lp_err:.2e}")
    print(f"next-token law vs the unquantized model: TV mean {statistics.mean(tv):.4f}, max {max(tv):.4f}")
    print(f"greedy tokens identical to the unquantized model before the first divergence: {agree / total:.1%}")
    (tmp / "bench_fp8.json").write_text(json.dumps(results, indent=2))
    print(f"\n{tmp / 'bench_fp8.json'}")


if __name__ == "__main__":
    main()
