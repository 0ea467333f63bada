"""One metrics path: every exported name is declared once in dspark_cluster.metrics.METRICS with
its meaning and its one writer, the server's /metrics and Ray's export are both written by
EngineMetrics, and a name means the same in both (dspark_spec_verified_share was "since start" in
one and "last step" in the other)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest

import actors.metrics as ray_metrics
from dspark_cluster.cost import TOKEN_KINDS
from dspark_cluster.metrics import METRICS, EngineMetrics, PrometheusSink, names
from dspark_cluster.http_edge import ServerMetrics

STATS = {"state": "ok", "restarts": 1, "kv_blocks_used": 3, "kv_blocks_total": 64, "running": 2, "waiting": 1,
         "preemptions": 4, "prefix_cache_hits": 30, "prefix_cache_queries": 120, "verify_budget": 17,
         "speculative": {"verified_share": 0.8, "mean_accepted_length": 2.5,
                         "drafter_versions": {"serving_version": 2, "live_tau": 2.25}}}
# the last step verified half of its drafts: "since start" (0.8) is what the gauge means, everywhere
STEP = {"step_time_s": 0.02, "num_seqs": 2, "num_tokens": 9, "num_drafted": 4, "num_verified": 2}


class _Seq:
    finish_reason = "length"

    def metrics(self):
        return {"ttft_s": 0.05, "tpot_s": 0.01, "itl_s": [0.01, 0.01], "e2e_s": 0.07, "num_output_tokens": 3,
                "num_prompt_tokens": 5, "num_draft_tokens": 4, "num_accepted_tokens": 2, "num_cached_tokens": 0}


def _feed(m: EngineMetrics) -> None:
    m.set_stats(STATS)
    m.observe_step(STEP)
    m.observe_experts([0.5, 0.75], 1)
    m.observe_request(_Seq())


class _Recorder:
    """A sink that records (name, value, labels) per write."""

    def __init__(self):
        self.writes = []

    def set(self, name, value, labels=None, help_text=None):
        self.writes.append((name, value, labels or {}))

    inc = observe = set


def test_every_name_is_declared_once_and_none_collides_in_one_registry():
    sink = PrometheusSink(declare=tuple(METRICS))  # prometheus_client refuses x next to x_total, x_count, ...
    ledger = {"cost": 1.0, "cost_per_million_output_tokens": 2.0, "memory": {"held_bytes": 3},
              "roles": {"target": {"device_seconds": 4.0, "utilisation": 0.5}}, "tokens": dict.fromkeys(TOKEN_KINDS, 1)}
    EngineMetrics(sink).set_ledger(ledger)  # the cost gauges (their table: cost.ledger_metrics) beside them
    assert all(m.meaning and m.source in ("state", "step", "request", "http") for m in METRICS.values())
    assert all(m.name.endswith("_total") for m in METRICS.values() if m.kind == "counter")
    text = generate_latest(sink.registry).decode()
    for name, m in METRICS.items():
        assert f"# HELP {name} {m.meaning}" in text


def test_each_writer_writes_only_its_own_names():
    for source, call in (("state", lambda m: m.set_stats({**STATS, "cost": None})),
                         ("step", lambda m: (m.observe_step(STEP), m.observe_experts([0.5], 1))),
                         ("request", lambda m: m.observe_request(_Seq()))):
        rec = _Recorder()
        call(EngineMetrics(rec))
        written = {name for name, _, _ in rec.writes}
        assert written == set(names(source)), source


class _FakeRay:
    """ray.util.metrics' Counter / Gauge / Histogram, recording what they are given."""

    def __init__(self, kind):
        self.kind, self.values = kind, {}

    def __call__(self, name, description="", tag_keys=(), boundaries=None):
        fake = _FakeRay(self.kind)
        fake.name, fake.tag_keys = name, tuple(tag_keys)
        made.append(fake)
        return fake

    def _key(self, tags):
        assert set(tags) == set(self.tag_keys)
        return tuple(sorted((k, v) for k, v in tags.items() if k != "model"))

    def set(self, value, tags):
        self.values[self._key(tags)] = value

    def inc(self, value, tags):
        assert value > 0  # Ray's counters refuse other increments
        self.values[self._key(tags)] = self.values.get(self._key(tags), 0) + value

    def observe(self, value, tags):
        n, s = self.values.get(self._key(tags), (0, 0.0))
        self.values[self._key(tags)] = (n + 1, s + value)


made: list = []


def test_a_name_means_the_same_in_the_server_and_in_ray(monkeypatch):
    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(ray_metrics, kind, _FakeRay(kind))
    made.clear()
    ray, server = ray_metrics.RayMetrics("tiny-moe"), ServerMetrics()
    for m in (ray, server):
        _feed(m)
    text = generate_latest(server.registry).decode()

    def sample(line_prefix):
        return [float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_prefix + " ")
                or line.startswith(line_prefix + "{")]

    checked = 0
    for fake in made:
        m = METRICS[fake.name]
        for key, value in fake.values.items():
            labels = ",".join(f'{k}="{v}"' for k, v in key)
            name = fake.name + ("_count" if m.kind == "histogram" else "")
            got = sample(f"{name}{{{labels}}}" if labels else name)
            want = value[0] if m.kind == "histogram" else value
            assert got and math.isclose(got[0], want), (fake.name, got, want)
            checked += 1
    assert checked >= 20
    assert sample("dspark_spec_verified_share") == [pytest.approx(0.8)]  # since start, not the last step's 0.5
    assert ray.sink.get("dspark_spec_verified_share").values == {(): 0.8}
