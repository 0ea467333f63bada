#!/usr/bin/env python
"""Offline measurements of the bundled tiny model family, with `transformers`.

    python launch/eval_tiny_models.py            # ~10 min on 2 CPU cores

Measures, on the held-out modules of ``launch/train_tiny_models.py``:

* held-out bits per byte of ``tiny-moe`` (target) and ``tiny-draft`` (drafter):
  total NLL in nats over the held-out tokens / ln 2 / UTF-8 bytes of the
  held-out text; every document is scored after a leading ``<|endoftext|>``
  with sliding ``--ctx``-token windows (stride ctx/2, so every token has at
  least ctx/2 tokens of context unless it is nearer the document start);
* top-1 agreement of the drafter with the target under teacher forcing
  (fraction of scored positions where argmax(drafter) == argmax(target));
* greedy speculation simulated offline with ``--k`` draft tokens on the
  prompt set (``prompts/heldout.jsonl``): each round the drafter proposes k
  greedy tokens, the target verifies them in one forward pass, the round
  yields the matching prefix + 1 target token. Reports τ = mean tokens per
  verify round and acceptance by draft position;
* per-layer expert load of the target on the held-out text (top-k
  assignments per routed expert, recorded by hooks on the MoE gates) and
  max / mean: the model's natural hot spots.

Prints a markdown report, writes it into both model cards (between the
``eval`` markers) and into the "## Tiny model family (issue 3)" section of
BENCHMARKS.md (other sections are left alone). ``--no-write`` only prints.
"""

from __future__ import annotations

import argparse
import json
import os
import math
import pathlib
import platform
import re
import subprocess
import sys
import time

# Sleep instead of spinning in OpenMP barriers: on a shared 2-core machine
# spinning threads make each step many times slower (must precede "import torch").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_tiny_models as T  # noqa: E402

SECTION = "## Tiny model family (issue 3)"


def machine_info(threads: int) -> str:
    try:
        nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    except OSError:
        nproc = "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), "?")
    except OSError:
        model = "?"
    return (
        f"`nproc` = {nproc}, `lscpu | grep 'Model name'` = {model}; {threads} torch threads; "
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{__import__('transformers').__version__}; no GPU"
    )


def is_table_module(text: str, module: str) -> bool:
    """Generated data tables (charmap codecs, stringprep): near-trivial to predict."""
    return module == "stringprep" or "decoding_table = (" in text


@torch.no_grad()
def simulate_speculation(target, draft, prompts_ids, k: int, max_new: int, eos_id: int):
    """Greedy speculative decoding without KV caches: returns per-round accepted counts + outputs."""
    rounds, outputs = [], []
    for ids in prompts_ids:
        ctx = list(ids)
        gen: list[int] = []
        while len(gen) < max_new:
            d: list[int] = []
            for _ in range(k):
                lg = draft(input_ids=torch.tensor([ctx + gen + d])).logits[0, -1]
                d.append(int(lg.argmax()))
            seq = ctx + gen + d
            tl = target(input_ids=torch.tensor([seq])).logits[0, len(ctx) + len(gen) - 1 :]
            t = tl.argmax(-1).tolist()  # k + 1 target tokens
            m = 0
            while m < k and d[m] == t[m]:
                m += 1
            rounds.append(m)
            new = d[:m] + [t[m]]
            stop = False
            if eos_id in new:
                new = new[: new.index(eos_id) + 1]
                stop = True
            gen.extend(new)
            if stop:
                break
        outputs.append(gen[:max_new])
    return rounds, outputs


def fmt_row(cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def replace_between(text: str, start: str, end: str, body: str) -> str:
    i, j = text.find(start), text.find(end)
    if i < 0 or j < 0:
        return text.rstrip("\n") + f"\n\n{start}\n{body}\n{end}\n"
    return text[: i + len(start)] + "\n" + body + "\n" + text[j:]


def update_benchmarks(path: pathlib.Path, section_body: str):
    new_section = f"{SECTION}\n\n{section_body.strip()}\n"
    if not path.exists():
        path.write_text("# Benchmarks\n\n" + new_section)
        return
    text = path.read_text()
    if SECTION in text:
        i = text.index(SECTION)
        m = re.search(r"^## ", text[i + len(SECTION) :], flags=re.M)
        j = i + len(SECTION) + m.start() if m else len(text)
        rest = text[j:]
        text = text[:i] + new_section + ("\n" + rest if rest else "")
    else:
        text = text.rstrip("\n") + "\n\n" + new_section
    path.write_text(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets", type=pathlib.Path, default=T.ASSETS)
    ap.add_argument("--ctx", type=int, default=512, help="held-out scoring window (stride ctx/2)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per speculation round")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompts", type=int, default=0, help="0: all prompts")
    ap.add_argument("--max-docs", type=int, default=0, help="0: all held-out modules (smoke runs only)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--benchmarks", type=pathlib.Path, default=T.REPO / "BENCHMARKS.md")
    ap.add_argument("--no-write", action="store_true", help="print only; leave model cards and BENCHMARKS.md alone")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    cmd = " ".join(["python launch/eval_tiny_models.py"] + list(sys.argv[1:] if argv is None else argv))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tdir, ddir = args.assets / "tiny-moe", args.assets / "tiny-draft"
    tok = AutoTokenizer.from_pretrained(tdir)
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    cfg = target.config
    E = cfg.n_routed_experts
    eos = tok.eos_token_id

    # ---------------------------------------------------------------- held-out text
    _, held = T.load_corpus()
    if args.max_docs:
        held = held[: args.max_docs]
    held_ids = [[eos] + tok(text, add_special_tokens=False, verbose=False).input_ids for _, text in held]
    n_bytes = [len(text.encode("utf-8")) for _, text in held]
    tables = [is_table_module(text, T.module_name(rel)) for rel, text in held]

    rec = T.RouterRecorder(target)
    load = {layer: torch.zeros(E, dtype=torch.long) for layer, _ in rec.gates}
    correct = [0, 0]

    def on_batch(logits_list, tgt, msk):
        for layer, cnt in rec.counts(E, mask=msk).items():
            load[layer] += cnt
        rec.clear()
        for i, lg in enumerate(logits_list):
            correct[i] += ((lg.argmax(-1) == tgt) & msk).sum().item()

    t0 = time.time()
    nll, ntok, agree = T.evaluate_docs([target, draft], held_ids, args.ctx, on_batch=on_batch)
    rec.remove()
    t_heldout = time.time() - t0
    N = sum(ntok)
    B = sum(n_bytes)
    res = {
        "heldout_modules": len(held),
        "heldout_bytes": B,
        "heldout_tokens": N,
        "target_bpb": T.bits_per_byte(sum(nll[0]), B),
        "draft_bpb": T.bits_per_byte(sum(nll[1]), B),
        "target_nll_per_token": sum(nll[0]) / N,
        "draft_nll_per_token": sum(nll[1]) / N,
        "target_top1_acc": correct[0] / N,
        "draft_top1_acc": correct[1] / N,
        "agreement": agree[1] / N,
    }
    code = [i for i, t in enumerate(tables) if not t]
    Bc = sum(n_bytes[i] for i in code)
    res["target_bpb_code"] = T.bits_per_byte(sum(nll[0][i] for i in code), Bc)
    res["draft_bpb_code"] = T.bits_per_byte(sum(nll[1][i] for i in code), Bc)
    res["table_modules"] = [T.module_name(rel) for (rel, _), t in zip(held, tables) if t]
    print(f"held-out pass: {t_heldout:.0f}s, {json.dumps({k: v for k, v in res.items() if k != 'table_modules'})}", flush=True)

    # ---------------------------------------------------------------- speculation
    prompts = [json.loads(l) for l in open(args.assets / "prompts" / "heldout.jsonl")]
    if args.max_prompts:
        prompts = prompts[: args.max_prompts]
    p_ids = [tok(p["prompt"], add_special_tokens=False).input_ids for p in prompts]
    t0 = time.time()
    rounds, outs = simulate_speculation(target, draft, p_ids, args.k, args.max_new_tokens, eos)
    t_spec = time.time() - t0
    tau = sum(m + 1 for m in rounds) / len(rounds)
    acc_pos = [sum(m >= i for m in rounds) / len(rounds) for i in range(1, args.k + 1)]
    cond_pos = [
        sum(m >= i for m in rounds) / max(1, sum(m >= i - 1 for m in rounds)) for i in range(1, args.k + 1)
    ]
    # losslessness check against transformers' own greedy generate on a few prompts
    checks = []
    for ids, out in list(zip(p_ids, outs))[:3]:
        ref = target.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        checks.append(ref == out)
    res.update({"k": args.k, "tau": tau, "rounds": len(rounds), "acc_pos": acc_pos, "cond_pos": cond_pos,
                "prompts": len(prompts), "greedy_match": f"{sum(checks)}/{len(checks)}"})
    print(f"speculation: {t_spec:.0f}s, tau {tau:.3f}, acceptance by position {acc_pos}", flush=True)

    # ---------------------------------------------------------------- report
    L = []
    L.append(f"Measured by `{cmd}` with `transformers` (fp32, offline) on {machine_info(args.threads)}; "
             f"{time.time() - t_start:.0f} s in all.")
    L.append("")
    L.append(f"Held-out text: {len(held)} modules, {B:,} bytes, {N:,} scored tokens "
             f"(sliding {args.ctx}-token windows, stride {args.ctx // 2}, each module after a leading `<|endoftext|>`).")
    L.append("")
    L.append(fmt_row(["model", "params", "held-out bits/byte", "bits/byte w/o tables", "nats/token", "top-1 acc vs text"]))
    L.append(fmt_row(["---", "---:", "---:", "---:", "---:", "---:"]))
    for name, m, key in (("tiny-moe (target)", target, "target"), ("tiny-draft (drafter)", draft, "draft")):
        L.append(fmt_row([name, f"{T.n_params(m):,}", f"**{res[key + '_bpb']:.4f}**", f"{res[key + '_bpb_code']:.4f}",
                          f"{res[key + '_nll_per_token']:.4f}", f"{res[key + '_top1_acc']:.1%}"]))
    L.append("")
    L.append(f"\"w/o tables\" leaves out the generated data-table modules among the held-out ones "
             f"({', '.join('`' + m + '`' for m in res['table_modules'])}).")
    L.append("")
    L.append(f"- Drafter top-1 agreement with the target (teacher forcing, all scored held-out positions): **{res['agreement']:.1%}**.")
    L.append(f"- Greedy speculation simulated offline, k = {args.k}, on the {len(prompts)} held-out prompts "
             f"(`prompts/heldout.jsonl`), up to {args.max_new_tokens} new tokens each, {len(rounds)} verify rounds: "
             f"**τ = {tau:.3f}** tokens per verify round (accepted draft tokens + 1). "
             f"Speculative output equals `generate(do_sample=False)` on {res['greedy_match']} checked prompts.")
    L.append("")
    L.append(fmt_row(["draft position"] + [str(i) for i in range(1, args.k + 1)]))
    L.append(fmt_row(["---"] + ["---:"] * args.k))
    L.append(fmt_row(["accepted (fraction of rounds)"] + [f"{a:.1%}" for a in acc_pos]))
    L.append(fmt_row(["accepted given previous accepted"] + [f"{a:.1%}" for a in cond_pos]))
    L.append("")
    L.append(f"Expert load of the target on the held-out text: top-{cfg.num_experts_per_tok} assignments per routed "
             f"expert over the {N:,} scored tokens (n_group = {cfg.n_group}, topk_group = {cfg.topk_group}; "
             "groups are experts 0-1, 2-3, ...):")
    L.append("")
    L.append(fmt_row(["layer"] + [f"e{i}" for i in range(E)] + ["max/mean", "min/mean"]))
    L.append(fmt_row(["---"] + ["---:"] * (E + 2)))
    res["expert_load"] = {}
    for layer in sorted(load):
        c = load[layer].double()
        mean = c.mean().item()
        res["expert_load"][layer] = load[layer].tolist()
        L.append(fmt_row([layer] + [f"{int(x):,}" for x in load[layer]] +
                         [f"{c.max().item() / mean:.2f}", f"{c.min().item() / mean:.2f}"]))
    sizes = {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in (tdir, ddir)}
    L.append("")
    L.append(f"Checkpoint folders (fp32 safetensors + tokenizer + card): tiny-moe {sizes['tiny-moe'] / 2**20:.2f} MiB, "
             f"tiny-draft {sizes['tiny-draft'] / 2**20:.2f} MiB, {sum(sizes.values()) / 2**20:.2f} MiB together (budget 25 MiB).")
    report = "\n".join(L)
    print("\n" + report + "\n")

    if not args.no_write:
        for d in (tdir, ddir):
            card = d / "README.md"
            if card.exists():
                body = "## Evaluation\n\n" + report
                card.write_text(replace_between(card.read_text(), T.EVAL_START, T.EVAL_END, body))
        update_benchmarks(args.benchmarks, report + "\n\nModel cards: `dspark_cluster/assets/tiny-moe/README.md`, "
                          "`dspark_cluster/assets/tiny-draft/README.md`; training: `python launch/train_tiny_models.py` "
                          "(see the cards for its numbers).")
        print(f"wrote model cards and {args.benchmarks}")
    (pathlib.Path("/tmp") / "tiny_eval_results.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
