"""The engine: one step of continuous batching, top to bottom (`step`), over parts a reader can
hold one at a time:

    InputProcessor (input_processor.py)  validation and tokenising of a request, once
    Scheduler x data groups (scheduler.py, kv_cache.py)  the batch, KV blocks, preemption
    Speculation (speculative/controller.py)  the drafter, the verify budget, proposals on the step
    ExpertBalancer (balancer.py)  the expert load window, EPLB and its placement handshake
    the executor (executor.py; actors/cluster.py on Ray)  runs the step on the target's devices
    CostMeter (cost.py)  the counters of the cost ledger
    restart_workers (recovery.py)  a lost worker: new workers, the requests in flight re-run

`add_request` validates and queues; `step` runs one iteration and returns the tokens each request
gained. `LLM` and `AsyncEngine` (the server's, the Router actor's) step it through `EngineCore`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from .balancer import ExpertBalancer
from .config import Config
from .cost import CostMeter
from .errors import EngineError, RequestError, StepError, WorkerError
from .executor import make_executor, resolve_for_executor
from .heap import freeze_heap, unfreeze_heap
from .input_processor import InputProcessor, load_tokenizer
from .kv_cache import BlockManager
from .model.compiled import bucket_of, compile_buckets, resolve_compile
from .model.spec import ModelSpec, load_spec
from .outputs import TokenEvent, TokenLogprob
from .recovery import restart_workers
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .speculative.controller import Speculation
from .speculative.dspark_model import prefix_recompute_rows
from .step import StepInput, StepOutput
from .step_builder import build_step_input, expert_capacity
from .worker import WorkerConfig

log = logging.getLogger(__name__)

# per-step statistics kept for live metrics in a long-running server; a run's report records every
# step through `LLMEngine.step_record`
STEP_STATS_KEPT = 4096
IDLE_GAP_S = 0.05  # a step that starts this long after the last one ended follows an idle engine


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
    submitted_at: float = 0.0  # perf_counter when its submission began
    # submitted right after the step before it was processed (it verified drafts, so it could not be
    # scheduled ahead): the host's seconds from that step's output to this submission
    early_host_s: Optional[float] = None
    done_at: float = 0.0  # perf_counter when its output was in


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
        cfg = self.cfg = resolve_for_executor(cfg)  # e.g. draft_passes auto for the devices that draft
        self.spec: ModelSpec = load_spec(cfg.model.path, cfg.model.dtype)
        self.executor = make_executor(cfg, self.spec)
        sc = cfg.scheduler
        self.block_size = sc.block_size
        self.num_blocks = self.executor.num_blocks
        self.max_model_len = sc.max_model_len or self.spec.max_position_embeddings
        # the token counts a compiled step is padded to on the workers (model.compile), or None
        device = (self.executor.reports or [{"device": getattr(self.executor, "device", "cpu")}])[0]["device"]
        self.compile_buckets = compile_buckets(cfg) if resolve_compile(cfg.model.compile, device) else None
        # one scheduler and KV pool per data-parallel group; each group runs its own batch, and the
        # groups meet in the expert-parallel all-to-all
        self.num_groups = cfg.parallel.data
        self.speculation: Optional[Speculation] = None
        if cfg.speculative.enabled:
            try:
                self.speculation = Speculation(cfg, self.spec, self.executor, self.num_groups)
            except BaseException:  # a refused or failed drafter group: the started target goes too
                self.executor.shutdown()
                raise
        lookahead = cfg.speculative.num_tokens if self.speculation is not None else 0
        self.schedulers = [
            Scheduler(BlockManager(self.num_blocks, sc.block_size, sc.prefix_caching), sc.max_num_seqs,
                      sc.max_num_batched_tokens, self.max_model_len, lookahead)
            for _ in range(self.num_groups)
        ]
        if self.speculation is not None and cfg.speculative.method == "dspark":
            recompute = prefix_recompute_rows(WorkerConfig.of(cfg).context_window)
            for g in self.schedulers:
                g.speculative_recompute = recompute
        self.balancer = None
        if self.spec.is_moe:
            self.balancer = ExpertBalancer(cfg, sum(self.spec.moe_layers), self.spec.num_experts,
                                           cfg.parallel.world_size, self.spec.n_group)
            self.balancer.enabled = self.balancer.enabled and cfg.parallel.world_size > 1
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
        self.inputs = InputProcessor(self.tokenizer, self.spec, self.max_model_len, self.num_blocks * self.block_size)
        self.seqs: dict[str, Sequence] = {}
        self.step_stats: deque = deque(maxlen=STEP_STATS_KEPT)  # the latest steps (bounded: servers run for long)
        self.step_record: Optional[list] = None  # every step's stats, when a run's report asks for them
        self.num_steps = self.num_overlapped_steps = 0
        self._last_done_at = -math.inf  # when the last step's outputs came back (perf_counter)
        # fault tolerance (executor ray): target restarts so far, and whether one is under way
        self.num_restarts, self.restarting = 0, False
        self.last_restart: Optional[dict] = None  # step, teardown and start-up seconds of the last restart
        # async scheduling: schedule step n+1 while the workers run step n (see step())
        mode = sc.async_scheduling
        self.async_scheduling = cfg.parallel.executor == "ray" if mode == "auto" else bool(mode)
        self._inflight: Optional[_InFlight] = None
        self._scheduling = None  # the step being submitted (to fail its requests if that fails)
        self.meter = CostMeter(cfg, self.num_groups)
        self._usage_at_start = self.usage()
        freeze_heap()  # what start-up left alive: no full collection walks it again (heap.py)

    @property
    def drafter(self):
        """The drafter group's front (speculative.drafting.Drafter), or None without speculation."""
        return self.speculation.drafter if self.speculation is not None else None

    @property
    def planner(self):
        """The verify budget (speculative.verify_budget.VerifyPlanner) of the confidence schedule."""
        return self.speculation.planner if self.speculation is not None else None

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None) -> str:
        """Validate and queue a request; raises RequestError naming what is wrong."""
        seq = self.inputs.make_sequence(prompt, params, request_id)
        self.enqueue(seq)
        return seq.request_id

    def enqueue(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            raise RequestError(f"request_id: {seq.request_id!r} is already in use")
        self.seqs[seq.request_id] = seq
        self.meter.prompt_tokens += seq.num_prompt_tokens
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
        if self.speculation is not None and removed:  # its drafter state goes too (and none of its rounds is learnt)
            self.speculation.free(removed, reason)
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

    def release(self, request_id: str) -> None:
        """Forget a finished request's state."""
        self.seqs.pop(request_id, None)

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
        if self.speculation is not None:
            self.speculation.poll(self.schedulers, self.num_steps)
        try:
            if step is None:
                self._plan_drafts()
                step = self._schedule_and_submit(events, None)
                if step is None:
                    return self._free_drafts(events)
            if step.ahead_ok:
                self._plan_drafts()
                if self._overlap():
                    self._inflight = self._schedule_and_submit(events, step)
            got, learn = self._advance(step, t0)
            events.extend(got)
            if self.async_scheduling and self._inflight is None:
                self._submit_early(events, step)
            self._learn(learn)  # (after an early submission: the planner learns from this step one step later)
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
                restart_workers(self, e)
                return self._free_drafts(events)
            if not isinstance(e, Exception) or isinstance(e, EngineError):
                raise  # an interrupt, or the engine's own failure
            log.exception("a step failed; failing its %d request(s), the engine goes on", len(failed))
            raise StepError(self._fail(failed), e) from e
        return self._free_drafts(events)

    def _submit_early(self, events: list, step: "_InFlight") -> None:
        """Async scheduling, when the next step could not be scheduled while `step` ran (it verified
        drafts: the next one needs its tokens): schedule and submit it now, right after `step`'s tokens
        reached the scheduler, so the caller's handling of them (detokenizing, streaming) runs while
        the workers compute. A failure here is left to the next call, which schedules again and
        raises it with its requests named (raising here would lose `step`'s events)."""
        self._plan_drafts()
        try:
            nxt = self._schedule_and_submit(events, None)
        except Exception as e:  # noqa: BLE001 -- rolled back; the next call meets it again
            log.debug("early submission failed (%s: %s); scheduling again at the next step", type(e).__name__, e)
            self._scheduling = None
            return
        if nxt is not None:
            nxt.early_host_s = nxt.submitted_at + nxt.submit_s - step.done_at
        self._inflight = nxt

    def drain(self) -> list[TokenEvent]:
        """Process the step in flight, if any, without scheduling another (async scheduling: the
        last requests may end by a stop token while the step after theirs already runs)."""
        step, self._inflight = self._inflight, None
        return self._free_drafts(self._process(step, time.perf_counter())) if step is not None else []

    def _plan_drafts(self) -> None:
        if self.speculation is not None:
            self.speculation.plan(self.schedulers)

    def _overlap(self) -> bool:
        """Schedule ahead: on when configured, off while speculating (drafts need the last tokens)."""
        return self.async_scheduling and not any(g.speculation_enabled and g.lookahead for g in self.schedulers)

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
        if self.speculation is not None:
            self.speculation.attach(scheds, self.schedulers)
        # the next step may take this one's tokens as inputs only if each row samples one token
        ahead_ok = self._overlap() and not any(s.proposal for sc in scheds for s in sc.scheduled)
        share_sampled = ahead_ok and self.cfg.parallel.tensor > 1
        spec_fields = self.speculation.step_fields(scheds, self.schedulers) if self.speculation is not None else [{}] * len(scheds)
        eplb_fields = self.balancer.step_fields() if self.balancer is not None else {}
        inputs = []  # an idle group still runs an empty step: its ranks take part in the experts' all-to-all
        capacity = 0
        if self.spec.is_moe and self.cfg.parallel.world_size > 1:
            tokens = [sum(s.num_new_tokens + s.num_draft for s in sc.scheduled) for sc in scheds]
            if self.compile_buckets:  # a group's step within the buckets runs compiled, padded to its bucket
                tokens = [bucket_of(t, self.compile_buckets) for t in tokens]
            capacity = expert_capacity(tokens, self.cfg.parallel.tensor, self.spec.top_k, self.cfg.parallel.world_size,
                                       self.spec.hidden_size * self.spec.dtype.itemsize)
        for g, sc in enumerate(scheds):
            prev_rows = None
            if prev is not None:
                prev_rows = {s.seq.seq_id: i for i, s in enumerate(r for r in prev.scheds[g].scheduled if r.samples)}
            inputs.append(build_step_input(sc.scheduled, self.schedulers[g].blocks.block_tables, self.block_size,
                                           prev_rows, share_sampled=share_sampled, expert_capacity=capacity,
                                           **spec_fields[g], **eplb_fields))
        t = time.perf_counter()
        handle = self.executor.submit(inputs if self.num_groups > 1 else inputs[0])
        return _InFlight(scheds, inputs, handle, time.perf_counter() - t, ahead_ok, scheduled_ahead=prev is not None,
                         submitted_at=t)

    def _process(self, step: "_InFlight", t0: float) -> list[TokenEvent]:
        """Wait for a submitted step and advance its sequences with the tokens it sampled."""
        events, learn = self._advance(step, t0)
        self._learn(learn)
        return events

    def _learn(self, learn: list) -> None:
        """The verify outcomes of a processed step, to the drafter's statistics and the verify planner
        (off the critical path: nothing the next step's input needs). A failure to learn (the drafter's statistics,
        the online calibration's trial of a version, the planner) is logged and counted (`learn_failures` in the
        speculative summary, a gauge at /metrics), never raised: the step's tokens are out already (raised, the
        events of the requests it finished were lost and their callers waited for ever), and what is learned here
        decides only how much is drafted and verified, never what is output."""
        for rows, sampled, num_steps in learn:
            try:
                self.speculation.observe(rows, sampled, num_steps)
            except Exception:  # noqa: BLE001 -- see above
                self.speculation.learn_failures += 1
                if self.speculation.learn_failures in (1, 10, 100) or self.speculation.learn_failures % 1000 == 0:
                    log.exception("learning from a step's verify outcomes failed (%d times so far); its tokens "
                                  "stand, the planner keeps what it learned before", self.speculation.learn_failures)

    def _advance(self, step: "_InFlight", t0: float) -> tuple[list[TokenEvent], list]:
        """_process but the verify outcomes' learning, returned for _learn: (events, learn)."""
        t_wait = time.perf_counter()
        outs = self.executor.wait(step.handle)
        step.done_at = time.perf_counter()
        # the step period, from the last step's end to this one's (None across an idle engine's gap): what the
        # verify planner judges drafting's delivery by
        period = step.done_at - self._last_done_at if t0 - self._last_done_at < IDLE_GAP_S else None
        self._last_done_at = step.done_at
        # submitted early, it ran while the caller handled the step before: its time runs from its submission
        execute_time = (step.done_at - step.submitted_at if step.early_host_s is not None
                        else step.submit_s + step.done_at - t_wait)
        outs = outs if isinstance(outs, list) else [outs]
        scheds, inputs = step.scheds, step.inputs
        if self.balancer is not None:
            self.balancer.read(inputs, outs)
        verify_time = time.perf_counter() - t_wait
        if self.speculation is not None:
            self.speculation.ingest(outs)
        step.processed = True
        events, learn = [], []
        spec_rounds = spec_tokens = 0  # verify rounds this step and the tokens they produced
        committed = 0
        for sc, g, step_in, out in zip(scheds, self.schedulers, inputs, outs):
            rows = [sc.scheduled[r] for r in step_in.sample_rows.tolist()]
            sampled = {s.seq.seq_id: toks[:n] for s, toks, n in zip(rows, out.sampled.tolist(), out.num_tokens.tolist())}
            token_lps = _token_logprobs(rows, sampled, out) if out.token_logprobs is not None else {}
            if out.prompt_token_logprobs is not None:
                _store_prompt_logprobs(sc.scheduled, step_in, out)
            if self.speculation is not None:
                rounds = [len(sampled[s.seq.seq_id]) for s in rows if s.proposal is not None]
                spec_rounds, spec_tokens = spec_rounds + len(rounds), spec_tokens + sum(rounds)
                learn.append((rows, sampled, self.num_steps))
                if self.speculation.on_target:
                    self.speculation.collect(rows, out, self.schedulers)
            for seq, new in g.update(sc.scheduled, sampled):
                lps = token_lps.get(seq.seq_id)
                if lps is not None:
                    lps = lps[: len(new)]  # a stop token or the length limit may end the row early
                    seq.output_logprobs.extend(lps)
                events.append(TokenEvent(seq.request_id, new, seq.finished, seq.finish_reason, seq, lps))
                self.meter.output_tokens += len(new)
                committed += len(new)
        self._record(step, scheds, outs, t0, execute_time, verify_time, spec_rounds, spec_tokens, (committed, period))
        return events, learn

    def _record(self, step, scheds, outs, t0, execute_time, verify_time, spec_rounds, spec_tokens,
                delivered: tuple) -> None:
        """The step's statistics: kept for live metrics, a run's report, the cost meter and the
        verify budget's step-cost model. delivered: (tokens committed, the step's period or None)."""
        stats = {
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
            # the Router's turn before this step: from the last step's output to this one's submission (a step
            # submitted early: the last one verified drafts, so nothing hid it; None otherwise)
            "early_host_s": step.early_host_s,
            "export_bytes": sum(o.export_bytes for o in outs),  # DSpark context rows sent to the drafter
            "num_drafted": 0, "num_verified": 0, "draft_len": 0,
            "spec_rounds": spec_rounds,
            "spec_tokens": spec_tokens,
            "drafter_version": 0,
        }
        if self.speculation is not None:
            self.drafter.stats.verify_time_s += verify_time
            stats.update(self.speculation.step_stats(scheds))
            if not stats["overlapped"] and not step.scheduled_ahead:  # (a drafter on the target drafted inside it)
                self.speculation.observe_step_cost(
                    max(sc.num_tokens + sum(s.num_draft for s in sc.scheduled) for sc in scheds),
                    execute_time - max(o.draft_s for o in outs),
                    step.early_host_s if step.early_host_s is not None
                    else stats["step_time_s"] - execute_time if self.async_scheduling else None,
                    num_rows=stats["num_seqs"], drafting=stats["num_drafted"] > 0)
            if delivered[1] is not None and stats["num_tokens"] == stats["num_seqs"]:
                # (decode steps only, a new token a row: a prompt chunk's step delivers little and says nothing of
                # drafting)
                self.speculation.observe_delivery(stats["num_seqs"], delivered[0], delivered[1],
                                                  stats["num_drafted"] > 0)
        stats["verify_budget"] = stats["num_tokens"] + stats["num_verified"]  # every token the step ran
        self.meter.step(stats, [g.blocks.num_used for g in self.schedulers])
        self.step_stats.append(stats)
        if self.step_record is not None:
            self.step_record.append(stats)
        self.num_steps += 1
        self.num_overlapped_steps += stats["overlapped"]

    def _free_drafts(self, events: list[TokenEvent]) -> list[TokenEvent]:
        if self.speculation is not None:
            done = [ev for ev in events if ev.finished]
            # (the drafter forgets them in batches: at its next call, or now when nothing is left to run)
            self.speculation.free([ev.seq for ev in done], {ev.seq.seq_id: ev.finish_reason for ev in done},
                                  flush=not self.has_unfinished())
        return events

    def _fail(self, seqs: list[Sequence]) -> list[str]:
        """Finish these sequences with reason "error" and free their KV; returns their request ids."""
        ids = list(dict.fromkeys(seq.request_id for seq in seqs if not seq.finished))
        for rid in ids:
            for seq in self.abort_request(rid, reason="error"):
                self.release(seq.request_id)
        if self.speculation is not None:
            self.speculation.free(seqs, "error")
        return ids

    # ---- speculation and balancing, at run time -------------------------------------------
    @property
    def num_drafted(self) -> int:
        return self.speculation.num_drafted if self.speculation is not None else 0

    @property
    def num_verified(self) -> int:
        return self.speculation.num_verified if self.speculation is not None else 0

    def drafter_status(self) -> dict:
        """Online calibration: the serving drafter version, its history and the calibrator's state."""
        if self.speculation is None:
            return {"calibration": False, "serving_version": None, "speculative": False}
        return self.speculation.status()

    def rollback_drafter(self, version: Optional[int] = None) -> dict:
        """Serve an earlier drafter version (None: the original weights) from the next step, and
        hold it until resume_drafter()."""
        if self.speculation is None:
            raise RequestError("version: speculative decoding is off; there is no drafter to roll back")
        return self.speculation.rollback(version, self.num_steps)

    def resume_drafter(self) -> dict:
        """After a manual rollback: let calibrated drafter versions publish again."""
        if self.speculation is None:
            raise RequestError("speculative decoding is off; there is no drafter to resume")
        return self.speculation.resume()

    def set_speculation(self, enabled: bool) -> None:
        """Switch speculation on or off for every request, at run time."""
        if self.speculation is None:
            for g in self.schedulers:
                g.speculation_enabled = False
            return
        self.speculation.wanted = bool(enabled)
        self.speculation.apply(self.schedulers)

    def compile_summary(self) -> Optional[dict]:
        """model.compile over the target's ranks, from their reports as last read (None: off): the buckets, the
        warm-up's seconds (the slowest rank's) and graphs, and what was compiled or recorded after it (issue 27's
        goal: nothing); "error" / "draft_error": why the steps / a drafter's rounds (on the target, in process or in a
        drafter group) run eager under auto (their compile failed)."""
        reports, drafters = self.meter.reports or ([], [])
        ranks = [d["compile"] for d in reports if d.get("compile")]
        errors = {"error": [d.get("compile_error") for d in reports],
                  "draft_error": [d.get("draft_compile_error") for d in reports]
                  + [d.get("compile_error") for d in drafters]}
        errors = {k: next(e for e in v if e) for k, v in errors.items() if any(v)}  # (the first rank's reason)
        if not ranks:
            return errors or None
        steps = [r for r in ranks if "compile_buckets" in r]  # (none: the steps' compile failed, the rounds' did not)

        def total(key):
            values = [r.get(key) for r in steps]
            return None if any(v is None for v in values) else sum(values)

        return {**({"ranks": len(steps), "buckets": steps[0]["compile_buckets"],
                    "warm_up_s": max(r["compile_warm_up_s"] for r in steps),
                    "warm_up_graphs": total("compile_warm_up_graphs"),
                    "compiled_steps": total("compile_steps"), "compiled_verify_steps": total("compile_verify_steps"),
                    "recompiles_after_warm_up": total("compile_recompiles_after_warm_up"),
                    "cuda_graphs_after_warm_up": total("compile_cuda_graphs_after_warm_up")} if steps else {}),
                # the drafter's rounds on the target's driver ranks (compiled_draft; absent: none there)
                **({"draft_warm_up_s": max(r["draft_compile_warm_up_s"] for r in ranks if "draft_compile_rounds" in r),
                    "draft_rounds": sum(r["draft_compile_rounds"] for r in ranks if "draft_compile_rounds" in r),
                    "draft_recompiles_after_warm_up": sum(r["draft_compile_recompiles_after_warm_up"] for r in ranks
                                                          if "draft_compile_rounds" in r)}
                   if any("draft_compile_rounds" in r for r in ranks) else {}), **errors}

    def speculative_summary(self) -> Optional[dict]:
        return self.speculation.summary() if self.speculation is not None else None

    def rebalance_now(self) -> None:
        """Rebalance experts at the next step (world > 1), whatever the interval."""
        if self.balancer is not None:
            self.balancer.request()

    # ---- the cost ledger ------------------------------------------------------------------
    def start_run(self) -> dict:
        """A run (`dspark run`'s workload) starts: its report records every step from here, its
        ledger covers it alone (the KV peak from zero) and the balancer keeps its history. Returns
        the usage snapshot its ledger is measured from."""
        self.meter.kv_peak_blocks = [0] * self.num_groups
        self.step_record = []
        if self.balancer is not None:
            self.balancer.keep_history()
        return self.usage(comm=True)

    def usage(self, comm: bool = False) -> dict:
        """Counters since the engine started, for the cost ledger: a run's ledger is the difference
        of the snapshots at its start and end. comm: also the bytes each rank sent (a call to every
        worker; left out of the live ledger /metrics reads)."""
        stats = self.drafter.stats if self.drafter is not None else None
        tokens = {"drafted": self.num_drafted, "accepted": sum(stats.accepted) if stats is not None else 0,
                  "recomputed": sum(g.num_recomputed_tokens for g in self.schedulers)}
        ranks = None
        if comm:
            ranks = list(self.executor.comm_stats())
            if self.drafter is not None and self.drafter.backend is not None:
                with contextlib.suppress(Exception):  # a drafter group restarting: its bytes are not counted
                    ranks += self.drafter.backend.comm_stats()
        # a drafter on the target drafts inside the workers' step: its time is in their forward time already
        draft_s = stats.draft_time_s if stats is not None and not self.speculation.on_target else 0.0
        return self.meter.usage(draft_s, tokens, ranks)

    def device_reports(self, refresh: bool = True) -> list[dict]:
        """Every device (or process) the engine holds, with its memory by kind (cost.CostMeter.devices).
        refresh=False: the workers' and drafters' memory as last read (reading it is a call to each),
        with the KV peak as of now."""
        if self.meter.reports is None or refresh:
            self.meter.reports = (self.executor.device_reports(),
                                  self.drafter.device_reports() if self.drafter is not None else [])
        return self.meter.devices(migrated=self.balancer is not None and bool(self.balancer.events))

    def cost_ledger(self, since: Optional[dict] = None, num_requests: int = 0, comm: bool = False,
                    refresh: bool = True) -> dict:
        """The cost ledger from `since` (a usage() snapshot; default: the engine's start) to now."""
        now = self.usage(comm)
        # (a drafter on the target has no devices of its own: its time and memory are the target's)
        return self.meter.ledger(since or self._usage_at_start, now, self.device_reports(refresh),
                                 self.speculation is not None and not self.speculation.on_target, num_requests)

    def shutdown(self) -> None:
        if self.drafter is not None:
            self.drafter.shutdown()
        self.executor.shutdown()
        unfreeze_heap()  # the engine's objects can be collected again (heap.py)

