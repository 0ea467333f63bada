"""The in-process engine (`executor: local`): scheduler, paged KV cache and one model on one device.

`add_request` validates and queues; `step` runs one iteration of continuous batching and returns
the tokens each request gained. `LLM` drives it; the Ray router drives the same scheduler.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from .balancer import ExpertBalancer
from .config import Config
from .cost import cost_ledger
from .errors import CheckpointError, EngineError, RequestError, StepError, WorkerError
from .executor import make_executor
from .kv_cache import BlockManager
from .model.spec import ModelSpec, ignore_remote_code, load_spec
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .speculative.drafting import Drafter
from .speculative.proposers import DraftRequest
from .speculative.spec_decode import Proposal
from .speculative.verify_budget import StepCost, VerifyPlanner
from .outputs import TokenEvent, TokenLogprob
from .step import StepInput, StepOutput, build_step_input, profile_input

log = logging.getLogger(__name__)

# per-step statistics kept for live metrics in a long-running server; a run's report records every
# step through `LLMEngine.step_record`
STEP_STATS_KEPT = 4096


def load_tokenizer(path) -> Optional[object]:
    """The checkpoint's tokenizer, or None when it ships none (then prompts must be token ids)."""
    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    remote = ignore_remote_code(p, "tokenizer_config.json")
    try:
        return AutoTokenizer.from_pretrained(str(p), trust_remote_code=False)
    except ValueError as e:
        if not remote:
            raise CheckpointError(f"{p}: the tokenizer cannot be loaded: {e}") from None
        raise CheckpointError(
            f"{p}/tokenizer_config.json: 'auto_map' names the checkpoint's own tokenizer code and transformers has no "
            "built-in class for it; DSpark never runs remote code (trust_remote_code=False). Ship a tokenizer.json "
            "(a fast tokenizer), or set model.tokenizer to a folder with one") from None


@dataclass
class _InFlight:
    """A step scheduled and submitted whose output is not processed yet."""

    scheds: list  # SchedulerOutput per data-parallel group
    inputs: list  # StepInput per data-parallel group
    handle: object  # the executor's, for wait()
    submit_s: float
    ahead_ok: bool  # built for async scheduling: the next step may take its tokens as inputs
    processed: bool = False  # its tokens were handed to the scheduler
    scheduled_ahead: bool = False  # submitted while the step before it ran (its wait includes that one)


def _token_logprobs(rows, sampled: dict, out: StepOutput) -> dict:
    """seq_id -> a TokenLogprob per token each sample row produced (rows that asked for them)."""
    out_lp, out_ids, out_top = out.token_logprobs.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
    lps = {}
    for i, s in enumerate(rows):
        k = s.seq.params.logprobs
        if k is None or s.seq.seq_id not in sampled:
            continue
        lps[s.seq.seq_id] = [TokenLogprob(tok, out_lp[i][j], tuple(zip(out_ids[i][j][:k], out_top[i][j][:k])))
                             for j, tok in enumerate(sampled[s.seq.seq_id])]
    return lps


def _store_prompt_logprobs(scheduled, step_in: StepInput, out: StepOutput) -> None:
    """Each scored prompt token's TokenLogprob, at its index in its sequence (a chunk computed
    again after a preemption writes the same values again)."""
    lp, ids, top = out.prompt_token_logprobs.tolist(), out.prompt_top_ids.tolist(), out.prompt_top_logprobs.tolist()
    for i, (row, index, target) in enumerate(zip(step_in.prompt_lp_row.tolist(), step_in.prompt_lp_index.tolist(),
                                                 step_in.prompt_lp_target.tolist())):
        seq = scheduled[row].seq
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None] * seq.num_prompt_tokens
        k = seq.params.prompt_logprobs
        seq.prompt_logprobs[index] = TokenLogprob(target, lp[i], tuple(zip(ids[i][:k], top[i][:k])))


def _rollback(scheds: list) -> None:
    """Undo what scheduling advanced for a step whose output will never be processed."""
    for sc in scheds:
        for s in sc.scheduled:
            s.seq.num_computed_tokens = min(s.seq.num_computed_tokens, s.start)
            s.seq.num_pending -= s.samples


class LLMEngine:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.spec: ModelSpec = load_spec(cfg.model.path, cfg.model.dtype)
        self.executor = make_executor(cfg, self.spec)
        sc = cfg.scheduler
        self.block_size = sc.block_size
        self.num_blocks = self.executor.num_blocks
        self.max_model_len = sc.max_model_len or self.spec.max_position_embeddings
        # one scheduler and KV pool per data-parallel group; each group runs its own batch, and the
        # groups meet in the expert-parallel all-to-all
        self.num_groups = cfg.parallel.data
        self.drafter = None
        if cfg.speculative.enabled:
            try:
                self.drafter = Drafter(cfg, self.spec, self.executor.device)
            except BaseException:  # a refused or failed drafter group: the started target goes too
                self.executor.shutdown()
                raise
        lookahead = cfg.speculative.num_tokens if self.drafter is not None else 0
        self.schedulers = [
            Scheduler(BlockManager(self.num_blocks, sc.block_size, sc.prefix_caching), sc.max_num_seqs,
                      sc.max_num_batched_tokens,
                      self.max_model_len, lookahead)
            for _ in range(self.num_groups)
        ]
        for g in self.schedulers:  # a DSpark drafter needs the target's states of every context token
            g.cache_skips_speculative = self.drafter is not None and cfg.speculative.method == "dspark"
        self.planner: Optional[VerifyPlanner] = None  # speculative.schedule: confidence
        if self.drafter is not None and cfg.speculative.schedule == "confidence":
            self.planner = VerifyPlanner(lookahead, self._profile_step_cost(), cfg.speculative.method)
        self.balancer = None
        if self.spec.is_moe:
            self.balancer = ExpertBalancer(cfg, sum(self.spec.moe_layers), self.spec.num_experts,
                                           cfg.parallel.world_size, self.spec.n_group)
            self.balancer.enabled = self.balancer.enabled and cfg.parallel.world_size > 1
        self._commit_version = None
        self._migration_bytes = 0
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
        self.seqs: dict[str, Sequence] = {}
        self.step_stats: deque = deque(maxlen=STEP_STATS_KEPT)  # the latest steps (bounded: servers run for long)
        self.step_record: Optional[list] = None  # every step's stats, when a run's report asks for them
        self.num_steps = self.num_overlapped_steps = 0
        self.num_drafted = self.num_verified = 0  # draft positions proposed / verified, over the run
        # fault tolerance (executor ray): target restarts so far, and whether one is under way
        self.num_restarts, self.restarting = 0, False
        self.last_restart: Optional[dict] = None  # step, teardown and start-up seconds of the last restart
        self._speculation_wanted = True  # the run-time switch, as last set (a drafter restart restores it)
        # async scheduling: schedule step n+1 while the workers run step n (see step())
        mode = sc.async_scheduling
        self.async_scheduling = cfg.parallel.executor == "ray" if mode == "auto" else bool(mode)
        self._inflight: Optional[_InFlight] = None
        self._scheduling = None  # the step being submitted (to fail its requests if that fails)
        self._drafter_version = 0  # online calibration: the drafter version the planner's window is of
        cal = cfg.speculative.calibration
        self._record_rounds = self.drafter is not None and cal.enabled
        # the cost ledger's counters since start (a run's ledger is the difference of two usage() snapshots)
        self.forward_s_total = 0.0  # the driver ranks' forward seconds
        self.export_bytes_total = 0
        self.num_prompt_tokens = self.num_output_tokens = 0
        self.kv_peak_blocks = [0] * self.num_groups  # per data-parallel group
        self._devices: Optional[tuple] = None  # (the target's, the drafter's) device reports as last read
        self._usage_at_start = self.usage()

    def _profile_step_cost(self, repeats: int = 5) -> StepCost:
        """T(B) at start-up: greedy verify steps of B tokens (up to the most a step can verify:
        max_num_seqs rows of 1 + num_tokens), the fastest of `repeats` after one warm-up each."""
        sc, k = self.cfg.scheduler, self.cfg.speculative.num_tokens
        rows_max = sc.max_num_seqs
        cap = max(1, min(sc.max_num_batched_tokens, rows_max * (1 + k)))
        grid = sorted({min(2**i, cap) for i in range(cap.bit_length() + 1)} | {cap})
        tokens, seconds = [], []
        for B in grid:
            rows = min(B, rows_max)
            q = -(-B // rows)
            inp = profile_input(rows, q, self.block_size, self.num_blocks)
            times = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                self.executor.wait(self.executor.submit([inp] * self.num_groups if self.num_groups > 1 else inp))
                times.append(time.perf_counter() - t)
            if rows * q not in tokens:
                tokens.append(rows * q)
                seconds.append(min(times[1:]))
        log.info("step cost profile (tokens: ms): %s",
                 ", ".join(f"{b}: {1e3 * t:.1f}" for b, t in zip(tokens, seconds)))
        return StepCost(tokens, seconds)

    # ---- requests -------------------------------------------------------------------------
    def encode(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt: got text, but the checkpoint has no tokenizer; pass token ids (list[int])")
            return list(self.tokenizer(prompt)["input_ids"])
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError(f"prompt: got {type(prompt).__name__}; expected a string or a list of token ids")
        bad = [t for t in prompt if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise RequestError(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {self.spec.vocab_size})")
        return list(prompt)

    def add_request(self, prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None) -> str:
        """Validate and queue a request; raises RequestError naming what is wrong."""
        seq = self.make_sequence(prompt, params, request_id)
        self.enqueue(seq)
        return seq.request_id

    def make_sequence(self, prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None) -> Sequence:
        """Validation without touching the scheduler (safe from another thread)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params: got {type(params).__name__}; expected SamplingParams")
        if params.top_k > self.spec.vocab_size:
            raise RequestError(f"top_k: got {params.top_k}; at most the vocabulary size {self.spec.vocab_size} "
                               "(0 = no top-k filter)")
        ids = self.encode(prompt)
        if not ids:
            raise RequestError("prompt: empty; give at least one token")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"prompt: {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                "(prompt plus at least one new token); shorten the prompt or raise scheduler.max_model_len"
            )
        capacity = self.num_blocks * self.block_size
        if len(ids) + 1 > capacity:
            raise RequestError(
                f"prompt: {len(ids)} tokens do not fit the KV cache ({capacity} tokens); "
                "raise scheduler.kv_cache_memory or num_kv_blocks"
            )
        return Sequence(request_id or uuid.uuid4().hex, ids, len(ids), params, self.spec.eos_token_ids)

    def enqueue(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            raise RequestError(f"request_id: {seq.request_id!r} is already in use")
        self.seqs[seq.request_id] = seq
        self.num_prompt_tokens += seq.num_prompt_tokens
        # the data-parallel group with the least work takes the request
        min(self.schedulers, key=lambda g: len(g.running) + len(g.waiting)).add(seq)

    @property
    def scheduler(self) -> Scheduler:
        """The first data-parallel group's scheduler (the only one when data = 1)."""
        return self.schedulers[0]

    @property
    def block_manager(self) -> BlockManager:
        return self.schedulers[0].blocks

    def abort_request(self, request_id: str, reason: str = "abort") -> list[Sequence]:
        removed = [s for g in self.schedulers for s in g.abort(request_id, reason)]
        if self.drafter is not None and removed:  # its drafter state goes too (and none of its rounds is learnt)
            self.drafter.free([s.seq_id for s in removed], {s.seq_id: reason for s in removed})
        return removed

    def has_unfinished(self) -> bool:
        return self._inflight is not None or any(g.has_unfinished() for g in self.schedulers)

    def load(self) -> dict:
        """Totals over the data-parallel groups."""
        return {
            "kv_blocks_total": self.num_blocks * self.num_groups,
            "kv_blocks_used": sum(g.blocks.num_used for g in self.schedulers),
            "running": sum(len(g.running) for g in self.schedulers),
            "waiting": sum(len(g.waiting) for g in self.schedulers),
            "preemptions": sum(g.num_preemptions for g in self.schedulers),
            # prefix caching, since start: prompt tokens looked up at admission and found cached
            "prefix_cache_queries": sum(g.prefix_cache_queries for g in self.schedulers),
            "prefix_cache_hits": sum(g.prefix_cache_hits for g in self.schedulers),
            "prefix_cache_evictions": sum(g.blocks.num_evicted for g in self.schedulers),
        }

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Process one step's output and return the tokens it gave. With async scheduling the next
        step is scheduled and submitted first, so the workers compute it while this process handles
        the output of the one before (the step's own tokens reach the workers from their own output).

        Failures: a lost worker (WorkerError) restarts the workers and re-runs every request in
        flight from its tokens (up to parallel.max_restarts; then EngineError). Any other error in a
        step fails that step's requests only (StepError names them; they are finished with reason
        "error" and their KV freed) and the engine steps on."""
        t0 = time.perf_counter()
        events: list[TokenEvent] = []
        step, self._inflight = self._inflight, None
        self._scheduling = None
        if self.drafter is not None:
            if self.drafter.poll(self.num_steps):
                self._apply_speculation()
            self._follow_drafter_version()
        try:
            if step is None:
                self._plan_drafts()
                step = self._schedule_and_submit(events, None)
                if step is None:
                    return self._free_drafts(events)
            if step.ahead_ok and self._plan_drafts() and self._overlap():
                self._inflight = self._schedule_and_submit(events, step)
            events.extend(self._process(step, t0))
        except BaseException as e:
            # scheduling advanced the sequences of every step not processed: undo it, so that the
            # engine (or a caller who catches this: LLM in process, an interrupt) can step again
            unprocessed = [u for u in (self._inflight, step) if u is not None and not u.processed]
            for u in unprocessed:
                _rollback(u.scheds)
            failed = [s.seq for u in unprocessed for sc in u.scheds for s in sc.scheduled]
            failed += [s.seq for sc in (self._scheduling or ()) for s in sc.scheduled]
            self._inflight = self._scheduling = None
            if isinstance(e, WorkerError):
                self._recover(e)
                return self._free_drafts(events)
            if not isinstance(e, Exception) or isinstance(e, EngineError):
                raise  # an interrupt, or the engine's own failure
            log.exception("a step failed; failing its %d request(s), the engine goes on", len(failed))
            raise StepError(self._fail(failed), e) from e
        return self._free_drafts(events)

    def _follow_drafter_version(self) -> None:
        """A published or rolled-back drafter version: the verify budget recalibrates on its rounds."""
        versions = self.drafter.versions
        if versions is not None and versions.serving != self._drafter_version:
            self._drafter_version = versions.serving
            if self.planner is not None:
                self.planner.drafter_changed()

    def drafter_status(self) -> dict:
        """Online calibration: the serving drafter version, its history and the calibrator's state."""
        if self.drafter is None:
            return {"calibration": False, "serving_version": None, "speculative": False}
        return self.drafter.status()

    def rollback_drafter(self, version: Optional[int] = None) -> dict:
        """Serve an earlier drafter version (None: the original weights) from the next step, and
        hold it until resume_drafter()."""
        if self.drafter is None:
            raise RequestError("version: speculative decoding is off; there is no drafter to roll back")
        out = self.drafter.rollback(version, self.num_steps)
        self._follow_drafter_version()
        return out

    def resume_drafter(self) -> dict:
        """After a manual rollback: let calibrated drafter versions publish again."""
        if self.drafter is None:
            raise RequestError("speculative decoding is off; there is no drafter to resume")
        return self.drafter.resume()

    def _fail(self, seqs: list[Sequence]) -> list[str]:
        """Finish these sequences with reason "error" and free their KV; returns their request ids."""
        ids = list(dict.fromkeys(seq.request_id for seq in seqs if not seq.finished))
        for rid in ids:
            for seq in self.abort_request(rid, reason="error"):
                self.release(seq.request_id)
        if self.drafter is not None:
            self.drafter.free([seq.seq_id for seq in seqs], {seq.seq_id: "error" for seq in seqs})
        return ids

    def _recover(self, error: WorkerError) -> None:
        """A target worker (or its node) was lost: tear the workers down, start new ones under the
        same placement rules, and queue every running request for recompute from the tokens it
        already has (prompt + output so far), so that clients see a pause and greedy outputs do
        not change. Raises EngineError once parallel.max_restarts are spent."""
        limit = self.cfg.parallel.max_restarts
        self.restarting = True
        try:
            while True:
                if self.num_restarts >= limit:
                    raise EngineError(f"the engine stopped: a worker failed and the {limit} restart(s) allowed "
                                      "(parallel.max_restarts) are spent") from error
                self.num_restarts += 1
                log.error("target worker lost (%s: %s); restart %d of %d", type(error.__cause__ or error).__name__,
                          error.__cause__ or error, self.num_restarts, limit)
                t0 = time.perf_counter()
                self.executor.shutdown()
                t1 = time.perf_counter()
                try:
                    self.executor = make_executor(self.cfg, self.spec)
                    self.last_restart = {"at_step": self.num_steps, "teardown_s": t1 - t0,
                                         "start_s": time.perf_counter() - t1}
                    log.warning("workers restarted: teardown %.2f s, new workers ready %.2f s",
                                t1 - t0, self.last_restart["start_s"])
                    break
                except Exception as e:  # noqa: BLE001 -- e.g. the lost node's devices are not back yet
                    log.error("restart %d failed: %s: %s", self.num_restarts, type(e).__name__, e)
                    error = e if isinstance(e, WorkerError) else WorkerError(str(e))
                    time.sleep(min(2.0 ** self.num_restarts, 30.0))
            self.num_blocks = self.executor.num_blocks
            self._devices = None  # new workers: their memory is read again
            for g in self.schedulers:
                g.requeue_all(BlockManager(self.num_blocks, self.block_size, self.cfg.scheduler.prefix_caching))
            if self.balancer is not None:  # new workers start from the default expert placement
                self.balancer.reset_placement()
            self._commit_version, self._migration_bytes = None, 0
        finally:
            self.restarting = False

    def drain(self) -> list[TokenEvent]:
        """Process the step in flight, if any, without scheduling another (async scheduling: the
        last requests may end by a stop token while the step after theirs already runs)."""
        step, self._inflight = self._inflight, None
        return self._free_drafts(self._process(step, time.perf_counter())) if step is not None else []

    def _free_drafts(self, events: list[TokenEvent]) -> list[TokenEvent]:
        if self.drafter is not None:
            done = [ev for ev in events if ev.finished]
            self.drafter.free([ev.seq.seq_id for ev in done], {ev.seq.seq_id: ev.finish_reason for ev in done})
        return events

    def _overlap(self) -> bool:
        """Schedule ahead: on when configured, off while speculating (drafts need the last tokens)."""
        return self.async_scheduling and not any(g.speculation_enabled and g.lookahead for g in self.schedulers)

    def _plan_drafts(self) -> bool:
        """Confidence schedule: choose how many positions the next step drafts (0 at a load where
        drafting does not pay: that step is plain decoding and may be scheduled ahead). True always."""
        if self.planner is not None:
            if any(g.speculation_enabled for g in self.schedulers):
                rows = sum(min(g.max_num_seqs, len(g.running) + len(g.waiting)) for g in self.schedulers)
                k = self.planner.draft_len(rows)
            else:
                k = 0
            for g in self.schedulers:
                g.lookahead = k
        return True

    def _schedule_and_submit(self, events: list, prev: Optional["_InFlight"]) -> Optional["_InFlight"]:
        """Schedule every data-parallel group and submit the step. `prev`: the step still in flight,
        whose sampled tokens this one takes as inputs."""
        scheds = [g.schedule() for g in self.schedulers]
        events.extend(TokenEvent(s.request_id, [], True, s.finish_reason, s) for sc in scheds for s in sc.finished)
        if not any(sc.scheduled for sc in scheds):
            return None
        try:
            return self._submit(scheds, prev)
        except BaseException:
            _rollback(scheds)
            self._scheduling = scheds  # for step(): the requests of a step that failed to start
            raise

    def _submit(self, scheds: list, prev: Optional["_InFlight"]) -> "_InFlight":
        self._attach_drafts(scheds)
        # drafter prompt prefill overlaps the target's prefill step (not while the confidence schedule
        # drafts nothing: a proposal catches up on what it missed)
        if self.drafter is not None and (self.planner is None or any(g.lookahead for g in self.schedulers)):
            self.drafter.prefill_async([
                DraftRequest(s.seq.seq_id, s.seq.token_ids, 0) for sc in scheds for s in sc.scheduled
                if s.samples and s.seq.num_output_tokens == 0 and s.seq.params.speculative
            ])
        # the next step may take this one's tokens as inputs only if each row samples one token
        ahead_ok = self._overlap() and not any(s.proposal for sc in scheds for s in sc.scheduled)
        # an idle group still runs an empty step: its ranks take part in the experts' all-to-all
        inputs = []
        export = self.drafter.export() if self.drafter is not None else None
        for g, sc in enumerate(scheds):
            prev_rows = None
            if prev is not None:
                prev_rows = {s.seq.seq_id: i for i, s in enumerate(r for r in prev.scheds[g].scheduled if r.samples)}
            step_in = build_step_input(sc.scheduled, self.schedulers[g].blocks.block_tables, self.block_size, prev_rows)
            step_in.share_sampled = ahead_ok and self.cfg.parallel.tensor > 1
            if export is not None and sc.scheduled:  # DSpark: the drafter reads the target's states
                step_in.export_layers, step_in.export_to = export
                # -1: a request that does not speculate exports nothing
                step_in.seq_ids = torch.tensor([s.seq.seq_id if s.seq.params.speculative else -1 for s in sc.scheduled],
                                               dtype=torch.long)
                if self._record_rounds:  # online calibration: the rounds of requests that let it are recorded
                    step_in.record_rounds = torch.tensor([s.seq.params.calibrate for s in sc.scheduled if s.samples],
                                                         dtype=torch.bool)
                    step_in.record_top_logprobs = self.cfg.speculative.calibration.top_logprobs
            inputs.append(step_in)
        if self.balancer is not None and self.cfg.parallel.world_size > 1:
            inputs[0].commit_placement, self._commit_version = self._commit_version, None
            inputs[0].placement_update = self.balancer.placement_update()
            for extra in inputs[1:]:
                extra.commit_placement, extra.placement_update = inputs[0].commit_placement, inputs[0].placement_update
        t = time.perf_counter()
        handle = self.executor.submit(inputs if self.num_groups > 1 else inputs[0])
        return _InFlight(scheds, inputs, handle, time.perf_counter() - t, ahead_ok, scheduled_ahead=prev is not None)

    def _process(self, step: "_InFlight", t0: float) -> list[TokenEvent]:
        """Wait for a submitted step and advance its sequences with the tokens it sampled."""
        t_wait = time.perf_counter()
        outs = self.executor.wait(step.handle)
        execute_time = step.submit_s + time.perf_counter() - t_wait
        outs = outs if isinstance(outs, list) else [outs]
        scheds, inputs = step.scheds, step.inputs
        if self.balancer is not None:
            self.balancer.observe(sum(o.expert_load for o in outs))
            if inputs[0].commit_placement is not None:
                self.balancer.committed(self._migration_bytes)
            elif outs[0].migration_ready:
                version = self.balancer.commit_version(True)
                if version is not None:  # None: already committing (its commit may not have been sent yet)
                    self._migration_bytes = outs[0].migration_bytes
                    self._commit_version = version
        verify_time = time.perf_counter() - t_wait
        if self.drafter is not None:  # in process, the exported context comes back with the output
            for out in outs:
                if out.context is not None:
                    self.drafter.ingest(out.context)
                    out.context = None
        step.processed = True
        events = []
        spec_rounds = spec_tokens = 0  # verify rounds this step and the tokens they produced (tau = tokens / rounds)
        for sc, g, step_in, out in zip(scheds, self.schedulers, inputs, outs):
            rows = [sc.scheduled[r] for r in step_in.sample_rows.tolist()]
            sampled = {s.seq.seq_id: toks[:n] for s, toks, n in zip(rows, out.sampled.tolist(), out.num_tokens.tolist())}
            token_lps = _token_logprobs(rows, sampled, out) if out.token_logprobs is not None else {}
            if out.prompt_token_logprobs is not None:
                _store_prompt_logprobs(sc.scheduled, step_in, out)
            if self.drafter is not None:
                for s in rows:
                    if s.proposal is not None:
                        self.drafter.stats.record(s.num_draft, len(sampled[s.seq.seq_id]) - 1, s.proposal.confidences)
                round_tokens = [len(sampled[s.seq.seq_id]) for s in rows if s.proposal is not None]
                self.drafter.observe_rounds(round_tokens, [s.num_draft for s in rows if s.proposal is not None],
                                            self.num_steps)
                spec_rounds += len(round_tokens)
                spec_tokens += sum(round_tokens)
                drafted = [s for s in rows if s.draft_confidences is not None and s.seq.seq_id in sampled]
                if self.planner is not None and drafted:
                    self.planner.observe(np.stack([s.draft_confidences for s in drafted]),
                                         [s.num_draft for s in drafted],
                                         [len(sampled[s.seq.seq_id]) - 1 for s in drafted])
            for seq, new in g.update(sc.scheduled, sampled):
                lps = token_lps.get(seq.seq_id)
                if lps is not None:
                    lps = lps[: len(new)]  # a stop token or the length limit may end the row early
                    seq.output_logprobs.extend(lps)
                events.append(TokenEvent(seq.request_id, new, seq.finished, seq.finish_reason, seq, lps))
                self.num_output_tokens += len(new)
        if self.drafter is not None:
            self.drafter.stats.verify_time_s += verify_time
        stats = (
            {
                "time": time.monotonic(),
                # with async scheduling: waiting for this step plus scheduling the next one
                "step_time_s": time.perf_counter() - t0,
                "execute_s": execute_time,  # submitting + waiting for the round (in process: the forward itself)
                "forward_s": max(o.forward_s for o in outs),  # the driver ranks' own time in execute_step
                "wire_s": self.executor.last_wire_s,  # pickling the round here (ray)
                "worker_s": outs[0].worker_s,  # ray: the driver rank's time in its step call (unpickling + forward)
                "worker_between_s": outs[0].between_s,  # ray: its time from the last output to this input
                "num_seqs": sum(len(sc.scheduled) for sc in scheds),
                "num_tokens": sum(sc.num_tokens for sc in scheds),
                "kv_blocks_used": sum(g.blocks.num_used for g in self.schedulers),
                "num_preempted": sum(len(sc.preempted) for sc in scheds),
                "overlapped": self._inflight is not None,  # the next step ran while this one was processed
                "export_bytes": sum(o.export_bytes for o in outs),  # DSpark context rows sent to the drafter
                # speculation: positions drafted and verified this step (the verify budget is
                # num_tokens + num_verified: every token the step ran)
                "num_drafted": sum(len(s.draft_confidences) - int(np.isnan(s.draft_confidences).sum())
                                   if s.draft_confidences is not None else s.num_draft
                                   for sc in scheds for s in sc.scheduled),
                "num_verified": sum(s.num_draft for sc in scheds for s in sc.scheduled),
                "draft_len": max((s.num_lookahead for sc in scheds for s in sc.scheduled), default=0),
                "spec_rounds": spec_rounds,
                "spec_tokens": spec_tokens,
                "drafter_version": self._drafter_version,
            }
        )
        stats["verify_budget"] = stats["num_tokens"] + stats["num_verified"]  # every token the step ran
        if self.planner is not None and not stats["overlapped"] and not step.scheduled_ahead:
            self.planner.step_cost.observe(max(sc.num_tokens + sum(s.num_draft for s in sc.scheduled) for sc in scheds),
                                           execute_time)
        self.forward_s_total += stats["forward_s"]
        self.export_bytes_total += stats["export_bytes"]
        for i, g in enumerate(self.schedulers):
            self.kv_peak_blocks[i] = max(self.kv_peak_blocks[i], g.blocks.num_used)
        self.step_stats.append(stats)
        if self.step_record is not None:
            self.step_record.append(stats)
        self.num_steps += 1
        self.num_overlapped_steps += stats["overlapped"]
        self.num_drafted += stats["num_drafted"]
        self.num_verified += stats["num_verified"]
        return events

    def _attach_drafts(self, scheds) -> None:
        """Ask the drafter for the decode rows that reserved draft slots; with the confidence
        schedule, keep of each proposal the prefix the verify budget admits."""
        if self.drafter is None:
            return
        rows = [s for sc in scheds for s in sc.scheduled if s.num_lookahead]
        if self.planner is not None and self.planner.exploring:
            rows = rows[: self.planner.explore_rows]  # drafting only to refresh the estimates
        if not rows:
            return
        reqs = [
            DraftRequest(s.seq.seq_id, s.seq.token_ids, s.num_lookahead, s.seq.params.temperature,
                         s.seq.params.top_k, s.seq.params.top_p,
                         -1 if s.seq.params.seed is None else s.seq.params.seed, s.seq.num_output_tokens)
            for s in rows
        ]
        t = time.perf_counter()
        props = self.drafter.propose(reqs)
        draft_s = time.perf_counter() - t
        for s, prop in zip(rows, props):
            if prop.tokens:
                s.proposal = Proposal(prop.tokens[: s.num_lookahead],
                                      None if prop.probs is None else prop.probs[: s.num_lookahead],
                                      None if prop.confidences is None else prop.confidences[: s.num_lookahead])
        if self.planner is not None:
            self.planner.drafted(len(reqs), max(s.num_lookahead for s in rows), draft_s)
            for sc in scheds:
                self._apply_verify_budget(sc, draft_s)
        if not self.drafter.alive:  # it failed: plain decoding until a restarted group takes over
            self._apply_speculation()

    def _apply_verify_budget(self, sc, draft_s: float) -> None:
        """Cut each proposal of one group's step to the verify length the budget gives it."""
        rows = [s for s in sc.scheduled if s.proposal is not None]
        if not rows:
            return
        raw = self.planner.raw_confidences([s.proposal for s in rows])
        lengths = self.planner.verify_lengths(raw, sc.num_tokens, sum(s.samples for s in sc.scheduled), draft_s)
        for s, conf, n in zip(rows, raw, lengths.tolist()):
            s.draft_confidences = conf
            p = s.proposal
            s.proposal = None if n == 0 else Proposal(p.tokens[:n], None if p.probs is None else p.probs[:n],
                                                      None if p.confidences is None else p.confidences[:n])

    def rebalance_now(self) -> None:
        """Rebalance experts at the next step (world > 1), whatever the interval."""
        if self.balancer is not None:
            self.balancer.request()

    def speculative_summary(self) -> Optional[dict]:
        """The drafter's acceptance figures; with the confidence schedule also the verify budget's
        (draft positions verified / drafted, STS temperatures, ECE by position, the step cost model)."""
        if self.drafter is None:
            return None
        out = self.drafter.stats.summary()
        out["schedule"] = self.cfg.speculative.schedule
        out["num_drafted_positions"] = self.num_drafted
        out["verified_share"] = self.num_verified / self.num_drafted if self.num_drafted else float("nan")
        if self.planner is not None:
            out["calibration"] = self.planner.summary()
        if self.drafter.versions is not None:  # online calibration (the calibrator's side: drafter_status())
            out["drafter_versions"] = self.drafter.versions.status()
        return out

    # ---- the cost ledger ------------------------------------------------------------------
    def usage(self, comm: bool = False) -> dict:
        """Counters since the engine started, for `cost_ledger`: a run's ledger is the difference of
        the snapshots at its start and end. comm: also the bytes each rank sent (a call to every
        worker; left out of the live ledger /metrics reads)."""
        stats = self.drafter.stats if self.drafter is not None else None
        out = {
            "time": time.monotonic(),
            "process_cpu_s": time.process_time(),  # this process's CPU seconds (the Router's busy time on Ray)
            "forward_s": self.forward_s_total,
            "export_bytes": self.export_bytes_total,  # DSpark context rows sent to the drafters
            "draft_s": stats.draft_time_s if stats is not None else 0.0,
            "tokens": {"prompt": self.num_prompt_tokens, "output": self.num_output_tokens,
                       "drafted": self.num_drafted, "accepted": sum(stats.accepted) if stats is not None else 0,
                       "recomputed": sum(g.num_recomputed_tokens for g in self.schedulers)},
            "comm_bytes": None,
        }
        if comm:
            ranks = list(self.executor.comm_stats())
            if self.drafter is not None and self.drafter.backend is not None:
                with contextlib.suppress(Exception):  # a drafter group restarting: its bytes are not counted
                    ranks += self.drafter.backend.comm_stats()
            totals: dict = {}
            for r in ranks:
                for kind, n in r["bytes"].items():
                    totals[kind] = totals.get(kind, 0) + n
            out["comm_bytes"] = totals
        return out

    def device_reports(self, refresh: bool = True) -> list[dict]:
        """Every device (or process) the engine holds, with its memory by kind (cost.cost_ledger's
        `devices`): the target's workers (KV peak from their group's peak blocks in use; expert
        staging where a rebalance staged weights), the drafter group and calibrator, and on Ray the
        Router's process (a CPU core). refresh=False: the workers' and drafters' memory as last read
        (reading it is a call to each), with the KV peak as of now."""
        if self._devices is None or refresh:
            self._devices = (self.executor.device_reports(),
                             self.drafter.device_reports() if self.drafter is not None else [])
        target, drafters = self._devices
        migrated = self.balancer is not None and bool(self.balancer.events)
        devices = []
        for d in target:
            memory = {**d["memory"], "kv_peak_used": d["kv_bytes_per_block"] * self.kv_peak_blocks[d["group"]],
                      "expert_staging": d["expert_bytes"] if migrated else 0}  # a migration stages every local expert
            devices.append({"role": d["role"], "rank": d["rank"], "kind": d["kind"], "memory": memory})
        for d in drafters:
            if d.get("shares_device"):  # in process: on the target's device
                for kind, n in d["memory"].items():
                    devices[0]["memory"][kind] = devices[0]["memory"].get(kind, 0) + n
            else:
                devices.append(d)
        if self.cfg.parallel.executor == "ray":
            devices.append({"role": "router", "rank": 0, "kind": "cpu", "memory": {}})
        return devices

    def cost_ledger(self, since: Optional[dict] = None, num_requests: int = 0, comm: bool = False,
                    refresh: bool = True) -> dict:
        """The cost ledger from `since` (a usage() snapshot; default: the engine's start) to now.
        Busy seconds: the target's forward time on each of its devices; the drafters' proposal
        time (as the engine waits for it) on each drafter; on Ray the Router process's CPU time. In
        process the drafter's time is on the target's device."""
        now, base = self.usage(comm), since or self._usage_at_start
        world = self.cfg.parallel.world_size
        forward = now["forward_s"] - base["forward_s"]
        draft = now["draft_s"] - base["draft_s"]
        if self.cfg.parallel.executor == "ray":
            busy = {"target": forward * world, "router": now["process_cpu_s"] - base["process_cpu_s"]}
            if self.drafter is not None:
                busy["drafter"] = draft * self.cfg.speculative.draft_workers
        else:
            busy = {"target": forward + draft}
        comm_bytes = {}
        if comm and base.get("comm_bytes") is not None:
            # max(0, ...): restarted workers count from zero again
            comm_bytes = {k: max(0, v - base["comm_bytes"].get(k, 0)) for k, v in now["comm_bytes"].items()}
        comm_bytes["hidden_state_export"] = now["export_bytes"] - base["export_bytes"]
        tokens = {k: v - base["tokens"].get(k, 0) for k, v in now["tokens"].items()}
        prices = self.cfg.cost.price_per_device_hour.model_dump()
        return cost_ledger(now["time"] - base["time"], self.device_reports(refresh), busy, tokens, comm_bytes, prices,
                           num_requests)

    def set_speculation(self, enabled: bool) -> None:
        """Switch speculation on or off for every request, at run time."""
        self._speculation_wanted = bool(enabled)
        self._apply_speculation()

    def _apply_speculation(self) -> None:
        enabled = self._speculation_wanted
        for g in self.schedulers:
            g.speculation_enabled = bool(enabled) and self.drafter is not None and self.drafter.alive

    def shutdown(self) -> None:
        if self.drafter is not None:
            self.drafter.shutdown()
        self.executor.shutdown()

    def release(self, request_id: str) -> None:
        """Forget a finished request's state."""
        self.seqs.pop(request_id, None)
