"""Hot-spot study: the same workload with EPLB off and on, tensor = 4 (EP over 4 workers).

    python launch/bench_hotspot.py [CONFIG ...] [--set key=value ...]

Default configs: configs/hotspot-tp4.yaml (bundled model, experts 0 and 1 biased hot) and
configs/hotspot-natural-tp4.yaml (the bundled model's own hot spots); add a random skewed tiny
model with --skewed. Prints balancedness per layer, tokens/s, step time p50/p99, and each
rebalance's duration and bytes moved.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from dspark_cluster import load_config  # noqa: E402
from dspark_cluster.balancer import served_balancedness  # noqa: E402
from dspark_cluster.runner import run_experiment  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def skewed_checkpoint() -> str:
    """A random DeepSeek-V3-style MoE whose gate strongly prefers a few experts."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                           n_shared_experts=1, num_experts_per_tok=2, q_lora_rank=64, kv_lora_rank=32,
                           qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_group=1, topk_group=1,
                           first_k_dense_replace=1, max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.tensor([2.0, 1.5, 0.5, 0, 0, -0.5, -1, -1]))  # a Zipf-like preference
    path = tempfile.mkdtemp(prefix="skewed-moe-")
    model.save_pretrained(path)
    return path


def run(config, overrides, eplb_on: bool):
    cfg = load_config(config, overrides + [f"eplb.enabled={str(eplb_on).lower()}", "report.out_dir=/tmp/dspark-hotspot",
                                           f"report.name={os.path.basename(str(config))}-{'on' if eplb_on else 'off'}"])
    rep = run_experiment(cfg, progress=False)
    steps = [s["step_time_s"] for s in rep["steps"] if s["num_tokens"] <= cfg.scheduler.max_num_seqs]  # decode steps
    ex = rep["experts"]
    # before: steps up to the first commit (all steps with EPLB off); after: the steps after it
    first = ex["rebalances"][0]["committed_at_step"] if ex["rebalances"] else len(ex["rank_history"])
    return {"tok_s": rep["summary"]["output_tokens_per_s"], "p50": np.percentile(steps, 50) * 1e3,
            "p99": np.percentile(steps, 99) * 1e3, "before": served_balancedness(ex["rank_history"], 0, first),
            "after": served_balancedness(ex["rank_history"], first), "events": ex["rebalances"], "out": rep["out_dir"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="*", default=[os.path.join(REPO, "configs/hotspot-tp4.yaml"),
                                                    os.path.join(REPO, "configs/hotspot-natural-tp4.yaml")])
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--skewed", action="store_true", help="also study a random skewed tiny MoE")
    args = ap.parse_args()
    studies = [(c, list(args.overrides)) for c in args.configs]
    if args.skewed:
        studies.append((os.path.join(REPO, "configs/hotspot-natural-tp4.yaml"),
                        args.overrides + [f"model.path={skewed_checkpoint()}", "workload.kind=synthetic",
                                          "workload.prompt_len=[16,128]"]))
    print("| study | EPLB | balancedness per layer, before first rebalance | after it | mean before -> after | tokens/s | "
          "decode step p50 / p99 (ms) | rebalances: duration (ms), bytes moved |")
    print("|---|---|---|---|---|---|---|---|")
    for config, overrides in studies:
        name = os.path.basename(config) + (" (skewed random model)" if any("model.path" in o for o in overrides) else "")
        for on in (False, True):
            r = run(config, overrides, on)
            ev = "; ".join(f"{e['duration_s'] * 1e3:.0f} ms, {e['bytes_moved'] / 1e6:.2f} MB" for e in r["events"]) or "-"
            fmt = lambda v: " ".join(f"{b:.2f}" for b in v) or "-"  # noqa: E731
            after = f"{np.mean(r['after']):.3f}" if r["after"] else "-"
            print(f"| {name} | {'on' if on else 'off'} | {fmt(r['before'])} | {fmt(r['after'])} | "
                  f"{np.mean(r['before']):.3f} -> {after} | {r['tok_s']:.0f} | {r['p50']:.1f} / {r['p99']:.1f} | {ev} |",
                  flush=True)


if __name__ == "__main__":
    main()
