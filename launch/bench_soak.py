"""Soak test of the HTTP edge: many clients, mixed traffic, clients that vanish, hostile input.

    python launch/bench_soak.py [CONFIG] [--executor local|ray] [--requests 2000] [--concurrency 64]
                                [--max-body-mb 8] [--out runs/soak/soak.json] [--max-seconds 1800]

Starts `dspark serve CONFIG` (the bundled configs/tiny.yaml by default) in a subprocess on
127.0.0.1 with an API key, then sends `--requests` requests from `--concurrency` concurrent
clients (one httpx.AsyncClient). The mix, drawn from a seeded RNG:
- ordinary requests (~80%): /v1/completions and /v1/chat/completions, streamed and not, greedy and
  seeded sampling, n = 1 or 2;
- hostile ones (~20%), each with the answer it must get: seed 2**63, top_k 2**63, seed 2**63 - 1
  with n = 2, stop_token_ids beyond int64, NaN temperature, a lone surrogate, 100,000-deep nesting,
  a 5000-digit integer, a body over the limit (with Content-Length and chunked), bad JSON, a wrong
  model, a missing API key, a prompt over the context length, top_k over the vocabulary;
- a third of all requests disconnect at a random moment (a random delay, or for streams after a
  random number of chunks).
Counts answers by status code (goal: no 5xx, no error event inside a stream, no unexpected code),
and records the server's RSS (its process tree) and the KV blocks in use (`dspark_kv_blocks_used`
from /metrics): idle before the load, peak during it, and at the end after the server settles
(all requests finished, so KV use should be back to its idle value). Prints a table and writes
the numbers as JSON to --out. Exit status 1 if any 5xx, stream error, unexpected answer or leak.
Loopback only; every loop is bounded in count and in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

API_KEY = "soak-key"
MODEL = "soak"
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly "
         "vexing sphinx of black quartz judge my vow and pack my box with five dozen liquor jugs").split()
I64 = 2**63 - 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# the server under test
# ---------------------------------------------------------------------------------------------


class Server:
    """`dspark serve` in a subprocess on loopback; its log goes to a file."""

    def __init__(self, config: str, executor: str, port: int, max_body_mb: float, log_path: Path):
        self.port, self.url, self.log_path = port, f"http://127.0.0.1:{port}", log_path
        cmd = [sys.executable, str(ROOT / "launch" / "serve.py"), config, "--host", "127.0.0.1", "--port", str(port),
               "--api-key", API_KEY, "--served-model-name", MODEL, "--max-body-mb", str(max_body_mb),
               "--log-level", "warning", "--set", f"parallel.executor={executor}"]
        self.log = open(log_path, "w")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                     start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the server did not come up in {timeout:.0f} s; see {self.log_path}")

    def rss_bytes(self) -> int:
        """RSS of the server process and its children (Ray workers started by it, if any)."""
        try:
            import psutil

            p = psutil.Process(self.proc.pid)
            procs = [p, *p.children(recursive=True)]
            total = 0
            for q in procs:
                try:
                    total += q.memory_info().rss
                except psutil.Error:
                    pass
            return total
        except ImportError:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except Exception:  # noqa: BLE001 -- the process is gone
            return 0
        return 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn shuts down, the engine with it
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # this process only (we started it)
                self.proc.wait(timeout=10)
        self.log.close()


# ---------------------------------------------------------------------------------------------
# the requests
# ---------------------------------------------------------------------------------------------


def auth(key: str = API_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def text_prompt(rng: random.Random, lo: int = 4, hi: int = 40) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def raw(obj_text: str) -> bytes:
    return obj_text.encode()


def ordinary(rng: random.Random) -> dict:
    """A normal request: its kind, path, JSON body, whether streamed."""
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    body: dict = {"model": MODEL, "max_tokens": rng.randint(1, 32), "stream": stream}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=1.0, seed=rng.randint(0, 2**40), top_p=0.9, top_k=rng.choice([0, 20]))
    if rng.random() < 0.15:
        body["n"] = 2
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": text_prompt(rng)}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = text_prompt(rng)
        path = "/v1/completions"
    kind = f"{'chat' if chat else 'completion'}-{'stream' if stream else 'full'}"
    return {"kind": kind, "path": path, "json": body, "stream": stream, "expect": {200}}


def hostile(rng: random.Random, max_body: int) -> dict:
    """An edge case and the status codes it must get."""
    base = {"model": MODEL, "prompt": text_prompt(rng, 2, 6), "max_tokens": 4}
    cases = {
        "seed-2^63": lambda: {"json": {**base, "seed": 2**63}},
        "top_k-2^63": lambda: {"json": {**base, "top_k": 2**63}},
        "seed-max-n2": lambda: {"json": {**base, "seed": I64, "n": 2}},
        "stop_token_ids-2^63": lambda: {"json": {**base, "stop_token_ids": [2**63]}},
        "nan-temperature": lambda: {"content": raw(f'{{"model": "{MODEL}", "prompt": "hi", "temperature": NaN}}')},
        "lone-surrogate": lambda: {"content": raw(f'{{"model": "{MODEL}", "prompt": "a\\ud800b"}}')},
        "deep-nesting": lambda: {"content": b'{"model": "soak", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"},
        "5000-digit-int": lambda: {"content": raw(f'{{"model": "{MODEL}", "prompt": [{"7" * 5000}]}}')},
        # bodies over the limit are made when sent (not held for the whole run)
        "oversized-content-length": lambda: {"oversized": max_body + 2, "expect": {413}},
        "oversized-chunked": lambda: {"oversized": max_body + 2, "chunked": True, "expect": {413}},
        "bad-json": lambda: {"content": b'{"model": "soak", "prompt": '},
        "wrong-model": lambda: {"json": {**base, "model": "gpt-4"}},
        "missing-auth": lambda: {"json": base, "headers": {}, "expect": {401}},
        "wrong-key": lambda: {"json": base, "headers": auth("nope"), "expect": {401}},
        "prompt-too-long": lambda: {"json": {**base, "prompt": " ".join(["hello"] * 5000)}},
        # the engine refuses top_k over the vocabulary (400); an older engine clamps it (200)
        "top_k-over-vocab": lambda: {"json": {**base, "top_k": 10**9}, "expect": {200, 400}},
    }
    kind = rng.choice(sorted(cases))
    spec = {"kind": kind, "path": "/v1/completions", "stream": False, "expect": {400}, **cases[kind]()}
    if kind in ("seed-2^63", "lone-surrogate") and rng.random() < 0.5:  # the chat route too
        spec["path"] = "/v1/chat/completions"
        if "json" in spec:
            spec["json"] = {**{k: v for k, v in spec["json"].items() if k != "prompt"},
                            "messages": [{"role": "user", "content": "hi"}]}
        else:
            spec["content"] = raw(f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "a\\ud800b"}}]}}')
    return spec


async def send(http, spec: dict, disconnect: dict | None, timeout: float) -> dict:
    """One request -> {"status", "outcome", ...}. outcome: "ok" (answered), "disconnected" (we left
    on purpose), "timeout", "stream_error" (an error event inside a 200 stream), "error:<Type>"."""
    import httpx

    headers = spec.get("headers", auth())
    kw = {"headers": headers}
    if "json" in spec:
        kw["json"] = spec["json"]
    elif "content" in spec:
        kw["content"] = spec["content"]
        kw["headers"] = {**headers, "Content-Type": "application/json"}
    elif spec.get("chunked"):  # no Content-Length: the server must count while it reads
        async def chunks(size=spec["oversized"]):
            for i in range(0, size, 65536):
                yield b" " * min(65536, size - i)

        kw["content"] = chunks()
    else:
        kw["content"] = b"{" + b" " * (spec["oversized"] - 2) + b"}"
    res = {"status": None, "outcome": "ok"}
    delay = disconnect.get("delay") if disconnect else None
    max_chunks = disconnect.get("chunks") if disconnect else None
    t0 = time.monotonic()

    async def go():
        async with http.stream("POST", spec["path"], **kw) as r:
            res["status"] = r.status_code
            if not spec["stream"] or r.status_code != 200:
                await r.aread()
                if r.status_code >= 500:
                    res["body"] = r.text[:300]
                return
            chunks, done = 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res["outcome"], res["body"] = "stream_error", line[:300]
                    return
                chunks += 1
                if max_chunks is not None and chunks >= max_chunks:
                    res["outcome"] = "disconnected"
                    return  # leaving the block closes the connection mid-stream
            if not done:
                res["outcome"] = "stream_error"
                res["body"] = "the stream ended without [DONE]"

    try:
        limit = min(delay, timeout) if delay is not None else timeout
        await asyncio.wait_for(go(), timeout=limit)
    except (asyncio.TimeoutError, TimeoutError):
        res["outcome"] = "disconnected" if delay is not None and delay < timeout else "timeout"
    except httpx.HTTPError as e:
        res["outcome"] = f"error:{type(e).__name__}"
    res["latency_s"] = time.monotonic() - t0
    return res


# ---------------------------------------------------------------------------------------------
# metrics of the server
# ---------------------------------------------------------------------------------------------


def parse_metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


async def server_numbers(http, server: Server) -> dict:
    r = await http.get("/metrics", timeout=10)
    return {"kv_blocks_used": parse_metric(r.text, "dspark_kv_blocks_used"),
            "kv_blocks_total": parse_metric(r.text, "dspark_kv_blocks_total"),
            "running": parse_metric(r.text, "dspark_num_requests_running"),
            "waiting": parse_metric(r.text, "dspark_num_requests_waiting"),
            "streams_open": parse_metric(r.text, "dspark_http_streams_open"),
            "rss_bytes": server.rss_bytes()}


async def soak(server: Server, args) -> dict:
    import httpx

    rng = random.Random(args.seed)
    max_body = int(args.max_body_mb * 2**20)
    specs, disconnects = [], []
    for _ in range(args.requests):  # everything drawn up front: the run is reproducible
        spec = hostile(rng, max_body) if rng.random() < args.hostile_fraction else ordinary(rng)
        specs.append(spec)
        if rng.random() < args.disconnect_fraction:
            if spec["stream"] and rng.random() < 0.5:
                disconnects.append({"chunks": rng.randint(1, 6)})
            else:
                disconnects.append({"delay": rng.uniform(0.0, 1.5)})
        else:
            disconnects.append(None)

    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=args.request_timeout) as http:
        idle = await server_numbers(http, server)
        peak = dict(idle)
        results: list = [None] * len(specs)
        next_index = 0
        deadline = time.monotonic() + args.max_seconds
        stop_sampling = asyncio.Event()

        async def sampler():
            while not stop_sampling.is_set():
                try:
                    now = await server_numbers(http, server)
                    for k in ("kv_blocks_used", "rss_bytes", "running", "waiting", "streams_open"):
                        if now[k] is not None and (peak[k] is None or now[k] > peak[k]):
                            peak[k] = now[k]
                except httpx.HTTPError:
                    pass
                try:
                    await asyncio.wait_for(stop_sampling.wait(), timeout=args.sample_interval)
                except asyncio.TimeoutError:
                    pass

        async def worker():
            nonlocal next_index
            while next_index < len(specs) and time.monotonic() < deadline:
                i = next_index
                next_index += 1
                results[i] = await send(http, specs[i], disconnects[i], args.request_timeout)
                done = sum(r is not None for r in results)
                if args.progress and done % max(1, len(specs) // 10) == 0:
                    print(f"  {done}/{len(specs)} requests", flush=True)

        t0 = time.monotonic()
        sampling = asyncio.ensure_future(sampler())
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        duration = time.monotonic() - t0
        stop_sampling.set()
        await sampling

        # settle: every request finished or aborted, KV back to idle (bounded wait)
        settle_deadline = time.monotonic() + args.settle_s
        while True:
            end = await server_numbers(http, server)
            if (end["kv_blocks_used"] == idle["kv_blocks_used"] and not end["running"] and not end["waiting"]) \
                    or time.monotonic() > settle_deadline:
                break
            await asyncio.sleep(0.25)
        settle_s = args.settle_s - max(0.0, settle_deadline - time.monotonic())
        health = await http.get("/health", timeout=10)
        final = await http.post("/v1/completions", headers=auth(), timeout=60,
                                json={"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 4})

    return summarize(specs, disconnects, results, idle, peak, end, duration, settle_s, health, final)


def summarize(specs, disconnects, results, idle, peak, end, duration, settle_s, health, final) -> dict:
    by_kind: dict = defaultdict(Counter)
    status_counts: Counter = Counter()
    outcomes: Counter = Counter()
    unexpected, failures = Counter(), []
    latencies = []
    sent = 0
    for spec, disc, res in zip(specs, disconnects, results):
        if res is None:  # not sent: the time limit came first
            continue
        sent += 1
        code = res["status"]
        label = str(code) if code is not None else "none"
        status_counts[label] += 1
        outcomes[res["outcome"]] += 1
        by_kind[spec["kind"]][label if res["outcome"] == "ok" else f"{label}/{res['outcome']}"] += 1
        if res["outcome"] == "ok":
            latencies.append(res["latency_s"])
        bad = (code is not None and code >= 500) or res["outcome"] in ("stream_error", "timeout") \
            or res["outcome"].startswith("error:")
        # a request we left early may have no status; one that answered must answer as expected
        if code is not None and code not in spec["expect"] and not (code >= 500):
            unexpected[f"{spec['kind']}:{code}"] += 1
            bad = True
        if bad and len(failures) < 20:
            failures.append({"kind": spec["kind"], "status": code, "outcome": res["outcome"],
                             "body": res.get("body"), "disconnect": disc})
    five_xx = sum(n for s, n in status_counts.items() if s.isdigit() and int(s) >= 500)
    latencies.sort()

    def pct(q):
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else None

    mib = lambda b: None if b is None else round(b / 2**20, 1)  # noqa: E731
    return {
        "requests_planned": len(specs), "requests_sent": sent, "duration_s": round(duration, 2),
        "requests_per_s": round(sent / duration, 1) if duration else None,
        "status_codes": dict(sorted(status_counts.items())), "outcomes": dict(sorted(outcomes.items())),
        "five_xx": five_xx, "stream_errors": outcomes.get("stream_error", 0), "timeouts": outcomes.get("timeout", 0),
        "client_errors": sum(n for o, n in outcomes.items() if o.startswith("error:")),
        "unexpected": dict(unexpected), "failures": failures,
        "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
        "latency_s": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": latencies[-1] if latencies else None},
        "rss_mib": {"idle": mib(idle["rss_bytes"]), "peak": mib(peak["rss_bytes"]), "end": mib(end["rss_bytes"])},
        "kv_blocks_used": {"idle": idle["kv_blocks_used"], "peak": peak["kv_blocks_used"],
                           "end": end["kv_blocks_used"], "total": idle["kv_blocks_total"]},
        "end_state": {"running": end["running"], "waiting": end["waiting"], "streams_open": end["streams_open"],
                      "settle_s": round(settle_s, 2)},
        "peak_running": peak["running"], "peak_waiting": peak["waiting"],
        "health_after": health.status_code, "request_after": final.status_code,
    }


def table(report: dict) -> str:
    lines = [f"requests: {report['requests_sent']}/{report['requests_planned']} in {report['duration_s']} s "
             f"({report['requests_per_s']} req/s)",
             "status codes: " + ", ".join(f"{k}: {v}" for k, v in report["status_codes"].items()),
             "outcomes: " + ", ".join(f"{k}: {v}" for k, v in report["outcomes"].items()),
             f"5xx: {report['five_xx']}   stream errors: {report['stream_errors']}   timeouts: {report['timeouts']}   "
             f"client errors: {report['client_errors']}   unexpected codes: {sum(report['unexpected'].values())}",
             "", f"{'kind':<28} answers"]
    for kind, counts in report["by_kind"].items():
        lines.append(f"{kind:<28} " + ", ".join(f"{k}: {v}" for k, v in counts.items()))
    r, kv = report["rss_mib"], report["kv_blocks_used"]
    lat = report["latency_s"]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    lines += ["", f"{'':<16}{'idle':>10}{'peak':>10}{'end':>10}",
              f"{'server RSS MiB':<16}{r['idle']:>10}{r['peak']:>10}{r['end']:>10}",
              f"{'KV blocks used':<16}{kv['idle']:>10g}{kv['peak']:>10g}{kv['end']:>10g}   (of {kv['total']:g})",
              f"answered latency s: p50 {fmt(lat['p50'])}  p90 {fmt(lat['p90'])}  p99 {fmt(lat['p99'])}  "
              f"max {fmt(lat['max'])}",
              f"after the load: /health {report['health_after']}, a request {report['request_after']}, "
              f"settled in {report['end_state']['settle_s']} s "
              f"(running {report['end_state']['running']:g}, waiting {report['end_state']['waiting']:g}, "
              f"streams open {report['end_state']['streams_open']:g})"]
    for f in report["failures"][:10]:
        lines.append(f"  failure: {f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default=str(ROOT / "configs" / "tiny.yaml"))
    ap.add_argument("--executor", choices=["local", "ray"], default="local")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--hostile-fraction", type=float, default=0.2)
    ap.add_argument("--disconnect-fraction", type=float, default=1 / 3)
    ap.add_argument("--max-body-mb", type=float, default=8.0, help="the server's body limit (default 8)")
    ap.add_argument("--port", type=int, default=0, help="loopback port (default: a free one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--max-seconds", type=float, default=1800.0, help="stop sending new requests after this")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--settle-s", type=float, default=30.0, help="how long to wait for KV to drain at the end")
    ap.add_argument("--sample-interval", type=float, default=0.25)
    ap.add_argument("--out", default=str(ROOT / "runs" / "soak" / "soak.json"))
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the load this many times on one server (memory growth between rounds)")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    args = ap.parse_args()
    if args.requests < 1 or args.concurrency < 1:
        ap.error("--requests and --concurrency must be at least 1")
    if not args.max_body_mb > 0:
        ap.error("--max-body-mb must be positive (the oversized cases need a limit)")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = Path(tempfile.mkdtemp(prefix="dspark-soak-")) / "server.log"
    port = args.port or free_port()
    print(f"soak: dspark serve {args.config} ({args.executor}) on 127.0.0.1:{port}; log {log_path}", flush=True)
    t_start = time.monotonic()
    server = Server(args.config, args.executor, port, args.max_body_mb, log_path)
    try:
        server.wait_ready(args.startup_timeout)
        print(f"server up in {time.monotonic() - t_start:.1f} s; {args.requests} requests, "
              f"{args.concurrency} clients", flush=True)
        rounds = []
        for r in range(args.rounds):  # the same server, fresh traffic: does memory keep growing?
            rounds.append(asyncio.run(soak(server, argparse.Namespace(**{**vars(args), "seed": args.seed + r}))))
            if args.rounds > 1:
                print(f"round {r + 1}/{args.rounds}: RSS end {rounds[-1]['rss_mib']['end']:.1f} MiB, "
                      f"KV end {rounds[-1]['kv_blocks_used']['end']}, 5xx {rounds[-1]['five_xx']}", flush=True)
        report = rounds[-1]
        report["rounds"] = [{k: r[k] for k in ("rss_mib", "kv_blocks_used", "five_xx", "stream_errors", "requests_sent")}
                            for r in rounds]
        for key in ("five_xx", "stream_errors", "timeouts", "client_errors"):
            report[key] = sum(r[key] for r in rounds)
        report["unexpected"] = {f"round {i + 1}: {k}": v for i, r in enumerate(rounds) for k, v in r["unexpected"].items()}
    finally:
        server.stop()
    log_text = log_path.read_text(errors="replace")
    report.update({
        "config": args.config, "executor": args.executor, "concurrency": args.concurrency, "seed": args.seed,
        "max_body_mb": args.max_body_mb, "server_log": str(log_path),
        "server_log_tracebacks": log_text.count("Traceback (most recent call last)"),
        "server_exit_code": server.proc.returncode,
    })
    print(table(report))
    print(f"server log: {log_path} ({report['server_log_tracebacks']} tracebacks)")
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    leak = report["kv_blocks_used"]["end"] != report["kv_blocks_used"]["idle"]
    bad = (report["five_xx"] or report["stream_errors"] or report["timeouts"] or report["client_errors"]
           or report["unexpected"] or leak or report["health_after"] != 200 or report["request_after"] != 200)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
