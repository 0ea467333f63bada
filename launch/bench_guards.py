"""Dynamo's guard check before a compiled step, at a target's depth: how many guards a step's graph carries (by kind)
and how long checking them takes on the host (every step, before any kernel runs), with the runner's guard filter
(`model/compiled.py` `module_guard_filter`) and with every guard kept; and the whole compiled decode step's time.

    python launch/bench_guards.py --layers 61            # a random DeepSeek-V3-shaped model, tiny widths (~40 s)
    python launch/bench_guards.py --layers 4 --json OUT

Each arm compiles in a process of its own (dynamo's caches and counters are per process); the check is the
graph's guard manager run on the step's own arguments, 5 x 200 times (microseconds, median of the five); the step
(one token at context 40, the runner's call) 6 x 100 times (ms, median of each hundred) through dynamo's guards,
interleaved with as many under `torch.compiler.set_stance(skip_guard_eval_unsafe=True)` (dynamo checks only the
guards that tell the frame's graphs apart: what the guard evaluation costs a step, in situ) and as many as the
runner calls its graphs (their code directly while its traced key holds: `CompiledSteps.forward`); and the time
to read the key a direct call compares before each step (`traced_key_us`: since session 34 the mark of the traced
values' latest assignment, before it the values themselves).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]


def deep_checkpoint(layers: int) -> str:
    """The test suite's tiny DeepSeek-V3 (conftest), `layers` deep, random (seed 0), saved to a new temporary
    directory: a target's depth at tiny widths (the guards and a step's dispatch depend on the depth)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=512)
    path = Path(tempfile.mkdtemp()) / "dsv3"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))
    return str(path)


def arm(layers: int, keep_all: bool) -> dict:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from dspark_cluster.kv_cache import allocate_kv_cache
    from dspark_cluster.model import compiled
    from dspark_cluster.model.loader import load_model
    from dspark_cluster.model.spec import load_spec

    torch.set_num_threads(1)
    path = deep_checkpoint(layers)
    model = load_model(path, load_spec(path, "float32"))
    allocate_kv_cache(model, 64, 4, torch.device("cpu"))
    counts = []
    real_filter = compiled.module_guard_filter

    def counted(entries):
        keep = [True] * len(entries) if keep_all else real_filter(entries)
        counts.append((len(entries), sum(keep), collections.Counter(e.guard_type for e in entries)))
        return keep

    compiled.module_guard_filter = counted  # (read when the runner compiles)
    runner = compiled.CompiledSteps(model, [1], "cpu")
    t0 = time.perf_counter()
    runner.warm_up()
    warm = time.perf_counter() - t0
    entry = _debug_get_cache_entry_list(runner.code)[0]
    with torch.inference_mode():  # the step's arguments as the runner passes them (inference tensors)
        f_locals = runner._probe(1, ())
        assert entry.guard_manager.check(f_locals), entry.guard_manager.check_verbose(f_locals)
        us = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(200):
                entry.guard_manager.check(f_locals)
            us.append((time.perf_counter() - t) / 200 * 1e6)
    step = SimpleNamespace(input_ids=torch.tensor([7]), query_lens=torch.tensor([1]), context_lens=torch.tensor([40]),
                           block_tables=torch.arange(16).view(1, 16), block_size=4, num_draft=None)
    for _ in range(10):
        runner(step)

    direct = runner.direct.on

    def hundred(arm: str) -> float:
        runner.direct.on = direct and arm == "direct"
        times = []
        for _ in range(100):
            t = time.perf_counter()
            with torch.compiler.set_stance(skip_guard_eval_unsafe=arm == "skip"):
                runner(step)
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    # the step through dynamo's guards, with dynamo evaluating only the guards that tell its graphs apart (the
    # process-wide stance), and as the runner calls it (its graph's code directly, `CompiledSteps.forward`),
    # interleaved
    ms = {"guarded": [], "skip": [], "direct": []}
    for i in range(6):
        for arm in (ms if i % 2 == 0 else reversed(list(ms))):
            ms[arm].append(hundred(arm))
    # the key a direct call reads before each step (the runner's `DirectCalls` key: the mark of the traced values'
    # latest assignment; a tree before it, the values themselves), 5 x 2000 times (us, median of the five)
    key, key_us = runner.direct._key_fn, []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(2000):
            key()
        key_us.append((time.perf_counter() - t) / 2000 * 1e6)
    return {"guards": counts[-1][0], "kept": counts[-1][1], "by_kind": dict(counts[-1][2].most_common()),
            "check_us": statistics.median(us), "check_us_runs": us, "step_ms_runs": ms["guarded"],
            "step_ms_skip_guards_runs": ms["skip"], "step_ms_direct_runs": ms["direct"], "direct": direct,
            "step_ms": statistics.median(ms["guarded"]), "step_ms_direct": statistics.median(ms["direct"]),
            "traced_key_us": statistics.median(key_us), "warm_up_s": warm}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--json", default=None)
    ap.add_argument("--arm", choices=["filtered", "all"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(arm(args.layers, args.arm == "all")))
        return
    res = {"layers": args.layers}
    # (the caller's package where it names one: ab.py --script-here runs this script against another tree's)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    for name in ("filtered", "all"):
        out = subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--arm", name], env=env,
                             capture_output=True, text=True, check=True).stdout
        res[name] = json.loads(out.strip().splitlines()[-1])
        r = res[name]
        def runs(key):
            return f"{', '.join(f'{x:.2f}' for x in r[key])} (median {statistics.median(r[key]):.2f})"

        print(f"{name}: {r['kept']} of {r['guards']} guards, check {r['check_us']:.1f} us, step ms through the guards "
              f"{runs('step_ms_runs')}; only the guards between its graphs {runs('step_ms_skip_guards_runs')}; the "
              f"runner's direct call {runs('step_ms_direct_runs')}, direct: {r['direct']} (warm-up "
              f"{r['warm_up_s']:.1f} s)", flush=True)
    print("guards by kind:", res["all"]["by_kind"])
    print(f"the direct call's key (read before each step): {res['filtered']['traced_key_us']:.1f} us")
    print(f"filtered / all: {res['filtered']['check_us'] / res['all']['check_us']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
