"""The OpenAI-compatible server (issue 8), exercised with the official `openai` client against a
real uvicorn server on loopback: streaming, usage, stop / seed / n, auth, bad input, disconnects,
32 concurrent streams, and serving through the Router actor. Hardening at the edge: numbers the
engine cannot represent, lone surrogates, deep nesting and oversized bodies are refused; /health
answers while a big prompt is tokenised and is 503 when the engine is not ok; errors never show a
client the internals."""

import asyncio
import json
import logging
import shutil
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from dspark_cluster import load_config
from dspark_cluster.client import EngineClient
from dspark_cluster.server import build_app

KEY = "test-key-123"
MODEL = "tiny-moe-test"
MAX_MODEL_LEN = 256
BODY_LIMIT = 4 * 2**20  # the served app's max_body_bytes
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_tokenizer(src, dst, chat_template=CHAT_TEMPLATE):
    """Copy a tiny checkpoint and give it a word-level tokenizer (w0..w154 and the chat roles)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(src, dst)
    words = ["<s>", "</s>", "system", "user", "assistant"] + [f"w{i}" for i in range(155)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            chat_template=chat_template).save_pretrained(str(dst))
    return dst


class ServerThread:
    """uvicorn in a background thread, on a free loopback port."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def start(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            assert self.thread.is_alive(), "the server thread died"
            time.sleep(0.05)
        return self

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=20)
        assert not self.thread.is_alive(), "the server did not stop"


def metric(url: str, name: str) -> float:
    """One unlabelled sample from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_kv_free(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        used, running = metric(url, "dspark_kv_blocks_used"), metric(url, "dspark_num_requests_running")
        if used == 0 and running == 0:
            return
        assert time.monotonic() < deadline, f"KV not freed: {used} blocks used, {running} running"
        time.sleep(0.05)


def auth(key=KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


class Served:
    def __init__(self, url, client):
        self.url, self.client = url, client
        self.openai = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)

    def post(self, path, body=None, content=None, headers=None, timeout=60):
        return httpx.post(f"{self.url}{path}", json=body, content=content,
                          headers=auth() if headers is None else headers, timeout=timeout)


@pytest.fixture(scope="module")
def chat_checkpoint(checkpoint, tmp_path_factory):
    return add_tokenizer(checkpoint("qwen3_moe"), tmp_path_factory.mktemp("served") / "tiny-moe-test")


@pytest.fixture(scope="module")
def served(chat_checkpoint):
    cfg = load_config({
        "model": {"path": str(chat_checkpoint)},
        "parallel": {"executor": "local", "threads_per_worker": 1},
        "scheduler": {"block_size": 4, "num_kv_blocks": 1024, "max_num_seqs": 64, "max_model_len": MAX_MODEL_LEN},
    })
    client = EngineClient.start(cfg)
    assert client.kind == "local" and client.max_model_len == MAX_MODEL_LEN
    server = ServerThread(build_app(client, MODEL, api_key=KEY, max_body_bytes=BODY_LIMIT)).start()
    try:
        yield Served(server.url, client)
    finally:
        server.stop()
        client.shutdown()


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_models_health_metrics(served):
    assert [m.id for m in served.openai.models.list().data] == [MODEL]
    assert served.openai.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{served.url}/health").status_code == 200  # open without the key
    r = httpx.get(f"{served.url}/metrics")
    assert r.status_code == 200 and "text/plain" in r.headers["content-type"]
    for name in ("dspark_http_time_to_first_token_seconds", "dspark_http_time_per_output_token_seconds",
                 "dspark_http_requests_total", "dspark_kv_blocks_used", "dspark_num_requests_running",
                 "dspark_num_requests_waiting", "dspark_device_seconds", "dspark_memory_held_bytes"):
        assert name in r.text
    assert metric(served.url, "dspark_kv_blocks_total") == 1024
    assert metric(served.url, "dspark_cost") > 0  # the live cost ledger (prices from the config's defaults)


def test_completions_usage_and_streaming(served):
    oa = served.openai
    full = oa.completions.create(model=MODEL, prompt="w5 w17 w3", max_tokens=12, **GREEDY)
    assert full.object == "text_completion" and len(full.choices) == 1
    assert full.choices[0].finish_reason == "length" and full.choices[0].text
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (3, 12, 15)

    stream = oa.completions.create(model=MODEL, prompt="w5 w17 w3", max_tokens=12, stream=True,
                                   stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == 3
    assert len([c for c in chunks if c.choices]) >= 2  # really streamed, not one blob

    # token-id prompts, and speculation switched off per request: the same greedy text
    ids = served.client.tokenizer("w5 w17 w3")["input_ids"]
    same = oa.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True, "speculative": False})
    assert same.choices[0].text == full.choices[0].text

    # the raw wire format: SSE data lines ending with [DONE]
    with httpx.stream("POST", f"{served.url}/v1/completions", headers=auth(), timeout=30,
                      json={"model": MODEL, "prompt": "w5 w17 w3", "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_chat_streaming_and_usage(served):
    oa = served.openai
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w9 w8 w7"}]
    tok = served.client.tokenizer
    prompt_ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]
    full = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    assert full.object == "chat.completion"
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content and full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(prompt_ids), 10)

    chunks = list(oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True,
                                             stream_options={"include_usage": True}, **GREEDY))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == len(prompt_ids) + 10

    # content as a list of text parts is the same message; no max_tokens runs to max_model_len
    parts = [{"role": "system", "content": "w1 w2"},
             {"role": "user", "content": [{"type": "text", "text": "w9 w8"}, {"type": "text", "text": " w7"}]}]
    again = oa.chat.completions.create(model=MODEL, messages=parts, max_tokens=10, **GREEDY)
    assert again.choices[0].message.content == msg.content
    long = oa.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert long.usage.total_tokens == MAX_MODEL_LEN and long.choices[0].finish_reason == "length"


def test_stop_seed_n(served):
    oa = served.openai
    ref = oa.completions.create(model=MODEL, prompt="w11 w12", max_tokens=20, **GREEDY).choices[0].text
    words = ref.split()
    stop = words[len(words) // 2]
    expected = ref[: ref.find(stop)]
    for stream in (False, True):
        r = oa.completions.create(model=MODEL, prompt="w11 w12", max_tokens=20, stop=[stop, "never-appears"],
                                  stream=stream, **GREEDY)
        if stream:
            chunks = [c for c in r if c.choices]
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (text, reason) == (expected, "stop")
    wait_kv_free(served.url)  # the stopped request was aborted, not left running

    # n with a seed: n distinct samples, reproducible; seed + i per choice
    kw = dict(model=MODEL, prompt="w3 w4", max_tokens=12, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    a, b = oa.completions.create(**kw), oa.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    assert a.usage.completion_tokens == 36 and a.usage.prompt_tokens == 2
    one = oa.completions.create(**{**kw, "n": 1, "seed": 8})
    assert one.choices[0].text == a.choices[1].text
    # streamed n: every choice index finishes once
    chunks = list(oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w3"}], n=2,
                                             max_tokens=6, stream=True, temperature=1.0, seed=3,
                                             extra_body={"ignore_eos": True}))
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]


def test_auth(served):
    r = httpx.get(f"{served.url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = served.post("/v1/completions", {"model": MODEL, "prompt": "w1"}, headers={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    wrong = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=MODEL, prompt="w1", max_tokens=2)
    assert e.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}], stream=True)
    assert httpx.get(f"{served.url}/v1/models", headers={"Authorization": KEY}).status_code == 401  # no "Bearer"
    assert httpx.get(f"{served.url}/metrics").status_code == 200


def _assert_400(r, param=None, code=None):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def test_bad_input_gets_400_and_disturbs_nothing(served):
    oa = served.openai
    # a long request runs while the bad ones come in; it must finish untouched
    with httpx.stream("POST", f"{served.url}/v1/completions", headers=auth(), timeout=60,
                      json={"model": MODEL, "prompt": "w40 w41", "max_tokens": 200, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0,
                            "ignore_eos": True}) as bystander:
        lines = bystander.iter_lines()
        first = next(line for line in lines if line)

        _assert_400(served.post("/v1/completions", content=b'{"model": "x", "prompt": '), code="invalid_json")
        _assert_400(served.post("/v1/chat/completions", content=b"not json at all"), code="invalid_json")
        _assert_400(served.post("/v1/completions", content=b"[1, 2]"))
        with pytest.raises(openai.NotFoundError) as e:  # as OpenAI: an unknown model is a 404
            oa.completions.create(model="no-such-model", prompt="w1")
        assert e.value.status_code == 404 and e.value.code == "model_not_found"
        with pytest.raises(openai.NotFoundError):
            oa.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "w1"}], stream=True)
        for bad in (0, -3):
            with pytest.raises(openai.BadRequestError) as e:
                oa.completions.create(model=MODEL, prompt="w1", max_tokens=bad)
            assert e.value.body["param"] == "max_tokens"
        too_long = " ".join(f"w{i % 150}" for i in range(MAX_MODEL_LEN + 10))
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(model=MODEL, prompt=too_long, max_tokens=4)
        assert e.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": too_long}], stream=True)
        assert e.value.code == "context_length_exceeded"
        _assert_400(served.post("/v1/completions", {"model": MODEL, "prompt": [7] * MAX_MODEL_LEN}), param="prompt")
        # wrong types
        _assert_400(served.post("/v1/completions", {"model": MODEL, "prompt": "w1", "temperature": "hot"}),
                    param="temperature")
        _assert_400(served.post("/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": "9"}),
                    param="max_tokens")
        _assert_400(served.post("/v1/completions", {"model": MODEL, "prompt": 42}), param="prompt")
        _assert_400(served.post("/v1/completions", {"model": MODEL, "prompt": "w1", "stream": "yes"}), param="stream")
        _assert_400(served.post("/v1/completions", {"model": MODEL, "prompt": "w1", "speculative": "no"}),
                    param="speculative")
        _assert_400(served.post("/v1/chat/completions", {"model": MODEL, "messages": "w1"}), param="messages")
        _assert_400(served.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "w1"}]}),
                    param="messages.0.role")
        _assert_400(served.post("/v1/chat/completions", {"model": MODEL, "messages": []}), param="messages")
        _assert_400(served.post("/v1/completions", {"prompt": "w1"}), param="model")
        # values the engine refuses, and what is not supported
        _assert_400(served.post("/v1/completions", {"model": MODEL, "prompt": [99999]}))
        _assert_400(served.post("/v1/completions", {"model": MODEL, "prompt": "w1", "top_p": 0}), param="top_p")
        _assert_400(served.post("/v1/completions", {"model": MODEL, "prompt": "w1", "logprobs": 21}), param="logprobs")
        _assert_400(served.post("/v1/completions", {"model": MODEL, "prompt": ""}), param="prompt")
        _assert_400(served.post("/v1/completions", {"model": MODEL, "prompt": "w1", "logit_bias": {"5": 10}}),
                    param="logit_bias", code="unsupported_parameter")
        with pytest.raises(openai.BadRequestError):  # top_logprobs without logprobs
            oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}], top_logprobs=2)
        nowhere = httpx.get(f"{served.url}/v1/nowhere", headers=auth())
        assert nowhere.status_code == 404 and set(nowhere.json()["error"]) == {"message", "type", "param", "code"}
        assert nowhere.json()["error"]["code"] == "not_found"

        rest = [json.loads(line[6:]) for line in lines if line and line != "data: [DONE]"]
    chunks = [json.loads(first[6:])] + rest
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    wait_kv_free(served.url)


def test_chat_without_template_is_400(checkpoint, tmp_path):
    """A tokenizer without a chat template: chat is refused with a clear 400, completions work."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    plain = add_tokenizer(checkpoint("qwen3_moe"), tmp_path / "plain", chat_template=None)
    tok = AutoTokenizer.from_pretrained(str(plain))
    assert not tok.chat_template

    class NoTemplate:  # the serving engine, seen through a tokenizer without a template
        tokenizer, max_model_len, model_path = tok, MAX_MODEL_LEN, str(plain)

        async def stats(self):
            return {}

    with TestClient(build_app(NoTemplate(), MODEL)) as tc:
        r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "w1"}]})
        _assert_400(r, code="no_chat_template")


def test_disconnect_mid_stream_cancels_and_frees_kv(served):
    engine = served.client.engine
    body = {"model": MODEL, "prompt": "w20 w21 w22", "max_tokens": 240, "stream": True, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", headers=auth(), json=body, timeout=30) as r:
        got = []
        for line in r.iter_lines():
            if line:
                got.append(json.loads(line[6:]))
            if len(got) == 2:
                break
    rid = got[0]["id"]  # leaving the block closed the connection mid-stream
    deadline = time.monotonic() + 20
    while not any(m["request_id"] == rid for m in list(engine.finished)):
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.02)
    m = next(m for m in list(engine.finished) if m["request_id"] == rid)
    assert m["finish_reason"] == "abort" and m["num_output_tokens"] < 240
    wait_kv_free(served.url)

    # chat, n=2, disconnected right after the first content: both choices are aborted
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 240, "n": 2,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", headers=auth(), json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line and "content" in line and '"content":""' not in line:
                rid = json.loads(line[6:])["id"]
                break
    deadline = time.monotonic() + 20
    while sum(m["request_id"].startswith(rid) for m in list(engine.finished)) < 2:
        assert time.monotonic() < deadline, "the choices were not cancelled"
        time.sleep(0.02)
    assert all(m["finish_reason"] == "abort" for m in list(engine.finished) if m["request_id"].startswith(rid))
    wait_kv_free(served.url)

    # a non-streamed request whose client gives up is cancelled too (the finished log is bounded:
    # look for the new entries, not at its length)
    seen = {m["request_id"] for m in list(engine.finished)}
    with pytest.raises(httpx.ReadTimeout):
        served.post("/v1/completions", {"model": MODEL, "prompt": "w6", "max_tokens": 240, "n": 4, "ignore_eos": True},
                    timeout=httpx.Timeout(10, read=0.1))
    deadline = time.monotonic() + 20
    while len(new := [m for m in list(engine.finished) if m["request_id"] not in seen]) < 4:
        assert time.monotonic() < deadline, "the non-streamed request was not cancelled"
        time.sleep(0.02)
    assert [m["finish_reason"] for m in new] == ["abort"] * 4
    wait_kv_free(served.url)


def test_32_concurrent_streaming_clients(served):
    prompts = [f"w{i + 3} w{(7 * i) % 150 + 3} w{(13 * i) % 150 + 3}" for i in range(32)]
    batch = served.openai.completions.create(model=MODEL, prompt=prompts, max_tokens=16, **GREEDY)
    expected = {c.index: c.text for c in batch.choices}
    assert len(expected) == 32 and batch.usage.completion_tokens == 32 * 16

    async def run_all():
        aoa = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=60)

        async def one(i):
            if i % 2:  # half completions, half chat
                stream = await aoa.completions.create(model=MODEL, prompt=prompts[i], max_tokens=16, stream=True,
                                                      stream_options={"include_usage": True}, **GREEDY)
                parts, usage, reason = [], None, None
                async for c in stream:
                    if c.choices:
                        parts.append(c.choices[0].text)
                        reason = c.choices[0].finish_reason or reason
                    if c.usage:
                        usage = c.usage
                return "".join(parts), usage.completion_tokens, reason
            stream = await aoa.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompts[i]}], max_tokens=16, stream=True,
                stream_options={"include_usage": True}, **GREEDY)
            parts, usage, reason = [], None, None
            async for c in stream:
                if c.choices:
                    parts.append(c.choices[0].delta.content or "")
                    reason = c.choices[0].finish_reason or reason
                if c.usage:
                    usage = c.usage
            return "".join(parts), usage.completion_tokens, reason

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), timeout=120)
        finally:
            await aoa.close()

    results = asyncio.run(run_all())
    assert all(r[1] == 16 and r[2] == "length" and r[0] for r in results)
    for i in range(1, 32, 2):
        assert results[i][0] == expected[i]
    chat_ref = served.openai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompts[0]}],
                                                     max_tokens=16, **GREEDY)
    assert results[0][0] == chat_ref.choices[0].message.content
    wait_kv_free(served.url)
    assert metric(served.url, "dspark_http_time_to_first_token_seconds_count") >= 32


# ---- hardening at the edge ---------------------------------------------------------------------


def _still_serving(served):
    """A normal request right after a bad one: the engine did not stop."""
    r = served.post("/v1/completions", {"model": MODEL, "prompt": "w5 w6", "max_tokens": 2, "temperature": 0,
                                        "ignore_eos": True}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{served.url}/health", timeout=10).json()["status"] == "ok"


def test_numbers_the_engine_cannot_represent_get_400(served):
    """seed / top_k / stop_token_ids beyond int64, seed + i overflowing for n choices, huge
    max_tokens, non-finite floats: a 400 naming the field, and the engine keeps serving."""
    i64 = 2**63 - 1
    cases = [
        ({"seed": 2**63}, "seed"),
        ({"seed": i64, "n": 2}, "seed"),  # choice 1 would sample with seed 2**63
        ({"seed": i64 - 2, "n": 4}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 2**64 + 5}, "top_k"),
        ({"stop_token_ids": [3, 2**63]}, "stop_token_ids.1"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"max_tokens": 2**31 + 1}, "max_tokens"),
        ({"seed": -1}, "seed"),
    ]
    for extra, param in cases:
        for path, body in (("/v1/completions", {"model": MODEL, "prompt": "w1 w2", "max_tokens": 2}),
                           ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w1"}],
                                                     "max_tokens": 2})):
            if path.endswith("chat/completions") and param == "max_tokens":
                extra = {"max_completion_tokens": 2**31 + 1}
                param = "max_completion_tokens"
            for stream in (False, True):
                _assert_400(served.post(path, {**body, **extra, "stream": stream}), param=param)
        _still_serving(served)
    # the edges themselves are fine: seed 2**63 - 1 for one choice, 2**63 - 2 for two
    for seed, n in ((i64, 1), (i64 - 1, 2)):
        r = served.post("/v1/completions", {"model": MODEL, "prompt": "w1 w2", "max_tokens": 3, "seed": seed, "n": n,
                                            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3 * n

    # NaN and Infinity are JSON to Python's parser; not to the engine
    for field, literal in (("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "NaN"),
                           ("presence_penalty", "-Infinity")):
        raw = f'{{"model": "{MODEL}", "prompt": "w1", "max_tokens": 2, "{field}": {literal}}}'.encode()
        _assert_400(served.post("/v1/completions", content=raw), param=field)
        _still_serving(served)
    # an integer literal too long for Python's int parser, inside the prompt's token ids
    raw = f'{{"model": "{MODEL}", "prompt": [{"9" * 5000}]}}'.encode()
    _assert_400(served.post("/v1/completions", content=raw), code="invalid_json")
    _assert_400(served.post("/v1/completions", {"model": MODEL, "prompt": [3, 2**64]}), param="prompt")
    _still_serving(served)


def test_lone_surrogates_and_deep_nesting_get_400(served):
    # "\ud800" is legal JSON but no UTF-8 text: refused, naming the field
    raw = f'{{"model": "{MODEL}", "prompt": "a\\ud800b", "max_tokens": 2}}'.encode()
    _assert_400(served.post("/v1/completions", content=raw), param="prompt", code="invalid_value")
    raw = f'{{"model": "{MODEL}", "prompt": ["w1", "w2\\udfff"], "max_tokens": 2}}'.encode()
    _assert_400(served.post("/v1/completions", content=raw), param="prompt.1")
    raw = (f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "w1"}}, '
           f'{{"role": "user", "content": [{{"type": "text", "text": "\\ud83d"}}]}}]}}').encode()
    _assert_400(served.post("/v1/chat/completions", content=raw), param="messages.1.content.0.text")
    raw = f'{{"model": "{MODEL}", "prompt": "w1", "max_tokens": 2, "user": "x", "k\\ud800": 1}}'.encode()
    _assert_400(served.post("/v1/completions", content=raw))
    # a valid surrogate pair is ordinary text
    raw = f'{{"model": "{MODEL}", "prompt": "w1 \\ud83d\\ude00", "max_tokens": 2, "ignore_eos": true}}'.encode()
    assert served.post("/v1/completions", content=raw).status_code == 200
    _still_serving(served)

    # 100,000 levels: Python's parser gives up (RecursionError) -> 400, not 500
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = b'{"model": "' + MODEL.encode() + b'", "prompt": ' + deep + b', "messages": ' + deep + b"}"
        _assert_400(served.post(path, content=body), code="invalid_json")
    _assert_400(served.post("/v1/completions", content=deep), code="invalid_json")
    # 65 levels parse, but more than 64 are refused before validation (in an ignored field, too)
    nested = "[" * 64 + "]" * 64
    raw = f'{{"model": "{MODEL}", "prompt": "w1", "max_tokens": 2, "metadata": {nested}}}'.encode()
    r = served.post("/v1/completions", content=raw)
    _assert_400(r, code="invalid_json")
    assert "64" in r.json()["error"]["message"]
    nested = "[" * 20 + "]" * 20
    raw = f'{{"model": "{MODEL}", "prompt": "w1", "max_tokens": 2, "metadata": {nested}}}'.encode()
    assert served.post("/v1/completions", content=raw).status_code == 200
    _still_serving(served)


def test_huge_lists_are_refused_without_listing_every_bad_item(served):
    """A list of a million bad items must not cost a pydantic error each (that took ~40 s): lists
    are capped at max(max_model_len, 4096) items, and past 20,000 problems only the first few
    are looked for."""
    r = served.post("/v1/completions", {"model": MODEL, "prompt": [0.5] * 600_000})
    _assert_400(r, param="prompt")
    assert "600000 items; at most 4096" in r.json()["error"]["message"]
    r = served.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot"}] * 5000})
    _assert_400(r, param="messages")
    r = served.post("/v1/completions", {"model": MODEL, "prompt": [[0.5] * 2000] * 200})  # 400,000+ problems
    _assert_400(r, param="prompt")
    assert r.json()["error"]["message"].startswith("400401 problems, among them: prompt")
    r = served.post("/v1/completions", {"model": MODEL, "prompt": [0.5] * 3000})  # 9,000: all listed, 4 shown
    _assert_400(r, param="prompt")
    assert "prompt.0: Input should be a valid string" in r.json()["error"]["message"]
    r = served.post("/v1/completions", {"model": MODEL, "prompt": [3] * 100_000})  # token ids: too long, at once
    _assert_400(r, param="prompt", code="context_length_exceeded")
    _still_serving(served)


def _assert_413(r):
    assert r.status_code == 413, r.text[:200]
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and str(BODY_LIMIT) in err["message"]
    assert r.headers["x-request-id"]


def test_oversized_bodies_get_413_before_parsing(served):
    prefix = f'{{"model": "{MODEL}", "prompt": "w1", "max_tokens": 2, "pad": "'.encode()
    over = prefix + b"x" * (BODY_LIMIT - len(prefix) - 1) + b'"}'  # valid JSON, one byte over
    assert len(over) == BODY_LIMIT + 1
    # with Content-Length: refused before a byte of the body is read
    _assert_413(served.post("/v1/completions", content=over))
    _assert_413(served.post("/v1/chat/completions", content=b"{" * (3 * BODY_LIMIT)))

    # chunked (no Content-Length): counted while read
    def chunked(data, size=65536):
        for i in range(0, len(data), size):
            yield data[i:i + size]

    r = served.post("/v1/completions", content=chunked(over))
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    _assert_413(r)
    _assert_413(served.post("/v1/chat/completions", content=chunked(b" " * (2 * BODY_LIMIT))))

    # at the limit it is an ordinary request, chunked or not
    at = over[:-3] + b'"}'
    assert len(at) == BODY_LIMIT
    for content in (at, chunked(at)):
        r = served.post("/v1/completions", content=content)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text[:200]
    text = httpx.get(f"{served.url}/metrics").text
    assert 'dspark_http_requests_total{endpoint="/v1/completions",status="413"} 2.0' in text
    _still_serving(served)


class _GatedTokenizer:
    """The served tokenizer, but a long text waits for `release` (at most 30 s) before it is
    tokenised: while it waits the server must keep answering."""

    def __init__(self, tok):
        self._tok = tok
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, text, *args, **kw):
        if isinstance(text, str) and len(text) > 20_000:
            self.entered.set()
            self.release.wait(timeout=30)
        return self._tok(text, *args, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_health_and_other_requests_answer_while_a_big_prompt_is_tokenised(served, monkeypatch):
    gated = _GatedTokenizer(served.client.tokenizer)
    monkeypatch.setattr(served.client, "tokenizer", gated)
    big = " ".join(f"w{i % 150}" for i in range(800_000))  # ~3.4 MB, under the body limit
    assert 3 * 2**20 < len(big) < BODY_LIMIT - 1000
    done, result = threading.Event(), {}

    def send_big():
        try:
            body = {"model": MODEL, "prompt": big, "max_tokens": 2}
            result["r"] = served.post("/v1/completions", body, timeout=60)
        finally:
            done.set()

    t = threading.Thread(target=send_big, daemon=True)
    t.start()
    try:
        assert gated.entered.wait(30), "the big prompt never reached the tokenizer"
        # the tokenizer is busy with the big prompt (held until released): the event loop is not
        r = httpx.get(f"{served.url}/health", timeout=5)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert httpx.get(f"{served.url}/metrics", timeout=5).status_code == 200
        small = served.post("/v1/completions", {"model": MODEL, "prompt": "w7 w8", "max_tokens": 3, "temperature": 0,
                                                "ignore_eos": True}, timeout=10)
        assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 3
        assert not done.is_set(), "the big request finished before /health answered"
    finally:
        gated.release.set()
        t.join(timeout=60)
    assert done.is_set()
    # and the big prompt gets its answer: far over the context length, found from its head alone
    _assert_400(result["r"], param="prompt", code="context_length_exceeded")
    assert "prompt: more than" in result["r"].json()["error"]["message"]


# -- stub engines: failures on demand --------------------------------------------------------------

SECRETS = ("ActorID(abc)", "pid=123", "10.0.0.1", "dspark-ns-secret", "Traceback")


def _Piece(ids, text, finished=False, finish_reason=None):
    from dspark_cluster.outputs import StreamPiece

    return StreamPiece("stub", ids, text, finished, finish_reason)


class StubClient:
    """The EngineClient surface build_app uses; fails the way it is told to."""

    def __init__(self, tokenizer, stats=None, submit_error=None, stream_error=None, pieces_before_error=1):
        self.tokenizer, self.max_model_len, self.model_path = tokenizer, MAX_MODEL_LEN, "stub"
        self._stats, self.submit_error, self.stream_error = stats, submit_error, stream_error
        self.pieces_before_error = pieces_before_error
        self.aborted, self.submitted = [], []  # submitted: the ids of each submit_many call

    async def submit_many(self, prompts, params, request_ids=None):
        if self.submit_error is not None:
            raise self.submit_error
        self.submitted.append(list(request_ids))
        return list(request_ids)

    async def stream(self, request_id):
        for _ in range(self.pieces_before_error):
            yield _Piece([5], " w5")
        if self.stream_error is not None:
            raise self.stream_error
        yield _Piece([6], " w6", True, "length")

    def abort(self, request_id):
        self.aborted.append(request_id)

    async def stats(self):
        if isinstance(self._stats, BaseException):
            raise self._stats
        if self._stats == "hang":
            await asyncio.sleep(60)
        return dict(self._stats or {})


def _no_secrets(text: str):
    for s in SECRETS:
        assert s not in text, f"{s!r} leaked to the client: {text[:300]}"


def test_errors_do_not_leak_internals(served, caplog):
    from fastapi.testclient import TestClient

    from dspark_cluster.errors import EngineError

    internal = RuntimeError("worker ActorID(abc) pid=123 ip=10.0.0.1 died; namespace dspark-ns-secret")
    body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 4}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 4}
    caplog.set_level(logging.WARNING, logger="dspark_cluster.server")
    for stub in (StubClient(served.client.tokenizer, stream_error=internal),
                 StubClient(served.client.tokenizer, submit_error=internal)):
        with TestClient(build_app(stub, MODEL), raise_server_exceptions=False) as tc:
            for path, b in (("/v1/completions", body), ("/v1/chat/completions", chat)):
                # not streamed: a 503 in OpenAI's shape whose message points at the log
                caplog.clear()
                r = tc.post(path, json=b)
                assert r.status_code == 503, r.text
                err = r.json()["error"]
                assert err["type"] == "server_error" and err["code"] == "engine_unavailable"
                rid = r.headers["x-request-id"]
                assert rid in err["message"] and "server log" in err["message"]
                _no_secrets(r.text)
                # ... and the log has the whole story, under the same request id
                logged = "\n".join(rec.getMessage() + str(rec.exc_info) for rec in caplog.records)
                assert rid in logged and "ActorID(abc)" in logged and "10.0.0.1" in logged
                # streamed: when the engine fails before any output, still a 503 with the safe message;
                # after output has started, an error event in the stream
                r = tc.post(path, json={**b, "stream": True})
                _no_secrets(r.text)
                if stub.submit_error is not None:
                    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
                else:
                    assert r.status_code == 200
                    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                    assert events[-1]["error"]["type"] == "server_error"
                    assert r.headers["x-request-id"] in events[-1]["error"]["message"]
                    assert "data: [DONE]" not in r.text
        if stub.stream_error is not None:
            assert stub.aborted  # the failed choices were aborted

    # an engine failure whose message is meant for clients is shown as it is
    restarting = EngineError("the engine is restarting after a worker failure; retry the request")
    with TestClient(build_app(StubClient(served.client.tokenizer, stream_error=restarting), MODEL)) as tc:
        r = tc.post("/v1/completions", json=body)
        assert r.status_code == 503 and "restarting after a worker failure" in r.json()["error"]["message"]
        r = tc.post("/v1/completions", json={**body, "stream": True})
        assert "restarting after a worker failure" in r.text

    # a bug anywhere else: a 500 naming the request id, not the exception
    class Broken:
        chat_template = "x"

        def __call__(self, *a, **k):
            raise ValueError("tokenizer state at 0x7f00 pid=123 ip=10.0.0.1")

        def apply_chat_template(self, *a, **k):
            raise KeyError("ActorID(abc)")  # a template refusal is the client's: 400, clipped

    with TestClient(build_app(StubClient(Broken()), MODEL), raise_server_exceptions=False) as tc:
        caplog.clear()
        r = tc.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        assert r.headers["x-request-id"] in r.json()["error"]["message"]
        _no_secrets(r.text)
        assert any("pid=123" in str(rec.exc_info) for rec in caplog.records)
    _still_serving(served)


def test_n_choices_of_every_prompt_are_submitted_in_one_call(served):
    """Prompt-major, n per prompt, named by choice: one submit_many (one round trip to a Router)."""
    from fastapi.testclient import TestClient

    stub = StubClient(served.client.tokenizer)
    with TestClient(build_app(stub, MODEL)) as tc:
        r = tc.post("/v1/completions", json={"model": MODEL, "prompt": ["w1 w2", "w3"], "max_tokens": 2, "n": 3})
        assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == list(range(6))
    assert len(stub.submitted) == 1
    rid = r.json()["id"]
    assert stub.submitted[0] == [f"{rid}-{i}" for i in range(6)]


def test_health_is_503_unless_the_engine_is_ok(served):
    from fastapi.testclient import TestClient

    tok = served.client.tokenizer
    cases = [
        ({"state": "failed", "error": "the engine stopped: a worker failed 3 times", "restarts": 3},
         503, "failed", "a worker failed 3 times"),
        ({"state": "restarting", "error": None, "restarts": 1}, 503, "restarting", "restarting"),
        (RuntimeError("ActorID(abc) pid=123 ip=10.0.0.1 unreachable"), 503, "unavailable", "did not answer"),
        ({"running": 0, "waiting": 0}, 200, "ok", None),  # no "state" yet: ok
        ({"state": "ok", "restarts": 2, "running": 1, "waiting": 0}, 200, "ok", None),
    ]
    for stats, code, status, reason in cases:
        with TestClient(build_app(StubClient(tok, stats=stats), MODEL)) as tc:
            r = tc.get("/health")
            assert r.status_code == code and r.json()["status"] == status, r.text
            if reason is not None:
                assert reason in r.json()["reason"]
            _no_secrets(r.text)
            text = tc.get("/metrics").text
            up = 1.0 if code == 200 else 0.0
            assert f"dspark_engine_up {up}" in text
            if isinstance(stats, dict):
                assert f"dspark_engine_restarts {float(stats.get('restarts', 0))}" in text
    with TestClient(build_app(StubClient(tok, stats="hang"), MODEL, health_timeout_s=0.2)) as tc:
        r = tc.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "unavailable",
                                                     "reason": "the engine did not answer in time"}
    # the real engine: up, no restarts
    assert httpx.get(f"{served.url}/health").json()["status"] == "ok"
    assert metric(served.url, "dspark_engine_up") == 1


def test_serve_command_line_takes_a_body_limit():
    from dspark_cluster.cli import _parser

    assert _parser().parse_args(["serve", "--max-body-mb", "0.5"]).max_body_mb == 0.5
    assert _parser().parse_args(["serve"]).max_body_mb == 8


def test_server_still_answers_after_everything(served):
    """Last in this module: after the bad input, the disconnects and the load, all is well."""
    assert httpx.get(f"{served.url}/health").json()["status"] == "ok"
    r = served.openai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w3 w4"}],
                                              max_tokens=5, **GREEDY)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    wait_kv_free(served.url)
    text = httpx.get(f"{served.url}/metrics").text
    assert 'dspark_http_requests_total{endpoint="/v1/completions",status="400"}' in text
    assert 'dspark_http_requests_total{endpoint="/v1/chat/completions",status="200"}' in text


def test_serving_through_the_router_actor(ray_cluster, chat_checkpoint):
    """executor: ray -- the same server in front of the Router actor."""
    cfg = load_config({
        "model": {"path": str(chat_checkpoint)},
        "parallel": {"executor": "ray", "tensor": 1},
        "scheduler": {"block_size": 4, "num_kv_blocks": 256, "max_model_len": MAX_MODEL_LEN},
    })
    client = EngineClient.start(cfg)
    assert client.kind == "ray" and client.max_model_len == MAX_MODEL_LEN
    server = ServerThread(build_app(client, MODEL)).start()  # no API key: any key is fine
    try:
        oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "w9 w8 w7"}]
        full = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
        chunks = list(oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 8 == full.usage.completion_tokens
        # a stop string ends the request in the Router, in the step that completed it
        text = full.choices[0].message.content
        stop = text.split()[len(text.split()) // 2]
        stopped = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stop=[stop], **GREEDY)
        assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == (text[: text.find(stop)], "stop")
        assert stopped.usage.completion_tokens <= len(text.split()) // 2 + 1 < 8
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(model=MODEL, prompt=[99999], max_tokens=2)  # refused by the router's engine
        assert "vocabulary" in e.value.message
        body = {"model": MODEL, "prompt": "w20 w21", "max_tokens": 240, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            n = 0
            for line in r.iter_lines():
                n += bool(line)
                if n == 2:
                    break
        wait_kv_free(server.url)
        assert oa.completions.create(model=MODEL, prompt="w1 w2", max_tokens=3).usage.completion_tokens >= 1
    finally:
        server.stop()
        client.shutdown()


def test_logprobs_and_echo(served):
    """Log-probabilities of the target's law (after temperature) for generated tokens, and with echo
    for the prompt's, in OpenAI's shapes; the values match transformers'. This is what lm-eval's
    local-completions model sends for likelihood and multiple-choice tasks."""
    from transformers import AutoModelForCausalLM

    oa, tok = served.openai, served.client.tokenizer
    prompt = tok("w5 w17 w3 w9", add_special_tokens=False)["input_ids"]
    r = served.post("/v1/completions", {"model": MODEL, "prompt": [prompt], "max_tokens": 3, "temperature": 0,
                                        "logprobs": 2, "echo": True, "ignore_eos": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    assert r["choices"][0]["text"].startswith(tok.decode(prompt))
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # greedy: each generated token is its position's best, and the top lists hold 2 (+ the chosen token)
    for token, lpv, top in zip(lp["tokens"][len(prompt):], lp["token_logprobs"][len(prompt):],
                               lp["top_logprobs"][len(prompt):]):
        assert lpv == pytest.approx(max(top.values())) and top[token] == lpv and 2 <= len(top) <= 3
    model = AutoModelForCausalLM.from_pretrained(str(served.client.model_path), dtype=torch.float32)
    gen = [tok.convert_tokens_to_ids(t.strip()) for t in lp["tokens"][len(prompt):]]
    ids = torch.tensor([prompt + gen])
    with torch.no_grad():
        ref = model(ids).logits.log_softmax(-1)[0]
    expected = [ref[t - 1, ids[0, t]].item() for t in range(1, ids.shape[1])]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    # without echo: the completion's tokens only; temperature scales the law
    plain = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, logprobs=0)
    assert len(plain.choices[0].logprobs.tokens) == 2 and plain.choices[0].logprobs.token_logprobs[0] == pytest.approx(
        expected[len(prompt) - 1], abs=1e-4)
    hot = served.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 2.0,
                                          "seed": 3, "logprobs": 0}).json()["choices"][0]["logprobs"]
    with torch.no_grad():
        last = model(torch.tensor([prompt])).logits[0, -1]
    tid = tok.convert_tokens_to_ids(hot["tokens"][0].strip())
    assert hot["token_logprobs"][0] == pytest.approx((last / 2.0).log_softmax(-1)[tid].item(), abs=1e-4)
    # streamed: the same values, chunk by chunk, the prompt's in the first chunk
    body = {"model": MODEL, "prompt": [prompt], "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, headers=auth(), timeout=30) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    streamed = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-6)
    assert "".join(c["choices"][0]["text"] for c in chunks) == r["choices"][0]["text"]
    # chat: logprobs / top_logprobs
    messages = [{"role": "user", "content": "w9 w8 w7"}]
    chat = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                      top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy: the best
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    stream = list(oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                             logprobs=True, top_logprobs=3, stream=True))
    got = [c.logprob for ch in stream if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert got == pytest.approx([c.logprob for c in content], abs=1e-6)
    wait_kv_free(served.url)
