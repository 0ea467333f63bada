"""Prometheus metrics through Ray's metrics API (exported by each node's metrics agent)."""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

from dspark_cluster.cost import label_names, ledger_metrics

_LATENCY = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class RayMetrics:
    """Per-request and per-step metrics, named like vLLM's with a dspark_ prefix."""

    def __init__(self, model_name: str):
        tags = ("model",)
        self.tags = {"model": model_name}
        h = lambda name, desc: Histogram(name, desc, boundaries=_LATENCY, tag_keys=tags)  # noqa: E731
        self.ttft = h("dspark_time_to_first_token_seconds", "Time from arrival to the first output token")
        self.tpot = h("dspark_time_per_output_token_seconds", "Mean time per output token after the first")
        self.itl = h("dspark_inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = h("dspark_e2e_request_latency_seconds", "Time from arrival to the last token")
        self.step_time = h("dspark_step_time_seconds", "Wall time of one engine step")
        self.requests = Counter("dspark_requests_finished_total", "Finished requests", tag_keys=("model", "finish_reason"))
        self.gen_tokens = Counter("dspark_generation_tokens_total", "Output tokens", tag_keys=tags)
        self.prompt_tokens = Counter("dspark_prompt_tokens_total", "Prompt tokens", tag_keys=tags)
        self.cached_tokens = Counter("dspark_prefix_cache_hit_tokens_total",
                                     "Prompt tokens whose KV came from the prefix cache", tag_keys=tags)
        self.preemptions = Counter("dspark_preemptions_total", "Sequences preempted (recompute)", tag_keys=tags)
        self.running = Gauge("dspark_num_running_seqs", "Sequences in the last step", tag_keys=tags)
        self.step_tokens = Gauge("dspark_step_tokens", "Tokens in the last step", tag_keys=tags)
        self.kv_used = Gauge("dspark_kv_blocks_used", "KV cache blocks in use", tag_keys=tags)
        self.balancedness = Gauge("dspark_expert_balancedness", "Mean / max tokens per rank over the window",
                                  tag_keys=("model", "layer"))
        self.rebalances = Gauge("dspark_expert_rebalances", "Expert placements committed so far", tag_keys=tags)
        self.draft_tokens = Counter("dspark_spec_draft_tokens_total", "Draft tokens proposed", tag_keys=tags)
        self.accepted_tokens = Counter("dspark_spec_accepted_tokens_total", "Draft tokens accepted", tag_keys=tags)
        self.drafted = Counter("dspark_spec_drafted_positions_total", "Draft positions proposed (verified or not)",
                               tag_keys=tags)
        self.verified = Counter("dspark_spec_verified_positions_total", "Draft positions the verify budget admitted",
                                tag_keys=tags)
        self.verify_budget = Gauge("dspark_spec_verify_budget", "Tokens the last step ran, drafts verified included",
                                   tag_keys=tags)
        self.verified_share = Gauge("dspark_spec_verified_share", "Share of the last step's drafts that were verified",
                                    tag_keys=tags)
        self.drafter_version = Gauge("dspark_drafter_version", "The drafter version serving (online calibration)",
                                     tag_keys=tags)
        self._ledger: dict = {}  # cost gauges by name, declared at their first sample
        self.restarts = Counter("dspark_engine_restarts_total", "Restarts of the target's workers after a lost worker",
                                tag_keys=tags)

    def observe_step(self, s: dict) -> None:
        self.step_time.observe(s["step_time_s"], self.tags)
        self.running.set(s["num_seqs"], self.tags)
        self.step_tokens.set(s["num_tokens"], self.tags)
        self.kv_used.set(s["kv_blocks_used"], self.tags)
        if s["num_preempted"]:
            self.preemptions.inc(s["num_preempted"], self.tags)
        self.verify_budget.set(s["verify_budget"], self.tags)
        if s["num_drafted"]:
            self.drafted.inc(s["num_drafted"], self.tags)
            self.verified_share.set(s["num_verified"] / s["num_drafted"], self.tags)
        if s["num_verified"]:
            self.verified.inc(s["num_verified"], self.tags)
        self.drafter_version.set(s.get("drafter_version", 0), self.tags)

    def observe_ledger(self, ledger: dict) -> None:
        """The cost gauges, declared from the core's one table (cost.ledger_metrics)."""
        for name, help_text, labels, value in ledger_metrics(ledger):
            gauge = self._ledger.get(name)
            if gauge is None:
                gauge = self._ledger[name] = Gauge(name, help_text, tag_keys=("model", *label_names(name)))
            gauge.set(value, {**self.tags, **labels})

    def observe_restarts(self, count: int) -> None:
        self.restarts.inc(count, self.tags)

    def observe_experts(self, balancedness: list, rebalances: int) -> None:
        for layer, b in enumerate(balancedness):
            self.balancedness.set(b, {**self.tags, "layer": str(layer)})
        self.rebalances.set(rebalances, self.tags)

    def observe_request(self, seq) -> None:
        m = seq.metrics()
        if m["ttft_s"] is not None:
            self.ttft.observe(m["ttft_s"], self.tags)
        if m["num_output_tokens"] > 1:
            self.tpot.observe(m["tpot_s"], self.tags)
        for gap in m["itl_s"]:
            self.itl.observe(gap, self.tags)
        if m["e2e_s"] is not None:
            self.e2e.observe(m["e2e_s"], self.tags)
        self.requests.inc(1, {**self.tags, "finish_reason": seq.finish_reason or "unknown"})
        if m["num_output_tokens"]:
            self.gen_tokens.inc(m["num_output_tokens"], self.tags)
        if m["num_draft_tokens"]:
            self.draft_tokens.inc(m["num_draft_tokens"], self.tags)
        if m["num_accepted_tokens"]:
            self.accepted_tokens.inc(m["num_accepted_tokens"], self.tags)
        self.prompt_tokens.inc(m["num_prompt_tokens"], self.tags)
        if m["num_cached_tokens"]:
            self.cached_tokens.inc(m["num_cached_tokens"], self.tags)
