"""Prometheus metrics: one table of every name this project exports, each with its one meaning
(`METRICS`, below, is where each name is documented), one writer of each name (`EngineMetrics`),
and two sinks it writes through: `dspark serve`'s /metrics (`PrometheusSink`, a registry of the
server's own) and Ray's metrics export (actors/metrics.py, the Router's). A name that both sinks
export was computed by the same line from the same source, so it means the same in both.

Where the values come from:
- state, from the engine's `stats()` (`EngineMetrics.set_stats`): what holds now, or totals since
  the engine started. The server reads it at each scrape; the Router every few seconds.
- steps and requests, pushed by the engine core after each step and each finished request
  (`observe_step`, `observe_request`, `observe_experts`): only where the engine runs (the Router).
- the HTTP layer's own (`dspark_http_*`): the server's.
- the cost ledger's gauges: their table is `cost.ledger_metrics` (names, meanings, labels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .cost import label_names, ledger_metrics
from .heartbeat import PARTS

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class Metric:
    name: str  # as exported (counters end in _total)
    kind: str  # counter | gauge | histogram
    source: str  # its one writer: state (set_stats) | step (observe_step, observe_experts) | request | http
    meaning: str
    labels: tuple = ()
    buckets: Optional[tuple] = None  # histograms


G, C, H = "gauge", "counter", "histogram"
L, T = LATENCY_BUCKETS, TPOT_BUCKETS


def _table(*groups: tuple) -> dict[str, Metric]:
    """(source, rows): each row (name, kind, meaning[, labels[, buckets]])."""
    table = {}
    for source, *rows in groups:
        for name, kind, meaning, *rest in rows:
            assert name not in table, f"{name}: declared twice"
            table[name] = Metric(name, kind, source, meaning, *rest)
    return table


METRICS = _table(
    ("state",  # set_stats: from the engine's stats(); what holds now, or since the engine started
     ("dspark_engine_up", G, "1 while the engine serves (state ok), else 0"),
     ("dspark_engine_restarts", G, "Restarts of the target's workers after a lost worker, since the engine started"),
     ("dspark_kv_blocks_used", G, "KV cache blocks in use"),
     ("dspark_kv_blocks_total", G, "KV cache blocks in the pool"),
     ("dspark_num_requests_running", G, "Requests in the running batch"),
     ("dspark_num_requests_waiting", G, "Requests waiting to be scheduled"),
     ("dspark_preemptions", G, "Preemptions since the engine started"),
     ("dspark_prefix_cache_hit_rate", G, "Prompt tokens found in the prefix cache at admission / prompt tokens "
                                         "looked up, since the engine started"),
     ("dspark_prefix_cache_hit_tokens", G, "Prompt tokens found in the prefix cache at admission, since the engine "
                                           "started"),
     ("dspark_spec_verify_budget", G, "Tokens the last step ran, drafts verified included (0 without a drafter)"),
     ("dspark_spec_verified_share", G, "Share of the drafted positions that the verify budget admitted, since the "
                                       "engine started"),
     ("dspark_spec_mean_accepted_length", G, "Tokens per verify round, since the engine started"),
     ("dspark_spec_learn_failures", G, "Steps whose verify outcomes the drafter's statistics and the verify planner "
                                       "could not learn from (logged; the steps' tokens stand), since the engine started"),
     ("dspark_drafter_version", G, "The drafter version serving (online calibration)"),
     ("dspark_drafter_live_tau", G, "Tokens per verify round of the serving drafter version over its last "
                                    "window_rounds"),
     ("dspark_background_stalled", G, "1 while a background part (calibrator, expert_staging, drafter_restart) "
                                      "should be working but has not progressed for parallel.stall_after_s, else 0 "
                                      "(the engine serves on: /health says degraded)", ("part",)),
     ("dspark_background_seconds_since_progress", G, "Seconds since a background part last progressed or began "
                                                     "to wait (0 for a part this engine does not run)", ("part",))),
    ("step",  # observe_step, observe_experts: pushed by the engine core after a step
     ("dspark_step_time_seconds", H, "Wall time of one engine step", (), L),
     ("dspark_num_running_seqs", G, "Sequences in the last step"),
     ("dspark_step_tokens", G, "Tokens in the last step"),
     ("dspark_spec_drafted_positions_total", C, "Draft positions proposed (verified or not)"),
     ("dspark_spec_verified_positions_total", C, "Draft positions the verify budget admitted"),
     ("dspark_expert_balancedness", G, "Mean / max tokens per rank over the window", ("layer",)),
     ("dspark_expert_rebalances", G, "Expert placements committed so far")),
    ("request",  # observe_request: pushed by the engine core when a request finishes
     ("dspark_time_to_first_token_seconds", H, "Time from arrival to the first output token", (), L),
     ("dspark_time_per_output_token_seconds", H, "Mean time per output token after the first", (), L),
     ("dspark_inter_token_latency_seconds", H, "Time between consecutive output tokens", (), L),
     ("dspark_e2e_request_latency_seconds", H, "Time from arrival to the last token", (), L),
     ("dspark_requests_finished_total", C, "Finished requests", ("finish_reason",)),
     ("dspark_generation_tokens_total", C, "Output tokens of finished requests"),
     ("dspark_prompt_tokens_total", C, "Prompt tokens of finished requests"),
     ("dspark_spec_draft_tokens_total", C, "Draft tokens proposed, over finished requests"),
     ("dspark_spec_accepted_tokens_total", C, "Draft tokens accepted, over finished requests")),
    ("http",  # the HTTP server's own
     ("dspark_http_time_to_first_token_seconds", H, "Request arrival at the server to its first token, per choice",
      (), L),
     ("dspark_http_time_per_output_token_seconds", H, "Mean time per output token after the first, per choice", (), T),
     ("dspark_http_request_latency_seconds", H, "Request arrival to its last byte of output", (), L),
     ("dspark_http_requests_total", C, "HTTP requests by endpoint and status code", ("endpoint", "status")),
     ("dspark_http_choices_finished_total", C, "Generated choices by finish reason", ("finish_reason",)),
     ("dspark_http_prompt_tokens_total", C, "Prompt tokens of served requests"),
     ("dspark_http_generation_tokens_total", C, "Tokens generated for served requests"),
     ("dspark_http_streams_open", G, "Streaming responses in progress")),
)


def names(source: str) -> tuple:
    return tuple(n for n, m in METRICS.items() if m.source == source)


def definition(name: str, help_text: Optional[str] = None) -> Metric:
    """The table's row for `name`; a cost gauge's from cost.ledger_metrics (its help, its labels)."""
    m = METRICS.get(name)
    if m is None:
        if help_text is None:
            raise KeyError(f"{name}: not in metrics.METRICS (every exported name is declared there, with its meaning)")
        m = Metric(name, G, "state", help_text, label_names(name))
    return m


class PrometheusSink:
    """prometheus_client metrics in a registry of their own (not the process-global one), declared
    from the table on first write (or up front: `declare`)."""

    def __init__(self, declare=()):
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()
        self._metrics: dict = {}
        for name in declare:
            self.get(name)

    def get(self, name: str, help_text: Optional[str] = None):
        m = self._metrics.get(name)
        if m is None:
            from prometheus_client import Counter, Gauge, Histogram

            d = definition(name, help_text)
            kw = dict(labelnames=d.labels, registry=self.registry)
            if d.kind == H:
                m = Histogram(d.name, d.meaning, buckets=d.buckets, **kw)
            else:
                m = (Counter if d.kind == C else Gauge)(d.name, d.meaning, **kw)
            self._metrics[name] = m
        return m

    def _one(self, name, labels, help_text=None):
        m = self.get(name, help_text)
        return m.labels(**labels) if labels else m

    def set(self, name: str, value: float, labels: Optional[dict] = None, help_text: Optional[str] = None) -> None:
        self._one(name, labels, help_text).set(value)

    def inc(self, name: str, value: float = 1.0, labels: Optional[dict] = None) -> None:
        self._one(name, labels).inc(value)

    def dec(self, name: str, value: float = 1.0, labels: Optional[dict] = None) -> None:
        self._one(name, labels).dec(value)

    def observe(self, name: str, value: float, labels: Optional[dict] = None) -> None:
        self._one(name, labels).observe(value)


def _finite(v) -> float:
    return v if v is not None and v == v else 0  # NaN (nothing drafted yet) shows as 0


class EngineMetrics:
    """The one writer of every engine metric, over a sink (PrometheusSink, or the Router's RaySink)."""

    def __init__(self, sink):
        self.sink = sink

    # ---- state ------------------------------------------------------------------------------
    def set_stats(self, s: dict) -> None:
        """From AsyncEngine.stats() (a client's stats(): the same dict)."""
        w = self.sink.set
        w("dspark_kv_blocks_used", s.get("kv_blocks_used", 0))
        w("dspark_kv_blocks_total", s.get("kv_blocks_total", 0))
        w("dspark_num_requests_running", s.get("running", 0))
        w("dspark_num_requests_waiting", s.get("waiting", 0))
        w("dspark_preemptions", s.get("preemptions", 0))
        w("dspark_engine_restarts", s.get("restarts") or 0)
        hits, queries = s.get("prefix_cache_hits") or 0, s.get("prefix_cache_queries") or 0
        w("dspark_prefix_cache_hit_tokens", hits)
        w("dspark_prefix_cache_hit_rate", hits / max(1, queries))
        self.set_up((s.get("state") or "ok") == "ok")
        spec = s.get("speculative") or {}
        w("dspark_spec_verify_budget", s.get("verify_budget") or 0)
        w("dspark_spec_verified_share", _finite(spec.get("verified_share")))
        w("dspark_spec_mean_accepted_length", _finite(spec.get("mean_accepted_length")))
        w("dspark_spec_learn_failures", spec.get("learn_failures") or 0)
        versions = spec.get("drafter_versions") or {}
        w("dspark_drafter_version", versions.get("serving_version") or 0)
        w("dspark_drafter_live_tau", versions.get("live_tau") or 0)
        self.set_background(s.get("background") or [])
        if s.get("cost"):
            self.set_ledger(s["cost"])

    def set_background(self, beats: list) -> None:
        """One series per part (heartbeat.PARTS), a part the engine does not run at 0."""
        by_part = {b["part"]: b for b in beats}
        for part in PARTS:
            b = by_part.get(part) or {}
            self.sink.set("dspark_background_stalled", 1 if b.get("stalled") else 0, {"part": part})
            self.sink.set("dspark_background_seconds_since_progress", b.get("seconds_since_progress") or 0,
                          {"part": part})

    def set_up(self, up: bool) -> None:
        self.sink.set("dspark_engine_up", 1 if up else 0)

    def set_ledger(self, ledger: dict) -> None:
        """The cost gauges, declared from the core's one table (cost.ledger_metrics)."""
        for name, help_text, labels, value in ledger_metrics(ledger):
            self.sink.set(name, value, labels, help_text=help_text)

    # ---- pushed by the engine core ----------------------------------------------------------
    def observe_step(self, s: dict) -> None:
        """One step's stats (engine.step_stats[-1])."""
        k = self.sink
        k.observe("dspark_step_time_seconds", s["step_time_s"])
        k.set("dspark_num_running_seqs", s["num_seqs"])
        k.set("dspark_step_tokens", s["num_tokens"])
        if s["num_drafted"]:
            k.inc("dspark_spec_drafted_positions_total", s["num_drafted"])
        if s["num_verified"]:
            k.inc("dspark_spec_verified_positions_total", s["num_verified"])

    def observe_experts(self, balancedness: list, rebalances: int) -> None:
        for layer, b in enumerate(balancedness):
            self.sink.set("dspark_expert_balancedness", b, {"layer": str(layer)})
        self.sink.set("dspark_expert_rebalances", rebalances)

    def observe_request(self, seq) -> None:
        """A finished request (its Sequence)."""
        k, m = self.sink, seq.metrics()
        if m["ttft_s"] is not None:
            k.observe("dspark_time_to_first_token_seconds", m["ttft_s"])
        if m["num_output_tokens"] > 1:
            k.observe("dspark_time_per_output_token_seconds", m["tpot_s"])
        for gap in m["itl_s"]:
            k.observe("dspark_inter_token_latency_seconds", gap)
        if m["e2e_s"] is not None:
            k.observe("dspark_e2e_request_latency_seconds", m["e2e_s"])
        k.inc("dspark_requests_finished_total", 1, {"finish_reason": seq.finish_reason or "unknown"})
        for name, key in (("dspark_generation_tokens_total", "num_output_tokens"),
                          ("dspark_prompt_tokens_total", "num_prompt_tokens"),
                          ("dspark_spec_draft_tokens_total", "num_draft_tokens"),
                          ("dspark_spec_accepted_tokens_total", "num_accepted_tokens")):
            if m[key]:  # (Ray's counters take positive increments only)
                k.inc(name, m[key])
