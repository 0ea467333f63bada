"""The engine's speculation: the drafter group, the verify budget, and what they add to a step.

Per step (`engine.LLMEngine.step` calls these in order):
    poll()                 a restarted drafter group or a published drafter version takes over
    plan(groups)           the confidence schedule sets how many positions the next step drafts
    attach(scheds)         proposals for the rows that reserved draft slots, cut to the verify budget
    step_fields(scheds)    DSpark: which rows export context to the drafter (the others' rows the workers
                           keep until drafting resumes for them), which rounds are recorded; with the
                           drafter on the target (speculative.placement target), which rows it drafts
                           for after this step
    collect(rows, out)     placement target: the proposals the step's driver rank drafted for the next
    observe(...)           each row's verify outcome: acceptance stats, the planner's calibration
    free(events)           the drafter forgets finished sequences
plus the admin operations (status, rollback, resume, the run-time switch) and the summary.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
import torch

from .drafting import Drafter
from .dspark_model import draft_passes_of
from .on_target import PROFILE_ROWS, profile_calls
from .proposers import DraftRequest
from .records import ContextRows, Proposal
from ..step_builder import profile_input
from .verify_budget import StepCost, VerifyPlanner, draft_forwards


log = logging.getLogger(__name__)


def profile_step_cost(executor, cfg, num_groups: int, repeats: int = 5) -> StepCost:
    """T(B) at start-up, for the verify budget: greedy verify steps of B tokens on the target (up to
    the most a step can verify: max_num_seqs rows of 1 + num_tokens), the fastest of `repeats`
    after one warm-up each."""
    sc, k = cfg.scheduler, cfg.speculative.num_tokens
    rows_max = sc.max_num_seqs
    cap = max(1, min(sc.max_num_batched_tokens, rows_max * (1 + k)))
    grid = sorted({min(2**i, cap) for i in range(cap.bit_length() + 1)} | {cap})
    tokens, seconds = [], []
    for B in grid:
        rows = min(B, rows_max)
        q = -(-B // rows)
        inp = profile_input(rows, q, sc.block_size, executor.num_blocks)
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            executor.wait(executor.submit([inp] * num_groups if num_groups > 1 else inp))
            times.append(time.perf_counter() - t)
        if rows * q not in tokens:
            tokens.append(rows * q)
            seconds.append(min(times[1:]))
    log.info("step cost profile (tokens: ms): %s", ", ".join(f"{b}: {1e3 * t:.1f}" for b, t in zip(tokens, seconds)))
    return StepCost(tokens, seconds)


class Speculation:
    def __init__(self, cfg, spec, executor, num_groups: int):
        """executor: the target's (its device hosts an in-process drafter; the confidence schedule
        profiles its step cost at start-up)."""
        self.cfg = cfg
        self.drafter = Drafter(cfg, spec, executor.device)
        self.lookahead = cfg.speculative.num_tokens
        self.planner: Optional[VerifyPlanner] = None  # speculative.schedule: confidence
        if cfg.speculative.schedule == "confidence":
            self.planner = VerifyPlanner(self.lookahead, profile_step_cost(executor, cfg, num_groups),
                                         cfg.speculative.method, prior_acceptance=cfg.speculative.prior_acceptance,
                                         draft_passes=draft_passes_of(cfg))
        self.spec = spec
        self.on_target = cfg.speculative.on_target
        self.drafter_profile: dict[int, float] = {}  # rows -> seconds of a drafting call, at start-up
        if self.planner is not None:
            self._seed_draft_cost(executor)
        self.record_rounds = cfg.speculative.calibration.enabled  # online calibration records verify rounds
        self.wanted = True  # the run-time switch, as last set (a drafter restart restores it)
        self.drafter_version = 0  # the drafter version the planner's window is of
        self.num_drafted = self.num_verified = 0  # draft positions proposed / verified, over the run
        self.learn_failures = 0  # steps whose verify outcomes the engine could not learn from (engine._learn)
        # DSpark, an idle drafter: a step that drafts nothing asks for no export; the target's workers keep
        # those rows (speculative/context.py ContextStash) and send them with the sequence's next export.
        # stale: sequences whose latest rows the workers hold (the drafter lacks them: no proposal for
        # them until a step has exported them); asked: this step's rows the drafter is asked for (or
        # catches up on); free_rows: sequences whose kept rows the workers drop, sent with the next step
        self.stale: set[int] = set()
        self._asked: set[int] = set()
        self._free_rows: list[int] = []
        self.num_catch_ups = 0  # exports of a stale sequence (each sends the rows the workers kept)
        # placement target: the drafter drafts on the target's driver ranks right after a step, for the next
        # one; ready: seq_id -> (the sequence length its proposal continues, the proposal); ahead_s: the
        # drafting seconds of the latest proposals (the verify budget's draft time for them)
        self.ready: dict[int, tuple[int, Proposal]] = {}
        self.ahead_s = 0.0

    # ---- start-up ------------------------------------------------------------------------
    def _seed_draft_cost(self, executor) -> None:
        """The drafter's cost before any live call, so that the planner's prior gate decides from the first
        step (a fresh engine at a load where drafting does not pay then never drafts to learn it): the
        drafter on the target measured itself at start-up (its worker's report); a drafter group is
        measured here, through the calls the steps make. Each figure counts as one call of its rows (live
        calls soon outvote it: DraftCost keeps the median of the latest)."""
        if self.on_target:
            found = [r["drafter_profile"] for r in executor.device_reports() if r.get("drafter_profile")]
            profile = found[0] if found else {}
        else:
            try:
                profile = self._measure_group()
            except Exception as e:  # noqa: BLE001 -- learnt on live rows instead, as without a profile
                log.warning("drafter start-up profile failed (%s: %s); its cost is learnt on live rows",
                            type(e).__name__, e)
                profile = {}
        forwards = draft_forwards(self.cfg.speculative.method, self.lookahead, self.planner.draft_passes)
        for rows, seconds in profile.items():
            self.planner.draft_cost.observe(int(rows), forwards, seconds)
        self.drafter_profile = {int(r): s for r, s in profile.items()}

    def _measure_group(self, rows=PROFILE_ROWS, context: int = 32, repeats: int = 3) -> dict[int, float]:
        """Seconds of a `Drafter.propose` call for `rows` synthetic sequences of `context` tokens drafting k
        each (the fastest of `repeats` calls after the first, which takes their prompts), freed after. A
        DSpark drafter in process first gets random context rows; a Ray DSpark group takes rows only from
        the target's workers, so it is not measured here (its cost is learnt on live rows)."""
        d, method = self.drafter, self.cfg.speculative.method
        dspark = method == "dspark"
        if method not in ("dspark", "draft_model") or d.backend is None or (dspark and d.export()[1] is not None):
            return {}
        width = self.spec.hidden_size * len(d.export()[0]) if dspark else 0
        vocab = max(self.spec.vocab_size - 2, 1)

        def prepare(ids, i):  # a DSpark drafter's context rows: the prompt's, then the row the last step committed
            r, n = len(ids), context if i == 0 else 1
            if dspark:
                d.ingest(ContextRows(ids, torch.full((r,), 0 if i == 0 else context + i - 1), torch.full((r,), n),
                                     torch.randn(r * n, width)))

        def call(ids, i):
            d.propose([DraftRequest(sid, [2 + (7 * j + 3 * t) % vocab for t in range(context + 1 + i)],
                                    self.lookahead, position=i) for j, sid in enumerate(ids.tolist())])
            if not d.alive:
                raise RuntimeError("the drafter failed in its start-up profile")

        spent = d.stats.draft_time_s
        out = profile_calls(prepare, call, lambda ids: d.free(ids.tolist(), flush=True), rows, repeats)
        d.stats.draft_time_s = spent
        log.info("drafter, ms a drafting call by rows: %s", ", ".join(f"{r}: {1e3 * s:.2f}" for r, s in out.items()))
        return out

    # ---- before scheduling ---------------------------------------------------------------
    def poll(self, groups, num_steps: int) -> None:
        if self.drafter.poll(num_steps):
            self.apply(groups)
        self.follow_version()

    def follow_version(self) -> None:
        """A published or rolled-back drafter version: the verify budget recalibrates on its rounds."""
        versions = self.drafter.versions
        if versions is not None and versions.serving != self.drafter_version:
            self.drafter_version = versions.serving
            if self.planner is not None:
                self.planner.drafter_changed()

    def plan(self, groups) -> None:
        """Confidence schedule: choose how many positions the next step drafts (0 at a load where
        drafting does not pay: that step is plain decoding and may be scheduled ahead)."""
        if self.planner is None:
            return
        if any(g.speculation_enabled for g in groups):
            k = self.planner.draft_len(sum(min(g.max_num_seqs, len(g.running) + len(g.waiting)) for g in groups))
        else:
            k = 0
        for g in groups:
            g.lookahead = k

    def apply(self, groups) -> None:
        """The run-time switch and the drafter's health, to every group's scheduler."""
        for g in groups:
            g.speculation_enabled = self.wanted and self.drafter.alive

    # ---- building the step ---------------------------------------------------------------
    def attach(self, scheds, groups) -> None:
        """Ask the drafter for the decode rows that reserved draft slots; with the confidence
        schedule, keep of each proposal the prefix the verify budget admits. Also start the
        drafter's prompt prefill beside the target's (not while the schedule drafts nothing: a
        proposal catches up on what it missed)."""
        rows = [s for sc in scheds for s in sc.scheduled if s.num_lookahead]
        if self.on_target:  # drafted with the last step, on the target: no drafter call here
            self._take_ready(rows, scheds)
            return
        if self.planner is not None and self.planner.exploring:  # drafting only to refresh the estimates,
            # on rows whose context the drafter has first (the others catch up in this step)
            rows = sorted(rows, key=lambda s: s.seq.seq_id in self.stale)[: self.planner.explore_rows]
        self._asked = {s.seq.seq_id for s in rows}
        rows = [s for s in rows if s.seq.seq_id not in self.stale]  # a stale one exports, and drafts next step
        if rows:
            self._propose(rows, scheds)
            if not self.drafter.alive:  # it failed: plain decoding until a restarted group takes over
                self.apply(groups)
        if self.planner is None or any(g.lookahead for g in groups):  # (a drafter group: not on the target)
            self.drafter.prefill_async([
                DraftRequest(s.seq.seq_id, s.seq.token_ids, 0) for sc in scheds for s in sc.scheduled
                if s.samples and s.seq.num_output_tokens == 0 and s.seq.params.speculative
            ])

    def _propose(self, rows, scheds) -> None:
        reqs = [
            DraftRequest(s.seq.seq_id, s.seq.token_ids, s.num_lookahead, s.seq.params.temperature,
                         s.seq.params.top_k, s.seq.params.top_p,
                         -1 if s.seq.params.seed is None else s.seq.params.seed, s.seq.num_output_tokens)
            for s in rows
        ]
        t = time.perf_counter()
        props = self.drafter.propose(reqs)
        draft_s = time.perf_counter() - t
        # what each row verifies: at most its draft slots (a proposal has no more than the request's k)
        keep = {}
        for s, prop in zip(rows, props):
            if prop.tokens:
                s.proposal = prop
                keep[id(s)] = s.num_lookahead
        if self.planner is not None:
            self.planner.drafted(len(reqs), max(s.num_lookahead for s in rows), draft_s)
            for sc in scheds:
                self._verify_budget(sc, draft_s, keep)
        for s in rows:  # one cut: the draft slots and the verify budget together
            if s.proposal is not None:
                n = keep[id(s)]
                s.proposal = None if n == 0 else _cut(s.proposal, n)

    def _take_ready(self, rows, scheds) -> None:
        """Placement target: each row's proposal drafted with the last step, if it continues the
        sequence as it is now (a row that was not proposed for, or whose proposal a preemption or a
        drafter failure left behind, runs plain), cut to its draft slots and the verify budget."""
        keep = {}
        for s in rows:
            got = self.ready.pop(s.seq.seq_id, None)
            if got is not None and got[0] == len(s.seq.token_ids) and got[1].tokens:
                s.proposal = got[1]
                keep[id(s)] = s.num_lookahead
        if not keep:
            return
        if self.planner is not None:
            for sc in scheds:
                self._verify_budget(sc, self.ahead_s, keep)
        for s in rows:
            if s.proposal is not None:
                n = keep[id(s)]
                s.proposal = None if n == 0 else _cut(s.proposal, n)

    def _verify_budget(self, sc, draft_s: float, keep: dict) -> None:
        """The verify length the budget gives each proposal of one group's step (keep: id(row) -> the
        most it may verify, lowered here)."""
        rows = [s for s in sc.scheduled if s.proposal is not None]
        if not rows:
            return
        raw = self.planner.raw_confidences([s.proposal for s in rows])
        for i, s in enumerate(rows):  # past its draft slots a position is not a candidate
            raw[i, keep[id(s)]:] = np.nan
        offsets = self.planner.sequence_offsets([s.seq.seq_id for s in rows])
        lengths = self.planner.verify_lengths(raw, sc.num_tokens, sum(s.samples for s in sc.scheduled), draft_s,
                                              offsets)
        for s, conf, n, d in zip(rows, raw, lengths.tolist(), offsets.tolist()):
            s.draft_confidences, s.draft_offset = conf, d
            keep[id(s)] = min(keep[id(s)], n)

    def step_fields(self, scheds, groups=None) -> list[dict]:
        """Per group, the StepInput fields speculation sets: with DSpark, the layers the driver rank
        exports to the drafter and the sequence ids that own the rows (-1: a request that does not
        speculate exports nothing), which of them export now (`export_rows`: in a step that drafts, every
        row but, while exploring, those not asked for; in a step that drafts nothing, none: the workers
        keep those rows) and the sequences whose kept rows go (`free_context`); with online calibration,
        the sample rows whose rounds are recorded. groups: the schedulers (their lookahead: whether
        this step drafts)."""
        export = self.drafter.export()
        if export is None:  # no drafter takes rows: the workers keep none (steps without seq_ids)
            self.stale.clear()
            self._free_rows = []
            return [{} for _ in scheds]
        for sc in scheds:  # a preempted sequence recomputes its rows: the ones kept go now
            self._free_rows += [seq.seq_id for seq in sc.preempted]
        free, self._free_rows = self._free_rows, []
        exploring = self.planner is not None and self.planner.exploring
        if self.on_target:  # the rows the drafter on the target drafts for after this step
            self._asked = self._to_propose(scheds, groups, exploring)
        out = []
        for gi, sc in enumerate(scheds):
            extra = {"free_context": torch.tensor(free, dtype=torch.long)} if free else {}
            if not sc.scheduled:
                out.append(extra)
                continue
            g = groups[gi] if groups is not None else None
            drafts = g is None or (g.speculation_enabled and g.lookahead > 0)
            if not drafts and not self._asked:  # the idle step: no row exports, every speculating one is kept
                ids = [s.seq.seq_id if s.seq.params.speculative else -1 for s in sc.scheduled]
                self.stale.update(ids)
                self.stale.discard(-1)
                out.append(self._fields(export, sc, ids, None, extra, drafts))
                continue
            ids, rows_out = [], []
            for s in sc.scheduled:
                sid = s.seq.seq_id if s.seq.params.speculative else -1
                now = sid >= 0 and (sid in self._asked or (drafts and not exploring))
                ids.append(sid)
                rows_out.append(now)
                if sid < 0:
                    continue
                if now:
                    if sid in self.stale:
                        self.stale.discard(sid)
                        self.num_catch_ups += 1
                else:
                    self.stale.add(sid)
            out.append(self._fields(export, sc, ids, rows_out, extra, drafts))
        return out

    def _fields(self, export, sc, ids: list, rows_out: Optional[list], extra: dict, drafts: bool) -> dict:
        """One group's StepInput fields (step_fields); rows_out None: no row exports."""
        fields = {"export_to": export[1],  # the layers (export[0]) are the workers' setup
                  "seq_ids": torch.tensor(ids, dtype=torch.long), **extra}
        if rows_out is None:
            fields["export_rows"] = torch.zeros(len(ids), dtype=torch.bool)
        elif not all(rows_out):
            fields["export_rows"] = torch.tensor(rows_out, dtype=torch.bool)
        if self.record_rounds:
            fields["record_rounds"] = torch.tensor([s.seq.params.calibrate for s in sc.scheduled if s.samples],
                                                   dtype=torch.bool)
        if self.on_target and drafts:
            k = [self._asked.get(s.seq.seq_id, 0) for s in sc.scheduled if s.samples]
            if any(k):
                fields["propose_k"] = torch.tensor(k, dtype=torch.long)
        return fields

    def _to_propose(self, scheds, groups, exploring: bool) -> dict:
        """Placement target: seq_id -> tokens to draft after this step, for the sample rows of the groups
        that draft (all of them; while exploring, the first `explore_rows`), but rows this step ends by
        length (they sample at least one token, and every one of them is their last)."""
        out = {}
        for gi, sc in enumerate(scheds):
            g = groups[gi] if groups is not None else None
            if g is not None and not (g.speculation_enabled and g.lookahead > 0):
                continue
            k = g.lookahead if g is not None else self.lookahead
            for s in sc.scheduled:
                p = s.seq.params
                if (s.samples and p.speculative and s.seq.num_output_tokens + 1 < p.max_tokens
                        and (not exploring or len(out) < self.planner.explore_rows)):
                    out[s.seq.seq_id] = k if p.num_speculative_tokens is None else min(k, p.num_speculative_tokens)
        return {sid: k for sid, k in out.items() if k > 0}

    def collect(self, rows, out, groups) -> None:
        """Placement target: the proposals the driver rank drafted after this step (out.draft_*, per sample
        row of `rows`), ready for the next; a drafter failure there switches speculation off (plain
        decoding from the next step: outputs do not change)."""
        if out.drafter_error is not None:
            self.drafter.fail(out.drafter_error)
            self.ready.clear()
            self.apply(groups)
            return
        if out.draft_lengths is None:
            return
        lengths, tokens, confs = out.draft_lengths.tolist(), out.draft_tokens, out.draft_confidences
        counts = (tokens >= 0).sum(1).tolist()
        n = 0
        for i, length in enumerate(lengths):
            if length and not rows[i].seq.finished:  # (one aborted while this step ran is freed already)
                k = counts[i]
                self.ready[rows[i].seq.seq_id] = (length, Proposal(tokens[i, :k].tolist(), None, confs[i, :k]))
                n += 1
        self.ahead_s = out.draft_s
        self.drafter.stats.draft_time_s += out.draft_s
        if self.planner is not None and n:
            self.planner.drafted(n, int(tokens.shape[1]), out.draft_s)

    def workers_restarted(self) -> None:
        """New target workers hold no kept rows, no drafter state: every sequence's context comes again
        (recovery re-runs each request from its tokens)."""
        self.stale.clear()
        self._free_rows = []
        self.ready.clear()

    # ---- after the step ------------------------------------------------------------------
    def ingest(self, outs) -> None:
        """In process, the exported context comes back with the output."""
        for out in outs:
            if out.context is not None:
                self.drafter.ingest(out.context)
                out.context = None

    def observe(self, rows, sampled: dict, num_steps: int) -> tuple[int, int]:
        """One group's sample rows after verification (sampled: seq_id -> its tokens). Returns the
        verify rounds and the tokens they produced (tau = tokens / rounds)."""
        stats = self.drafter.stats
        spec = [s for s in rows if s.proposal is not None]
        for s in spec:
            stats.record(s.num_draft, len(sampled[s.seq.seq_id]) - 1, s.proposal.confidences)
        round_tokens = [len(sampled[s.seq.seq_id]) for s in spec]
        self.drafter.observe_rounds(round_tokens, [s.num_draft for s in spec], num_steps)
        drafted = [s for s in rows if s.draft_confidences is not None and s.seq.seq_id in sampled]
        if self.planner is not None and drafted:
            self.planner.observe(np.stack([s.draft_confidences for s in drafted]), [s.num_draft for s in drafted],
                                 [len(sampled[s.seq.seq_id]) - 1 for s in drafted], [s.seq.seq_id for s in drafted],
                                 [s.draft_offset for s in drafted])
        return len(round_tokens), sum(round_tokens)

    def step_stats(self, scheds) -> dict:
        """Positions drafted and verified this step (the verify budget is num_tokens + num_verified:
        every token the step ran), and the longest draft slot reserved."""
        if not any(sc.lookahead for sc in scheds):  # no row could draft (the idle step: no loop over its rows)
            return {"num_drafted": 0, "num_verified": 0, "draft_len": 0, "drafter_version": self.drafter_version}
        drafted = sum(len(s.draft_confidences) - int(np.isnan(s.draft_confidences).sum())
                      if s.draft_confidences is not None else s.num_draft for sc in scheds for s in sc.scheduled)
        verified = sum(s.num_draft for sc in scheds for s in sc.scheduled)
        self.num_drafted += drafted
        self.num_verified += verified
        return {"num_drafted": drafted, "num_verified": verified,
                "draft_len": max((s.num_lookahead for sc in scheds for s in sc.scheduled), default=0),
                "drafter_version": self.drafter_version}

    def observe_step_cost(self, tokens: int, seconds: float, host_s: Optional[float] = None,
                          num_rows: int = 0, drafting: bool = False) -> None:
        """A step that did not overlap another: its tokens and the workers' seconds; host_s, with async
        scheduling on, the host's seconds in it (what a plain step would have hidden); num_rows its
        sequences; drafting: it verified drafts."""
        if self.planner is not None:
            self.planner.observe_step(tokens, seconds, num_rows, drafting)
            if host_s is not None:
                self.planner.observe_host(host_s)

    def observe_delivery(self, num_rows: int, tokens: int, seconds: float, drafting: bool) -> None:
        """A decode step's tokens committed in its period (the verify planner judges drafting by them)."""
        if self.planner is not None:
            self.planner.observe_delivery(num_rows, tokens, seconds, drafting)

    def free(self, seqs, reason, flush: bool = True) -> None:
        """The drafter forgets these sequences (in batches: at its next call, or with flush when the
        engine has nothing left to run), and the workers the rows they kept of them. reason: one for
        all, or seq_id -> reason."""
        reasons = reason if isinstance(reason, dict) else {s.seq_id: reason for s in seqs}
        ids = [s.seq_id for s in seqs]
        if self.planner is not None:
            self.planner.forget(ids)  # (their calibration offsets)
        if self.drafter.export() is not None:
            for sid in ids:
                if sid in self.stale:
                    self.stale.discard(sid)
                self.ready.pop(sid, None)
            self._free_rows += ids
        self.drafter.free(ids, reasons, flush)

    # ---- admin ---------------------------------------------------------------------------
    def status(self) -> dict:
        return self.drafter.status()

    def rollback(self, version: Optional[int], num_steps: int) -> dict:
        out = self.drafter.rollback(version, num_steps)
        self.follow_version()
        return out

    def resume(self) -> dict:
        return self.drafter.resume()

    def summary(self) -> dict:
        """The drafter's acceptance figures; with the confidence schedule also the verify budget's
        (draft positions verified / drafted, STS temperatures, ECE by position, the step cost model)."""
        out = self.drafter.stats.summary()
        out["schedule"] = self.cfg.speculative.schedule
        out["num_drafted_positions"] = self.num_drafted
        out["verified_share"] = self.num_verified / self.num_drafted if self.num_drafted else float("nan")
        out["learn_failures"] = self.learn_failures  # steps whose verify outcomes could not be learned (engine._learn)
        if self.planner is not None:
            out["calibration"] = self.planner.summary()
        if self.drafter.versions is not None:  # online calibration (the calibrator's side: status())
            out["drafter_versions"] = self.drafter.versions.status()
        return out


def _cut(p: Proposal, n: int) -> Proposal:
    """The first n positions of a proposal (itself when it has no more)."""
    if len(p.tokens) <= n:
        return p
    return Proposal(p.tokens[:n], None if p.probs is None else p.probs[:n],
                    None if p.confidences is None else p.confidences[:n])

