#!/usr/bin/env python
"""Train the bundled DSpark drafter (`tiny-dspark`) against the bundled target (`tiny-moe`), with DeepSpeed.

    python launch/train_dspark.py                      # ~35 min on 2 CPU cores (2 ranks, ZeRO-2, gloo)
    python launch/train_dspark.py --smoke              # a 1-minute plumbing check
    python launch/train_dspark.py --markov-rank 0 --out /tmp/no-markov      # ablations
    python launch/train_dspark.py --no-confidence --out /tmp/no-confidence
    python launch/train_dspark.py --init-from dspark_cluster/assets/tiny-dspark --lr 5e-4 --slot-decay 1e9 \
        --out /tmp/finetuned                                                      # fine-tune, flat slot weights

Data (never the held-out modules, whose prompts measure the drafter): (a) continuations the target
generates (our own engine, half the prompts greedy, half at temperature 1, each of those sampled
`--gen-t1-samples` times) of prompts extracted from the training modules of the standard library, loss on
the continuation; (b) random windows of the training text.
The teacher runs online every step: the target's chosen layers' outputs are the drafter's context,
its softmax the law the drafter learns (the drafter never sees a label the target did not give).

Loss (DSpark's): 0.1 CE + 0.9 L1 (= 2 TV) toward the target's law + 1.0 BCE of the confidence
toward 1 - TV, each weighted exp(-j / 4) along the block, a label hole ending the block. Options:
`--slot-decay S` (weights exp(-j / S); 1e9 = flat) or `--slot-weights w0,w1,..` (one per slot),
`--ce-alpha` / `--l1-alpha` / `--conf-alpha` (the terms' weights), `--kl-alpha` (an added KL(p_target ||
p_draft), the soft-label cross-entropy toward the target's whole law: at temperature 1 acceptance is 1 - TV
of the whole law, while the hard-label CE on greedy continuations pulls the draft toward the argmax).
`--init-from PATH` starts from a saved drafter (its architecture; fine-tuning) instead of random weights;
the LR schedule still warms up.

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
    ap.add_argument("--num-layers", type=int, default=None,
                    help="drafter layers (default 2, or --init-from's; more than --init-from's appends layers that start "
                         "as the identity: their output projections are zero)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=None, help="slots per block (default 6, or --init-from's)")
    ap.add_argument("--markov-rank", type=int, default=None,
                    help="rank of the Markov head (default 64, or --init-from's; a larger one than --init-from's widens "
                         "its Markov head function-preservingly: the new factors' output side starts at zero)")
    ap.add_argument("--markov-gate", action="store_true",
                    help="gate the Markov head's factors by the slot's row (DSparkConfig.markov_gate); added to an "
                         "--init-from drafter without one as a no-op (the gate starts at zero)")
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
    ap.add_argument("--init-from", default=None,
                    help="a saved drafter to start from (fine-tuning): its architecture (context layers, width, "
                         "depth, heads, Markov rank, confidence head) replaces the flags'; --block-size may differ")
    ap.add_argument("--slot-decay", type=float, default=4.0,
                    help="loss weight exp(-j / S) of block slot j (default 4; 1e9: flat)")
    ap.add_argument("--slot-weights", default=None,
                    help="comma-separated loss weight per slot (overrides --slot-decay), e.g. 1,1,1,1,0.5,0.25")
    ap.add_argument("--ce-alpha", type=float, default=0.1, help="hard-label CE weight")
    ap.add_argument("--l1-alpha", type=float, default=0.9, help="L1 (= 2 TV) toward the target's law weight")
    ap.add_argument("--conf-alpha", type=float, default=1.0, help="confidence BCE weight")
    ap.add_argument("--kl-alpha", type=float, default=0.0, help="added KL(p_target || p_draft) weight (default off)")
    ap.add_argument("--gen-per-module", type=int, default=4, help="prompts per training module for the continuations")
    ap.add_argument("--gen-t1-samples", type=int, default=1,
                    help="temperature-1 continuations sampled per prompt (different seeds): more distinct T=1 "
                         "contexts without more prompts")
    ap.add_argument("--gen-t1-share", type=float, default=None,
                    help="share of the continuation samples drawn from the temperature-1 ones (default: uniform "
                         "over all continuations, i.e. ~half)")
    ap.add_argument("--second-pass-share", type=float, default=0.0,
                    help="share of blocks trained as a second pass (slot 1 holds the true next token; slot 0 unscored)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.minutes, args.gen_prompts, args.gen_tokens, args.batch = 6, 1.0, 8, 32, 2
    if args.init_from:
        from dspark_cluster.speculative.dspark_model import DSparkConfig

        ic = DSparkConfig.load(pathlib.Path(args.init_from) / "config.json")
        args.layers = ",".join(str(i) for i in ic.target_layer_ids)
        args.hidden, args.heads = ic.hidden_size, ic.num_heads
        if args.num_layers is None:
            args.num_layers = ic.num_layers
        elif args.num_layers < ic.num_layers:
            raise SystemExit(f"--num-layers {args.num_layers}: --init-from has {ic.num_layers} layers; layers can only "
                             "be appended")
        args.intermediate, args.no_confidence = ic.intermediate_size, not ic.confidence_head
        args.markov_gate = args.markov_gate or ic.markov_gate
        if ic.draft_passes == 2 and not args.second_pass_share:  # keep training the second pass it serves
            args.second_pass_share = 0.5
        if args.markov_rank is None:
            args.markov_rank = ic.markov_rank
        elif not ic.markov_rank or args.markov_rank < ic.markov_rank:
            raise SystemExit(f"--markov-rank {args.markov_rank}: --init-from's rank {ic.markov_rank} can only be widened")
        if args.block_size is None:
            args.block_size = ic.block_size
    if args.block_size is None:
        args.block_size = 6
    if args.markov_rank is None:
        args.markov_rank = 64
    if args.num_layers is None:
        args.num_layers = 2
    return args


def widen_markov(state: dict, fresh: dict) -> dict:
    """A saved drafter's state with its Markov head widened to `fresh`'s rank, the same function: the new
    rows of P (markov_in) keep `fresh`'s random init, the new columns of Q (markov_out) and the confidence
    head's weights on the new inputs are zero."""
    state = dict(state)
    r0, r = state["markov_in.weight"].shape[0], fresh["markov_in.weight"].shape[0]
    if r0 == r:
        return state
    w = fresh["markov_in.weight"].clone()
    w[:r0] = state["markov_in.weight"]
    state["markov_in.weight"] = w
    w = torch.zeros_like(fresh["markov_out.weight"])
    w[:, :r0] = state["markov_out.weight"]
    state["markov_out.weight"] = w
    if "confidence.weight" in state:
        old = state["confidence.weight"]
        w = torch.zeros_like(fresh["confidence.weight"])
        w[:, : old.shape[1]] = old
        state["confidence.weight"] = w
    return state


def add_new_parts(state: dict, fresh: dict) -> dict:
    """A saved drafter's state with `fresh`'s extra layers (and Markov gate) added, the same function: each new
    layer keeps `fresh`'s random init except its attention and MLP output projections, which are zero, so the
    residual stream passes through it unchanged until training moves them; a new Markov gate is zero (a gate of
    1 on every factor)."""
    state = dict(state)
    for k, v in fresh.items():
        if k not in state and (k.startswith("layers.") or k == "markov_gate.weight"):
            zero = k.endswith(("o_proj.weight", "down_proj.weight")) or k == "markov_gate.weight"
            state[k] = torch.zeros_like(v) if zero else v.clone()
    return state


def slot_weights(args, S: int) -> torch.Tensor:
    """The loss weight of each block slot: --slot-weights, else exp(-j / --slot-decay)."""
    if args.slot_weights:
        w = [float(x) for x in args.slot_weights.split(",")]
        if len(w) != S:
            raise SystemExit(f"--slot-weights has {len(w)} values for a block of {S} slots")
        return torch.tensor(w)
    return torch.exp(-torch.arange(S).float() / args.slot_decay)


def slot_weighting_text(args, S: int) -> str:
    if args.slot_weights:
        return f"weighted {args.slot_weights} by slot"
    if args.slot_decay >= 1e6:
        return "flat over the slots"
    return f"weighted exp(-j/{args.slot_decay:g}) by slot"


# ---------------------------------------------------------------------------------------- data

def training_text_ids(tok) -> list[int]:
    from train_tiny_models import load_corpus

    train, _ = load_corpus()
    ids = []
    for _, text in train:
        ids.extend(tok(text)["input_ids"])
        ids.append(tok.eos_token_id)
    return ids


def generate_continuations(target: str, tok, n: int, max_tokens: int, seed: int, per_module: int = 4,
                           t1_samples: int = 1) -> list[tuple[list[int], int, float]]:
    """(prompt + continuation ids, prompt length, temperature) for prompts of the training modules, continued
    by the target itself: half the prompts greedily, the other half at temperature 1, `t1_samples` times each
    (different seeds)."""
    from train_tiny_models import extract_prompts, load_corpus

    from dspark_cluster import LLM, SamplingParams

    train, _ = load_corpus()
    prompts = [c["prompt"] for c in extract_prompts(train, n, per_module=per_module)]
    jobs = [(p, 0.0 if i % 2 == 0 else 1.0) for i, p in enumerate(prompts)]
    jobs = [j for j in jobs for _ in range(1 if j[1] == 0.0 else t1_samples)]
    llm = LLM(target, config={"scheduler": {"max_num_seqs": 64}})
    params = [SamplingParams(max_tokens=max_tokens, temperature=t, seed=seed + i, ignore_eos=True)
              for i, (_, t) in enumerate(jobs)]
    outs = llm.generate([p for p, _ in jobs], params)
    llm.shutdown()
    return [(o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids), t) for o, (_, t) in zip(outs, jobs)]


def continuation_pools(generated) -> list[list[tuple[list[int], int]]]:
    """[greedy, temperature 1] pools of (ids, prompt length). Data caches written before the temperature was
    stored hold pairs that alternate greedy (even index) and temperature 1 (odd index)."""
    if generated and len(generated[0]) == 2:
        return [generated[0::2], generated[1::2]]
    return [[(ids, plen) for ids, plen, t in generated if t == 0.0],
            [(ids, plen) for ids, plen, t in generated if t != 0.0]]


def batches(text_ids, generated, args, rank: int):
    """Endless (tokens [B, T], loss_mask [B, T]) batches: half generated samples, half text windows."""
    rng = random.Random(args.seed * 1000 + rank)
    T = args.window
    pools = continuation_pools(generated) if generated else None
    every = [g[:2] for g in generated]
    while True:
        toks, masks = [], []
        for b in range(args.batch):
            if generated and rng.random() < args.gen_fraction:
                if args.gen_t1_share is None:
                    ids, plen = every[rng.randrange(len(every))]
                else:
                    pool = pools[1] if rng.random() < args.gen_t1_share else pools[0]
                    ids, plen = pool[rng.randrange(len(pool))]
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
                     markov_gate=args.markov_gate, confidence_head=not args.no_confidence,
                     draft_passes=2 if args.second_pass_share else 1, mask_token_id=tcfg.pad_token_id or 1,
                     rope_theta=float(getattr(tcfg, "rope_theta", None) or 10000.0),
                     target={"name": pathlib.Path(args.target).name, "num_layers": tcfg.num_hidden_layers,
                             "embed_sha256": tensor_fingerprint(embed), "lm_head_sha256": tensor_fingerprint(head)})
    drafter = DSparkDrafter(c)
    if args.init_from:  # fine-tuning: the saved drafter's weights (fp16 on disk, upcast), the same on every rank
        from safetensors.torch import load_file

        state = {k: v.float() for k, v in load_file(str(pathlib.Path(args.init_from) / "model.safetensors")).items()}
        state = add_new_parts(widen_markov(state, drafter.state_dict()), drafter.state_dict())
        missing, unexpected = drafter.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise SystemExit(f"--init-from {args.init_from}: tensors missing {missing[:4]} / unexpected {unexpected[:4]}")
        if rank == 0:
            print(f"initialised from {args.init_from}", flush=True)
    drafter.set_target_tables(embed.float(), head.float())  # held, not copied: fp32 as the drafter trains
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
    w_slot = slot_weights(args, S).to(device)
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
        second = None
        if args.second_pass_share:
            second = (torch.rand(anchors.shape, generator=gen) < args.second_pass_share).to(device)
        z, conf = engine.module.forward_train(tokens, ctx, anchors, second)
        label_pos, weight = block_weights(anchors, tokens.shape[1], S, loss_mask=loss_mask)
        valid = weight > 0
        weight = valid * w_slot  # the slot weighting of the options (default exp(-j/4), block_weights')
        if second is not None:  # a second pass's slot 0 sees its own label at slot 1: not scored
            weight[..., 0] = weight[..., 0] * ~second
        B, A = anchors.shape
        flat = label_pos.reshape(B, A * S)
        labels = tokens.gather(1, flat).reshape(-1)
        # the target's law for the token at label_pos comes from its logits one position earlier
        pt = p_target.gather(1, (flat - 1)[..., None].expand(-1, -1, p_target.shape[-1])).reshape(-1, p_target.shape[-1])
        loss, m = dspark_loss(z.reshape(-1, z.shape[-1]), None if conf is None else conf.reshape(-1), labels, pt,
                              weight.reshape(-1), ce_alpha=args.ce_alpha, l1_alpha=args.l1_alpha,
                              conf_alpha=args.conf_alpha)
        if args.kl_alpha:
            wf = weight.reshape(-1)
            logq = z.reshape(-1, z.shape[-1]).log_softmax(-1)
            kl = (pt * (pt.clamp(min=1e-12).log() - logq)).sum(-1)
            kl_mean = (kl * wf).sum() / wf.sum().clamp(min=1e-6)
            loss = loss + args.kl_alpha * kl_mean
            m["kl"] = float(kl_mean.detach())
        engine.backward(loss)
        engine.step()
        step += 1
        if rank == 0 and (step % 25 == 0 or step == 1):
            # per-slot acceptance estimate (1 - TV) of this batch and tau = 1 + sum of cumulative products
            with torch.no_grad():
                q = z.float().softmax(-1)
                ptv = pt.view(B, A, S, -1)
                acc = (1 - 0.5 * (q - ptv).abs().sum(-1)).clamp(0, 1)
                first = valid if second is None else valid & ~second[..., None]
                by_slot = [(acc[..., j][first[..., j]].mean().item()) for j in range(S)]
                tau = 1 + sum(math.prod(by_slot[: j + 1]) for j in range(S))
                extra = {}
                if second is not None and bool(second.any()):  # slot 0 from a first pass, the rest from a second
                    two = [by_slot[0]] + [acc[..., j][(valid & second[..., None])[..., j]].mean().item()
                                          for j in range(1, S)]
                    extra = {"accept_by_slot_2p": [round(a, 3) for a in two],
                             "tau_est_2p": round(1 + sum(math.prod(two[: j + 1]) for j in range(S)), 3)}
            row = {"step": step, "min": round((time.time() - t0) / 60, 2), "loss": round(loss.item(), 4),
                   **{k: round(v, 4) for k, v in m.items()}, "accept_by_slot": [round(a, 3) for a in by_slot],
                   "tau_est": round(tau, 3), **extra}
            hist.append(row)
            print(json.dumps(row), flush=True)
    if rank == 0:
        drafter = engine.module.eval()
        size = save_drafter(drafter, args.out)
        info = {"steps": step, "minutes": round((time.time() - t0) / 60, 2), "ranks": args.ranks,
                "params": num_params(drafter), "bytes": size, "continuations": len(data[1]), "history": hist}
        if args.init_from:
            info["init_training"] = init_training_text(pathlib.Path(args.init_from))
        write_card(pathlib.Path(args.out), vars(args), info)
        print(f"saved {args.out}: {size:,} bytes, {step} steps in {info['minutes']} min", flush=True)
    torch.distributed.barrier()


def init_training_text(path: pathlib.Path) -> str:
    """One line on how the drafter at `path` was trained (its training.json), for a fine-tune's card."""
    try:
        t = json.loads((path / "training.json").read_text())
    except (OSError, ValueError):
        return "unknown (no training.json)"
    line = f"{t.get('steps')} steps in {t.get('minutes')} min"
    if t.get("argv") is not None:
        line += f", `{' '.join(t['argv']) or '(defaults)'}`"
    if t.get("init_training"):
        line += f", itself fine-tuned from a drafter trained {t['init_training']}"
    return line


def write_card(out: pathlib.Path, args: dict, info: dict) -> None:
    """README.md (the model card, with the training curve as a table) next to the weights."""
    from dspark_cluster.speculative.dspark_model import DSparkConfig

    c = DSparkConfig.load(out / "config.json")
    hist = info["history"]
    pick = hist[:: max(1, len(hist) // 12)] + ([hist[-1]] if hist and hist[-1] not in hist[:: max(1, len(hist) // 12)] else [])
    S = c.block_size
    wtext = slot_weighting_text(argparse.Namespace(**args), S)
    loss_text = (f"{args['ce_alpha']:g} CE + {args['l1_alpha']:g} L1 (= {2 * args['l1_alpha']:g} TV) toward tiny-moe's law"
                 + (f" + {args['kl_alpha']:g} KL(tiny-moe's law || draft law)" if args['kl_alpha'] else "")
                 + (f" + {args['conf_alpha']:g} BCE of the confidence toward 1 - TV" if c.confidence_head else "")
                 + f", {wtext}")
    init_text = ""
    if args.get("init_from"):
        init_text = (f"\nFine-tuned from `{pathlib.Path(args['init_from']).name}` (`--init-from {args['init_from']}`;"
                     f" that drafter's own training: {info.get('init_training', 'see its card')}).")
    t1_text = (f"; {args['gen_t1_share']:.0%} of the continuation samples drawn from the temperature-1 ones"
               if args.get("gen_t1_share") is not None else "")
    t1_samples_text = (f" ({args['gen_t1_samples']} samples each)" if args.get("gen_t1_samples", 1) > 1 else "")
    gate_text = "; each factor gated by the slot's row: bias = (W1[x_prev] * (1 + G h)) W2" if c.markov_gate else ""
    passes_text = ("\n- Second pass (draft_passes 2): slot 0 drafted from the block above, slots 1.. from a second forward"
                   " whose slot 1 holds that draft; trained on both, "
                   f"{args.get('second_pass_share') or 0:.0%} of the blocks as second passes (slot 0 unscored there)"
                   if c.draft_passes == 2 else "")
    rows = "\n".join(f"| {h['step']} | {h['min']} | {h['loss']} | {h['ce']} | {h['tv']} | {h.get('bce', '-')} | "
                     f"{' '.join(str(a) for a in h['accept_by_slot'])} | {h['tau_est']} |" for h in pick)
    out.joinpath("README.md").write_text(f"""# tiny-dspark

A DSpark drafter (DeepSeek's DSpark: parallel block drafting on the target's hidden states, a
low-rank Markov head, a confidence head) for the bundled `tiny-moe`, trained by
`launch/train_dspark.py` with DeepSpeed (ZeRO stage 2, {info['ranks']} rank(s), gloo on CPU).{init_text}

- Context: outputs of tiny-moe's decoder layers {c.target_layer_ids} (of {c.target.get('num_layers')}),
  concatenated ({len(c.target_layer_ids)} x {c.target_hidden_size}) and fused to width {c.hidden_size}.
- Backbone: {c.num_layers} layer(s), width {c.hidden_size}, {c.num_heads} heads, SwiGLU {c.intermediate_size};
  block of {c.block_size} slots (anchor + {c.block_size - 1} mask tokens, id {c.mask_token_id}); drafts up to
  {c.block_size} tokens per forward.
- Markov head: rank {c.markov_rank}, factored through tiny-moe's tables (W1 = E_in P, W2 = Q E_out^T){gate_text}.
- Confidence head: {'on, [h ; W1[x_prev]] -> logit' if c.confidence_head else 'off'}.{passes_text}
- {info['params']:,} parameters, stored in fp16 ({info['bytes']:,} bytes with this card); the embedding and LM
  head are tiny-moe's (frozen, not stored; their fingerprints are in config.json and checked at load).

Training: {info['steps']} steps in {info['minutes']} min (wall time, a 2-core CPU machine), batch
{args['batch']} windows of {args['window']} tokens per rank, {args['anchors']} blocks per window, AdamW
(lr {args['lr']}, warmup 4%, cosine), gradient clipping 1.0. Data: continuations tiny-moe generated
({info.get('continuations', args['gen_prompts'])} continuations of {args['gen_prompts']} prompts from the training modules, {args['gen_tokens']} tokens,
half the prompts greedy, half at temperature 1{t1_samples_text}{t1_text}) and windows of the training text; never the held-out modules. Loss: {loss_text}.

Reproduce: `python launch/train_dspark.py {' '.join(sys.argv[1:])}`{' (defaults)' if len(sys.argv) < 2 else ''}.

Training curve (accept_by_slot: mean 1 - TV per slot on the batch, teacher-forced; tau_est = 1 + sum of
their cumulative products):

| step | min | loss | CE | TV | BCE | accept by slot | tau_est |
|---|---|---|---|---|---|---|---|
{rows}
""")
    (out / "training.json").write_text(json.dumps({**info, "args": args, "argv": sys.argv[1:]}, indent=1) + "\n")


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
        generated = (generate_continuations(args.target, tok, args.gen_prompts, args.gen_tokens, args.seed,
                                            args.gen_per_module, args.gen_t1_samples) if args.gen_prompts else [])
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
