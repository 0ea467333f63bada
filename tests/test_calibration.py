"""Online drafter calibration: what is recorded and filtered, what the calibrator learns, how versions
publish and roll back, and that none of it changes outputs (greedy) or the output law (sampled)."""

import copy
import math
import time

import pytest
import torch

from dspark_cluster import LLM, SamplingParams, step_exec
from dspark_cluster.config import ASSETS_DIR
from dspark_cluster.errors import ConfigError, RequestError
from dspark_cluster.speculative.calibration import ReplayBuffer, SequenceSample, filter_sample, topk_law_distances
from dspark_cluster.speculative.calibrator import Candidate, DrafterVersions
from dspark_cluster.speculative.records import RoundRecords

from conftest import build_dspark, random_prompts
from test_speculative import small_vocab  # noqa: F401 -- fixture
from test_speculative import LAW_P, LAW_PROMPT, LAW_SCHED, first_position_law_verify, full_rounds, law_pvalue, seeded

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
TARGET, DRAFTER = ASSETS_DIR / "tiny-moe", ASSETS_DIR / "tiny-dspark"


def cal_config(draft, schedule="static", **calibration):
    return {"scheduler": {"block_size": 4, "num_kv_blocks": 512, "max_num_seqs": 16},
            "speculative": {"method": "dspark", "draft_model": str(draft), "num_tokens": 4, "schedule": schedule,
                            "calibration": {"enabled": True, "interval_s": 3600, "min_rounds": 16,
                                            "steps_per_update": 20, "margin": 0.0, **calibration}}}


def bundled_prompts(n, offset=0):
    import json

    lines = (ASSETS_DIR / "prompts" / "heldout.jsonl").read_text().splitlines()
    return [json.loads(x)["prompt"] for x in lines[offset : offset + n]]


# ---------------------------------------------------------------------------------------- pure parts

def rounds(n, K=3, k=4, V=16, greedy=True, seq=0, start=5):
    """n consistent rounds: the committed tokens are the laws' top-1."""
    g = torch.Generator().manual_seed(seq)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(n * (K + 1))]).view(n, K + 1, k)
    logp = torch.log_softmax(torch.tensor([3.0, 1.0, 0.5, 0.0])[:k], 0).expand(n, K + 1, k).clone() - 0.05
    nd = torch.full((n,), K)
    acc = torch.randint(0, K + 1, (n,), generator=g)
    out = ids[..., 0].clone()
    return RoundRecords(seq_ids=torch.full((n,), seq), anchor_pos=torch.arange(start, start + 4 * n, 4),
                        anchor=torch.randint(0, V, (n,), generator=g), draft_tokens=out[:, :K].clone(), num_draft=nd,
                        out_tokens=out, num_tokens=acc + 1, greedy=torch.full((n,), greedy),
                        topk_ids=ids, topk_logprobs=logp, entropy=torch.full((n, K + 1), 1.0))


def sample(r, reason="stop", rows=64):
    return SequenceSample(int(r.seq_ids[0]), torch.zeros(rows, 8, dtype=torch.float16), r, reason)


def test_filter_drops_what_would_teach_the_drafter_wrong():
    r = rounds(6)
    kept, dropped = filter_sample(sample(r), vocab_size=16)
    assert len(kept) == 6 and not dropped
    for reason, name in (("error", "request_error"), ("abort", "request_aborted")):
        kept, dropped = filter_sample(sample(r, reason), 16)
        assert kept is None and dropped == {name: 6}
    bad = copy.deepcopy(r)
    bad.topk_ids[1] = bad.topk_ids[1].roll(1, dims=-1)  # a wrong law: the committed token is not its top-1
    bad.entropy[2] = 0.95 * math.log(16)  # the target does not know
    bad.topk_logprobs[3, 0, 0] = float("nan")
    bad.anchor_pos[4] = 1000  # past the rows the drafter had
    kept, dropped = filter_sample(sample(bad), 16)
    assert dropped == {"inconsistent_law": 1, "extreme_entropy": 1, "invalid_law": 1, "missing_context": 1}
    assert len(kept) == 2
    tie = copy.deepcopy(r)  # greedy with tied top logits: the committed token may be listed second
    tie.topk_logprobs[:, :, :2] = math.log(0.4)
    tie.topk_ids[0, 0, :2] = tie.topk_ids[0, 0, [1, 0]]
    assert filter_sample(sample(tie), 16)[1] == {}
    loop = rounds(8)  # a degenerate repeat: "7 8 7 8 ..."
    loop.anchor[:] = 7
    loop.out_tokens[:] = torch.tensor([8, 7, 8, 7])
    loop.num_tokens[:] = 4
    loop.topk_ids[..., 0] = loop.out_tokens
    _, dropped = filter_sample(sample(loop), 16)
    assert dropped["degenerate_repeat"] == 5  # once 16 tokens of it are seen


def test_topk_distances_are_exact_with_the_whole_vocabulary():
    g = torch.Generator().manual_seed(0)
    z, t = torch.randn(5, 12, generator=g), torch.randn(5, 12, generator=g)
    p, q = t.softmax(-1), z.softmax(-1)
    top = t.log_softmax(-1).topk(12)
    tv, kl, _ = topk_law_distances(z, top.indices, top.values)
    assert torch.allclose(tv, 0.5 * (p - q).abs().sum(-1), atol=1e-5)
    assert torch.allclose(kl, (p * (p.log() - q.log())).sum(-1), atol=1e-5)
    top4 = t.log_softmax(-1).topk(4)  # fewer: the rest is one bucket, a lower bound on TV
    tv4, _, _ = topk_law_distances(z, top4.indices, top4.values)
    assert (tv4 <= tv + 1e-6).all() and (tv4 > 0).all()


def test_buffer_is_bounded_and_holds_back_whole_sequences():
    buf = ReplayBuffer(max_rounds=40, holdout=0.25)
    for s in range(30):
        buf.add(sample(rounds(5, seq=s)), 16)
    st = buf.state()
    assert st["rounds"] <= 40 and st["evicted"] == 30 * 5 - st["rounds"] and st["rounds_offered"] == 150
    held = {s.seq_id for s, h in buf.samples if h}
    assert held and held != {s.seq_id for s, _ in buf.samples}
    assert all(buf.held_out(sid) for sid in held)  # by sequence, stable
    assert st["holdout_rounds"] == 5 * len(held)
    # only the rows its rounds read are kept (the MAX_CONTEXT before each anchor), with their offset
    from dspark_cluster.speculative import calibration

    far = rounds(3, seq=99, start=calibration.MAX_CONTEXT + 100)
    buf2 = ReplayBuffer(max_rounds=1000, holdout=0.0)
    buf2.add(sample(far, rows=calibration.MAX_CONTEXT + 200), 16)
    (kept, _), = buf2.samples
    assert kept.row_offset == 100 and kept.rows.shape[0] == int(far.anchor_pos.max()) - 100
    # and the bytes are bounded as well as the rounds
    small = ReplayBuffer(max_rounds=1000, holdout=0.0, max_bytes=3 * sample(rounds(5)).nbytes)
    for s in range(10):
        small.add(sample(rounds(5, seq=s)), 16)
    assert small.state()["bytes"] <= small.max_bytes and len(small.samples) < 10


def test_versions_roll_back_when_live_tau_falls_below_the_predecessor():
    v = DrafterVersions(window_rounds=20, rollback_margin=0.1)
    assert v.observe([3] * 80) is None  # version 0: tau 3
    v.switch(1, "publish", step=10, meta={"rounds_trained": 100})
    assert v.observe([2] * 19) is None  # judged at the end of each window
    assert v.observe([3]) == 0  # (2 x 19 + 3) / 20 = 2.05 < 0.9 x 3
    v.switch(0, "auto rollback", step=20)
    v.switch(2, "publish", step=30)
    assert v.observe([3] * 18 + [2] * 2) is None  # 2.9 >= 2.7
    assert v.observe([2] * 10 + [3] * 10) is None  # a poor window, but 2.7 over all 40 rounds
    assert v.observe([3] * 40) is None and v.trial is None  # 4 windows: the trial is passed
    assert v.observe([1] * 100) is None  # not on trial any more
    st = v.status()
    assert st["serving_version"] == 2 and [e["event"] for e in st["events"]] == ["publish", "auto rollback", "publish"]
    assert st["history"][1]["rolled_back"] == "auto rollback" and st["history"][1]["live_tau"] == 2.05
    assert st["history"][2]["trial"] == "passed" and st["history"][2]["predecessor_live_tau"] == 3.0
    v.switch(3, "publish", step=40)  # its predecessor's baseline: version 2's last 80 rounds
    assert v.baseline == 1.0 and v.observe([1] * 20) is None
    v.switch(4, "publish", step=50)
    v.pin()  # a manual hold: not on trial any more
    assert v.observe([0] * 100) is None and v.pinned


def test_calibration_is_for_the_dspark_drafter():
    with pytest.raises(ConfigError, match="calibration.enabled"):
        LLM(TARGET, config={"speculative": {"method": "ngram", "calibration": {"enabled": True}}})


# ---------------------------------------------------------------------------------------- in the engine

@pytest.fixture(scope="module")
def random_drafter(checkpoint, tmp_path_factory):
    """(The random test target's laws are nearly flat: its rounds pass the entropy filter only with
    calibration.max_entropy_share 1.)"""
    return build_dspark(checkpoint("qwen3_moe"), tmp_path_factory.mktemp("cal-dspark"), layers=(0, 1))


def test_the_calibrator_learns_from_live_rounds_and_publishes_without_changing_outputs(checkpoint, random_drafter):
    """A random drafter, calibrated on the rounds of its own traffic: the candidate beats it in the
    shadow evaluation, publishes at a step boundary, and greedy outputs never change."""
    target = checkpoint("qwen3_moe")
    prompts = random_prompts([7, 12, 5, 20, 9, 15, 11, 6], seed=3)
    base = [o.token_ids for o in LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts, GREEDY)]
    llm = LLM(target, config=cal_config(random_drafter, learning_rate=3e-3, max_entropy_share=1.0))
    try:
        drafter = llm.engine.drafter
        mixed = [GREEDY, SamplingParams(max_tokens=24, temperature=1.0, seed=1, ignore_eos=True)]
        for _ in range(3):
            assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == base
            llm.generate(prompts, mixed * 4)
        buf = drafter.calibrator.status()["buffer"]
        assert buf["train_rounds"] > 0 and buf["holdout_rounds"] > 0, buf
        # a random target's greedy continuations loop: those rounds go, and nothing else does
        assert buf["rounds_kept"] + buf["dropped"].get("degenerate_repeat", 0) == buf["rounds_offered"], buf
        record = drafter.calibrator.update()
        assert record["shadow"]["tau"] > record["serving_shadow"]["tau"], record
        assert record["shadow"]["tv"] < record["serving_shadow"]["tv"]
        assert record["outcome"] == "candidate version 1"
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == base  # published during this call
        st = llm.drafter_status()
        assert st["serving_version"] == 1 and drafter.backend.proposer.version == 1
        assert st["history"][-1]["rounds_trained"] == record["train_rounds"]
        assert st["history"][-1]["shadow"]["tau"] == record["shadow"]["tau"]
        assert st["history"][-1]["live_rounds"] > 0 and st["calibrator"]["serving"] == 1
        assert llm.engine.speculative_summary()["drafter_versions"]["serving_version"] == 1
    finally:
        llm.shutdown()


def test_requests_that_opt_out_are_never_recorded(checkpoint, random_drafter):
    llm = LLM(checkpoint("qwen3_moe"), config=cal_config(random_drafter, max_entropy_share=1.0))
    try:
        prompts = random_prompts([7, 12, 5, 20], seed=4)
        llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, calibrate=False))
        assert llm.engine.drafter.stats.rounds > 0
        assert llm.drafter_status()["calibrator"]["buffer"]["rounds_offered"] == 0
        llm.generate(prompts, GREEDY)
        assert llm.drafter_status()["calibrator"]["buffer"]["rounds_offered"] > 0
        assert not llm.engine.drafter.backend.proposer.ctx  # every sequence's state went with it
    finally:
        llm.shutdown()


def flipping_versions_law_pvalue(small_vocab, tmp_path, k=3, n=3000, seed=0) -> float:  # noqa: F811
    """Every step serves another version (the original and a perturbed one, switched at the step
    boundary with their context keys/values recomputed), k drafts a round: the p-value of the output
    law against the target's (see test_speculative's law tests), after checking that rounds
    verifying all k drafts ran and that both versions served."""
    draft = build_dspark(small_vocab["target"], tmp_path / "d", seed=5, layers=(0,), block_size=3, hidden=16, scale=2.0)
    cfg = cal_config(draft)
    cfg["scheduler"] = LAW_SCHED
    cfg["speculative"]["num_tokens"] = k
    llm = LLM(small_vocab["target"], config=cfg)
    try:
        drafter = llm.engine.drafter
        g = torch.Generator().manual_seed(1)
        original = drafter.calibrator.versions[0]
        state = {name: v + 0.5 * torch.randn(v.shape, generator=g) for name, v in original.items()}
        drafter.backend.proposer.stage(1, state, keep={0, 1})
        drafter.available = {0, 1}
        poll = drafter.poll

        def flip(step=0):
            out = poll(step)
            drafter.versions.switch(step % 2, "test flip", step)
            return out

        drafter.poll = flip
        spec = llm.generate([LAW_PROMPT] * n, seeded(n, seed, max_tokens=k + 2))
        stats = drafter.stats
        assert full_rounds(llm, k) >= n / 2, stats.proposed  # every first round verifies all k
        assert 0 < stats.accepted[k - 1] and sum(stats.accepted) < sum(stats.proposed)
        assert {e["to"] for e in drafter.versions.events} == {0, 1}
        p = law_pvalue(spec, small_vocab["target"], LAW_PROMPT)
        print(f"law p-value {p:.3g} (versions flipping, k={k}, drafts by position {stats.proposed}, "
              f"accepted {stats.accepted})")
        return p
    finally:
        llm.shutdown()


def test_the_output_law_holds_while_versions_change_every_step(small_vocab, tmp_path):  # noqa: F811
    """Every step serves another version (the original and a perturbed one, switched at the step
    boundary with their context keys/values recomputed): the output law is still the target's."""
    p = flipping_versions_law_pvalue(small_vocab, tmp_path)
    assert p > LAW_P, p


def test_the_flipping_versions_law_test_fails_on_a_verifier_that_reuses_the_first_draft_law(  # noqa: F811
        small_vocab, tmp_path, monkeypatch):
    monkeypatch.setattr(step_exec, "verify", first_position_law_verify)
    p = flipping_versions_law_pvalue(small_vocab, tmp_path)
    assert p < LAW_P, p


@pytest.fixture(scope="module")
def bundled():
    """The bundled target and drafter with calibration on (its loop idle unless a test asks)."""
    llm = LLM(TARGET, config=cal_config(DRAFTER, window_rounds=20, rollback_margin=0.2, learning_rate=3e-3))
    yield llm
    llm.shutdown()


def test_a_bad_version_rolls_back_automatically_and_manual_rollback_works(bundled):
    llm, drafter = bundled, bundled.engine.drafter
    prompts = bundled_prompts(16)
    base = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    tau0 = drafter.versions.live_tau(0)
    assert tau0 > 1.5
    original = drafter.calibrator.versions[0]
    g = torch.Generator().manual_seed(0)
    bad = {k: v + (v.std() if v.numel() > 1 else 1.0) * torch.randn(v.shape, generator=g) for k, v in original.items()}
    with drafter.calibrator._lock:  # the calibrator offers a version that drafts badly
        drafter.calibrator.versions[1] = bad
        drafter.calibrator.pending = Candidate(1, bad, {"version": 1, "rounds_trained": 0, "shadow": None})
        drafter.calibrator.next_version = 2
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == base
    st = llm.drafter_status()
    assert [(e["event"], e["to"]) for e in st["events"]] == [("publish", 1), ("auto rollback", 0)], st
    assert st["serving_version"] == 0 and st["history"][1]["rolled_back"] == "auto rollback"
    assert st["history"][1]["live_tau"] < 0.8 * tau0
    assert drafter.calibrator.serving == 0
    # manual: to a version held, to the original, never to one that is not held
    drafter.backend.proposer.stage(2, original, keep={0, 1, 2})
    drafter.calibrator.versions[2] = original
    drafter.available |= {2}
    assert llm.rollback_drafter(2)["serving_version"] == 2
    assert [o.token_ids for o in llm.generate(prompts[:4], GREEDY)] == base[:4] and drafter.backend.proposer.version == 2
    assert llm.rollback_drafter(None)["serving_version"] == 0
    with pytest.raises(RequestError, match="version: got 7"):
        llm.rollback_drafter(7)
    # a manual rollback holds: a candidate waits until resume
    with drafter.calibrator._lock:
        drafter.calibrator.versions[3] = original
        drafter.calibrator.pending = Candidate(3, original, {"version": 3, "rounds_trained": 0, "shadow": None})
    llm.generate(prompts[:2], GREEDY)
    assert llm.drafter_status()["serving_version"] == 0 and drafter.calibrator.pending is not None
    assert llm.resume_drafter()["pinned"] is False
    llm.generate(prompts[:2], GREEDY)
    assert llm.drafter_status()["serving_version"] == 3


def test_poisoned_laws_are_filtered_and_a_poisoned_candidate_is_rejected(bundled):
    """Wrong target laws injected into the buffer: those that contradict what the target committed
    are filtered; those let past the filter make a candidate that loses the shadow check (a lower
    tau, or a top-1 that matches the tokens the target produced less often), so the serving version
    stays."""
    llm, cal = bundled, bundled.engine.drafter.calibrator
    llm.generate(bundled_prompts(32, offset=16), GREEDY)
    cal.take_inbox()
    with cal._lock:
        clean = [s for s, _ in cal.buffer.samples]
    assert clean
    g = torch.Generator().manual_seed(0)

    def poison(s):
        r = copy.deepcopy(s.rounds)
        r.topk_ids = torch.randint(0, cal.vocab_size, r.topk_ids.shape, generator=g)
        return SequenceSample(s.seq_id + 10**6, s.rows, r, "stop", row_offset=s.row_offset)

    before = cal.status()["buffer"]["dropped"].get("inconsistent_law", 0)
    n = sum(len(s.rounds) for s in clean)
    cal.add([poison(s) for s in clean])
    assert cal.status()["buffer"]["dropped"]["inconsistent_law"] - before == n
    # past the filter (as a law wrong in a way no check sees would be)
    serving = cal.serving
    with cal._lock:
        cal.buffer.samples.clear()
        cal.buffer.num_rounds = 0
        for s in clean:
            p = poison(s)
            cal.buffer.samples.append((p, cal.buffer.held_out(s.seq_id)))
            cal.buffer.num_rounds += len(p.rounds)
    record = cal.update()
    # rejected: its shadow tau fell, or its top-1 matches the target's tokens less (which of the two
    # shows depends on which sequences are held out, i.e. on the process's sequence ids so far)
    assert record["outcome"].startswith("rejected"), record
    cand, serve = record["shadow"], record["serving_shadow"]
    assert cand["tau"] < serve["tau"] or cand["match"] < serve["match"] * (1 - cal.cc.margin), record
    assert cal.pending is None and cal.serving == serving
    with cal._lock:
        cal.buffer.samples.clear()
        cal.buffer.num_rounds = 0


def test_admin_routes_and_cli():
    import httpx

    from dspark_cluster.cli import main
    from dspark_cluster.client import EngineClient
    from dspark_cluster.config import load_config
    from dspark_cluster.server import build_app
    from test_server import ServerThread

    cfg = load_config({**cal_config(DRAFTER), "model": {"path": str(TARGET)}})
    client = EngineClient.start(cfg)
    server = ServerThread(build_app(client, "tiny-moe", api_key="k")).start()
    key = {"Authorization": "Bearer k"}
    try:
        r = httpx.post(f"{server.url}/v1/completions", headers=key, timeout=60, json={
            "model": "tiny-moe", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0, "calibrate": False})
        assert r.status_code == 200, r.text
        assert httpx.get(f"{server.url}/admin/drafter").status_code == 401
        assert httpx.post(f"{server.url}/admin/drafter/rollback", json={}).status_code == 401
        st = httpx.get(f"{server.url}/admin/drafter", headers=key).json()
        assert st["serving_version"] == 0 and st["calibrator"]["buffer"]["rounds_offered"] == 0
        r = httpx.post(f"{server.url}/admin/drafter/rollback", headers=key, json={"version": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "version"
        r = httpx.post(f"{server.url}/admin/drafter/rollback", headers=key, json={"version": "3"})
        assert r.status_code == 400
        r = httpx.post(f"{server.url}/admin/drafter/rollback", headers=key, json={"version": None})
        assert r.status_code == 200 and r.json()["serving_version"] == 0
        assert main(["drafter", "rollback", "--url", server.url, "--api-key", "k"]) == 0
        assert httpx.get(f"{server.url}/admin/drafter", headers=key).json()["pinned"] is True
        assert main(["drafter", "resume", "--url", server.url, "--api-key", "k"]) == 0
        assert httpx.get(f"{server.url}/admin/drafter", headers=key).json()["pinned"] is False
        assert httpx.post(f"{server.url}/admin/drafter/resume").status_code == 401
        assert main(["drafter", "status", "--url", server.url, "--api-key", "wrong"]) == 1
    finally:
        server.stop()
        client.shutdown()


def test_versions_publish_to_the_whole_drafter_group_through_ray(checkpoint, random_drafter, ray_cluster):
    """Two drafter actors and a calibrator actor: the calibrator trains on the rounds the drafters
    send it, a winning version reaches both drafters and both switch at the same step; outputs stay
    identical; a rollback through the Router switches both back. (DSpark drafters are not
    tensor-parallel: `draft_tensor` > 1 is refused for them, so the group is its data-parallel actors.)"""
    import ray

    target = checkpoint("qwen3_moe")
    prompts = random_prompts([7, 12, 5, 20, 9, 15, 11, 6], seed=5)
    base = [o.token_ids for o in LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts, GREEDY)]
    cfg = cal_config(random_drafter, interval_s=0.5, learning_rate=3e-3, max_entropy_share=1.0)
    cfg["parallel"] = {"executor": "ray"}
    cfg["speculative"]["draft_workers"] = 2
    llm = LLM(target, config=cfg)
    try:
        deadline = time.monotonic() + 180
        while llm.drafter_status()["serving_version"] == 0:
            assert time.monotonic() < deadline, llm.drafter_status()
            assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == base
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == base
        st = llm.drafter_status()
        v = st["serving_version"]
        # this engine's drafters (not every named drafter in the session's Ray instance: an earlier test's
        # group may still be going away)
        names = ray.get(llm.router.drafter_names.remote())
        reports = [ray.get(ray.get_actor(n).version_report.remote()) for n in names]
        # both drafters switched together, to the calibrated version of the last proposal; a newer version
        # may have been staged and made the serving one since (drafters take it with their next proposal)
        assert len(reports) == 2 and len({r["version"] for r in reports}) == 1, reports
        assert 1 <= reports[0]["version"] <= llm.drafter_status()["serving_version"] and v >= 1
        assert reports[0]["weights_sum"] == reports[1]["weights_sum"]
        assert st["calibrator"]["buffer"]["rounds_kept"] > 0 and st["history"][-1]["shadow"]["tau"] > 0
        # the calibrator actor's heartbeat reaches the engine without a wait (asked once a second, in the background)
        while (beat := {b["part"]: b for b in llm.drafter_status()["background"]}["calibrator"])["activity"] == "starting":
            assert time.monotonic() < deadline + 30
            time.sleep(0.1)
        assert not beat["stalled"] and beat["seconds_since_progress"] >= 0 and not llm.drafter_status()["stalled"]
        assert llm.rollback_drafter(None)["serving_version"] == 0  # and held there
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == base
        assert {ray.get(ray.get_actor(n).version_report.remote())["version"] for n in names} == {0}
        assert llm.drafter_status()["pinned"] and llm.resume_drafter()["pinned"] is False
    finally:
        llm.shutdown()
