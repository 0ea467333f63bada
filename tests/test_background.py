"""Background parts that cannot hang silently (issue 29): the calibrator trains without DeepSpeed's
comm backend (a stale build lock in the torch extensions cache cannot stop it), every background
part has a heartbeat whose stall reaches drafter_status(), /admin/drafter, /health (200, degraded)
and /metrics within the bound and clears after, and a publish or rollback during an update never
touches the model in training."""

import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

from dspark_cluster.config import load_config
from dspark_cluster.heartbeat import Heartbeat
from dspark_cluster.speculative import calibrator as calibrator_mod
from dspark_cluster.speculative import drafting

from test_calibration import DRAFTER, TARGET, bundled_prompts, cal_config

BOUND = 2.0  # parallel.stall_after_s in these tests (an optimiser step of the bundled drafter takes ~0.5 s)


# ---------------------------------------------------------------------------------------- heartbeats

class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_heartbeat_stalls_only_while_it_should_be_working():
    clock = Clock()
    hb = Heartbeat("calibrator", 10.0, clock=clock)
    clock.t = 100  # resting: never a stall
    assert not hb.snapshot()["stalled"]
    hb.beat("training")
    clock.t = 109
    assert not hb.snapshot()["stalled"]
    clock.t = 111
    snap = hb.snapshot()
    assert snap["stalled"] and snap["reason"].startswith("calibrator: no progress for 11 s while training")
    hb.beat("training on")
    assert not hb.snapshot()["stalled"]
    # a step-driven part: only the time up to its last step counts (an idle engine is no stall)
    staging = Heartbeat("expert_staging", 10.0, step_driven=True, clock=clock)
    staging.beat("staging")
    clock.t += 50
    assert not staging.snapshot()["stalled"]
    staging.ran()
    assert staging.snapshot()["stalled"]


def test_expert_staging_that_stops_moving_is_reported(checkpoint):
    from dspark_cluster.balancer import ExpertBalancer

    cfg = load_config({"model": {"path": str(checkpoint("deepseek_v3"))}, "parallel": {"executor": "ray", "tensor": 2,
                                                                                        "stall_after_s": 10},
                       "eplb": {"enabled": True, "num_redundant_experts": 2, "window_steps": 3, "interval_steps": 4,
                                "min_gain": 0.0}})
    b = ExpertBalancer(cfg, num_moe_layers=2, num_experts=8, num_ranks=2)
    clock = Clock()
    b.heartbeat._clock = clock
    hot = torch.tensor([[50, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 40]])
    for _ in range(4):
        b.observe(hot)
    assert b.placement_update() is not None and b.heartbeat.working

    def step(sent, ready=False):
        clock.t += 6
        b.read([SimpleNamespace(commit_placement=None)],
               [SimpleNamespace(expert_load=hot, migration_ready=ready, migration_bytes=sent)] * 2)

    step(2**20)  # the first bytes: progress
    step(2**20)
    assert not b.heartbeat.snapshot()["stalled"]
    step(2**20)  # 12 s without a byte more, but stepping: stalled
    assert b.heartbeat.snapshot()["stalled"] and "staging placement 1" in b.heartbeat.snapshot()["reason"]
    step(2 * 2**20)  # moved on
    assert not b.heartbeat.snapshot()["stalled"]
    clock.t += 100  # the engine idles: staging cannot move, no stall
    assert not b.heartbeat.snapshot()["stalled"]
    step(2 * 2**20, ready=True)
    b.read([SimpleNamespace(commit_placement=1)], [SimpleNamespace(expert_load=hot, migration_ready=None,
                                                                   migration_bytes=0)] * 2)
    assert b.pending is None and not b.heartbeat.working


def test_a_drafter_restart_that_hangs_is_reported_and_clears(monkeypatch):
    cfg = load_config({"speculative": {"method": "ngram", "num_tokens": 2},
                       "parallel": {"stall_after_s": 0.3, "max_restarts": 2}})

    class Group:
        restartable, calibrator, names = True, None, None

        def calibrator_heartbeat(self):
            return None

        def shutdown(self):
            pass

    release = threading.Event()

    def make(cfg, spec, device="cpu", first_version=1, progress=None):
        if made:
            progress("starting the drafter actors")
            release.wait(30)
        made.append(1)
        return Group()

    made: list = []
    monkeypatch.setattr(drafting, "make_drafter_group", make)
    d = drafting.Drafter(cfg, None)
    d._drop()  # the group is lost: a restart in the background, which hangs
    deadline = time.monotonic() + 10
    while not d.status()["stalled"]:
        assert time.monotonic() < deadline, d.status()
        time.sleep(0.05)
    (reason,) = d.status()["stalled"]
    assert reason.startswith("drafter_restart: no progress") and "restart 1 of 2: starting the drafter actors" in reason
    release.set()
    d._restarting.join(10)
    assert not d.status()["stalled"] and d.poll() and d.alive
    assert d.restart_beat.activity == "idle"
    d.shutdown()


def test_a_calibrator_actor_that_stops_answering_is_a_stall(monkeypatch):
    """executor ray: the engine asks the calibrator actor for its heartbeat at most once a second and
    never waits for it; an actor that has not answered for the bound, or that failed, is a stall."""
    from actors import drafter_group as dg

    clock, answers, asked = Clock(), {}, []
    monkeypatch.setattr(dg, "time", SimpleNamespace(monotonic=clock))
    monkeypatch.setattr(dg.ray, "wait", lambda refs, timeout=0: ([r for r in refs if r in answers], []))
    monkeypatch.setattr(dg.ray, "get", lambda ref: answers[ref]())
    g = object.__new__(dg.RayDrafterGroup)
    g.stall_after_s, g._beat_lock = 5.0, threading.Lock()
    g._beat, g._beat_t, g._beat_ref, g._beat_asked = None, 0.0, None, 0.0
    g.calibrator = SimpleNamespace(heartbeat=SimpleNamespace(remote=lambda: asked.append(1) or f"ref{len(asked)}"))
    clock.t = 10
    assert g.calibrator_heartbeat()["activity"] == "starting" and asked == [1]
    answers["ref1"] = lambda: {"part": "calibrator", "activity": "training", "working": True,
                               "seconds_since_progress": 0.5, "stalled": False, "reason": None}
    clock.t = 10.2
    assert g.calibrator_heartbeat()["activity"] == "training" and len(asked) == 1  # at most once a second
    clock.t = 11.5
    beat = g.calibrator_heartbeat()
    assert beat["seconds_since_progress"] == 1.8 and not beat["stalled"] and len(asked) == 2
    clock.t = 16  # ref2 unanswered for 4.5 s: the last answer stands
    assert not g.calibrator_heartbeat()["stalled"]
    clock.t = 17
    beat = g.calibrator_heartbeat()
    assert beat["stalled"] and beat["reason"].startswith("calibrator: its actor has not answered for 6 s")

    def lost():
        raise RuntimeError("the actor died")

    answers["ref2"] = lost
    beat = g.calibrator_heartbeat()
    assert beat["stalled"] and "its actor failed (RuntimeError)" in beat["reason"]


# ---------------------------------------------------------------------------------------- the calibrator

@pytest.fixture(scope="module")
def served():
    """The bundled target and DSpark drafter with calibration on (its loop idle: the tests run the
    updates), behind the HTTP server, after traffic that fills the replay buffer."""
    from dspark_cluster.client import EngineClient
    from dspark_cluster.server import build_app
    from test_server import ServerThread

    cfg = load_config({**cal_config(DRAFTER, learning_rate=3e-3), "model": {"path": str(TARGET)},
                       "parallel": {"stall_after_s": BOUND}})
    client = EngineClient.start(cfg)
    server = ServerThread(build_app(client, "tiny-moe")).start()
    try:
        r = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
            "model": "tiny-moe", "prompt": bundled_prompts(16), "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        cal = client.engine.engine.drafter.calibrator
        cal.take_inbox()
        assert cal.buffer.num_rounds >= cal.cc.min_rounds
        yield SimpleNamespace(url=server.url, client=client, cal=cal)
    finally:
        server.stop()
        client.shutdown()


class Blocked:
    """The calibrator's forward, held at its first call of an update until released."""

    def __init__(self, monkeypatch):
        self.entered, self.release = threading.Event(), threading.Event()
        real = calibrator_mod.forward

        def forward(*args):
            if not self.entered.is_set():
                self.entered.set()
                assert self.release.wait(120), "the test never released the update"
            return real(*args)

        monkeypatch.setattr(calibrator_mod, "forward", forward)

    def start(self, cal):
        out = {}
        self.thread = threading.Thread(target=lambda: out.update(record=cal.update()), daemon=True)
        self.thread.start()
        assert self.entered.wait(120)
        self.t_entered = time.monotonic()
        return out

    def finish(self):
        self.release.set()
        self.thread.join(120)
        assert not self.thread.is_alive()


def test_a_stale_build_lock_does_not_stop_the_calibrator(served, tmp_path, monkeypatch):
    """The lock a DeepSpeed comm op build stopped midway leaves in the torch extensions cache: the
    calibrator never builds an op, so its first update completes (it waited for ever before)."""
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    cal = served.cal
    assert cal._engine is None  # this is its first update: the trainer is made now
    out = {}
    t = threading.Thread(target=lambda: out.update(record=cal.update()), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), f"the calibrator's first update hung: {cal.heartbeat.snapshot()}"
    assert out["record"]["steps"] > 0 and "outcome" in out["record"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["deepspeed_shm_comm", "lock"]  # nothing was built
    assert not cal.heartbeat.snapshot()["working"]


def test_a_hung_update_is_reported_within_the_bound_and_clears(served, monkeypatch):
    def stalled_gauge():
        text = httpx.get(f"{served.url}/metrics", timeout=10).text
        (line,) = [x for x in text.splitlines() if x.startswith('dspark_background_stalled{part="calibrator"}')]
        return float(line.split()[-1])

    health = httpx.get(f"{served.url}/health", timeout=10).json()
    assert health["status"] == "ok" and stalled_gauge() == 0
    hang = Blocked(monkeypatch)
    hang.start(served.cal)
    while True:  # /health, polled as a load balancer would
        r = httpx.get(f"{served.url}/health", timeout=10)
        if r.json()["status"] != "ok":
            break
        assert time.monotonic() - hang.t_entered < BOUND + 5, r.json()
        time.sleep(0.05)
    delay = time.monotonic() - hang.t_entered
    try:
        assert r.status_code == 200 and r.json()["status"] == "degraded", r.json()
        reason = r.json()["reason"]
        assert reason.startswith("calibrator: no progress for") and "optimiser step 1 of" in reason, reason
        assert BOUND - 0.2 <= delay < BOUND + 2, delay
        st = httpx.get(f"{served.url}/admin/drafter", timeout=10).json()
        assert st["stalled"] == [st["calibrator"]["heartbeat"]["reason"]] and st["calibrator"]["heartbeat"]["working"]
        assert stalled_gauge() == 1
        # still serving meanwhile
        r = httpx.post(f"{served.url}/v1/completions", timeout=60, json={
            "model": "tiny-moe", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "calibrate": False})
        assert r.status_code == 200
    finally:
        hang.finish()
    assert httpx.get(f"{served.url}/health", timeout=10).json()["status"] == "ok"
    assert httpx.get(f"{served.url}/admin/drafter", timeout=10).json()["stalled"] == []
    assert stalled_gauge() == 0
    print(f"stall reported {delay:.2f} s after the update hung (bound {BOUND} s)")


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k].float(), b[k].float()) for k in b)


def test_publishing_and_rolling_back_during_an_update_wait_for_its_end(served, monkeypatch):
    cal = served.cal
    cal.set_serving(0)
    base = cal.serving
    g = torch.Generator().manual_seed(0)
    other = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in cal.versions[0].items()}
    v = max(cal.versions) + 1
    with cal._lock:
        cal.versions[v] = other
        cal.next_version = max(cal.next_version, v + 1)
    trainable = set(cal.versions[0])

    def trained_weights():
        return {k: t for k, t in _weights(cal.model).items() if k in trainable}

    # a publish, then a rollback, while the update runs: neither touches the model in training
    hang = Blocked(monkeypatch)
    out = hang.start(cal)
    before = trained_weights()
    cal.set_serving(v, keep={0, v})
    assert cal.serving == base and cal.status()["switch_after_update"] == v and _same(trained_weights(), before)
    cal.set_serving(0, keep={0, v})
    assert cal.serving == base and cal.status()["switch_after_update"] == 0 and _same(trained_weights(), before)
    hang.finish()
    record = out["record"]
    assert record["outcome"].startswith("discarded (the serving version changed to 0"), record
    assert cal.serving == 0 and cal.pending is None and cal.status()["switch_after_update"] is None
    assert _same(trained_weights(), cal.versions[0])  # trains on from the version that serves, not a blend

    # a publish alone: it takes effect after the update, whose candidate is dropped
    hang = Blocked(monkeypatch)
    out = hang.start(cal)
    cal.set_serving(v, keep={0, v})
    assert cal.serving == 0
    hang.finish()
    assert out["record"]["outcome"].startswith(f"discarded (the serving version changed to {v}")
    assert cal.serving == v and cal.pending is None and _same(trained_weights(), other)
    assert v in cal.versions and cal.updates_log()[-1]["outcome"] == out["record"]["outcome"]
    cal.set_serving(0, keep={0})  # between updates: at once
    assert cal.serving == 0 and _same(trained_weights(), cal.versions[0]) and v not in cal.versions
