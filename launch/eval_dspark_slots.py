"""Teacher-forced acceptance by slot of DSpark drafters on held-out text: a drafter's quality without the
serving loop's sampling noise, and a second block pass (slot 1 holding the drafted slot 0) scored beside
the first.

    python launch/eval_dspark_slots.py [--drafter name=PATH ...] [--prompts 48] [--max-tokens 64]
        [--temperatures 0,1]

The held-out prompts (the ones `bench_dspark.py` uses) are continued by the target through `LLM` at each
temperature (seeded per prompt; greedy at 0). Every position of a continuation that has a whole block
after it anchors a block. Per slot j, the chance that the draft is accepted given that the slots before
it were (the previous tokens the true ones): 1 - TV(q_j, p_j) at temperature 1 (p_j the target's law),
whether the two argmaxes agree at 0. tau = 1 + the sum of the running products over the first k = 4
slots (bench_dspark.py's table). `first`: every slot from one block forward (what serves today);
`second`: slot 0 from the first forward, slots 1.. from a forward whose slot 1 holds the token after the
anchor (a drafter trained with `train_dspark.py --second-pass-share`; one that was not is scored too).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dspark_cluster import LLM, SamplingParams  # noqa: E402
from dspark_cluster.config import ASSETS_DIR  # noqa: E402
from dspark_cluster.model.spec import load_spec  # noqa: E402
from dspark_cluster.speculative.dspark_model import load_drafter, target_tables  # noqa: E402
from dspark_cluster.workload import DEFAULT_PROMPTS, read_prompts  # noqa: E402
from launch.train_dspark import Teacher  # noqa: E402


def continuations(target: str, prompts, temperature: float, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt token ids as the engine read them, the continuation's token ids) per prompt."""
    llm = LLM(target, config={"model": {"dtype": "float32"}})
    try:
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i if temperature else None,
                                 ignore_eos=True) for i in range(len(prompts))]
        outs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    return [(list(o.prompt_token_ids), o.token_ids) for o in outs]


@torch.no_grad()
def slot_acceptance(drafter, teacher, seqs, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean 1 - TV by slot [S] of the first pass and of the second pass, over every full block."""
    S = drafter.c.block_size
    sums, n = torch.zeros(2, S), torch.zeros(2, S)
    for prompt, out in seqs:
        tokens = torch.tensor([prompt + out])
        T = tokens.shape[1]
        ctx, p = teacher(tokens)
        anchors = torch.arange(len(prompt) - 1, T - S)[None]  # blocks inside the continuation
        if anchors.numel() == 0:
            continue
        label = anchors[0][:, None] + torch.arange(S) + 1  # [A, S]
        pt = p[0, label - 1]  # the target's law for the token at label comes from one position earlier
        for i, second in enumerate((None, torch.ones_like(anchors, dtype=torch.bool))):
            z, _ = drafter.forward_train(tokens, ctx, anchors, second)
            if temperature == 0:  # greedy: the drafter's argmax is accepted when it is the target's
                acc = (z[0].argmax(-1) == pt.argmax(-1)).float()
            else:
                acc = 1 - 0.5 * (z[0].softmax(-1) - pt).abs().sum(-1)  # [A, S]
            sums[i] += acc.sum(0)
            n[i] += acc.shape[0]
    return sums[0] / n[0], sums[1] / n[1]


def tau(by_slot, k: int = 4) -> float:
    return 1 + sum(math.prod(by_slot[: j + 1]) for j in range(k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(ASSETS_DIR / "tiny-moe"))
    ap.add_argument("--drafter", action="append", default=[], help="name=path (default: the shipped tiny-dspark)")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = read_prompts(DEFAULT_PROMPTS)[: args.prompts]
    spec = load_spec(args.target, "float32")
    embed, head = target_tables(args.target, spec)
    drafters = [d.split("=", 1) for d in args.drafter] or [("tiny-dspark", str(ASSETS_DIR / "tiny-dspark"))]
    models = {name: load_drafter(path, embed, head).float() for name, path in drafters}
    layers = next(iter(models.values())).c.target_layer_ids
    teacher = Teacher(args.target, layers)
    print(f"{len(prompts)} held-out prompts, {args.max_tokens} tokens; teacher-forced 1 - TV by slot; tau at k = 4")
    print("\n| drafter | temp | pass | 1 - TV by slot | tau (k=4, from the slots) |")
    print("|---|---|---|---|---|")
    for temp in (float(t) for t in args.temperatures.split(",")):
        seqs = continuations(args.target, prompts, temp, args.max_tokens)
        for name, m in models.items():
            assert m.c.target_layer_ids == layers, "drafters read different target layers"
            first, second = slot_acceptance(m, teacher, seqs, temp)
            both = torch.cat([first[:1], second[1:]])
            for label, s in (("first", first), ("second (slot 0 from the first)", both)):
                row = " ".join(f"{a:.3f}" for a in s.tolist())
                print(f"| {name} | {temp:g} | {label} | {row} | {tau(s.tolist()):.3f} |", flush=True)


if __name__ == "__main__":
    main()
