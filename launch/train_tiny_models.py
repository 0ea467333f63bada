#!/usr/bin/env python
"""Train the bundled tiny model family on the Python standard library's source.

Produces, from scratch and offline, on CPU:

* a byte-level BPE tokenizer (``tokenizers``), shared by both models;
* ``tiny-moe``: a DeepSeek-V3-architecture MoE target (``DeepseekV3ForCausalLM``:
  MLA with q/kv LoRA ranks and decoupled RoPE, 8 routed experts in 4 groups +
  1 shared expert, top-2 with group-limited routing, one dense first layer);
* ``tiny-draft``: a dense 2-layer ``LlamaForCausalLM`` drafter;
* ``prompts/heldout.jsonl``: prompts (signatures + docstrings, class headers)
  drawn from the held-out modules.

The text is every ``*.py`` file of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), minus test folders and site-packages,
in sorted order. About 5% of the modules (those whose SHA-256 of the dotted
module name is 0 mod 20) are held out for evaluation and never trained on,
not even by the tokenizer.

Plain PyTorch loop: AdamW, linear warmup + cosine decay, fp32, gradient
clipping. The MoE router is balanced the DeepSeek-V3 way (auxiliary-loss-free:
after every step each layer's ``e_score_correction_bias`` moves by
``--bias-update-speed`` against the sign of the expert's load error), so the
checkpoint carries a non-zero correction bias.

Everything is seeded. Each run has a step count and a wall-time cap
(``--target-steps`` / ``--target-minutes``, ``--draft-steps`` /
``--draft-minutes``); the LR schedule follows whichever is further along, so
on an idle 2-core machine the step counts decide (reproducible on the same
software stack) and on a loaded one the cap ends the run on time with a
completed schedule (then not bit-reproducible). Set ``--*-minutes 0`` for
steps only or ``--*-steps 0`` for time only.

    python launch/train_tiny_models.py            # <= ~55 min on 2 CPU cores
    python launch/train_tiny_models.py --smoke    # a 1-minute plumbing check

The held-out evaluation reported here (and by ``launch/eval_tiny_models.py``)
is bits per byte: total NLL (nats) over the held-out tokens / ln 2 / number
of UTF-8 bytes of the held-out text.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import pathlib
import platform
import random
import sys
import sysconfig
import textwrap
import time

# Sleep instead of spinning in OpenMP barriers: on a shared 2-core machine
# spinning threads make each step many times slower (must precede "import torch").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

REPO = pathlib.Path(__file__).resolve().parents[1]
ASSETS = REPO / "dspark_cluster" / "assets"

EOS = "<|endoftext|>"
PAD = "<|pad|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SPECIAL_TOKENS = [EOS, PAD, USER, ASSISTANT]  # ids 0, 1, 2, 3
EOS_ID, PAD_ID = 0, 1

# A minimal chat format: "<|user|>\n{content}\n<|assistant|>\n{content}<|endoftext|>\n".
# System messages are rendered like user turns under a "<|user|>" header with a
# "system: " prefix so the template never fails on them.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>\n{{ message['content'] }}<|endoftext|>\n"
    "{% elif message['role'] == 'system' %}"
    "<|user|>\nsystem: {{ message['content'] }}\n"
    "{% else %}"
    "<|user|>\n{{ message['content'] }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

LICENSE_NOTE = (
    "The training text is the source code of the CPython {ver} standard library, "
    "Copyright (c) 2001-2023 Python Software Foundation, distributed under the "
    "Python Software Foundation License Version 2 (PSF-2.0, "
    "https://docs.python.org/3/license.html). The weights are derived from it."
)


# --------------------------------------------------------------------------- data


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def module_name(rel: str) -> str:
    m = rel[:-3].replace("/", ".")
    return m[: -len(".__init__")] if m.endswith(".__init__") else m


def is_heldout(rel: str) -> bool:
    """Deterministic ~5% split by the SHA-256 of the dotted module name."""
    return int(hashlib.sha256(module_name(rel).encode()).hexdigest(), 16) % 20 == 0


def list_stdlib_files(root: pathlib.Path | None = None) -> list[str]:
    """Sorted relative paths of the stdlib's *.py files, no tests, no site-packages."""
    root = root or stdlib_root()
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        parts = rel.split("/")
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        if any(p in ("test", "tests", "idle_test") for p in parts[:-1]):
            continue
        out.append(rel)
    return out


def load_corpus(root: pathlib.Path | None = None):
    """Returns (train, heldout): lists of (relpath, text), empty files dropped."""
    root = root or stdlib_root()
    train, held = [], []
    for rel in list_stdlib_files(root):
        text = (root / rel).read_bytes().decode("utf-8")
        if not text:
            continue
        (held if is_heldout(rel) else train).append((rel, text))
    return train, held


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


# --------------------------------------------------------------------------- prompts


def extract_prompts(held: list[tuple[str, str]], max_prompts: int, per_module: int = 12):
    """Signatures + docstrings of functions / methods / classes in held-out modules.

    prompt = the ``def``/``class`` line(s) through the end of the docstring,
    dedented, ending in a newline; ``reference`` = the next few source lines.
    """
    cands = []
    for rel, text in held:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        parents = {}
        for node in ast.walk(tree):
            for ch in ast.iter_child_nodes(node):
                parents[ch] = node
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if ast.get_docstring(node) is None:
                continue
            doc = node.body[0]
            start, end = node.lineno, doc.end_lineno
            prompt = textwrap.dedent("\n".join(lines[start - 1 : end])) + "\n"
            if not (40 <= len(prompt) <= 1000) or "\t" in prompt:
                continue
            # up to 6 following lines of the body, dedented the same way
            indent = len(lines[start - 1]) - len(lines[start - 1].lstrip())
            ref_lines = lines[end : min(node.end_lineno, end + 6)]
            ref = "\n".join(l[indent:] if l[:indent].strip() == "" else l for l in ref_lines)
            if isinstance(node, ast.ClassDef):
                kind = "class"
            elif isinstance(parents.get(node), ast.ClassDef):
                kind = "method"
            else:
                kind = "function"
            cands.append(
                {
                    "prompt": prompt,
                    "module": module_name(rel),
                    "path": rel,
                    "name": node.name,
                    "kind": kind,
                    "lineno": start,
                    "reference": ref + ("\n" if ref else ""),
                }
            )
    key = lambda c: hashlib.sha256(f"{c['module']}:{c['name']}:{c['lineno']}".encode()).hexdigest()
    cands.sort(key=key)
    chosen, per = [], {}
    for c in cands:
        if per.get(c["module"], 0) >= per_module:
            continue
        per[c["module"]] = per.get(c["module"], 0) + 1
        chosen.append(c)
        if len(chosen) >= max_prompts:
            break
    chosen.sort(key=lambda c: (c["module"], c["lineno"]))
    return chosen


# --------------------------------------------------------------------------- models


def target_config(vocab_size: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,  # the dense first layer
        moe_intermediate_size=128,  # each routed expert and the shared expert
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=2048,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        use_cache=True,
    )


def draft_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        use_cache=True,
    )


def build_model(cfg):
    from transformers import AutoModelForCausalLM

    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg)
    return model.float()


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


class RouterRecorder:
    """Forward hooks on every DeepseekV3 MoE gate: collects top-k expert indices."""

    def __init__(self, model):
        self.gates = []
        self.indices: dict[int, list[torch.Tensor]] = {}
        self.handles = []
        for name, mod in model.named_modules():
            if type(mod).__name__ == "DeepseekV3TopkRouter":
                layer = int(name.split("layers.")[1].split(".")[0])
                self.gates.append((layer, mod))
                self.handles.append(mod.register_forward_hook(self._hook(layer)))
        self.active = True

    def _hook(self, layer):
        def fn(_mod, _inp, out):
            if self.active:
                self.indices.setdefault(layer, []).append(out[2].detach())

        return fn

    def counts(self, num_experts: int, mask: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        res = {}
        for layer, chunks in self.indices.items():
            idx = torch.cat(chunks)  # [tokens, k]
            if mask is not None:
                idx = idx[mask.reshape(-1)]
            res[layer] = torch.bincount(idx.reshape(-1), minlength=num_experts)
        return res

    def clear(self):
        self.indices = {}

    def remove(self):
        for h in self.handles:
            h.remove()


# --------------------------------------------------------------------------- evaluation


def sliding_windows(ids: list[int], ctx: int):
    """(input, target, score_mask) windows covering ids[1:] with >= ctx/2 context.

    Each document is scored given a leading EOS; windows of ctx tokens move by
    ctx/2 and only the tokens not scored by an earlier window count.
    """
    stride = ctx // 2
    out = []
    n = len(ids)
    start, scored_upto = 0, 1  # ids[0] (EOS) is context only
    while True:
        end = min(start + ctx + 1, n)
        inp, tgt = ids[start : end - 1], ids[start + 1 : end]
        mask = [start + 1 + j >= scored_upto for j in range(len(tgt))]
        out.append((inp, tgt, mask))
        scored_upto = end
        if end >= n:
            break
        start += stride
    return out


@torch.no_grad()
def evaluate_docs(models, docs_ids, ctx, batch_size=16, on_batch=None):
    """Per-doc NLL sums (nats) for each model, plus top-1 agreement counts.

    models: list of causal LMs. docs_ids: list of token id lists (with leading EOS).
    on_batch(logits_list, tgt, mask) is called per batch if given.
    Returns nll[model][doc], ntok[doc], agree (count of argmax(models[i]) == argmax(models[0])).
    """
    wins = []
    for d, ids in enumerate(docs_ids):
        for inp, tgt, mask in sliding_windows(ids, ctx):
            wins.append((d, inp, tgt, mask))
    # group windows of similar length for less padding
    order = sorted(range(len(wins)), key=lambda i: len(wins[i][1]))
    nll = [[0.0] * len(docs_ids) for _ in models]
    ntok = [0] * len(docs_ids)
    agree = [0] * len(models)
    for b in range(0, len(order), batch_size):
        chunk = [wins[i] for i in order[b : b + batch_size]]
        T = max(len(w[1]) for w in chunk)
        inp = torch.full((len(chunk), T), PAD_ID, dtype=torch.long)
        tgt = torch.zeros((len(chunk), T), dtype=torch.long)
        msk = torch.zeros((len(chunk), T), dtype=torch.bool)
        for r, (_, i, t, m) in enumerate(chunk):
            inp[r, : len(i)] = torch.tensor(i)
            tgt[r, : len(t)] = torch.tensor(t)
            msk[r, : len(m)] = torch.tensor(m)
        logits_list = []
        for mi, model in enumerate(models):
            # right padding + causal attention: padded positions never affect real ones
            logits = model(input_ids=inp).logits.float()
            logits_list.append(logits)
            lp = F.cross_entropy(logits.transpose(1, 2), tgt, reduction="none")
            lp = (lp * msk).sum(1)
            for r, w in enumerate(chunk):
                nll[mi][w[0]] += lp[r].item()
        am0 = logits_list[0].argmax(-1)
        for mi in range(len(models)):
            agree[mi] += ((logits_list[mi].argmax(-1) == am0) & msk).sum().item()
        for r, w in enumerate(chunk):
            ntok[w[0]] += int(msk[r].sum())
        if on_batch is not None:
            on_batch(logits_list, tgt, msk)
    return nll, ntok, agree


def bits_per_byte(nll_nats: float, nbytes: int) -> float:
    return nll_nats / math.log(2) / nbytes


# --------------------------------------------------------------------------- training


def lr_at(progress: float, base_lr: float, warmup_frac: float, final_frac: float) -> float:
    if progress < warmup_frac:
        return base_lr * progress / warmup_frac
    p = min(1.0, (progress - warmup_frac) / max(1e-9, 1.0 - warmup_frac))
    return base_lr * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def train_model(
    name,
    model,
    stream: torch.Tensor,
    val_windows: torch.Tensor,
    *,
    steps: int,
    minutes: float,
    batch_size: int,
    seq_len: int,
    lr: float,
    warmup: float,
    weight_decay: float,
    seed: int,
    eval_every: int,
    bias_update_speed: float = 0.0,
    teacher=None,
    distill_weight: float = 0.0,
    long_seq_len: int = 0,
    long_frac: float = 0.0,
    log=print,
):
    """Returns the history: list of dicts (step, time, lr, train_loss, val_loss)."""
    g = torch.Generator().manual_seed(seed)
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    recorder = RouterRecorder(model) if bias_update_speed > 0 else None
    num_experts = getattr(model.config, "n_routed_experts", 0)
    # progress in [0, 1] drives the LR schedule: by steps, by wall time, or (both
    # given) whichever is further along, so a slow / shared machine still ends
    # the run on time with a completed schedule.
    assert steps > 0 or minutes > 0
    budget_s = minutes * 60.0 if minutes > 0 else float("inf")
    max_steps = steps if steps > 0 else None
    hist, run_loss, run_n = [], 0.0, 0
    t0 = time.time()
    c0 = time.process_time()
    step = 0
    tokens_seen = 0

    def val_loss():
        model.eval()
        with torch.no_grad():
            if recorder:
                recorder.active = False
            tot = 0.0
            for b in range(0, len(val_windows), 16):
                x = val_windows[b : b + 16]
                lg = model(input_ids=x[:, :-1]).logits
                tot += F.cross_entropy(lg.reshape(-1, lg.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
            if recorder:
                recorder.active = True
        model.train()
        return tot / val_windows[:, 1:].numel()

    model.train()
    while True:
        elapsed = time.time() - t0
        progress = max(elapsed / budget_s, step / max_steps if max_steps else 0.0)
        if progress >= 1.0:
            break
        cur_lr = lr_at(progress, lr, warmup, 0.1)
        for grp in opt.param_groups:
            grp["lr"] = cur_lr
        # the last long_frac of the run uses longer windows (same tokens per batch)
        T, B = seq_len, batch_size
        if long_seq_len and progress >= 1.0 - long_frac:
            T, B = long_seq_len, max(1, batch_size * seq_len // long_seq_len)
        starts = torch.randint(0, len(stream) - T - 1, (B,), generator=g)
        x = torch.stack([stream[s : s + T + 1] for s in starts.tolist()]).long()
        out = model(input_ids=x[:, :-1])
        logits = out.logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        total = loss
        if teacher is not None and distill_weight > 0:
            with torch.no_grad():
                tl = teacher(input_ids=x[:, :-1]).logits
            kd = F.kl_div(
                F.log_softmax(logits, -1).reshape(-1, logits.shape[-1]),
                F.log_softmax(tl, -1).reshape(-1, tl.shape[-1]),
                log_target=True,
                reduction="batchmean",
            )
            total = (1 - distill_weight) * loss + distill_weight * kd
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if recorder is not None:
            # DeepSeek-V3 auxiliary-loss-free balancing: b_i += gamma * sign(mean load - load_i)
            with torch.no_grad():
                for layer, cnt in recorder.counts(num_experts).items():
                    gate = dict(recorder.gates)[layer]
                    err = cnt.float().mean() - cnt.float()
                    gate.e_score_correction_bias += bias_update_speed * torch.sign(err)
            recorder.clear()
        run_loss += loss.item()
        run_n += 1
        step += 1
        tokens_seen += B * T
        last = (time.time() - t0) >= budget_s or (max_steps is not None and step >= max_steps)
        if step % eval_every == 0 or last or step == 1:
            vl = val_loss()
            rec = {
                "step": step,
                "time_s": round(time.time() - t0, 1),
                "cpu_s": round(time.process_time() - c0, 1),
                "lr": cur_lr,
                "train_loss": run_loss / run_n,
                "val_loss": vl,
                "tokens": tokens_seen,
                "seq_len": T,
            }
            hist.append(rec)
            log(
                f"[{name}] step {step:5d}  {rec['time_s']:7.1f}s  lr {cur_lr:.2e}  "
                f"train {rec['train_loss']:.4f}  val {vl:.4f}  ({rec['tokens'] / max(1e-9, rec['time_s']):.0f} tok/s)"
            )
            run_loss, run_n = 0.0, 0
    if recorder is not None:
        recorder.remove()
    model.eval()
    return hist


# --------------------------------------------------------------------------- outputs


def save_tokenizer(hf_tok, out_dir: pathlib.Path):
    """save_pretrained, then name the class portably (transformers 4.x and 5.x both know it)."""
    hf_tok.save_pretrained(out_dir)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only", "name_or_path"):  # loading artefacts (--only draft)
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def save_generation_config(out_dir: pathlib.Path):
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        do_sample=False,
        max_new_tokens=128,
    ).save_pretrained(out_dir)


def plot_curve(hist, path: pathlib.Path, title: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # matplotlib is optional
        return False
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=80)
    ax.plot([h["step"] for h in hist], [h["train_loss"] for h in hist], label="train")
    ax.plot([h["step"] for h in hist], [h["val_loss"] for h in hist], label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(top=min(8.0, max(h["val_loss"] for h in hist[1:] or hist) + 0.5))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def curve_table(hist, max_rows=14):
    if len(hist) > max_rows:
        idx = sorted({round(i * (len(hist) - 1) / (max_rows - 1)) for i in range(max_rows)})
        hist = [hist[i] for i in idx]
    rows = ["| step | tokens seen | window | wall time (s) | lr | train loss | held-out loss (window sample) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for h in hist:
        rows.append(
            f"| {h['step']} | {h['tokens']:,} | {h['seq_len']} | {h['time_s']:.0f} | {h['lr']:.2e} | {h['train_loss']:.4f} | {h['val_loss']:.4f} |"
        )
    return "\n".join(rows)


EVAL_START = "<!-- eval:start (written by launch/eval_tiny_models.py) -->"
EVAL_END = "<!-- eval:end -->"


def write_card(out_dir, *, kind, cfg, model, hist, info, args, heldout_mods, bpb, has_png):
    is_target = kind == "target"
    name = out_dir.name
    arch = (
        "DeepSeek-V3 architecture (`DeepseekV3ForCausalLM`): MLA attention with "
        f"q_lora_rank={cfg.q_lora_rank}, kv_lora_rank={cfg.kv_lora_rank}, decoupled RoPE "
        f"(qk_rope_head_dim={cfg.qk_rope_head_dim}, qk_nope_head_dim={cfg.qk_nope_head_dim}, "
        f"v_head_dim={cfg.v_head_dim}, rope_interleave={cfg.rope_interleave}), "
        f"{cfg.num_hidden_layers} layers (first {cfg.first_k_dense_replace} dense, "
        f"intermediate {cfg.intermediate_size}), MoE layers with {cfg.n_routed_experts} routed experts "
        f"in n_group={cfg.n_group} groups (topk_group={cfg.topk_group}) + {cfg.n_shared_experts} shared expert, "
        f"moe_intermediate_size={cfg.moe_intermediate_size}, num_experts_per_tok={cfg.num_experts_per_tok}, "
        f"sigmoid scores + e_score_correction_bias, norm_topk_prob={cfg.norm_topk_prob}, "
        f"routed_scaling_factor={cfg.routed_scaling_factor}; no MTP layers"
        if is_target
        else f"dense Llama (`LlamaForCausalLM`), {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads, intermediate {cfg.intermediate_size}, RoPE theta "
        f"{cfg.rope_parameters['rope_theta']}"
    )
    steps = hist[-1]["step"]
    tokens = hist[-1]["tokens"]
    bs = args.target_batch if is_target else args.draft_batch
    lr = args.target_lr if is_target else args.draft_lr
    train_s = hist[-1]["time_s"]
    req_steps = args.target_steps if is_target else args.draft_steps
    cap_min = args.target_minutes if is_target else args.draft_minutes
    if req_steps > 0 and steps >= req_steps:
        stop_reason = f"the step count; wall-time cap {cap_min:g} min" if cap_min > 0 else "the step count"
    else:
        stop_reason = (f"stopped by the {cap_min:g}-min wall-time cap before the requested {req_steps} steps"
                       if req_steps > 0 else f"{cap_min:g}-min wall-time budget")
    cpu_note = ""
    if "cpu_s" in hist[-1]:
        cpu_note = f" (process CPU time {hist[-1]['cpu_s'] / 60:.1f} min)"
    png = "\n![loss curve](loss_curve.png)\n" if has_png else ""
    extra = ""
    if is_target:
        extra = (
            f"- Router balancing: DeepSeek-V3 auxiliary-loss-free bias update, speed "
            f"{args.bias_update_speed} per step (no auxiliary loss); the learned "
            "`e_score_correction_bias` buffers are in the checkpoint and are part of the routing.\n"
        )
    else:
        if args.distill > 0:
            extra = (
                f"- Loss: {1 - args.distill:.2f} x cross-entropy on the text + {args.distill:.2f} x "
                "KL(target || drafter) against `tiny-moe`'s logits (distillation).\n"
            )
    card = f"""---
license: psf-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [dspark-cluster, tiny, python-code, {'moe, deepseek_v3' if is_target else 'llama, drafter'}]
---

# {name}

{'The MoE **target** model' if is_target else 'The dense **drafter**'} of DSpark Cluster's bundled tiny model
family (issue 3): {'the model the runtime serves, shards (TP / EP) and balances' if is_target else 'the speculative-decoding proposer for `tiny-moe`'}.
Trained from scratch on CPU in this repository by `launch/train_tiny_models.py`; it writes Python-ish
code and nothing else. It is a test and benchmark fixture, not a useful assistant.

- Architecture: {arch}.
- Parameters: {n_params(model):,} ({'all in fp32' }); vocabulary {cfg.vocab_size}; max_position_embeddings {cfg.max_position_embeddings} (trained on windows of {args.seq_len} tokens, the last {args.long_frac:.0%} of steps on {args.long_seq_len} tokens; keep prompt + output within about {max(args.seq_len, args.long_seq_len)} tokens for in-distribution behaviour).
- Weights: `model.safetensors`, **float32**, `tie_word_embeddings=false` (separate `lm_head.weight`).
- Tokenizer: byte-level BPE trained with `tokenizers` on the training split (shared by `tiny-moe` and `tiny-draft`), loaded as `PreTrainedTokenizerFast`; special tokens `<|endoftext|>` = 0 (bos = eos), `<|pad|>` = 1, `<|user|>` = 2, `<|assistant|>` = 3; no BOS is added automatically. Chat template: `<|user|>\\n{{content}}\\n<|assistant|>\\n` (the model never saw chat data; the template exists for API plumbing).

## Data

{LICENSE_NOTE.format(ver=platform.python_version())}

- Source: every `*.py` file under `sysconfig.get_paths()["stdlib"]` of Python {platform.python_version()}, sorted, excluding `test/`, `tests/`, `idle_test/` folders and site-packages; empty files dropped.
- Split: a module is held out when `int(sha256(dotted_module_name), 16) % 20 == 0`: {info['n_heldout_files']} modules, {info['heldout_bytes']:,} bytes held out; {info['n_train_files']} files, {info['train_bytes']:,} bytes ({info['train_tokens']:,} tokens, {info['train_bytes'] / info['train_tokens']:.2f} bytes/token) for training. Held-out modules (never seen by the tokenizer or the models):

  {', '.join(f'`{m}`' for m in heldout_mods)}

## Training

- Command: `{info['command']}`
- Plain PyTorch loop, fp32, seed {args.seed}, {torch.get_num_threads()} CPU threads: AdamW (betas 0.9/0.95, weight decay {args.weight_decay}), peak LR {lr}, linear warmup over {args.warmup:.0%} of the run then cosine decay to 10%, gradient clipping 1.0, batch {bs} x {args.seq_len} tokens, then {bs * args.seq_len // max(1, args.long_seq_len or args.seq_len)} x {args.long_seq_len or args.seq_len} for the last {args.long_frac:.0%} of steps (random windows from the concatenated training stream, documents separated by `<|endoftext|>`).
{extra}- Steps: {steps} ({stop_reason}), tokens seen: {tokens:,} ({tokens / info['train_tokens']:.2f} epochs), training wall time {train_s / 60:.1f} min{cpu_note} on {info['machine']}.
- Held-out loss at the end of training (whole held-out set, sliding {args.eval_ctx}-token windows, stride {args.eval_ctx // 2}): **{bpb['nll_per_token']:.4f} nats/token, {bpb['bpb']:.4f} bits per byte**.

Loss curve (train loss = {'mean' if is_target or args.distill <= 0 else 'the cross-entropy part, mean'} over the steps since the previous row; held-out loss on a fixed sample of {info['n_val_windows']} held-out windows):

{curve_table(hist)}
{png}
{EVAL_START}
(run `python launch/eval_tiny_models.py` to fill in)
{EVAL_END}

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("dspark_cluster/assets/{name}")
model = AutoModelForCausalLM.from_pretrained("dspark_cluster/assets/{name}")
ids = tok("def fibonacci(n):\\n    \\"\\"\\"Return the n-th Fibonacci number.\\"\\"\\"\\n", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=40, do_sample=False)[0]))
```
"""
    (out_dir / "README.md").write_text(card)


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=ASSETS, help="assets folder (tiny-moe/, tiny-draft/, prompts/ go here)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--long-seq-len", type=int, default=512, help="window length for the last --long-frac of each run (0: off)")
    ap.add_argument("--long-frac", type=float, default=0.25)
    ap.add_argument("--eval-ctx", type=int, default=512, help="context of the final held-out evaluation (stride = half)")
    ap.add_argument("--target-steps", type=int, default=3000, help="0: no step limit, wall time only")
    ap.add_argument("--target-minutes", type=float, default=38.0,
                    help="wall-time cap (0: none); the LR schedule follows whichever of steps / time is further along")
    ap.add_argument("--target-batch", type=int, default=16)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--draft-steps", type=int, default=1500, help="0: no step limit, wall time only")
    ap.add_argument("--draft-minutes", type=float, default=12.0, help="wall-time cap (0: none), as --target-minutes")
    ap.add_argument("--draft-batch", type=int, default=16)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--distill", type=float, default=0.7,
                    help="weight of KL(target || drafter) against the target's logits in the drafter loss (0: plain LM)")
    ap.add_argument("--warmup", type=float, default=0.03, help="warmup fraction of the run")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--bias-update-speed", type=float, default=1e-3, help="aux-loss-free router balancing speed")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--val-windows", type=int, default=64)
    ap.add_argument("--max-prompts", type=int, default=160)
    ap.add_argument("--only", choices=["all", "target", "draft", "prompts"], default="all",
                    help="draft alone reuses the tokenizer (and, with --distill, the target) already in --out")
    ap.add_argument("--smoke", action="store_true", help="tiny step counts, writes to /tmp/tiny_smoke unless --out is given")
    args = ap.parse_args(argv)
    if args.smoke:
        if "--out" not in (argv or sys.argv):
            args.out = pathlib.Path("/tmp/tiny_smoke")
        args.target_steps, args.draft_steps, args.eval_every, args.val_windows = 6, 6, 3, 4
        args.target_minutes = args.draft_minutes = 0
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    t_start = time.time()
    out = args.out
    tdir, ddir, pdir = out / "tiny-moe", out / "tiny-draft", out / "prompts"
    for d in (tdir, ddir, pdir):
        d.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    train, held = load_corpus()
    heldout_mods = [module_name(r) for r, _ in held]
    log(f"corpus: {len(train)} train files ({sum(len(t.encode()) for _, t in train):,} B), "
        f"{len(held)} held-out files ({sum(len(t.encode()) for _, t in held):,} B)")

    # prompts (needs no model)
    prompts = extract_prompts(held, args.max_prompts)
    with open(pdir / "heldout.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    log(f"wrote {len(prompts)} prompts to {pdir / 'heldout.jsonl'}")
    if args.only == "prompts":
        return

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.only in ("all", "target"):
        tok = train_tokenizer([t for _, t in train], args.vocab_size)
        hf_tok = wrap_tokenizer(tok)
        log(f"tokenizer: vocab {tok.get_vocab_size()}")
    else:
        hf_tok = AutoTokenizer.from_pretrained(tdir)
        tok = hf_tok.backend_tokenizer
    enc = tok.encode_batch([t for _, t in train])
    stream_ids = []
    for e in enc:
        stream_ids.extend(e.ids)
        stream_ids.append(EOS_ID)
    stream = torch.tensor(stream_ids, dtype=torch.int16 if args.vocab_size < 32768 else torch.int32)
    held_ids = [[EOS_ID] + e.ids for e in tok.encode_batch([t for _, t in held])]
    held_bytes = sum(len(t.encode()) for _, t in held)
    # fixed held-out sample for the curve: windows from evenly spaced positions of the held-out stream
    hstream = torch.tensor([i for ids in held_ids for i in ids])
    L = args.seq_len + 1
    pos = torch.linspace(0, len(hstream) - L - 1, args.val_windows).long()
    val_windows = torch.stack([hstream[p : p + L] for p in pos.tolist()]).long()
    info = {
        "n_train_files": len(train),
        "n_heldout_files": len(held),
        "train_bytes": sum(len(t.encode()) for _, t in train),
        "heldout_bytes": held_bytes,
        "train_tokens": len(stream_ids),
        "n_val_windows": args.val_windows,
        "machine": machine_string(args.threads),
        "command": " ".join(["python launch/train_tiny_models.py"] + list(sys.argv[1:] if argv is None else argv)),
    }
    log(f"train stream {len(stream_ids):,} tokens; held-out {sum(len(i) - 1 for i in held_ids):,} tokens")

    results = {}

    def final_eval(model, label):
        t = time.time()
        nll, ntok, _ = evaluate_docs([model], held_ids, args.eval_ctx)
        tot = sum(nll[0])
        r = {"nll_per_token": tot / sum(ntok), "bpb": bits_per_byte(tot, held_bytes)}
        log(f"{label}: held-out {r['nll_per_token']:.4f} nats/token = {r['bpb']:.4f} bits/byte ({time.time() - t:.0f}s)")
        return r

    target = None
    if args.only in ("all", "target"):
        cfg = target_config(args.vocab_size)
        torch.manual_seed(args.seed)
        target = build_model(cfg)
        log(f"target: {n_params(target):,} parameters")
        hist = train_model(
            "target", target, stream, val_windows,
            steps=args.target_steps, minutes=args.target_minutes, batch_size=args.target_batch,
            seq_len=args.seq_len, lr=args.target_lr, warmup=args.warmup, weight_decay=args.weight_decay,
            long_seq_len=args.long_seq_len, long_frac=args.long_frac,
            seed=args.seed + 1, eval_every=args.eval_every, bias_update_speed=args.bias_update_speed, log=log,
        )
        results["target"] = final_eval(target, "target")
        target.config.use_cache = True
        target.save_pretrained(tdir)
        save_tokenizer(hf_tok, tdir)
        save_generation_config(tdir)
        has_png = plot_curve(hist, tdir / "loss_curve.png", "tiny-moe")
        write_card(tdir, kind="target", cfg=target.config, model=target, hist=hist, info=info, args=args,
                   heldout_mods=heldout_mods, bpb=results["target"], has_png=has_png)
        (pathlib.Path("/tmp") / "tiny_target_hist.json").write_text(json.dumps(hist))

    if args.only in ("all", "draft"):
        teacher = None
        if args.distill > 0:
            teacher = target if target is not None else AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32)
            teacher.eval()
        dcfg = draft_config(args.vocab_size)
        torch.manual_seed(args.seed + 10)
        draft = build_model(dcfg)
        log(f"drafter: {n_params(draft):,} parameters")
        hist = train_model(
            "draft", draft, stream, val_windows,
            steps=args.draft_steps, minutes=args.draft_minutes, batch_size=args.draft_batch,
            seq_len=args.seq_len, lr=args.draft_lr, warmup=args.warmup, weight_decay=args.weight_decay,
            long_seq_len=args.long_seq_len, long_frac=args.long_frac,
            seed=args.seed + 2, eval_every=args.eval_every, teacher=teacher, distill_weight=args.distill, log=log,
        )
        (pathlib.Path("/tmp") / "tiny_draft_hist.json").write_text(json.dumps(hist))
        results["draft"] = final_eval(draft, "drafter")
        draft.save_pretrained(ddir)
        save_tokenizer(hf_tok, ddir)
        save_generation_config(ddir)
        has_png = plot_curve(hist, ddir / "loss_curve.png", "tiny-draft")
        write_card(ddir, kind="draft", cfg=draft.config, model=draft, hist=hist, info=info, args=args,
                   heldout_mods=heldout_mods, bpb=results["draft"], has_png=has_png)

    # verify: reload through the Auto classes and generate
    tk = AutoTokenizer.from_pretrained(tdir)
    for d in (tdir, ddir):
        if not (d / "model.safetensors").exists():
            continue
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        ids = tk(prompts[0]["prompt"], return_tensors="pt").input_ids
        gen = m.generate(ids, max_new_tokens=24, do_sample=False)
        log(f"{d.name} generates: {tk.decode(gen[0, ids.shape[1]:])!r}")
    log(f"done in {(time.time() - t_start) / 60:.1f} min: " + json.dumps(results))


def machine_string(threads: int) -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core CPU ({name}), {threads} torch threads"


if __name__ == "__main__":
    main()
