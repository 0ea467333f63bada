"""The OpenAI-compatible server (issue 8), exercised with the official `openai` client against a
real uvicorn server on loopback: streaming, usage, stop / seed / n, auth, bad input, disconnects,
32 concurrent streams, and serving through the Router actor."""

import asyncio
import json
import shutil
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from dspark_cluster import load_config
from dspark_cluster.client import EngineClient
from dspark_cluster.server import build_app

KEY = "test-key-123"
MODEL = "tiny-moe-test"
MAX_MODEL_LEN = 256
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
    server = ServerThread(build_app(client, MODEL, api_key=KEY)).start()
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
                 "dspark_num_requests_waiting"):
        assert name in r.text
    assert metric(served.url, "dspark_kv_blocks_total") == 1024


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
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(model="no-such-model", prompt="w1")
        assert e.value.status_code == 400 and e.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError):
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
        _assert_400(served.post("/v1/completions", {"model": MODEL, "prompt": "w1", "logprobs": 2}), param="logprobs")
        _assert_400(served.post("/v1/completions", {"model": MODEL, "prompt": ""}), param="prompt")
        with pytest.raises(openai.BadRequestError):
            oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}], logprobs=True)
        assert httpx.get(f"{served.url}/v1/nowhere", headers=auth()).json()["error"]["code"] == "not_found"

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

    # a non-streamed request whose client gives up is cancelled too
    seen = len(engine.finished)
    with pytest.raises(httpx.ReadTimeout):
        served.post("/v1/completions", {"model": MODEL, "prompt": "w6", "max_tokens": 240, "n": 4, "ignore_eos": True},
                    timeout=httpx.Timeout(10, read=0.1))
    deadline = time.monotonic() + 20
    while len(engine.finished) < seen + 4:
        assert time.monotonic() < deadline, "the non-streamed request was not cancelled"
        time.sleep(0.02)
    assert [m["finish_reason"] for m in list(engine.finished)[seen:]] == ["abort"] * 4
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
