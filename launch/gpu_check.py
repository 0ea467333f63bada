"""What the CPU test suite cannot reach, checked on one device in one run (at most ~8 minutes on
one H200): the core's `LLM` in process (`parallel.executor: local`, no Ray) on CUDA.

Prepare the device (it has torch, transformers and safetensors, numpy, tokenizers, pyyaml and tqdm,
but no pydantic and no package index). Of what `from dspark_cluster import LLM` and an in-process
run import (sys.modules after a whole `--device cpu --small` run, which records it under
env.modules; `python -X importtime -c "from dspark_cluster import LLM"` shows the same), only these
are missing there; they travel as wheels (2.6 MB, Python 3.12, x86-64):

    pydantic==2.13.4  pydantic_core==2.46.4  annotated_types==0.7.0  typing_inspection==0.4.2
    typing_extensions==4.16.0   (pydantic wants >= 4.14.1; the device's torch may bring an older one)

The script itself imports only the standard library, torch, transformers, safetensors and the core
(never ray, scipy, fastapi: the chi-square p-values come from torch.special.gammaincc).

Here, in the repository root (a machine with the index; the wheels then travel with the tree,
untracked and git-excluded):

    echo /.whl/ >> .git/info/exclude
    for w in pydantic==2.13.4 pydantic_core==2.46.4 annotated_types==0.7.0 typing_inspection==0.4.2 \\
             typing_extensions==4.16.0; do
      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl "$w"; done

On the device, in the repository root (the device tool's `run` with carry [".whl"]):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site
    PYTHONUNBUFFERED=1 python3 launch/gpu_check.py --out $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log

(bf16 by default; parity and speculative run their fp32 part too, so one run covers both dtypes;
`--dtype float32` runs every check in fp32.)

On CPU (what tests/test_gpu_check.py runs, so that the script cannot rot):

    python launch/gpu_check.py --device cpu --small --dtype float32

Checks (`--only NAME,...` runs a subset):
  parity       greedy generation and prompt logits vs transformers on tiny random checkpoints of
               deepseek_v3, qwen3_moe, qwen2_moe, mixtral and a dense llama. fp32 (always run):
               tokens identical to transformers' and logits rel. error <= 1e-4. bf16 (with --dtype
               bfloat16): per-position logits error vs transformers-fp32 within a bf16 tolerance,
               beside transformers' own bf16 error (median and p90; the max too for the dense model:
               in an MoE a router near-tie flips an expert in bf16); the share of tokens identical
               to transformers-bf16's, the first divergence and transformers' logit gap there are
               reported, not required (bf16 promises no identity over long generations).
  speculative  draft_model (a poor drafter; the target itself) and dspark (random drafter, static
               and confidence schedules): greedy output vs no speculation, same engine config
               otherwise. fp32: identical. bf16: identical, or diverging only where the
               non-speculative run's own log-probabilities of the two tokens are within 0.5 nats.
               With model.compile on (--compile; on CUDA by default): dspark with idle stretches
               forced (plain steps run compiled, as CUDA graphs on CUDA, and the context stash
               holds their states until drafting resumes): the same identity, no recompile and no
               CUDA graph recorded after the warm-up, none skipped.
  spec_law     sampled output (temperature 1, 8-token vocabulary, seeded per request) with
               draft_model and dspark: chi-square of the first token, the second (the first one
               drafted) and the 3-token joint against the target's exact law as the engine computes
               it in the run's dtype (every continuation scored by prompt_logprobs; the
               non-speculative run is the control), a two-sample test against that control run,
               and (reported) the fit to transformers-fp32's law; and dspark with model.compile on
               and unseeded rows, which the drafter's compiled rounds draw inside their (CUDA)
               graphs: the same tests, and such rounds must have run.
  grouped_mm   the MoE expert path: with skewed routing run_experts takes torch._grouped_mm (on
               CUDA in bf16 it must, not the per-slot loop fallback; on the CPU with this many rows a
               slot, oneDNN slot by slot) and agrees with a per-expert fp32 loop reference; the
               decode-shaped (padded bmm) branch too.
  decode       decode tok/s at batch 1, 16 and 64 on a random model with Qwen3-30B-A3B's layer
               shapes (4 layers), against the HBM roofline (active weight bytes + KV bytes read per
               step) / measured device-to-device copy bandwidth; with model.compile off and on
               (--compile; on CUDA `on` is torch.compile + CUDA graphs per token bucket, cut
               around attention), with the compile warm-up and the recompiles and CUDA graphs
               recorded after it (none, and none skipped, or the check fails). And at batch 1 with
               DSpark drafting every step: a drafting step's time over the decode step's (its
               verify forward compiled in the decode step's graphs where compile is on: the check
               fails if none did, or if one compiled anything after the warm-up).

Output: a table per check on stdout and a JSON file (--out, default gpu_check.json; rewritten
after every check, so a run cut short keeps what it finished) with every figure, the device,
the versions and pass/fail per check. Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
import torch.nn.functional as F

CHECKS = ("parity", "speculative", "spec_law", "grouped_mm", "decode")
VOCAB = 160

# Tiny random checkpoints, the recipe of tests/conftest.py ARCHS (the script cannot import tests/).
ARCHS = {
    "deepseek_v3": lambda t: t.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, initializer_range=0.1,
        max_position_embeddings=512),
    "qwen3_moe": lambda t: t.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.1, max_position_embeddings=512),
    "qwen2_moe": lambda t: t.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], initializer_range=0.1,
        max_position_embeddings=512),
    "mixtral": lambda t: t.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, initializer_range=0.1,
        max_position_embeddings=512),
    "llama": lambda t: t.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=512),
}

# Qwen3-30B-A3B's layer shapes (fewer layers); --small: tiny ones of the same kind
QWEN3_30B_A3B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936,
                     rms_norm_eps=1e-6, norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)
QWEN3_TINY = dict(QWEN3_30B_A3B, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                  vocab_size=VOCAB)

FP32_REL_TOL = 1e-4  # DESIGN.md: sharded execution = transformers, fp32 relative error <= 1e-4
# bf16 logits: max-abs error / max |logit| vs transformers-fp32 per prompt position (measured on CPU: ~0.005-0.01
# for ours and for transformers-bf16; a router near-tie that flips an expert gives ~0.1 at that position)
BF16_REL_TOL_P50 = 0.02
BF16_REL_TOL = 0.03
# a greedy divergence with speculation in bf16 passes when the non-speculative run's log-probabilities of
# the two tokens differ by less (a verify forward of k + 1 rows is not bitwise a decode of one; an expert
# flipped at a router near-tie moves a logit by ~0.1-0.3); a wrongly accepted draft is typically nats away
BF16_TIE_NATS = 0.5
MOE_ARCHS = ("deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral")
# chi-square p-value below which a law check fails: a lossless-sampling bug moves percents of mass (p ~ 1e-10
# at 3000 samples); 1e-4 keeps a chance failure of the ~10 correlated tests of one run well under 0.1%
P_MIN = 1e-4


# ---- small helpers ---------------------------------------------------------------------------------
def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def max_abs(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max())


def random_prompts(lengths, seed=0, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def position_errors(ours: list, refs: list) -> list:
    """Per prompt position: max |ours - ref| over the vocabulary / max |ref| over that prompt."""
    out = []
    for o, r in zip(ours, refs):
        out += ((o.float() - r.float()).abs().amax(-1) / r.float().abs().max()).tolist()
    return out


def quantile(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def first_divergence(a: list, b: list):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def chi2_sf(stat: float, df: int) -> float:
    """P(chi2_df >= stat) (no scipy on the device: the regularised upper incomplete gamma)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def gof_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson goodness of fit of counts to a law; outcomes expected < 5 times are pooled (into the
    smallest kept bin when the pool itself is expected < 5 times). Returns (p-value, bins)."""
    observed, probs = observed.double().flatten(), probs.double().flatten()
    probs = probs / probs.sum()
    n = float(observed.sum())
    expected = probs * n
    keep = expected >= 5
    obs, exp = observed[keep].tolist(), expected[keep].tolist()
    rest_obs, rest_exp = float(observed[~keep].sum()), float(expected[~keep].sum())
    if rest_exp >= 5:
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_exp > 0 or rest_obs > 0:
        i = min(range(len(exp)), key=exp.__getitem__)
        obs[i] += rest_obs
        exp[i] += rest_exp
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return chi2_sf(stat, len(obs) - 1), len(obs)


def two_sample_pvalue(a: dict, b: dict) -> float:
    """Chi-square test of homogeneity of two samples of outcomes (outcomes seen < 10 times pooled)."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
    big = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= 10]
    rest = [k for k in keys if k not in big]
    cols = [(a.get(k, 0), b.get(k, 0)) for k in big]
    cols.append((sum(a.get(k, 0) for k in rest), sum(b.get(k, 0) for k in rest)))
    cols = [c for c in cols if sum(c) > 0]
    na, nb = sum(c[0] for c in cols), sum(c[1] for c in cols)
    n = na + nb
    stat = 0.0
    for ca, cb in cols:
        tot = ca + cb
        for obs, row in ((ca, na), (cb, nb)):
            e = row * tot / n
            stat += (obs - e) ** 2 / e
    return chi2_sf(stat, len(cols) - 1)


def table(headers: list, rows: list) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "PASS" if v else "FAIL"
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v == 0 or 1e-3 <= abs(v) < 1e5:
            return f"{v:.4g}"
        return f"{v:.2e}"
    return "-" if v is None else str(v)


def say(*a):
    print(*a, flush=True)


# ---- checkpoints -----------------------------------------------------------------------------------
def build_checkpoint(arch: str, path: str, seed: int = 0) -> str:
    """Random-weight checkpoint of `arch` (tests/conftest.py build_checkpoint), saved in fp32."""
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = ARCHS[arch](transformers)
    cfg.eos_token_id, cfg.bos_token_id = 1, 0
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # non-zero so the bias path is exercised
                buf.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


def build_small_vocab(path: str, seed: int, scale: float) -> str:
    """An 8-token Llama (tests/test_speculative.py small_vocab): few enough outcomes for chi-square."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, initializer_range=scale, max_position_embeddings=64, eos_token_id=None,
                      bos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def build_dspark(target_path: str, out_dir: str, **kw) -> str:
    """A random DSpark drafter for `target_path`, saved in fp32 (dspark_model.random_drafter)."""
    from dspark_cluster.speculative.dspark_model import random_drafter

    return str(random_drafter(target_path, out_dir, **kw))


def write_random_qwen3_moe(path: str, shape: dict, num_layers: int, device, dtype=torch.bfloat16, std=0.02) -> int:
    """A random Qwen3-MoE checkpoint written straight to safetensors (HF's per-expert names), the
    tensors drawn on `device`: no transformers model is built. Returns the bytes written."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(num_hidden_layers=num_layers, decoder_sparse_step=1, mlp_only_layers=[], **shape)
    cfg.eos_token_id, cfg.bos_token_id = 1, 0
    cfg.dtype = dtype  # what the tensors are (a config without it makes load_spec read the deprecated torch_dtype)
    cfg.save_pretrained(path)
    H, V, E, I = shape["hidden_size"], shape["vocab_size"], shape["num_experts"], shape["moe_intermediate_size"]
    nh, nkv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*s):
        return (torch.randn(*s, device=device, generator=gen) * std).to(dtype).cpu()

    def ones(n):
        return torch.ones(n, dtype=dtype)

    t = {"model.embed_tokens.weight": rnd(V, H), "lm_head.weight": rnd(V, H), "model.norm.weight": ones(H)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H),
                  p + "self_attn.q_proj.weight": rnd(nh * hd, H), p + "self_attn.k_proj.weight": rnd(nkv * hd, H),
                  p + "self_attn.v_proj.weight": rnd(nkv * hd, H), p + "self_attn.o_proj.weight": rnd(H, nh * hd),
                  p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
                  p + "mlp.gate.weight": rnd(E, H)})
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            t.update({q + "gate_proj.weight": rnd(I, H), q + "up_proj.weight": rnd(I, H),
                      q + "down_proj.weight": rnd(H, I)})
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return sum(v.numel() * v.element_size() for v in t.values())


def make_llm(path, dtype: str, device: str, scheduler=None, speculative=None, compile_mode: str = "off"):
    from dspark_cluster import LLM

    cfg = {"model": {"dtype": dtype, "compile": compile_mode}, "parallel": {"executor": "local", "device": device},
           "scheduler": {"block_size": 8, "num_kv_blocks": 512, **(scheduler or {})}}
    if speculative:
        cfg["speculative"] = speculative
    return LLM(str(path), config=cfg)


def hf_model(path, dtype, device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()  # its own bf16 rules


# ---- parity ----------------------------------------------------------------------------------------
def engine_prompt_logits(llm, prompts) -> list:
    """The served model's fp32 logits at every prompt position (one prefill of all prompts), run on
    the engine's own model and KV pool before it serves anything (its blocks are all free)."""
    from dspark_cluster.kv_cache import BlockManager
    from dspark_cluster.model.attention import build_metadata

    ex = llm.engine.executor
    model, device, bs = ex.model, ex.device, llm.engine.block_size
    blocks = BlockManager(llm.engine.num_blocks, bs)
    for i, p in enumerate(prompts):
        blocks.allocate(i, len(p))
    width = max(len(t) for t in blocks.block_tables.values())
    tables = torch.tensor([blocks.block_tables[i] + [0] * (width - len(blocks.block_tables[i]))
                           for i in range(len(prompts))])
    lens = torch.tensor([len(p) for p in prompts])
    positions, meta = build_metadata(lens, lens, tables, bs)
    with torch.inference_mode():
        hidden = model(torch.tensor(sum(prompts, [])).to(device), positions.to(device),
                       meta.to(device, model.lm_head.weight.dtype))
        logits = model.compute_logits(hidden).float().cpu()
    return list(logits.split(lens.tolist()))


def hf_greedy(hf, prompt, n, device):
    """transformers greedy generation: (tokens, logits [n, V] fp32 at each generated position)."""
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                          output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0].float().cpu()


def check_parity(args, tmp) -> dict:
    from dspark_cluster import SamplingParams

    small = args.small
    # (one long enough that its attention runs in query chunks, attention.query_chunks, and its decodes beside
    # short ones)
    prompts = random_prompts([5, 11, 3, 140] if small else [5, 23, 11, 40, 300], seed=3)
    n_new = 12 if small else 64
    dtypes = ["float32"] + (["bfloat16"] if args.dtype == "bfloat16" else [])
    greedy = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    res, rows, ok = {"archs": {}, "new_tokens": n_new, "prompt_lens": [len(p) for p in prompts]}, [], True
    for arch in ARCHS:
        path = build_checkpoint(arch, os.path.join(tmp, arch))
        hf32 = hf_model(path, torch.float32, args.device)
        with torch.no_grad():
            ref32 = [hf32(torch.tensor([p], device=args.device)).logits[0].float().cpu() for p in prompts]
        per = {}
        for dt in dtypes:
            tdt = getattr(torch, dt)
            hf = hf32 if dt == "float32" else hf_model(path, tdt, args.device)
            with make_llm(path, dt, args.device) as llm:
                ours_logits = engine_prompt_logits(llm, prompts)
                outs = llm.generate(prompts, greedy)
            pos = position_errors(ours_logits, ref32)
            r = {"rel_err": max(pos), "rel_err_p50": quantile(pos, 0.5), "rel_err_p90": quantile(pos, 0.9),
                 "max_abs_err": max(max_abs(o, r_) for o, r_ in zip(ours_logits, ref32))}
            if dt != "float32":  # transformers' own bf16 error, the yardstick
                with torch.no_grad():
                    hf_lo = [hf(torch.tensor([p], device=args.device)).logits[0].float().cpu() for p in prompts]
                hpos = position_errors(hf_lo, ref32)
                r.update(hf_rel_err=max(hpos), hf_rel_err_p50=quantile(hpos, 0.5), hf_rel_err_p90=quantile(hpos, 0.9),
                         hf_max_abs_err=max(max_abs(h, r_) for h, r_ in zip(hf_lo, ref32)),
                         rel_err_vs_hf_same_dtype=max(rel_err(o, h) for o, h in zip(ours_logits, hf_lo)))
            same, divs, gaps = 0, [], []
            for p, out in zip(prompts, outs):
                ref_toks, ref_logits = hf_greedy(hf, p, n_new, args.device)
                d = first_divergence(out.token_ids, ref_toks)
                divs.append(d)
                same += n_new if d is None else d
                if d is not None and d < len(out.token_ids):  # how close transformers' two candidates were
                    gaps.append(float(ref_logits[d, ref_toks[d]] - ref_logits[d, out.token_ids[d]]))
            r.update(token_share=same / (n_new * len(prompts)), first_divergence=divs, divergence_logit_gaps=gaps)
            if dt == "float32":
                r["passed"] = r["rel_err"] <= FP32_REL_TOL and all(d is None for d in divs)
            else:  # tokens are reported, not required: bf16 does not promise identity over long generations
                r["passed"] = (r["rel_err_p50"] <= BF16_REL_TOL_P50
                               and r["rel_err_p90"] <= max(BF16_REL_TOL, 2 * r["hf_rel_err_p90"])
                               and (arch in MOE_ARCHS or r["rel_err"] <= max(BF16_REL_TOL, 2 * r["hf_rel_err"])))
            ok &= r["passed"]
            per[dt] = r
            rows.append([arch, dt, r["rel_err_p50"], r["rel_err_p90"], r["rel_err"], r.get("hf_rel_err_p90"),
                         r.get("hf_rel_err"), r["token_share"],
                         ",".join("-" if d is None else str(d) for d in divs),
                         max(gaps) if gaps else None, r["passed"]])
            if hf is not hf32:
                del hf
        res["archs"][arch] = per
        del hf32
    say(table(["arch", "dtype", "rel err p50", "p90", "max", "hf bf16 p90", "hf max", "same tokens",
               "first diverge", "gap at div", "ok"], rows))
    say(f"(logits rel err per prompt position = max |ours - transformers fp32| / max |logit|. fp32: max <= "
        f"{FP32_REL_TOL} and tokens identical to transformers fp32. bf16: p50 <= {BF16_REL_TOL_P50}, p90 <= max("
        f"{BF16_REL_TOL}, 2 x transformers-bf16's p90), dense models also max <= max({BF16_REL_TOL}, 2 x "
        "transformers'); the max is not bounded for MoE, where a router near-tie flips an expert in bf16; tokens vs "
        "transformers-bf16 reported: same-token share, first divergence, transformers' logit gap there)")
    res["passed"] = ok
    return res


# ---- speculative: greedy identity ------------------------------------------------------------------
def spec_cfg(method, draft, k, schedule="static"):
    return {"method": method, "draft_model": str(draft), "num_tokens": k, "schedule": schedule}


def compile_modes(args) -> list:
    """model.compile modes besides off that the checks run (--compile; default: on for CUDA, none on the CPU)."""
    return [m for m in (args.compile or ("off,on" if torch.device(args.device).type == "cuda" else "off")).split(",")
            if m != "off"]


def idle_stretches(llm, pattern) -> None:
    """The confidence schedule's choice replaced: the i-th step drafts pattern[i % len(pattern)] positions (0: a
    plain step, compiled where model.compile is on, whose exported states the context stash holds) and verifies
    every drafted position."""
    planner, calls = llm.engine.speculation.planner, iter(range(10**9))

    def draft_len(num_rows):
        planner.exploring = planner._learning = False
        return pattern[next(calls) % len(pattern)]

    planner.draft_len = draft_len
    planner.verify_lengths = lambda raw, *a: (~np.isnan(raw)).sum(1)


def compile_faults(stats) -> list:
    """What a model.compile run's stats show wrong: recompiles or CUDA graphs recorded after the warm-up (a direct
    call that did not start a new generation would record one a step), skipped CUDA graphs, a warm-up that compiled
    more graphs than expected (graph breaks, a batch size specialised; fewer are an earlier engine's, reused), no
    compiled step, none that called its graphs without dynamo's guards (one process, one device: they all should)."""
    if stats is None:
        return ["no compiled runner"]
    bad = [k for k in ("compile_recompiles_after_warm_up", "compile_cuda_graphs_after_warm_up",
                       "compile_cuda_graph_skips", "draft_compile_recompiles_after_warm_up",
                       "draft_compile_cuda_graphs_after_warm_up") if stats.get(k)]
    expected = stats.get("compile_graphs_expected")
    if expected is not None and stats["compile_warm_up_graphs"] > expected:
        bad.append("compile_warm_up_graphs")
    return bad + ([] if stats.get("compile_steps") else ["no compiled step"]) + (
        [] if stats.get("compile_direct_steps") else ["no step called its graphs directly"])


def check_speculative(args, tmp) -> dict:
    from dspark_cluster import SamplingParams

    small = args.small
    targets = ["qwen3_moe"] if small else ["qwen3_moe", "deepseek_v3"]
    prompts = random_prompts([5, 17, 9, 28, 3] if not small else [5, 17, 9], seed=43)
    n_new = 10 if small else 48
    dtypes = ["float32"] + (["bfloat16"] if args.dtype == "bfloat16" else [])
    base_params = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True, logprobs=5)
    greedy = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    poor = build_checkpoint("llama", os.path.join(tmp, "spec-llama"))
    res, rows, ok = {"runs": {}, "new_tokens": n_new}, [], True
    for arch in targets:
        target = build_checkpoint(arch, os.path.join(tmp, f"spec-{arch}"))
        dspark = build_dspark(target, os.path.join(tmp, f"spec-dspark-{arch}"), layers=(0, 1))
        dspark2 = build_dspark(target, os.path.join(tmp, f"spec-dspark2-{arch}"), layers=(0, 1), draft_passes=2)
        variants = {"draft_model_poor": spec_cfg("draft_model", poor, 4),
                    "draft_model_self": spec_cfg("draft_model", target, 4),
                    "dspark_static": spec_cfg("dspark", dspark, 3),
                    # a drafter trained for a second block pass, served with it (auto would too on CUDA)
                    "dspark_two_passes": {**spec_cfg("dspark", dspark2, 3), "draft_passes": 2}}
        if not small:
            variants["dspark_confidence"] = spec_cfg("dspark", dspark, 3, "confidence")
        for mode in compile_modes(args):  # plain steps compiled (CUDA graphs on CUDA), their states held for later
            variants[f"dspark_idle_compile_{mode}"] = {**spec_cfg("dspark", dspark, 3, "confidence"),
                                                       "context_window": 4, "compile": mode}
        for dt in dtypes:
            with make_llm(target, dt, args.device) as llm:
                base = llm.generate(prompts, base_params)
            for name, sp in variants.items():
                sp = dict(sp)
                mode = sp.pop("compile", "off")
                sched = {"max_num_seqs": len(prompts)} if mode != "off" else None  # few buckets to compile
                compiled = None
                with make_llm(target, dt, args.device, speculative=sp, scheduler=sched, compile_mode=mode) as llm:
                    if mode != "off":
                        idle_stretches(llm, [0] * 6 + [3] * 2)
                    outs = llm.generate(prompts, greedy)
                    if mode != "off":
                        worker = llm.engine.executor.worker
                        compiled = worker.compile_stats()
                        flushes = worker.stash.flushes if worker.stash is not None else 0
                drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
                accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
                divs, gaps = [], []
                for b, o in zip(base, outs):
                    d = first_divergence(o.token_ids, b.token_ids)
                    divs.append(d)
                    if d is not None and d < len(o.token_ids):
                        lp = b.logprobs[d]
                        alt = dict(lp.top).get(o.token_ids[d], -math.inf)
                        gaps.append(lp.logprob - alt)
                same = sum(n_new if d is None else d for d in divs) / (n_new * len(prompts))
                r = {"identical": all(d is None for d in divs), "token_share": same, "first_divergence": divs,
                     "divergence_logprob_gaps": gaps, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                     "acceptance": accepted / drafted if drafted else float("nan")}
                if dt == "float32":
                    passed = r["identical"]
                    if name == "draft_model_self":  # the target drafting for itself: every draft accepted
                        passed &= drafted > 0 and accepted >= 0.98 * drafted
                else:
                    passed = all(g <= BF16_TIE_NATS for g in gaps)
                # drafting must have happened, except where the confidence schedule may judge it not worth it
                passed &= all(len(o.token_ids) == n_new for o in outs) and (drafted > 0 or "confidence" in name)
                if mode != "off":  # drafting resumed after the compiled idle steps, from the rows held for it
                    r.update(compile=compiled, compile_faults=compile_faults(compiled), stash_flushes=flushes)
                    passed &= drafted > 0 and flushes > 0 and not r["compile_faults"]
                r["passed"] = passed = bool(passed)
                ok &= passed
                res["runs"][f"{arch}/{dt}/{name}"] = r
                rows.append([arch, dt, name, drafted, r["acceptance"], same,
                             ",".join("-" if d is None else str(d) for d in divs), max(gaps) if gaps else None, passed])
    say(table(["target", "dtype", "speculation", "drafted", "acceptance", "same tokens", "first diverge",
               "gap at div", "ok"], rows))
    say(f"(vs the same engine without speculation; fp32: identical; bf16: divergences only at near-ties, "
        f"<= {BF16_TIE_NATS} nats in the non-speculative run's own log-probabilities)")
    res["passed"] = ok
    return res


# ---- speculative: the sampled law ------------------------------------------------------------------
def exact_law(path, prompt, device) -> torch.Tensor:
    """The target's exact law of its next 3 tokens after `prompt` (transformers, fp32): [V, V, V]."""
    hf = hf_model(path, torch.float32, device)
    V = hf.config.vocab_size
    with torch.no_grad():
        def nxt(seqs):
            return hf(torch.tensor(seqs, device=device)).logits[:, -1].double().softmax(-1).cpu()
        p1 = nxt([prompt])[0]
        p2 = nxt([prompt + [a] for a in range(V)])
        p3 = nxt([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def engine_law(path, prompt, dtype, device, sched, V) -> torch.Tensor:
    """The target's law of its next 3 tokens after `prompt` as the engine computes it in `dtype`,
    without speculation: every continuation scored in one batch of prefills (prompt_logprobs).
    In bf16 this, not transformers-fp32's, is the law a sampled run follows (the logits' bf16
    rounding moves a peaky law's probabilities by ~2%, which 3000 samples see)."""
    from dspark_cluster import SamplingParams

    seqs = [prompt + [a, b, c] for a in range(V) for b in range(V) for c in range(V)]
    with make_llm(path, dtype, device, scheduler=sched) as llm:
        outs = llm.generate(seqs, SamplingParams(max_tokens=1, temperature=1.0, ignore_eos=True, prompt_logprobs=0))
    n = len(prompt)
    lp = torch.tensor([[o.prompt_logprobs[n + i].logprob for i in range(3)] for o in outs], dtype=torch.float64)
    return lp.sum(1).exp().view(V, V, V)


def check_spec_law(args, tmp) -> dict:
    from dspark_cluster import SamplingParams

    n = 600 if args.small else 3000
    prompt = [1, 5, 2, 3, 1, 5, 2]
    target = build_small_vocab(os.path.join(tmp, "law-target"), 0, 0.35)
    poor = build_small_vocab(os.path.join(tmp, "law-poor"), 7, 0.5)
    dspark = build_dspark(target, os.path.join(tmp, "law-dspark"), seed=5, layers=(0,), block_size=3, hidden=16,
                          scale=2.0)
    hf_law = exact_law(target, prompt, args.device)
    V = hf_law.shape[0]
    sched = {"block_size": 4, "num_kv_blocks": 2048, "max_num_seqs": 512, "max_num_batched_tokens": 8192}
    law = engine_law(target, prompt, args.dtype, args.device, sched, V)
    # dspark_compiled: model.compile on (CUDA graphs on CUDA), unseeded rows, which the drafter's compiled rounds draw in
    # their graphs (the compiler's random stream under CUDA-graph replays: it must advance at every replay)
    runs = {"none": None, "draft_model": spec_cfg("draft_model", poor, 2), "dspark": spec_cfg("dspark", dspark, 2),
            "dspark_compiled": spec_cfg("dspark", dspark, 2)}
    res = {"n": n, "prompt": prompt, "runs": {},
           "law_max_abs_diff_vs_transformers_fp32": float((law / law.sum() - hf_law).abs().max())}
    rows, ok, samples = [], True, {}
    for i, (name, sp) in enumerate(runs.items()):
        compiled = name == "dspark_compiled"
        params = [SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, seed=None if compiled
                                 else 100_000 * (i + 1) + j) for j in range(n)]  # seeded per request, each run its own
        torch.manual_seed(100_000 * (i + 1))  # (unseeded rows draw from the global generator)
        with make_llm(target, args.dtype, args.device, speculative=sp, compile_mode="on" if compiled else "off",
                      scheduler={**sched, "max_num_seqs": 16} if compiled else sched) as llm:  # (few buckets)
            outs = llm.generate([prompt] * n, params)
            sampled_rounds = llm.engine.executor.worker.compile_stats()["draft_compile_sampled_rounds"] if compiled \
                else None
        toks = torch.tensor([o.token_ids[:3] for o in outs])
        joint = torch.zeros(V ** 3, dtype=torch.float64).index_add_(
            0, toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], torch.ones(n, dtype=torch.float64))
        samples[name] = {}
        for t in toks.tolist():
            samples[name][tuple(t)] = samples[name].get(tuple(t), 0) + 1
        p_first, _ = gof_pvalue(torch.bincount(toks[:, 0], minlength=V), law.sum((1, 2)))
        p_second, _ = gof_pvalue(torch.bincount(toks[:, 1], minlength=V), law.sum((0, 2)))
        p_joint, bins = gof_pvalue(joint, law.flatten())
        drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
        accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
        r = {"p_first": p_first, "p_second": p_second, "p_joint": p_joint, "joint_bins": bins,
             "p_joint_vs_transformers_fp32": gof_pvalue(joint, hf_law.flatten())[0],  # reported only
             "num_draft_tokens": drafted, "num_accepted_tokens": accepted}
        passed = min(p_first, p_second, p_joint) > P_MIN
        if sp is not None:
            r["p_two_sample_vs_none"] = two_sample_pvalue(samples["none"], samples[name])
            # speculation really ran (at most one draft fits before the 3rd token) and was sometimes rejected
            passed &= drafted > n / 20 and 0 < accepted < drafted and r["p_two_sample_vs_none"] > P_MIN
        if compiled:  # the drafts came from compiled rounds that drew sampled rows
            r["draft_compile_sampled_rounds"] = sampled_rounds
            passed &= sampled_rounds > 0
        r["passed"] = bool(passed)
        ok &= r["passed"]
        res["runs"][name] = r
        rows.append([name, n, drafted, accepted / drafted if drafted else None, p_first, p_second, p_joint,
                     r.get("p_two_sample_vs_none"), r["p_joint_vs_transformers_fp32"], r["passed"]])
    say(table(["speculation", "samples", "drafted", "acceptance", "p first tok", "p 2nd tok", "p joint(3)",
               "p vs none", "p joint vs hf32", "ok"], rows))
    say(f"(chi-square against the target's exact law as the engine computes it in {args.dtype} without speculation "
        f"(every 3-token continuation scored); pass: p > {P_MIN}; 'p vs none': two-sample against the "
        f"non-speculative run; 'p joint vs hf32': against transformers fp32's law, reported only; the two laws differ "
        f"by {res['law_max_abs_diff_vs_transformers_fp32']:.3g} at most)")
    res["passed"] = ok
    return res


# ---- the MoE expert path ---------------------------------------------------------------------------
def experts_reference(xs, slots, w13, w2) -> torch.Tensor:
    """A plain per-expert loop in fp32."""
    ys = torch.zeros(xs.shape, dtype=torch.float32, device=xs.device)
    for e in range(w13.shape[0]):
        idx = torch.nonzero(slots == e).flatten()
        if idx.numel():
            gate, up = (xs[idx].float() @ w13[e].float().T).chunk(2, dim=-1)
            ys[idx] = (F.silu(gate) * up) @ w2[e].float().T
    return ys


def _time_ms(fn, device, reps=5):
    fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t) / reps * 1e3


def check_grouped_mm(args, tmp) -> dict:
    from dspark_cluster.model import layers

    dev, dtype = args.device, getattr(torch, args.dtype)
    if args.small:
        H, I, E, N, B = 64, 32, 8, 512, 16
    else:
        H, I, E, N, B = 2048, 768, 128, 8192, 64
    g = torch.Generator().manual_seed(0)
    gd = torch.Generator(device=dev).manual_seed(0)  # the big tensors are drawn where they live
    w13 = (torch.randn(E, 2 * I, H, generator=gd, device=dev) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gd, device=dev) / I ** 0.5).to(dtype)
    # skewed routing (a hot expert, empty slots): the fullest slot is far above 2 N / E, so run_experts
    # takes the grouped matmul, not the padded bmm
    weight = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
    weight[E // 3: E // 3 + 2] = 0
    slots = torch.multinomial(weight, N, replacement=True, generator=g).to(dev)
    xs = torch.randn(N, H, generator=gd, device=dev).to(dtype)
    counts = torch.bincount(slots, minlength=E)
    calls = {"grouped_mm": 0, "loop_fallback": 0, "onednn_by_slot": 0}
    orig, by_slot = layers._grouped_mm_experts, layers.experts_by_slot

    def counting(*a):
        out = orig(*a)
        calls["grouped_mm" if out is not None else "loop_fallback"] += 1
        return out

    def counting_by_slot(*a):  # the CPU's oneDNN products slot by slot (the loop fallback is counted above)
        calls["onednn_by_slot"] += len(a) > 4 and a[4] is not F.linear
        return by_slot(*a)

    layers._grouped_mm_experts, layers.experts_by_slot = counting, counting_by_slot
    try:
        with torch.inference_mode():
            ys, _ = layers.run_experts(xs, slots, w13, w2)
    finally:
        layers._grouped_mm_experts, layers.experts_by_slot = orig, by_slot
    with torch.inference_mode():
        ref = experts_reference(xs, slots, w13, w2)
        err = rel_err(ys, ref)
        # the loop fallback in the run's dtype: how far the same arithmetic without grouping lands
        loop = torch.zeros_like(xs)
        for e in range(E):
            idx = torch.nonzero(slots == e).flatten()
            if idx.numel():
                gate, up = (xs[idx] @ w13[e].T).chunk(2, dim=-1)
                loop[idx] = (F.silu(gate) * up) @ w2[e].T
        loop_err = rel_err(loop, ref)
        order = torch.argsort(slots, stable=True)
        xs_sorted = xs[order]
        grouped_ms = _time_ms(lambda: orig(xs_sorted, counts, w13, w2), dev)

        def loop_run():
            start = 0
            for e, c in enumerate(counts.tolist()):
                if c:
                    gate, up = (xs_sorted[start: start + c] @ w13[e].T).chunk(2, dim=-1)
                    (F.silu(gate) * up) @ w2[e].T
                    start += c

        loop_ms = _time_ms(loop_run, dev)
        # decode-shaped: B tokens x top-k spread over the experts -> the padded bmm branch
        dslots = torch.randint(0, E, (B * 8,), generator=g).to(dev)
        dxs = torch.randn(B * 8, H, generator=g).to(dev, dtype)
        dys, dcounts = layers.run_experts(dxs, dslots, w13, w2)
        bmm_branch = True  # one path now: the grouped matmul at every size (no host read of the counts)
        bmm_err = rel_err(dys, experts_reference(dxs, dslots, w13, w2))
        fallback_error = None
        if calls["loop_fallback"]:  # why: the error the library swallows when it falls back
            try:
                offs = torch.cumsum(counts, 0, dtype=torch.int32)
                torch._grouped_mm(xs_sorted, w13.transpose(1, 2), offs=offs)
            except Exception as e:  # noqa: BLE001
                fallback_error = f"{type(e).__name__}: {e}"[:500]
    tol = FP32_REL_TOL if dtype == torch.float32 else BF16_REL_TOL
    on_cuda = torch.device(dev).type == "cuda"
    unsupported = sorted(str(k) for k in layers._NO_GROUPED_MM)
    res = {"shape": {"hidden": H, "intermediate": I, "experts": E, "rows": N}, "dtype": args.dtype,
           "fullest_slot": int(counts.max()), "empty_slots": int((counts == 0).sum()), "calls": calls,
           "grouped_mm_taken": calls["grouped_mm"] == 1 and calls["loop_fallback"] == 0,
           "path": next((k for k, n in calls.items() if n), None),
           "rel_err": err, "loop_same_dtype_rel_err": loop_err, "tolerance": tol, "grouped_ms": grouped_ms,
           "loop_ms": loop_ms, "fallback_error": fallback_error, "bmm_branch": bmm_branch, "bmm_rel_err": bmm_err,
           "no_grouped_mm_keys": unsupported}
    # on CUDA in bf16 the grouped matmul must be taken; elsewhere (fp32 on CUDA has no grouped kernel in
    # some torch builds) a fallback is allowed, and must agree too
    res["grouped_mm_required"] = must = on_cuda and dtype == torch.bfloat16
    res["passed"] = bool(err <= tol and bmm_err <= tol and (res["grouped_mm_taken"] or not must))
    say(table(["path", "rows", "rel err vs fp32 loop", "ms", "taken"],
              [["grouped_mm (skewed)", N, err, grouped_ms, res["grouped_mm_taken"]],
               [f"per-slot loop ({args.dtype})", N, loop_err, loop_ms, None],
               ["grouped_mm (decode-shaped)", B * 8, bmm_err, None, bmm_branch]]))
    say(f"(tolerance {tol}; fullest slot {res['fullest_slot']} rows of {N}, {res['empty_slots']} empty slots; "
        f"grouped_mm {'must' if must else 'need not'} be taken here)")
    return res


# ---- decode throughput against the roofline --------------------------------------------------------
def copy_bandwidth(device, nbytes: int, reps: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    dt = time.perf_counter() - t
    del src, dst
    return 2 * nbytes * reps / dt


def record_steps(llm) -> list:
    """Every step the engine's executor runs from now on, timed, with what it read: a list that fills as it runs."""
    ex, record = llm.engine.executor, []
    orig = ex.submit

    def submit(step):
        t0 = time.perf_counter()
        out = orig(step)
        record.append({"t0": t0, "t1": time.perf_counter(), "rows": int(step.query_lens.numel()),
                       "decode": bool((step.query_lens == 1).all()), "drafted": step.num_draft is not None,
                       "ctx": int(step.context_lens.sum()), "experts": (out.expert_load > 0).sum(1).tolist()})
        return out

    ex.submit = submit
    return record


def check_decode(args, tmp) -> dict:
    from dspark_cluster import SamplingParams
    from dspark_cluster.kv_cache import kv_bytes_per_block

    small, dev = args.small, args.device
    shape = QWEN3_TINY if small else QWEN3_30B_A3B
    num_layers = 2 if small else 4
    batches = (1, 4) if small else (1, 16, 64)
    prompt_len, steps = (16, 8) if small else (128, 64)
    bw = copy_bandwidth(dev, (64 if small else 2048) * 2**20, 5 if small else 20)
    path = os.path.join(tmp, "qwen3-30b-a3b-shapes")
    os.makedirs(path)
    t = time.perf_counter()
    written = write_random_qwen3_moe(path, shape, num_layers, dev)
    write_s = time.perf_counter() - t
    sched = {"block_size": 16, "num_kv_blocks": "auto", "kv_cache_memory": "1GiB", "max_num_seqs": max(batches),
             "max_num_batched_tokens": max(batches) * prompt_len}
    res = {"model": {"shape": shape, "num_layers": num_layers, "checkpoint_bytes": written, "write_s": write_s},
           "dtype": args.dtype, "copy_bandwidth_GBps": bw / 1e9, "prompt_len": prompt_len, "decode_steps": steps,
           "batches": {}}
    def run_mode(mode):
        t = time.perf_counter()
        llm = make_llm(path, args.dtype, dev, scheduler=sched, compile_mode=mode)
        res["model"][f"load_s_compile_{mode}"] = time.perf_counter() - t
        rows = []
        try:
            ex = llm.engine.executor
            model = ex.model
            moe = model.moe_layers[0]
            expert_bytes = (moe.w13[0].numel() + moe.w2[0].numel()) * moe.w13.element_size()  # one expert of one layer
            dense_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                              if not n.endswith((".w13", ".w2")) and "embed_tokens" not in n)
            kv_per_token = kv_bytes_per_block(model, llm.engine.block_size) / llm.engine.block_size
            emb_row = model.model.embed_tokens.weight[0].numel() * model.model.embed_tokens.weight.element_size()
            res["model"].update(expert_bytes_each=expert_bytes, dense_bytes=dense_bytes, kv_bytes_per_token=kv_per_token,
                                device_weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
            record = record_steps(llm)
            for B in batches:
                warm = random_prompts([prompt_len] * B, seed=100 + B, vocab=shape["vocab_size"])
                llm.generate(warm, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
                prompts = random_prompts([prompt_len] * B, seed=200 + B, vocab=shape["vocab_size"])
                record.clear()
                t = time.perf_counter()
                outs = llm.generate(prompts, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
                wall = time.perf_counter() - t
                dec = [r for r in record if r["decode"] and r["rows"] == B]
                if len(dec) < 2:
                    raise RuntimeError(f"batch {B}: {len(dec)} decode steps of {B} rows seen; expected {steps}")
                walls = sorted(b["t0"] - a["t0"] for a, b in zip(dec, dec[1:]))
                fwd = sorted(r["t1"] - r["t0"] for r in dec)
                step_s = walls[len(walls) // 2] if walls else float("nan")
                fwd_s = fwd[len(fwd) // 2]
                experts = sum(sum(r["experts"]) for r in dec) / len(dec)  # active (layer, expert) pairs per step
                ctx = sum(r["ctx"] for r in dec) / len(dec)
                weight_read = dense_bytes + experts * expert_bytes + B * emb_row
                kv_read = ctx * kv_per_token
                roof_s = (weight_read + kv_read) / bw
                r = {"decode_tok_s": B / step_s, "step_ms": step_s * 1e3, "forward_ms": fwd_s * 1e3,
                     "roofline_ms": roof_s * 1e3, "x_roofline": step_s / roof_s, "forward_x_roofline": fwd_s / roof_s,
                     "active_experts_per_layer": experts / num_layers, "weight_bytes_per_step": weight_read,
                     "kv_bytes_per_step": kv_read, "decode_steps_measured": len(dec), "generate_wall_s": wall,
                     "tokens": sum(len(o.token_ids) for o in outs)}
                res["batches" if mode == "off" else f"batches_compile_{mode}"][str(B)] = r
                rows.append([f"{B} (compile {mode})", r["decode_tok_s"], r["step_ms"], r["forward_ms"], r["roofline_ms"],
                             r["x_roofline"], r["active_experts_per_layer"], weight_read / 1e6, kv_read / 1e6])
            if mode != "off":
                res[f"compile_{mode}"] = llm.engine.executor.worker.compile_stats()
                res[f"compile_{mode}_faults"] = compile_faults(res[f"compile_{mode}"])
        finally:
            llm.shutdown()
            del llm
            if torch.device(dev).type == "cuda":
                torch.cuda.empty_cache()
        return rows

    def verify_cost(mode):
        """Batch 1 with DSpark drafting every step (static schedule, k = 3, a random drafter): the executor's time of a
        drafting step (the verify forward of 4 tokens, compiled where compile is on: the 4-token bucket's graphs,
        which decode steps of 4 rows replay too; with the drafter on the target, its round too, compiled where
        compile is on: `compiled_draft`) against the same mode's decode step. On a GPU with compile on: what a
        drafting step costs beside a CUDA-graph decode step, every part of it in CUDA graphs but attention."""
        draft = build_dspark(path, os.path.join(tmp, f"dspark-{mode}"), layers=(0, 1))
        with make_llm(path, args.dtype, dev, scheduler=sched, speculative=spec_cfg("dspark", draft, 3),
                      compile_mode=mode) as llm:
            record = record_steps(llm)
            prompt = random_prompts([prompt_len], seed=300, vocab=shape["vocab_size"])
            llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm
            record.clear()
            llm.generate(prompt, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
            compiled = llm.engine.executor.worker.compile_stats()
        if torch.device(dev).type == "cuda":
            torch.cuda.empty_cache()
        times = [r["t1"] - r["t0"] for r in record if r["drafted"] and r["rows"] == 1]
        key = "batches" if mode == "off" else f"batches_compile_{mode}"
        decode_ms = res[key]["1"]["forward_ms"]
        verify_ms = sorted(times)[len(times) // 2] * 1e3 if times else float("nan")
        res[f"verify_compile_{mode}"] = {"verify_forward_ms": verify_ms, "decode_forward_ms": decode_ms,
                                         "verify_over_decode": verify_ms / decode_ms, "verify_steps": len(times),
                                         "compile": compiled, "compile_faults": [] if mode == "off" else
                                         compile_faults(compiled) + ([] if (compiled or {}).get(
                                             "compile_verify_steps") else ["no verify step compiled"]) + (
                                             [] if (compiled or {}).get("draft_compile_rounds") else
                                             ["no drafter round compiled"]) + (
                                             [] if (compiled or {}).get("draft_compile_direct_rounds") else
                                             ["no drafter round called its graphs directly"])}
        return [mode, verify_ms, decode_ms, verify_ms / decode_ms, len(times)]

    def kv_share():
        """kv_cache_memory as a share of the device (0.01): on CUDA each worker first runs its largest steps (a
        prompt chunk of max_num_batched_tokens, a full batch's verify step) and leaves their peak out of the pool;
        a prompt of max_num_batched_tokens then runs on it. Again with a DSpark drafter on the target: its largest
        round's stores and laws, held while those steps run, add to the reserve. Off CUDA nothing is measured
        (0)."""
        kv = {**sched, "kv_cache_memory": 0.01, "num_kv_blocks": "auto"}
        draft = build_dspark(path, os.path.join(tmp, "dspark-kv-share"), layers=(0, 1))
        reserves, ok = {}, True
        for name, sp in (("plain", None), ("dspark", spec_cfg("dspark", draft, 3))):
            with make_llm(path, args.dtype, dev, scheduler=kv, speculative=sp) as llm:
                reserves[name] = llm.engine.executor.worker.memory_report()["activation_reserve_bytes"]
                prompt = random_prompts([kv["max_num_batched_tokens"]], seed=400, vocab=shape["vocab_size"])
                out = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
                blocks = llm.engine.num_blocks if name == "plain" else blocks
            if torch.device(dev).type == "cuda":
                torch.cuda.empty_cache()
            ok = ok and (reserves[name] > 0) == (torch.device(dev).type == "cuda") and len(out[0].token_ids) == 2
        ok = ok and (reserves["dspark"] > reserves["plain"]) == (torch.device(dev).type == "cuda")
        res["kv_share"] = {"activation_reserve_bytes": reserves["plain"], "num_blocks": blocks,
                           "activation_reserve_bytes_dspark_on_target": reserves["dspark"], "passed": ok}
        say(f"kv_cache_memory 0.01: the largest steps' reserve {reserves['plain'] / 2**20:,.1f} MiB "
            f"({reserves['dspark'] / 2**20:,.1f} MiB with a DSpark drafter on the target), {blocks:,} blocks; a "
            f"{kv['max_num_batched_tokens']}-token prompt ran on them")

    kv_share()
    rows, verify_rows = [], []
    for mode in ["off", *compile_modes(args)]:
        if mode != "off":
            res["batches_compile_" + mode] = {}
        rows += run_mode(mode)
        verify_rows.append(verify_cost(mode))
    say(table(["batch", "tok/s", "step ms", "forward ms", "roofline ms", "x roofline", "experts/layer",
               "weights MB/step", "KV MB/step"], rows))
    say(f"(Qwen3-30B-A3B layer shapes, {num_layers} layers, {args.dtype}; roofline = bytes read per decode step / "
        f"measured device-to-device copy bandwidth {bw / 1e9:.0f} GB/s (bytes read + written per second); step ms = "
        "wall time between decode steps, forward ms = the executor's own time)")
    say(table(["compile", "verify forward ms", "decode forward ms", "verify / decode", "verify steps"], verify_rows))
    say("(batch 1, DSpark k = 3 every step: a drafting step's executor time, its verify forward compiled where compile "
        "is on, against the decode forward above)")
    res["passed"] = res["kv_share"]["passed"] and \
        all(r["decode_steps_measured"] >= steps - 2 for r in res["batches"].values()) and \
        not any(res[f"compile_{m}_faults"] for m in compile_modes(args)) and \
        all(r["verify_steps"] >= steps // 4 and not r["compile_faults"]
            for r in (res[f"verify_compile_{m}"] for m in ["off", *compile_modes(args)]))
    return res


# ---- the run ---------------------------------------------------------------------------------------
def environment(args) -> dict:
    import transformers

    dev = torch.device(args.device)
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "platform": platform.platform(), "device": args.device, "dtype": args.dtype, "small": args.small}
    try:
        import safetensors
        env["safetensors"] = safetensors.__version__
    except Exception:  # noqa: BLE001
        pass
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update(device_name=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                   device_memory_GiB=p.total_memory / 2**30,
                   allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    else:
        env.update(device_name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                           cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except Exception:  # noqa: BLE001
        env["git_commit"] = None
    return env


def loaded_modules() -> list:
    """Top-level modules this process imported that are not in the standard library."""
    names = {m.split(".")[0] for m, mod in list(sys.modules.items()) if mod is not None}
    return sorted(n for n in names if n not in sys.stdlib_module_names and not n.startswith("_")
                  and n not in ("__main__", "__mp_main__"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--small", action="store_true", help="tiny sizes and few steps (for CPU)")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(CHECKS)}")
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--compile", default=None, help="model.compile modes of the decode and speculative checks "
                                                   "(default: off,on on cuda, off on cpu)")
    args = ap.parse_args(argv)
    only = CHECKS if not args.only else tuple(s.strip() for s in args.only.split(",") if s.strip())
    bad = [c for c in only if c not in CHECKS]
    if bad:
        ap.error(f"--only: unknown check(s) {', '.join(bad)}; choose from {', '.join(CHECKS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (use --device cpu --small on a CPU machine)")
    t_start = time.perf_counter()
    torch.manual_seed(0)
    report = {"env": environment(args), "checks": {}, "passed": None}
    say(f"gpu_check: {report['env']['device_name']} | torch {torch.__version__} | transformers "
        f"{report['env']['transformers']} | {args.dtype}{' | small' if args.small else ''} | checks: {', '.join(only)}")

    def write():
        report["total_s"] = time.perf_counter() - t_start
        report["env"]["modules"] = loaded_modules()
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2, default=str)

    tmp = tempfile.mkdtemp(prefix="gpu_check-")
    runners = {"parity": check_parity, "speculative": check_speculative, "spec_law": check_spec_law,
               "grouped_mm": check_grouped_mm, "decode": check_decode}
    try:
        for name in only:
            say(f"\n== {name} ==")
            t = time.perf_counter()
            try:
                res = runners[name](args, tmp)
            except Exception as e:  # noqa: BLE001 -- one failing check does not stop the others
                traceback.print_exc()
                res = {"passed": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            res["seconds"] = time.perf_counter() - t
            report["checks"][name] = res
            say(f"-- {name}: {'PASS' if res['passed'] else 'FAIL'} ({res['seconds']:.1f} s)")
            write()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report["passed"] = all(c["passed"] for c in report["checks"].values())
    write()
    say("\n" + table(["check", "result", "seconds"],
                     [[n, c["passed"], c["seconds"]] for n, c in report["checks"].items()]))
    say(f"total {report['total_s']:.1f} s; {'ALL PASS' if report['passed'] else 'FAILED'}; wrote {args.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
