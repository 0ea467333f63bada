"""What the HTTP layer costs: TTFT and TPOT through the OpenAI-compatible server against the
in-process AsyncEngine API, same engine, same load, same run.

    python launch/bench_http.py [--model PATH] [--loads 1,16] [--prompt-len 64] [--max-tokens 64]
                                [--threads 1] [--repeats 5] [--no-write]

One engine serves both paths. Per load c, rounds alternate (so drift hits both alike):
- in-process: c coroutines on the server's event loop `submit` + `stream` at once;
- HTTP: c concurrent streaming POST /v1/completions from a client in another process (httpx),
  timed where the client sees the SSE chunks.
TTFT: request sent -> first token seen; TPOT: (last token - first token) / (tokens - 1). Greedy,
EOS ignored, token-id prompts. The engine's own view of the HTTP requests (arrival at the engine ->
first token) is reported too, which splits the HTTP cost into before and after the engine.
Writes the section "## HTTP serving overhead (issue 8)" of BENCHMARKS.md (other sections untouched).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SECTION = "## HTTP serving overhead (issue 8)"
MODEL_NAME = "bench"


# ---------------------------------------------------------------------------------------------
# the HTTP client (runs in its own process: `--client URL`)
# ---------------------------------------------------------------------------------------------


async def _client_main(url: str) -> None:
    """Reads one JSON command per stdin line: {"prompts": [[ids]...], "max_tokens": M}; runs them
    as concurrent streams and prints one JSON line of per-request timings."""
    import httpx

    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=512)) as http:

        async def one(ids, max_tokens):
            body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first = last = None
            tokens = 0
            async with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        now = time.perf_counter()
                        first = first or now
                        last = now
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            return {"id": chunk["id"], "ttft": first - t0, "t_first": first, "t_last": last, "tokens": tokens,
                    "t0": t0}

        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line.strip():
                return
            cmd = json.loads(line)
            t0 = time.perf_counter()
            res = await asyncio.gather(*(one(p, cmd["max_tokens"]) for p in cmd["prompts"]))
            wall = time.perf_counter() - t0
            print(json.dumps({"requests": res, "wall": wall}), flush=True)


# ---------------------------------------------------------------------------------------------
# the server side
# ---------------------------------------------------------------------------------------------


def build_tiny_checkpoint(path: Path) -> Path:
    """A tiny random DeepSeek-V3-style MoE with a word-level tokenizer (when the bundled model is absent)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, DeepseekV3Config, PreTrainedTokenizerFast

    torch.manual_seed(0)
    vocab = 512
    cfg = DeepseekV3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
        q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_group=4,
        topk_group=2, first_k_dense_replace=1, initializer_range=0.05, max_position_embeddings=1024,
        bos_token_id=0, eos_token_id=1,
    )
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))
    words = ["<s>", "</s>"] + [f"w{i}" for i in range(vocab - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(str(path))
    return path


class UvicornThread:
    """uvicorn on its own event loop in a thread; `call(coro)` runs a coroutine on that loop."""

    def __init__(self, app, port: int):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    access_log=False))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=lambda: self.loop.run_until_complete(self.server.serve()), daemon=True)

    def start(self):
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


async def inprocess_round(engine, prompts, max_tokens):
    """c concurrent requests through the AsyncEngine API (submit + stream), timed by the caller."""
    from dspark_cluster.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def one(ids):
        t0 = time.perf_counter()
        rid = engine.submit(ids, params)
        first = last = None
        tokens = 0
        async for piece in engine.stream(rid):
            if piece.token_ids:
                now = time.perf_counter()
                first = first or now
                last = now
                tokens += len(piece.token_ids)
        return {"id": rid, "ttft": first - t0, "t_first": first, "t_last": last, "tokens": tokens}

    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(p) for p in prompts))
    return {"requests": res, "wall": time.perf_counter() - t0}


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(rounds) -> dict:
    ttft, tpot, tokens, wall = [], [], 0, 0.0
    for rnd in rounds:
        wall += rnd["wall"]
        for r in rnd["requests"]:
            ttft.append(r["ttft"])
            if r["tokens"] > 1:
                tpot.append((r["t_last"] - r["t_first"]) / (r["tokens"] - 1))
            tokens += r["tokens"]
    return {"ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
            "tok_s": tokens / wall if wall else float("nan"), "n": len(ttft)}


def engine_view(finished: list[dict], ids: set) -> dict:
    ms = [m for m in finished if m["request_id"] in ids]
    ttft = [m["ttft_s"] for m in ms if m["ttft_s"] is not None]
    tpot = [m["tpot_s"] for m in ms if m["num_output_tokens"] > 1]
    return {"ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
            "tok_s": float("nan"), "n": len(ms)}


def machine() -> str:
    import torch

    model = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except Exception:
        pass
    try:
        nproc = subprocess.run(["nproc"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        nproc = str(os.cpu_count())
    import fastapi
    import uvicorn

    return (f"nproc={nproc}, CPU: {model}, torch {torch.__version__}, Python {platform.python_version()}, "
            f"fastapi {fastapi.__version__}, uvicorn {uvicorn.__version__}")


def write_section(text: str, path: Path) -> None:
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, l in enumerate(lines) if l.rstrip() == SECTION), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        tail = "".join(lines[end:])
        new = "".join(lines[:start]) + text + ("\n" + tail if tail else "")
    path.write_text(new)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="checkpoint (default: dspark_cluster/assets/tiny-moe, else a tiny random one)")
    ap.add_argument("--loads", default="1,16", help="concurrent streams per round, comma-separated (default 1,16)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine (default 1)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds per load (at least 16 requests per path)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = ap.parse_args()
    if args.client:
        asyncio.run(_client_main(args.client))
        return

    import socket

    import torch

    from dspark_cluster import load_config
    from dspark_cluster.client import EngineClient
    from dspark_cluster.config import ASSETS_DIR
    from dspark_cluster.server import build_app

    t_start = time.time()
    torch.set_num_threads(args.threads)
    tmp = None
    if args.model:
        model, model_label = args.model, args.model
    elif (ASSETS_DIR / "tiny-moe" / "config.json").is_file():
        model, model_label = str(ASSETS_DIR / "tiny-moe"), "dspark_cluster/assets/tiny-moe"
    else:
        tmp = tempfile.mkdtemp(prefix="bench_http_")
        model = str(build_tiny_checkpoint(Path(tmp) / "tiny-random-moe"))
        model_label = "a tiny random DeepSeek-V3-style MoE built by the script (4 layers, 16 experts, hidden 128)"
    loads = [int(x) for x in args.loads.split(",")]
    cfg = load_config({"model": {"path": model, "dtype": "float32"},
                       "parallel": {"executor": "local", "threads_per_worker": args.threads},
                       "scheduler": {"max_num_seqs": max(64, max(loads)), "max_num_batched_tokens": 4096}})
    client = EngineClient.start(cfg)
    engine = client.engine
    vocab = engine.engine.spec.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompts(c):
        return [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(c)]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = UvicornThread(build_app(client, MODEL_NAME), port).start()
    proc = subprocess.Popen([sys.executable, __file__, "--client", f"http://127.0.0.1:{port}"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def http_round(ps):
        proc.stdin.write(json.dumps({"prompts": ps, "max_tokens": args.max_tokens}) + "\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    results = []
    try:
        http_round(prompts(2))  # warm-up both paths
        server.call(inprocess_round(engine, prompts(2), args.max_tokens))
        for c in loads:
            rounds = max(args.repeats, math.ceil(16 / c))
            inproc, http = [], []
            for _ in range(rounds):
                inproc.append(server.call(inprocess_round(engine, prompts(c), args.max_tokens)))
                http.append(http_round(prompts(c)))
            ids = {r["id"] for rnd in http for r in rnd["requests"]}
            results.append((c, summarize(inproc), summarize(http), engine_view(list(engine.finished), ids)))
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        server.stop()
        client.shutdown()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    def ms(x):
        return "-" if math.isnan(x) else f"{x * 1000:.1f}"

    rows = ["| concurrent streams | path | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) | output tok/s | requests |",
            "|---|---|---|---|---|---|---|---|"]
    for c, a, h, e in results:
        for label, r in (("in-process AsyncEngine API", a), ("HTTP + SSE (client in another process)", h),
                         ("HTTP requests as the engine saw them", e)):
            tok_s = "-" if math.isnan(r["tok_s"]) else f"{r['tok_s']:.0f}"
            rows.append(f"| {c} | {label} | {ms(r['ttft_p50'])} | {ms(r['ttft_p99'])} | {ms(r['tpot_p50'])} | "
                        f"{ms(r['tpot_p99'])} | {tok_s} | {r['n']} |")
    table = "\n".join(rows)
    cost = "\n".join(
        f"- {c} stream(s): HTTP adds {ms(h['ttft_p50'] - a['ttft_p50'])} ms to TTFT p50 "
        f"({ms(h['ttft_p50'] - e['ttft_p50'])} ms of it outside the engine: loopback, HTTP and JSON parsing, "
        f"validation, SSE framing) and {ms(h['tpot_p50'] - a['tpot_p50'])} ms to TPOT p50; throughput "
        f"{h['tok_s'] / a['tok_s']:.2f}x of in-process."
        for c, a, h, e in results)
    cmd = "python launch/bench_http.py" + "".join(f" {a}" for a in sys.argv[1:] if a != "--no-write")
    text = (
        f"{SECTION}\n\n"
        f"Command: `{cmd}`\n"
        f"Machine: {machine()} (engine torch threads: {args.threads}; the CPU was shared with other jobs, "
        f"so absolute times are upper bounds; both paths ran interleaved in the same run).\n\n"
        f"Model: {model_label}; prompts of {args.prompt_len} random token ids, {args.max_tokens} new tokens each, "
        f"greedy, EOS ignored; speculation off. Both paths share one engine (executor: local); the HTTP client "
        f"is httpx in a separate process streaming `POST /v1/completions`, timed at the SSE chunks it receives; "
        f"the in-process path is `AsyncEngine.submit` + `stream` on the server's event loop.\n\n"
        f"{table}\n\n{cost}\n"
        f"- \"as the engine saw them\": the engine's own TTFT (arrival at the engine -> first token) and TPOT for "
        f"the same HTTP requests.\n"
        f"- the client process, the server's event loop (JSON, SSE) and the engine's step thread share the "
        f"machine's {os.cpu_count()} cores here, so part of the HTTP cost under load is CPU contention that clients "
        f"on other machines would not add.\n"
        f"- total benchmark time: {time.time() - t_start:.0f} s.\n"
    )
    print(text)
    if not args.no_write:
        write_section(text, ROOT / "BENCHMARKS.md")
        print(f"wrote the section to {ROOT / 'BENCHMARKS.md'}")


if __name__ == "__main__":
    main()
