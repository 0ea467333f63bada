"""Bytes on the speculative wire per step: the StepInput as pickled for the workers (whole, and what
each tensor-parallel rank receives) and the DraftRequests sent to the drafter group, at a small and a
DeepSeek-V3-sized vocabulary, greedy and sampled. Random target (tiny DeepSeek-V3 MoE) and drafter
(tiny Llama) over the same vocabulary, built with transformers; one process (executor local), the
per-rank split computed as `actors.cluster.Cluster.submit` does it for `--tp` ranks.

    python launch/bench_spec_wire.py [--vocab 2048 129280] [--rows 64] [--k 4] [--prompt-len 256]
                                     [--max-tokens 12] [--tp 2] [--dtype float32] [--json OUT]

Runs on older checkouts too (a tree without the per-rank split sends every rank the whole StepInput),
so `git worktree add /tmp/wire-before HEAD` and the same command there give the "before" table.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dspark_cluster import SamplingParams, load_config  # noqa: E402
from dspark_cluster.engine import LLMEngine  # noqa: E402
from dspark_cluster.step import to_wire  # noqa: E402


def build_models(root: Path, vocab: int) -> tuple[Path, Path]:
    """A random tiny DeepSeek-V3 target and a random tiny Llama drafter with `vocab` tokens (cached)."""
    import transformers

    target, draft = root / f"target-v{vocab}", root / f"draft-v{vocab}"
    if not (target / "config.json").exists():
        torch.manual_seed(0)
        cfg = transformers.DeepseekV3Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=12, n_group=4, topk_group=2, first_k_dense_replace=1, initializer_range=0.1,
            max_position_embeddings=1024, eos_token_id=1, bos_token_id=0)
        transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(target))
    if not (draft / "config.json").exists():
        torch.manual_seed(1)
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                                       max_position_embeddings=1024, eos_token_id=1, bos_token_id=0)
        transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(draft))
    return target, draft


def per_rank_bytes(step, tp: int) -> list[int]:
    """Bytes each of `tp` ranks of one group receives for this step."""
    try:
        from actors.cluster import input_slots, rank_inputs
    except ImportError:  # a tree without the split: every rank gets the whole StepInput
        return [len(to_wire(step))] * tp
    inputs = rank_inputs(step, tp, 1)
    return [len(to_wire(inputs[slot])) for slot in input_slots(tp, tp)]


def measure(target, draft, vocab: int, mode: str, args) -> dict:
    cfg = load_config({
        "model": {"path": str(target), "dtype": args.dtype},
        "scheduler": {"block_size": 16, "num_kv_blocks": 4096, "max_num_seqs": args.rows,
                      "max_num_batched_tokens": max(4096, args.rows * (args.prompt_len + 1))},
        "speculative": {"method": "draft_model", "draft_model": str(draft), "num_tokens": args.k,
                        "schedule": "static"},
    })
    eng = LLMEngine(cfg)
    steps, calls = [], []
    submit = eng.executor.submit

    def spy_submit(step):
        if step.draft_tokens is not None:  # a speculative step (drafts to verify)
            law = getattr(step, "draft_probs", None)
            steps.append({"step_input": len(to_wire(step)), "ranks": per_rank_bytes(step, args.tp),
                          "law": 0 if law is None else law.numel() * law.element_size(),
                          "law_dtype": None if law is None else str(law.dtype).removeprefix("torch."),
                          "law_rows": 0 if law is None else int(law.shape[0]),
                          "rows": int(step.sample_rows.numel()), "drafts": int(step.num_draft.sum())})
        return submit(step)

    group = eng.drafter.backend
    propose, prefill, prefills = group.propose, group.prefill_async, []

    def spy_propose(requests, version=0):
        calls.append(len(pickle.dumps(requests, protocol=pickle.HIGHEST_PROTOCOL)))  # as Ray pickles them
        return propose(requests, version)

    def spy_prefill(requests):
        prefills.append(len(pickle.dumps(requests, protocol=pickle.HIGHEST_PROTOCOL)))
        return prefill(requests)

    eng.executor.submit, group.propose, group.prefill_async = spy_submit, spy_propose, spy_prefill
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.rows)]
    temp = 0.0 if mode == "greedy" else 1.0
    try:
        for i, p in enumerate(prompts):
            eng.add_request(p, SamplingParams(max_tokens=args.max_tokens, temperature=temp, seed=i, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
    finally:
        eng.shutdown()
    if not steps:
        raise SystemExit(f"V={vocab} {mode}: no speculative step ran")
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0  # noqa: E731
    return {"vocab": vocab, "mode": mode, "dtype": args.dtype, "spec_steps": len(steps),
            "rows": mean([s["rows"] for s in steps]), "drafts": mean([s["drafts"] for s in steps]),
            "step_input_bytes": mean([s["step_input"] for s in steps]),
            "rank_bytes": [mean([s["ranks"][r] for s in steps]) for r in range(args.tp)],
            "law_bytes": mean([s["law"] for s in steps]), "law_rows": mean([s["law_rows"] for s in steps]),
            "law_dtype": next((s["law_dtype"] for s in steps if s["law_dtype"]), None),
            "prefill_request_bytes": sum(prefills),
            "draft_request_bytes": mean(calls), "propose_calls": len(calls)}


def human(n: float) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[2048, 129280])
    ap.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks the per-rank bytes are for")
    ap.add_argument("--dtype", default="float32", help="model.dtype (the drafter runs in it too)")
    ap.add_argument("--models", default=None, help="where to build / find the random models (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.models) if args.models else Path(tempfile.gettempdir()) / "dspark-bench-spec-wire"
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for vocab in args.vocab:
        target, draft = build_models(root, vocab)
        for mode in args.modes:
            rows.append(measure(target, draft, vocab, mode, args))
            print(f"  measured V={vocab} {mode}", file=sys.stderr)
    print(f"{args.rows} rows, k={args.k}, prompts of {args.prompt_len} tokens, {args.max_tokens} new, model dtype {args.dtype}; "
          f"means over speculative steps; per-rank bytes for TP={args.tp} (rank 0 verifies)")
    head = (f"{'V':>7} {'mode':<8} {'steps':>5} {'StepInput':>10} "
            + " ".join(f"{'rank ' + str(r):>10}" for r in range(args.tp))
            + f" {'law':>10} {'law rows':>8} {'law dtype':>9} {'prefill req':>11} {'DraftReq/propose':>16}")
    print(head)
    for r in rows:
        print(f"{r['vocab']:>7} {r['mode']:<8} {r['spec_steps']:>5} {human(r['step_input_bytes']):>10} "
              + " ".join(f"{human(b):>10}" for b in r["rank_bytes"])
              + f" {human(r['law_bytes']):>10} {r['law_rows']:>8.1f} {str(r['law_dtype'] or '-'):>9}"
              f" {human(r['prefill_request_bytes']):>11} {human(r['draft_request_bytes']):>16}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
