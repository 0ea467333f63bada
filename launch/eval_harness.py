"""lm-eval against `dspark serve`: a multiple-choice task (likelihoods: `echo` + `logprobs`) and a
generate-until task (stop strings), both built from the bundled held-out prompts.

    pip install "lm-eval[api]"        # not a dependency of the package
    python launch/eval_harness.py [--config configs/tiny.yaml] [--limit 40] [--out runs/lm-eval]

It writes two task YAMLs and their JSONL data under --out, starts `dspark serve` on a free port,
waits for /health, runs `lm_eval --model local-completions` on both tasks, prints lm-eval's table
and exits with lm-eval's status (0: the tasks ran with no errors). The tasks:
- `dspark_heldout_mc`: the context is a function's signature and docstring; the choices are its own
  body and the bodies of three other held-out functions; acc / acc_norm.
- `dspark_heldout_gen`: the same contexts; generate until a newline; exact match with the body's
  first line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
HELDOUT = ROOT / "dspark_cluster" / "assets" / "prompts" / "heldout.jsonl"

MC_YAML = """task: dspark_heldout_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

GEN_YAML = """task: dspark_heldout_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  temperature: 0.0
  max_gen_toks: 32
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def build_tasks(out: Path, seed: int = 0) -> Path:
    """The two tasks' data and YAMLs under out/tasks; returns that folder (lm-eval's --include_path)."""
    items = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    mc, gen = [], []
    for i, it in enumerate(items):
        others = rng.sample([j for j in range(len(items)) if j != i], 3)
        choices = [it["reference"]] + [items[j]["reference"] for j in others]
        order = list(range(4))
        rng.shuffle(order)
        mc.append({"context": it["prompt"], "choices": [choices[k] for k in order], "gold": order.index(0)})
        first = it["reference"].split("\n")[0]
        gen.append({"context": it["prompt"], "target": first})
    tasks = out / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    for name, rows, yaml in (("mc", mc, MC_YAML), ("gen", gen, GEN_YAML)):
        data = tasks / f"heldout_{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"dspark_heldout_{name}.yaml").write_text(yaml.format(data=data))
    return tasks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    ap.add_argument("--limit", type=int, default=40, help="documents per task (the held-out set has 131)")
    ap.add_argument("--out", default="runs/lm-eval")
    ap.add_argument("--concurrent", type=int, default=4, help="lm-eval's num_concurrent requests")
    args = ap.parse_args()
    if shutil.which("lm_eval") is None:
        print("error: lm_eval not found; pip install \"lm-eval[api]\"", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    tasks = build_tasks(out)
    port = free_port()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    server = subprocess.Popen([sys.executable, "-m", "dspark_cluster.cli", "serve", args.config, "--port", str(port),
                               "--served-model-name", "tiny-moe", "--log-level", "warning"], env=env, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                print("error: dspark serve did not come up", file=sys.stderr)
                return 1
            time.sleep(1)
        from dspark_cluster.config import load_config

        tokenizer = load_config(args.config).model.path  # the checkpoint ships its tokenizer
        model_args = (f"model=tiny-moe,base_url={url}/v1/completions,tokenizer={tokenizer},tokenizer_backend=huggingface,"
                      f"num_concurrent={args.concurrent},max_retries=1,timeout=120")
        cmd = ["lm_eval", "--model", "local-completions", "--model_args", model_args,
               "--tasks", "dspark_heldout_mc,dspark_heldout_gen", "--include_path", str(tasks),
               "--limit", str(args.limit), "--output_path", str(out / "results")]
        print("$", " ".join(cmd), flush=True)
        t0 = time.monotonic()
        rc = subprocess.run(cmd, env=env).returncode
        print(f"lm_eval exited {rc} after {time.monotonic() - t0:.0f} s", flush=True)
        return rc
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
