#!/usr/bin/env python
"""Train the bundled DSpark drafter (`tiny-dspark`) against the bundled target (`tiny-moe`), with DeepSpeed.

    python launch/train_dspark.py                      # ~35 min on 2 CPU cores (2 ranks, ZeRO-2, gloo)
    python launch/train_dspark.py --smoke              # a 1-minute plumbing check
    python launch/train_dspark.py --markov-rank 0 --out /tmp/no-markov      # ablations
    python launch/train_dspark.py --no-confidence --out /tmp/no-confidence

Data (never the held-out modules, whose prompts measure the drafter): (a) continuations the target
generates (our own engine, half greedy, half temperature 1) of prompts extracted from the training
modules of the standard library, loss on the continuation; (b) random windows of the training text.
The teacher runs online every step: the target's chosen layers' outputs are the drafter's context,
its softmax the law the drafter learns (the drafter never sees a label the target did not give).

Loss (DSpark's): 0.1 CE + 0.9 L1 (= 2 TV) toward the target's law + 1.0 BCE of the confidence
toward 1 - TV, each weighted exp(-j / 4) along the block, a label hole ending the block.

DeepSpeed: `deepspeed.initialize` (ZeRO stage 2, torch AdamW, gradient clipping 1.0); the script
spawns `--ranks` processes (gloo on CPU with DS_ACCELERATOR=cpu, NCCL on GPUs with the same code),
each with its own teacher and its own data stream. Rank 0 saves fp16 weights without the target's
tables (the drafter reads them from the target), config.json and a model card.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "launch"))

import torch  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(ROOT / "dspark_cluster/assets/tiny-moe"))
    ap.add_argument("--out", default=str(ROOT / "dspark_cluster/assets/tiny-dspark"))
    ap.add_argument("--layers", default="1,2,3", help="target decoder layers whose outputs are the context")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=6)
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--no-confidence", action="store_true")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--minutes", type=float, default=32.0, help="wall-time cap (the LR schedule follows it)")
    ap.add_argument("--batch", type=int, default=8, help="windows per rank per step")
    ap.add_argument("--window", type=int, default=192)
    ap.add_argument("--anchors", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--gen-prompts", type=int, default=1024, help="training-module prompts the target continues")
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--gen-fraction", type=float, default=0.5, help="share of each batch from the continuations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-cache", default=None, help="save/load the tokenised text and continuations here")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.minutes, args.gen_prompts, args.gen_tokens, args.batch = 6, 1.0, 8, 32, 2
    return args


# ---------------------------------------------------------------------------------------- data

def training_text_ids(tok) -> list[int]:
    from train_tiny_models import load_corpus

    train, _ = load_corpus()
    ids = []
    for _, text in train:
        ids.extend(tok(text)["input_ids"])
        ids.append(tok.eos_token_id)
    return ids


def generate_continuations(target: str, tok, n: int, max_tokens: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt + continuation ids, prompt length) for prompts of the training modules, continued by
    the target itself (half greedy, half temperature 1)."""
    from train_tiny_models import extract_prompts, load_corpus

    from dspark_cluster import LLM, SamplingParams

    train, _ = load_corpus()
    prompts = [c["prompt"] for c in extract_prompts(train, n, per_module=4)]
    llm = LLM(target, config={"scheduler": {"max_num_seqs": 64}})
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 == 0 else 1.0, seed=seed + i,
                             ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    llm.shutdown()
    return [(o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids)) for o in outs]


def batches(text_ids, generated, args, rank: int):
    """Endless (tokens [B, T], loss_mask [B, T]) batches: half generated samples, half text windows."""
    rng = random.Random(args.seed * 1000 + rank)
    T = args.window
    while True:
        toks, masks = [], []
        for b in range(args.batch):
            if generated and rng.random() < args.gen_fraction:
                ids, plen = generated[rng.randrange(len(generated))]
                start = max(0, min(plen - T // 2, len(ids) - T))
                win = ids[start : start + T]
                mask = [start + i >= plen for i in range(len(win))]
            else:
                start = rng.randrange(0, len(text_ids) - T)
                win, mask = text_ids[start : start + T], [True] * T
            pad = T - len(win)
            toks.append(win + [0] * pad)
            masks.append(mask + [False] * pad)
        yield torch.tensor(toks), torch.tensor(masks)


def sample_anchors(loss_mask, A: int, gen: torch.Generator):
    """[B, T] -> anchors [B, A]: positions whose next token is in the loss mask, drawn without
    replacement (repeats allowed only when there are too few), sorted."""
    B, T = loss_mask.shape
    ok = torch.zeros_like(loss_mask)
    ok[:, :-1] = loss_mask[:, 1:]
    ok[:, 0] = False  # at least one context row before the anchor
    scores = torch.rand(B, T, generator=gen) + ok.float() * 2
    return scores.topk(A, dim=1).indices.sort(dim=1).values


# ---------------------------------------------------------------------------------------- teacher

class Teacher:
    """The target (transformers), its chosen layers' raw outputs and its law at every position."""

    def __init__(self, path: str, layers: list[int]):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.layers = layers

    @torch.no_grad()
    def __call__(self, tokens):
        out = self.model(tokens, output_hidden_states=True)
        # hidden_states[i + 1] is decoder layer i's output (the last entry is normed: never chosen)
        ctx = torch.cat([out.hidden_states[i + 1] for i in self.layers], dim=-1)
        return ctx, out.logits.float().softmax(-1)


# ---------------------------------------------------------------------------------------- training

def lr_at(progress: float, base: float, warmup: float = 0.04, final: float = 0.05) -> float:
    if progress < warmup:
        return base * progress / warmup
    p = min(1.0, (progress - warmup) / (1 - warmup))
    return base * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * p)))


def train_rank(rank: int, args, port: int, data) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.ranks))
    import deepspeed

    from dspark_cluster.speculative.dspark_model import (DSparkConfig, DSparkDrafter, block_weights, dspark_loss,
                                                          num_params, save_drafter, tensor_fingerprint)

    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's collectives (and the final barrier) run on this rank's GPU
    deepspeed.init_distributed("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(args.seed)  # the same initial drafter on every rank
    layers = [int(x) for x in args.layers.split(",")]
    teacher = Teacher(args.target, layers)
    tcfg = teacher.model.config
    embed = teacher.model.get_input_embeddings().weight.detach()
    head = teacher.model.get_output_embeddings().weight.detach()
    c = DSparkConfig(target_hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size, target_layer_ids=layers,
                     hidden_size=args.hidden, num_layers=args.num_layers, num_heads=args.heads,
                     intermediate_size=args.intermediate, block_size=args.block_size, markov_rank=args.markov_rank,
                     confidence_head=not args.no_confidence, mask_token_id=tcfg.pad_token_id or 1,
                     rope_theta=float(getattr(tcfg, "rope_theta", None) or 10000.0),
                     target={"name": pathlib.Path(args.target).name, "num_layers": tcfg.num_hidden_layers,
                             "embed_sha256": tensor_fingerprint(embed), "lm_head_sha256": tensor_fingerprint(head)})
    drafter = DSparkDrafter(c)
    drafter.set_target_tables(embed, head)
    teacher.model.to(device)
    drafter.to(device).train()
    ds_cfg = {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True,
                              "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
        "steps_per_print": 10**9,
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=drafter, model_parameters=[p for p in drafter.parameters()],
                                                   config=ds_cfg)
    text_ids, generated = data
    stream = batches(text_ids, generated, args, rank)
    gen = torch.Generator().manual_seed(args.seed * 7 + rank)
    S = c.block_size
    t0, hist, step = time.time(), [], 0
    if rank == 0:
        print(f"drafter: {num_params(drafter):,} trainable parameters; {args.ranks} rank(s), DeepSpeed ZeRO-2", flush=True)
    while True:
        progress = max(step / args.steps, (time.time() - t0) / 60 / args.minutes if args.minutes else 0)
        # on the group's device (NCCL reduces no CPU tensors); every rank stops at the same step (ZeRO's collectives)
        done = torch.tensor([float(progress >= 1.0)], device=device)
        torch.distributed.all_reduce(done)
        if done.item() > 0:
            break
        for g in optimizer.param_groups:
            g["lr"] = lr_at(progress, args.lr)
        tokens, loss_mask = next(stream)
        tokens, loss_mask = tokens.to(device), loss_mask.to(device)
        ctx, p_target = teacher(tokens)
        anchors = sample_anchors(loss_mask.cpu(), args.anchors, gen).to(device)
        z, conf = engine.module.forward_train(tokens, ctx, anchors)
        label_pos, weight = block_weights(anchors, tokens.shape[1], S, loss_mask=loss_mask)
        B, A = anchors.shape
        flat = label_pos.reshape(B, A * S)
        labels = tokens.gather(1, flat).reshape(-1)
        # the target's law for the token at label_pos comes from its logits one position earlier
        pt = p_target.gather(1, (flat - 1)[..., None].expand(-1, -1, p_target.shape[-1])).reshape(-1, p_target.shape[-1])
        loss, m = dspark_loss(z.reshape(-1, z.shape[-1]), None if conf is None else conf.reshape(-1), labels, pt,
                              weight.reshape(-1))
        engine.backward(loss)
        engine.step()
        step += 1
        if rank == 0 and (step % 25 == 0 or step == 1):
            # per-slot acceptance estimate (1 - TV) of this batch and tau = 1 + sum of cumulative products
            with torch.no_grad():
                q = z.float().softmax(-1)
                ptv = pt.view(B, A, S, -1)
                acc = (1 - 0.5 * (q - ptv).abs().sum(-1)).clamp(0, 1)
                valid = weight > 0
                by_slot = [(acc[..., j][valid[..., j]].mean().item()) for j in range(S)]
                tau = 1 + sum(math.prod(by_slot[: j + 1]) for j in range(S))
            row = {"step": step, "min": round((time.time() - t0) / 60, 2), "loss": round(loss.item(), 4),
                   **{k: round(v, 4) for k, v in m.items()}, "accept_by_slot": [round(a, 3) for a in by_slot],
                   "tau_est": round(tau, 3)}
            hist.append(row)
            print(json.dumps(row), flush=True)
    if rank == 0:
        drafter = engine.module.eval()
        size = save_drafter(drafter, args.out)
        info = {"steps": step, "minutes": round((time.time() - t0) / 60, 2), "ranks": args.ranks,
                "params": num_params(drafter), "bytes": size, "history": hist}
        write_card(pathlib.Path(args.out), vars(args), info)
        print(f"saved {args.out}: {size:,} bytes, {step} steps in {info['minutes']} min", flush=True)
    torch.distributed.barrier()


def write_card(out: pathlib.Path, args: dict, info: dict) -> None:
    """README.md (the model card, with the training curve as a table) next to the weights."""
    from dspark_cluster.speculative.dspark_model import DSparkConfig

    c = DSparkConfig.load(out / "config.json")
    hist = info["history"]
    pick = hist[:: max(1, len(hist) // 12)] + ([hist[-1]] if hist and hist[-1] not in hist[:: max(1, len(hist) // 12)] else [])
    rows = "\n".join(f"| {h['step']} | {h['min']} | {h['loss']} | {h['ce']} | {h['tv']} | {h.get('bce', '-')} | "
                     f"{' '.join(str(a) for a in h['accept_by_slot'])} | {h['tau_est']} |" for h in pick)
    out.joinpath("README.md").write_text(f"""# tiny-dspark

A DSpark drafter (DeepSeek's DSpark: parallel block drafting on the target's hidden states, a
low-rank Markov head, a confidence head) for the bundled `tiny-moe`, trained by
`launch/train_dspark.py` with DeepSpeed (ZeRO stage 2, {info['ranks']} rank(s), gloo on CPU).

- Context: outputs of tiny-moe's decoder layers {c.target_layer_ids} (of {c.target.get('num_layers')}),
  concatenated ({len(c.target_layer_ids)} x {c.target_hidden_size}) and fused to width {c.hidden_size}.
- Backbone: {c.num_layers} layer(s), width {c.hidden_size}, {c.num_heads} heads, SwiGLU {c.intermediate_size};
  block of {c.block_size} slots (anchor + {c.block_size - 1} mask tokens, id {c.mask_token_id}); drafts up to
  {c.block_size} tokens per forward.
- Markov head: rank {c.markov_rank}, factored through tiny-moe's tables (W1 = E_in P, W2 = Q E_out^T).
- Confidence head: {'on, [h ; W1[x_prev]] -> logit' if c.confidence_head else 'off'}.
- {info['params']:,} parameters, stored in fp16 ({info['bytes']:,} bytes with this card); the embedding and LM
  head are tiny-moe's (frozen, not stored; their fingerprints are in config.json and checked at load).

Training: {info['steps']} steps in {info['minutes']} min (wall time, a 2-core CPU machine), batch
{args['batch']} windows of {args['window']} tokens per rank, {args['anchors']} blocks per window, AdamW
(lr {args['lr']}, warmup 4%, cosine), gradient clipping 1.0. Data: continuations tiny-moe generated
({args['gen_prompts']} prompts from the training modules, {args['gen_tokens']} tokens, half greedy, half
temperature 1) and windows of the training text; never the held-out modules. Loss: 0.1 CE + 0.9 L1
(= 1.8 TV) toward tiny-moe's law + 1.0 BCE of the confidence toward 1 - TV, weighted exp(-j/4) by slot.

Reproduce: `python launch/train_dspark.py` (defaults; command line: `{' '.join(sys.argv[1:]) or '(none)'}`).

Training curve (accept_by_slot: mean 1 - TV per slot on the batch, teacher-forced; tau_est = 1 + sum of
their cumulative products):

| step | min | loss | CE | TV | BCE | accept by slot | tau_est |
|---|---|---|---|---|---|---|---|
{rows}
""")
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")


def main(argv=None):
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from parallel.state import free_port

    t0 = time.time()
    if args.data_cache and os.path.exists(args.data_cache):
        data = torch.load(args.data_cache)
        print(f"data from {args.data_cache}", flush=True)
    else:
        tok = AutoTokenizer.from_pretrained(args.target, trust_remote_code=False)
        text_ids = training_text_ids(tok)
        print(f"training text: {len(text_ids):,} tokens ({time.time() - t0:.0f} s)", flush=True)
        t1 = time.time()
        generated = generate_continuations(args.target, tok, args.gen_prompts, args.gen_tokens, args.seed) if args.gen_prompts else []
        print(f"target continuations: {len(generated)} x {args.gen_tokens} tokens ({time.time() - t1:.0f} s)", flush=True)
        data = (text_ids, generated)
        if args.data_cache:
            torch.save(data, args.data_cache)
    port = free_port()
    if args.ranks == 1:
        train_rank(0, args, port, data)
    else:
        torch.multiprocessing.spawn(train_rank, args=(args, port, data), nprocs=args.ranks, join=True)
    print(f"total {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
