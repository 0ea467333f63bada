"""The one output path: incremental text equal to a full decode, stop strings applied where the
tokens are produced (in process, through AsyncEngine, through the Router), and per-request queues
that are always cleaned up."""

from __future__ import annotations

import asyncio
import random

import pytest

from dspark_cluster import LLM, SamplingParams
from dspark_cluster.async_engine import AsyncEngine
from dspark_cluster.config import ASSETS_DIR, load_config
from dspark_cluster.outputs import Detokenizer, OutputProcessor, StopStrings

TINY = ASSETS_DIR / "tiny-moe"
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY))


def test_incremental_text_is_the_full_decode(tokenizer):
    """Token by token through DecodeStream (no decode of the whole output per step), flushed on the
    last piece: the concatenation is tokenizer.decode(ids) exactly, incomplete UTF-8 included."""
    for seed in range(300):
        r = random.Random(seed)
        ids = [r.randrange(tokenizer.vocab_size) for _ in range(r.randrange(1, 40))]
        d = Detokenizer(tokenizer)
        assert d._stream is not None  # the fast path
        parts, i = [], 0
        while i < len(ids):
            n = r.randrange(1, 5)  # a step may bring several tokens (speculative decoding)
            parts.append(d.add(ids[i : i + n], final=i + n >= len(ids)))
            i += n
        assert "".join(parts) == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_strings_hold_back_and_cut():
    s = StopStrings(["END", "xy"])
    assert s.feed("abcE", False) == ("ab", False)  # "cE" may begin "END": held back
    assert s.feed("N", False) == ("c", False)  # "EN" still may
    assert s.feed("Dtail", False) == ("", True)  # cut before the stop; what follows never appears
    assert s.text[: s.sent] == "abc"
    p = OutputProcessor(None, ("never",))
    assert p.add([1, 2], final=True) == ("", False)  # no tokenizer: token ids only
    assert StopStrings([""]).feed("abc", True) == ("abc", False)  # an empty stop string stops nothing


def _stop_from(text: str) -> str:
    """A stop string that first occurs in the middle of `text`."""
    for start in range(len(text) // 3, len(text) - 3):
        cand = text[start : start + 3]
        if cand.strip() and text.find(cand) == start:
            return cand
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_end_the_request_where_its_tokens_are_made(tokenizer):
    llm = LLM(TINY)
    try:
        full = llm.generate([PROMPT], GREEDY)[0]
        stop = _stop_from(full.text)
        cut = full.text.index(stop)
        # the fewest tokens whose text contains the stop: the request must end right there
        need = next(n for n in range(1, len(full.token_ids) + 1)
                    if stop in tokenizer.decode(full.token_ids[:n], skip_special_tokens=True))
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop=("@@never@@", stop))
        out = llm.generate([PROMPT], params)[0]
        assert (out.text, out.finish_reason) == (full.text[:cut], "stop")
        assert out.token_ids == full.token_ids[:need]
        pieces = list(llm.stream(PROMPT, params))
        assert "".join(p.text for p in pieces) == full.text[:cut] and pieces[-1].finish_reason == "stop"
        assert sum(len(p.token_ids) for p in pieces) == need
        assert llm.engine.block_manager.num_used == 0 and not llm.engine.has_unfinished()

        # the same in the asynchronous engine (the server's and the Router's)
        engine = AsyncEngine(load_config(None, {"model.path": str(TINY)}))
        try:
            got = asyncio.run(engine.generate([PROMPT], [params]))[0]
            assert (got.text, got.finish_reason, got.token_ids) == (out.text, "stop", out.token_ids)
            assert engine.finished[-1]["finish_reason"] == "stop"
        finally:
            engine.shutdown()
    finally:
        llm.shutdown()


def test_request_queues_are_always_cleaned_up():
    engine = AsyncEngine(load_config(None, {"model.path": str(TINY)}))

    async def scenarios():
        long = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        # read to the end
        rid = engine.submit(PROMPT, GREEDY)
        assert (await engine.result(rid)).finish_reason == "length"
        # the reader leaves early (the request is aborted)
        rid = engine.submit(PROMPT, long)
        async for piece in engine.stream(rid):
            if piece.token_ids:
                break
        # submitted, never read, aborted (a refused sibling choice in the server does this)
        rid = engine.submit(PROMPT, long)
        engine.abort(rid)
        for _ in range(200):
            if not engine.engine.has_unfinished():
                break
            await asyncio.sleep(0.02)

    try:
        asyncio.run(scenarios())
        assert engine._queues == {} and engine._consumed == set()
        assert not engine.engine.has_unfinished() and engine.engine.block_manager.num_used == 0
        assert [r["finish_reason"] for r in list(engine.finished)[-3:]] == ["length", "abort", "abort"]
    finally:
        engine.shutdown()


def test_logprobs_are_the_target_law_with_or_without_speculation():
    """Each output token's log-probability (and the prompt's) equal transformers' to float error;
    speculative decoding (DSpark, every draft verified) gives the same tokens and the same values."""
    import torch
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    plain = LLM(TINY)
    spec = LLM(TINY, config={"speculative": {"method": "dspark", "draft_model": "tiny-dspark", "schedule": "static"}})
    try:
        out = plain.generate([PROMPT], params)[0]
        again = spec.generate([PROMPT], params)[0]
        streamed = list(plain.stream(PROMPT, params))
    finally:
        plain.shutdown()
        spec.shutdown()
    model = AutoModelForCausalLM.from_pretrained(str(TINY), dtype=torch.float32)
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    with torch.no_grad():
        law = model(ids).logits.log_softmax(-1)[0]
    n = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    for t in range(1, ids.shape[1]):
        got = out.prompt_logprobs[t] if t < n else out.logprobs[t - n]
        assert got.token_id == ids[0, t] and got.logprob == pytest.approx(law[t - 1, ids[0, t]].item(), abs=1e-4)
        top = torch.topk(law[t - 1], 2 if t < n else 3)
        assert [i for i, _ in got.top] == top.indices.tolist()
    assert all(lp.top[0][0] == lp.token_id for lp in out.logprobs)  # greedy: the best token
    assert again.token_ids == out.token_ids and again.metrics["num_draft_tokens"] > 0
    assert [x.logprob for x in again.logprobs] == pytest.approx([x.logprob for x in out.logprobs], abs=1e-4)
    assert [x.logprob for x in again.prompt_logprobs[1:]] == pytest.approx([x.logprob for x in out.prompt_logprobs[1:]],
                                                                           abs=1e-5)
    assert streamed[0].prompt_logprobs == out.prompt_logprobs
    assert [x for p in streamed for x in p.logprobs] == out.logprobs


def test_a_request_that_cannot_be_queued_fails_alone(monkeypatch):
    """An error while the step thread queues a request fails that request only: the thread goes on
    and serves the others (before, it died and every stream waited forever)."""
    from dspark_cluster.engine_core import EngineCore
    from dspark_cluster.errors import EngineError

    engine = AsyncEngine(load_config(None, {"model.path": str(TINY)}))
    real = EngineCore.add

    def add(self, seq):
        if seq.params.max_tokens == 7:
            raise RuntimeError("test: cannot queue")
        real(self, seq)

    monkeypatch.setattr(EngineCore, "add", add)

    async def scenario():
        bad = engine.submit(PROMPT, SamplingParams(max_tokens=7, temperature=0))
        good = engine.submit(PROMPT, GREEDY)
        with pytest.raises(EngineError, match="could not be queued"):
            await engine.result(bad)
        return await engine.result(good)

    try:
        out = asyncio.run(scenario())
        assert len(out.token_ids) == GREEDY.max_tokens and engine.stats()["state"] == "ok"
        assert engine._queues == {}
    finally:
        engine.shutdown()
