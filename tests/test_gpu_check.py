"""launch/gpu_check.py (what a lent GPU checks) runs here on CPU with tiny sizes, so it cannot rot:
every check passes and the JSON holds every figure. It runs as the device would run it: in a fresh
process where the packages the device lacks (Ray, the HTTP stack, DeepSpeed) and scipy cannot be
imported."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "gpu_check.py"
# not on the device (or not needed there): the script and the in-process core must run without them
ABSENT = ("ray", "fastapi", "uvicorn", "starlette", "deepspeed", "openai", "scipy", "matplotlib")
CHECKS = ("parity", "speculative", "spec_law", "grouped_mm", "decode")

RUN = """
import runpy, sys
for name in {absent!r}:
    sys.modules[name] = None  # import fails, importlib.util.find_spec says absent
sys.argv = [{script!r}] + {args!r}
try:
    runpy.run_path({script!r}, run_name="__main__")
except SystemExit as e:
    sys.exit(e.code)
"""


def run_script(args, timeout=300):
    code = RUN.format(absent=ABSENT, script=str(SCRIPT), args=list(args))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_gpu_check_passes_on_cpu_small(tmp_path):
    out = tmp_path / "gpu_check.json"
    # model.compile on as well (a GPU's default): on CUDA the CUDA-graph path, here its compiled steps
    p = run_script(["--device", "cpu", "--small", "--dtype", "float32", "--compile", "off,on", "--out", str(out)],
                   timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "ALL PASS" in p.stdout
    report = json.loads(out.read_text())
    assert report["passed"] is True
    env = report["env"]
    for key in ("device_name", "torch", "transformers", "python", "dtype", "modules"):
        assert env[key] is not None, key
    assert not set(ABSENT) & set(env["modules"])  # the device lacks them
    assert {"pydantic", "pydantic_core", "annotated_types", "typing_inspection"} <= set(env["modules"])  # the wheels
    checks = report["checks"]
    assert set(checks) == set(CHECKS)
    for name, c in checks.items():
        assert c["passed"] is True and c["seconds"] >= 0, (name, c.get("error"))

    parity = checks["parity"]["archs"]
    assert set(parity) == {"deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral", "llama"}
    for arch, per in parity.items():
        r = per["float32"]
        assert r["rel_err"] <= 1e-4 and r["token_share"] == 1.0 and r["first_divergence"] == [None] * 4, arch

    spec = checks["speculative"]["runs"]
    assert {k.split("/")[2] for k in spec} >= {"draft_model_poor", "draft_model_self", "dspark_static",
                                               "dspark_two_passes", "dspark_idle_compile_on"}
    for name, r in spec.items():
        assert r["identical"] and r["num_draft_tokens"] > 0, name
    idle = spec["qwen3_moe/float32/dspark_idle_compile_on"]  # idle steps compiled, their states held, drafting resumed
    assert idle["compile_faults"] == [] and idle["stash_flushes"] > 0 and idle["compile"]["compile_steps"] > 0
    assert idle["compile"]["compile_warm_up_graphs"] == idle["compile"]["compile_graphs_expected"] == 4  # 2 a capture

    law = checks["spec_law"]["runs"]
    assert set(law) == {"none", "draft_model", "dspark", "dspark_compiled"}
    assert law["dspark_compiled"]["draft_compile_sampled_rounds"] > 0  # unseeded rows drawn in the compiled rounds
    for name, r in law.items():
        assert min(r["p_first"], r["p_second"], r["p_joint"]) > 1e-4, name
    assert law["dspark"]["num_draft_tokens"] > 0 and law["dspark"]["p_two_sample_vs_none"] > 1e-4

    gm = checks["grouped_mm"]
    # one expert path taken (on this CPU, with 64 rows a slot: oneDNN slot by slot, model/gemm.py)
    assert sum(gm["calls"].values()) == 1 and gm["rel_err"] <= 1e-4
    assert gm["bmm_branch"] and gm["bmm_rel_err"] <= 1e-4

    dec = checks["decode"]
    assert dec["copy_bandwidth_GBps"] > 0
    assert set(dec["batches"]) == {"1", "4"}
    assert dec["kv_share"] == {"activation_reserve_bytes": 0, "num_blocks": dec["kv_share"]["num_blocks"],
                               "activation_reserve_bytes_dspark_on_target": 0,
                               "passed": True}  # (measured on CUDA only)
    for b, r in dec["batches"].items():
        for key in ("decode_tok_s", "step_ms", "forward_ms", "roofline_ms", "x_roofline", "weight_bytes_per_step",
                    "kv_bytes_per_step", "active_experts_per_layer"):
            assert r[key] > 0, (b, key)
        assert r["decode_steps_measured"] >= dec["decode_steps"] - 2
    assert set(dec["batches_compile_on"]) == {"1", "4"} and dec["compile_on_faults"] == []
    for mode in ("off", "on"):  # a drafting step's time beside the decode step's
        v = dec[f"verify_compile_{mode}"]
        assert v["verify_steps"] >= 2 and v["verify_forward_ms"] > 0 and v["verify_over_decode"] > 0, v
    on = dec["verify_compile_on"]  # the drafter's rounds compiled beside the target's steps
    assert on["compile_faults"] == [] and on["compile"]["draft_compile_rounds"] > 0, on
    # a second engine's graphs in the same process (the speculative check's came first): none left eager
    assert dec["compile_on"]["compile_warm_up_graphs"] == dec["compile_on"]["compile_graphs_expected"] == 2


def test_gpu_check_refuses_an_unknown_check(tmp_path):
    p = run_script(["--device", "cpu", "--only", "parity,nope", "--out", str(tmp_path / "x.json")], timeout=120)
    assert p.returncode == 2 and "unknown check(s) nope" in p.stderr
