"""The simulated engine: the real Scheduler and BlockManager per data-parallel group, the real
VerifyPlanner and EPLB policy, on a virtual clock; a cost model where the workers would run.

`SimEngine.step` mirrors `engine.LLMEngine.step` on its synchronous path (plan the draft length,
schedule every group, attach the proposals cut to the verify budget, run, update each group's
scheduler with the tokens, observe), with three stand-ins:
- the executor: sampled tokens are one synthetic token per sample row plus the drafts accepted
  (drawn from the survival curve); the step takes `cost_model.step_time` seconds of virtual time;
- the drafter: proposals of the reserved length with confidences drawn per row (`Acceptance`; with
  `acceptance.sequence_spread` each sequence's drafts survive more or less than their confidences say,
  which the planner's sequence offsets learn as the engine's do);
- the expert routing: token-expert counts drawn per layer (`ExpertTraffic`), spread over the
  current placement's replicas as the dispatch does.
Why not the real LLMEngine with a simulated executor: the engine, the scheduler and the sequence
read time.monotonic() themselves (arrivals, token times, exploration pacing), so a virtual clock
cannot be injected without touching them; this loop calls the same parts in the same order and
re-stamps the times the scheduler wrote with the virtual clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch

from .. import eplb
from ..kv_cache import BlockManager, kv_budget_bytes
from ..model.spec import ModelSpec
from ..placement import default_placement, placement_from_phy2log
from ..scheduler import Scheduler
from ..sequence import Sequence
from ..speculative.drafting import SpecStats
from ..speculative.dspark_model import prefix_recompute_rows
from ..speculative.records import Proposal
from ..speculative.verify_budget import StepCost, VerifyPlanner, draft_forwards
from .cost_model import Precision, StepShape, Topology, drafter_time, profile_grid, step_time
from .hardware import Device
from .shapes import ModelShapes, model_shapes


@dataclass
class _Routing:
    """The current placement as index arrays for the per-step rank loads (numpy, all layers at once)."""

    phy2log: np.ndarray  # [L, S]
    replicas: np.ndarray  # [L, E]
    num_ranks: int

    def rank_loads(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """counts [L, E] -> tokens per rank [L, R] (an expert's tokens split evenly over its replicas)
        and experts with work per rank [L, R]."""
        per_slot = np.take_along_axis(counts / self.replicas, self.phy2log, axis=1)  # [L, S]
        L, S = per_slot.shape
        per_slot = per_slot.reshape(L, self.num_ranks, S // self.num_ranks)
        return per_slot.sum(-1), (per_slot > 0).sum(-1)


def precision_for(spec: ModelSpec, mode: str, dev: Device) -> Precision:
    """The bytes and dtypes the deployment runs at (see SimOptions.precision)."""
    elem = float(spec.dtype.itemsize)
    if dev.name == "cpu" or not dev.flops.get("bf16"):
        return Precision(elem, elem, elem, "fp32" if elem == 4 else "bf16", "fp32" if elem == 4 else "bf16", elem, elem)
    dtype = "fp32" if elem == 4 else "bf16"
    if mode == "fp8":
        return Precision(weight_bytes=1.0, act_bytes=2.0, kv_bytes=2.0, gemm_dtype="fp8", attn_dtype="bf16",
                         dispatch_bytes=1.0, combine_bytes=2.0)
    return Precision(elem, elem, elem, dtype, dtype, elem, elem)


def rank_memory(cfg, shapes: ModelShapes, prec: Precision, dev: Device) -> dict:
    """One rank's weights, its KV bytes per block and the blocks its pool holds (as kv_plan and
    kv_cache.plan_num_blocks reckon them: a share of kv_cache_memory is of what the weights leave)."""
    tp, world = cfg.parallel.tensor, cfg.parallel.world_size
    slots = shapes.num_experts + cfg.eplb.num_redundant_experts
    weights = shapes.rank_weight_params(tp, world, slots)["total"] * prec.weight_bytes
    sc = cfg.scheduler
    per_block = int(shapes.kv_elems_per_token_layer(tp) * prec.kv_bytes * shapes.num_layers * sc.block_size)
    if isinstance(sc.num_kv_blocks, int):
        blocks = sc.num_kv_blocks
    else:
        device_type = "cpu" if dev.name == "cpu" else "cuda"
        left = max(0, int(dev.memory_bytes - weights))
        budget = kv_budget_bytes(sc.kv_cache_memory, device_type, left, 1)
        blocks = max(1, budget // per_block)
    return {"weight_bytes": int(weights), "kv_bytes_per_block": per_block, "num_blocks": int(blocks)}


class DrafterFigures(NamedTuple):
    params: float = 0.0  # parameters of one forward
    export_layers: int = 0  # DSpark: the target layers whose hidden states it reads
    context_window: int = 0  # DSpark: the committed rows a sequence keeps while its drafter is idle
    num_layers: int = 0  # its decoder layers (each pays the device's layer_overhead_s a forward)
    draft_passes: int = 1  # DSpark: block forwards a proposal takes


class SimEngine:
    def __init__(self, cfg, spec: ModelSpec, opts, dev: Device, drafter_dev: Optional[Device] = None,
                 drafter: DrafterFigures = DrafterFigures(), survival=None):
        self.cfg, self.spec, self.opts, self.dev = cfg, spec, opts, dev
        self.drafter_dev = drafter_dev or dev
        self.shapes = model_shapes(spec)
        self.prec = precision_for(spec, opts.precision, dev)
        p = cfg.parallel
        self.num_slots = self.shapes.num_experts + cfg.eplb.num_redundant_experts
        self.topo = Topology(p.tensor, p.data, dev.gpus_per_node, self.num_slots)
        self.memory = rank_memory(cfg, self.shapes, self.prec, dev)
        sc = cfg.scheduler
        self.block_size, self.num_blocks = sc.block_size, self.memory["num_blocks"]
        self.max_model_len = sc.max_model_len or spec.max_position_embeddings
        self.num_groups = p.data
        sp = cfg.speculative
        self.speculating = sp.enabled
        lookahead = sp.num_tokens if self.speculating else 0
        self.schedulers = [Scheduler(BlockManager(self.num_blocks, sc.block_size, sc.prefix_caching), sc.max_num_seqs,
                                     sc.max_num_batched_tokens, self.max_model_len, lookahead)
                           for _ in range(self.num_groups)]
        for g in self.schedulers:  # as the engine: a DSpark request computes its prompt's latest rows past a cached prefix
            g.speculative_recompute = (prefix_recompute_rows(drafter.context_window)
                                       if self.speculating and sp.method == "dspark" else None)
        mode = opts.async_scheduling
        self.async_host = (p.executor == "ray" if sc.async_scheduling == "auto" else bool(sc.async_scheduling)) \
            if mode == "auto" else mode == "on"
        self.async_host = self.async_host and not self.speculating  # the engine does not overlap while speculating
        self.drafter = drafter
        drafter_params, export_layers = drafter.params, drafter.export_layers
        # DSpark's idle drafter: a sequence's committed rows wait on the workers (the latest
        # context_window) until it drafts again; that proposal exports them and computes their keys and
        # values in the drafter's forward (speculative/context.py ContextStash)
        self.context_window = drafter.context_window
        self.held_rows: dict[int, int] = {}  # seq_id -> rows the workers keep (its drafter is idle)
        self.stale: set[int] = set()  # sequences whose latest rows the drafter lacks: no proposal until exported
        self.unread_rows: dict[int, int] = {}  # seq_id -> rows exported whose keys/values the drafter computes next
        self._export_tokens = 0
        # a drafter on the target's driver rank (speculative.placement target) drafts on the target's device
        # inside the step, and its context rows never leave that device
        self.on_target = sp.on_target
        if self.on_target:
            self.drafter_dev = dev
        self.step_kw = dict(overlap=opts.overlap, drafter_params=drafter_params, drafter_layers=drafter.num_layers,
                            drafter_dev=self.drafter_dev,
                            export_bytes_per_token=0.0 if self.on_target else
                            export_layers * self.shapes.hidden * self.prec.act_bytes,
                            async_host=self.async_host, dispatch=opts.dispatch)
        self.planner: Optional[VerifyPlanner] = None
        self.acceptance = None
        if self.speculating:
            from .traffic import Acceptance

            self.acceptance = Acceptance(survival, opts.acceptance.spread, opts.seed + 7,
                                         opts.acceptance.sequence_spread)
            if sp.schedule == "confidence":
                # the simulated device's T(B), as the engine profiles its own at start-up
                cap = max(1, min(sc.max_num_batched_tokens, sc.max_num_seqs * (1 + sp.num_tokens)))
                # (the start-up profile times the executor's round alone: no host terms)
                bare = dev.model_copy(update={"host_overhead_s": 0.0, "per_seq_overhead_s": 0.0,
                                              "per_token_overhead_s": 0.0})
                xs, ys = profile_grid(self.shapes, self.topo, bare, self.prec, sc.max_num_seqs, cap,
                                      **{k: v for k, v in self.step_kw.items()
                                         if k in ("overlap", "async_host", "dispatch")})
                self.planner = VerifyPlanner(sp.num_tokens, StepCost(xs, ys), sp.method,
                                             prior_acceptance=sp.prior_acceptance, draft_passes=drafter.draft_passes)
                self.planner.clock = lambda: self.now  # its exploration paced in simulated time
        # experts: routing draws, the placement, the balancer's window
        self.moe = self.shapes.num_moe_layers > 0 and self.topo.world > 1
        self.traffic = None
        if self.shapes.num_moe_layers:
            from .traffic import ExpertTraffic

            el = opts.expert_load
            self.traffic = ExpertTraffic(self.shapes.num_moe_layers, self.shapes.num_experts, el.kind, el.skew,
                                         el.drift_every_steps, el.drift_share, el.report, cfg.workload.hot_experts,
                                         cfg.workload.hot_bias, opts.seed + 11)
        self.eplb_enabled = cfg.eplb.enabled and self.moe
        if self.moe:
            pl = default_placement(self.shapes.num_moe_layers, self.shapes.num_experts, self.topo.world,
                                   cfg.eplb.num_redundant_experts)
            phy2log = pl.phy2log
            if opts.eplb_initial == "balanced":  # the policy over the expected load, before the first step
                e = cfg.eplb
                phy2log, _, _ = eplb.rebalance(torch.as_tensor(self.traffic.probs * 1e6), self.num_slots,
                                               e.num_groups or spec.n_group, e.num_nodes, self.topo.world, e.policy,
                                               refine=opts.eplb_refine)
            self._set_placement(phy2log)
        self.window: deque = deque(maxlen=cfg.eplb.window_steps)
        self.expert_total = np.zeros((self.shapes.num_moe_layers, self.shapes.num_experts)) if self.traffic else None
        self.rebalances: list[dict] = []
        self.balancedness: list[float] = []
        self.now = 0.0
        self.num_steps = 0
        self.step_record: list[dict] = []
        self.schedule_record: list = []
        self.finished: list[Sequence] = []
        self.shape_record: list = []
        self.busy_s = 0.0  # the target's device seconds (forward), for the ledger
        self.comm_bytes = {"all_reduce": 0.0, "all_gather": 0.0, "all_to_all": 0.0, "hidden_state_export": 0.0}
        self.tokens = {"prompt": 0, "output": 0, "drafted": 0, "accepted": 0}
        # the engine's own acceptance statistics, over the rounds the simulation verified
        self.spec_stats = SpecStats(cfg.speculative.num_tokens)
        self.kv_peak_blocks = 0
        self.terms_total: dict = {}
        self._token = 2 if 2 not in spec.eos_token_ids else 3  # the synthetic token (never an end of sequence)

    # ---- requests -----------------------------------------------------------------------
    def enqueue(self, seq: Sequence) -> None:
        """As LLMEngine.enqueue: the data-parallel group with the least work takes it."""
        self.tokens["prompt"] += seq.num_prompt_tokens
        min(self.schedulers, key=lambda g: len(g.running) + len(g.waiting)).add(seq)

    def has_unfinished(self) -> bool:
        return any(g.has_unfinished() for g in self.schedulers)

    # ---- experts -------------------------------------------------------------------------
    def _set_placement(self, phy2log) -> None:
        pl = placement_from_phy2log(torch.as_tensor(phy2log), self.shapes.num_experts, self.topo.world)
        self.placement = pl
        self.routing = _Routing(pl.phy2log.numpy(), pl.replica_count.numpy().astype(np.float64), self.topo.world)

    def _maybe_rebalance(self) -> None:
        """As ExpertBalancer: every interval_steps, the policy over the window; kept when the window's
        balancedness would rise by min_gain (the simulation commits at once: no staging steps)."""
        e = self.cfg.eplb
        if not self.eplb_enabled or self.num_steps % e.interval_steps or not self.window:
            return
        load = torch.as_tensor(np.sum(self.window, axis=0))
        num_groups = e.num_groups or self.spec.n_group
        phy2log, _, _ = eplb.rebalance(load, self.num_slots, num_groups, e.num_nodes, self.topo.world, e.policy,
                                       refine=self.opts.eplb_refine)
        before = float(eplb.balancedness(load, self.placement.phy2log, self.topo.world).mean())
        after = float(eplb.balancedness(load, phy2log, self.topo.world).mean())
        if after >= before + e.min_gain:
            self._set_placement(phy2log)
            self.rebalances.append({"step": self.num_steps, "committed_at_step": self.num_steps, "time_s": self.now,
                                    "balancedness_before": before, "balancedness_after": after})

    # ---- speculation ---------------------------------------------------------------------
    def _plan(self) -> None:
        if self.planner is None:
            return
        k = self.planner.draft_len(sum(min(g.max_num_seqs, len(g.running) + len(g.waiting)) for g in self.schedulers)) \
            if any(g.speculation_enabled for g in self.schedulers) else 0
        for g in self.schedulers:
            g.lookahead = k

    def _attach(self, scheds) -> tuple[float, dict]:
        """As Speculation.attach: proposals for the rows that reserved draft slots, cut to the verify
        budget. Returns the drafting's seconds and id(row) -> its conditional acceptances."""
        rows = [s for sc in scheds for s in sc.scheduled if s.num_lookahead]
        if self.planner is not None and self.planner.exploring:
            rows = sorted(rows, key=lambda s: s.seq.seq_id in self.stale)[: self.planner.explore_rows]
        if self.context_window:
            stale = set(self.stale)
            self._export_tokens = self._export_context(scheds, {s.seq.seq_id for s in rows})
            rows = [s for s in rows if s.seq.seq_id not in stale]  # a stale one exports now, drafts next step
        if not rows:
            return 0.0, {}
        k = max(s.num_lookahead for s in rows)
        conf = self.acceptance.draw(len(rows), k)
        cond = self.acceptance.truth(conf, [s.seq.seq_id for s in rows])
        law, keep = {}, {}
        for i, s in enumerate(rows):
            n = s.num_lookahead
            s.proposal = Proposal([self._token] * n, None, torch.from_numpy(conf[i, :n].astype(np.float32)))
            law[id(s)] = cond[i]
            keep[id(s)] = n
        method = self.cfg.speculative.method
        forwards = draft_forwards(method, k, self.drafter.draft_passes)
        per_forward = len(rows) * (k if method == "dspark" else 1)
        if self.context_window:  # the drafter computes the keys and values of the rows it got since its last call
            per_forward += sum(self.unread_rows.pop(s.seq.seq_id, 0) for s in rows)
        draft_s = drafter_time(per_forward, forwards, self.drafter.params, self.drafter.num_layers, self.drafter_dev,
                               self.prec)
        if self.planner is not None:
            self.planner.drafted(len(rows), k, draft_s)
            for sc in scheds:
                vrows = [s for s in sc.scheduled if s.proposal is not None]
                if not vrows:
                    continue
                raw = self.planner.raw_confidences([s.proposal for s in vrows])
                for i, s in enumerate(vrows):
                    raw[i, keep[id(s)]:] = np.nan
                offsets = self.planner.sequence_offsets([s.seq.seq_id for s in vrows])  # as Speculation.attach
                lengths = self.planner.verify_lengths(raw, sc.num_tokens, sum(s.samples for s in sc.scheduled), draft_s,
                                                      offsets)
                for s, c, n, d in zip(vrows, raw, lengths.tolist(), offsets.tolist()):
                    s.draft_confidences, s.draft_offset = c, d
                    keep[id(s)] = min(keep[id(s)], n)
        for s in rows:
            if s.proposal is not None:
                n = keep[id(s)]
                if n == 0:
                    s.proposal = None
                elif len(s.proposal.tokens) > n:
                    p = s.proposal
                    s.proposal = Proposal(p.tokens[:n], None, p.confidences[:n])
        self._draft = (len(rows), per_forward, forwards)
        return draft_s, law

    def _forget(self, seq_ids: list) -> None:
        """Sequences that ended: their calibration offsets go (as Speculation.free), and their hidden ones."""
        if seq_ids and self.planner is not None:
            self.planner.forget(seq_ids)
        if seq_ids and self.acceptance is not None:
            self.acceptance.forget(seq_ids)

    def _export_context(self, scheds, asked: set) -> int:
        """As Speculation.step_fields with the workers' ContextStash: a step that drafts exports its
        rows (each stale sequence's kept rows first), one that drafts nothing keeps them (the latest
        context_window a sequence), exploring exports the rows asked for. Returns the rows exported."""
        exploring = self.planner is not None and self.planner.exploring
        exported = 0
        for sc, g in zip(scheds, self.schedulers):
            drafts = g.speculation_enabled and g.lookahead > 0 and not exploring
            for q in sc.preempted:  # it recomputes its rows: the kept ones are dropped
                self.held_rows.pop(q.seq_id, None)
                self.stale.discard(q.seq_id)
            for s in sc.scheduled:
                sid = s.seq.seq_id
                if drafts or sid in asked:
                    n = self.held_rows.pop(sid, 0) + s.num_new_tokens
                    self.unread_rows[sid] = self.unread_rows.get(sid, 0) + n
                    self.stale.discard(sid)
                    exported += n
                else:
                    self.held_rows[sid] = min(self.held_rows.get(sid, 0) + s.num_new_tokens, self.context_window)
                    self.stale.add(sid)
        return exported

    # ---- the step ------------------------------------------------------------------------
    def _shape(self, scheds) -> StepShape:
        G = self.num_groups
        tokens, samples, seqs, pairs, kv, free, ppairs, pctx, padded, padded_kv = (np.zeros(G) for _ in range(10))
        decode_only = self.opts.role == "decode"
        bs = self.block_size
        for g, sc in enumerate(scheds):
            t = sp = pr = kr = fr = ppr = pkr = 0
            n_dec = ctx_dec = n_oth = q_oth = ctx_oth = 0  # the padded batches: decode rows, the other rows
            for s in sc.scheduled:
                q = s.num_new_tokens + (len(s.proposal.tokens) if s.proposal is not None else 0)
                t += q
                sp += s.samples
                pair = q * s.start + q * (q + 1) // 2
                pr += pair
                kr += s.start + q
                if q == 1:
                    n_dec, ctx_dec = n_dec + 1, max(ctx_dec, s.start + 1)
                else:
                    n_oth, q_oth, ctx_oth = n_oth + 1, max(q_oth, q), max(ctx_oth, s.start + q)
                if s.start < s.seq.num_prompt_tokens and q > 1:  # a prompt chunk (not a decode or verify row)
                    ppr += pair
                    pkr += s.start + q
                if decode_only and s.start < s.seq.num_prompt_tokens:
                    fr += min(s.num_new_tokens, s.seq.num_prompt_tokens - s.start)
            tokens[g], samples[g], seqs[g], pairs[g], kv[g], free[g] = t, sp, len(sc.scheduled), pr, kr, fr
            ppairs[g], pctx[g] = ppr, pkr
            # a batch's keys span its longest context in whole blocks (model/attention.py _batch)
            s_dec, s_oth = -(-ctx_dec // bs) * bs, -(-ctx_oth // bs) * bs
            padded[g], padded_kv[g] = n_dec * s_dec + n_oth * q_oth * s_oth, n_dec * s_dec + n_oth * s_oth
        shape = StepShape(tokens, samples, seqs, pairs, kv, free if decode_only else None, ppairs, pctx,
                          padded_pairs=padded, padded_kv=padded_kv)
        if self.traffic is not None:
            routed = int(max(0.0, float((tokens - free).sum()))) * self.shapes.top_k
            counts = self.traffic.sample(routed)
            self.expert_total += counts
            if self.moe:
                self.window.append(counts)
                shape.rank_tokens, shape.rank_active = self.routing.rank_loads(counts)
                peak = shape.rank_tokens.max(axis=1)
                if routed:
                    self.balancedness.append(float(np.mean(shape.rank_tokens.mean(axis=1) / np.maximum(peak, 1e-12))))
        return shape

    def step(self) -> bool:
        """One step at the virtual time `now`; False when nothing could be scheduled."""
        self._plan()
        scheds = [g.schedule() for g in self.schedulers]
        for sc in scheds:
            for seq in sc.finished:  # ended by the scheduler (the pool cannot hold it)
                seq.finish_time = self.now
            self._forget([seq.seq_id for seq in sc.finished])
        if not any(sc.scheduled for sc in scheds):
            return False
        self._draft = (0, 0, 0)
        _, law = self._attach(scheds) if self.speculating else (0.0, {})
        shape = self._shape(scheds)
        shape.draft_rows, shape.draft_tokens, shape.draft_forwards = self._draft
        shape.export_tokens, self._export_tokens = self._export_tokens, 0
        if self.opts.record_shapes:
            self.shape_record.append(shape)
        host_seqs = float(shape.num_seqs.max()) if self.opts.host == "per_group" else None
        terms = step_time(shape, self.shapes, self.topo, self.dev, self.prec, host_seqs=host_seqs, **self.step_kw)
        t_end = self.now + terms["total"]
        for k, v in terms.items():
            self.terms_total[k] = self.terms_total.get(k, 0.0) + v
        device_s = terms["total"] - terms["host"] - terms["drafter"]
        self.busy_s += device_s
        if self.planner is not None and not self.async_host:  # as the engine: the live time corrects the profile
            self.planner.observe_step(int(shape.tokens.max()), device_s, sum(len(sc.scheduled) for sc in scheds),
                                      drafting=any(s.num_draft for sc in scheds for s in sc.scheduled))
        self._count_comm(shape)
        drafted = verified = accepted = 0
        one = [self._token]  # one list for every plain decode row (update only reads it)
        for sc, g in zip(scheds, self.schedulers):
            sampled, rounds = {}, []
            if not self.speculating:  # the fast path: one token per sample row
                sampled = {s.seq.seq_id: one for s in sc.scheduled if s.samples}
            for s in (sc.scheduled if self.speculating else ()):
                n_acc = 0
                if s.samples and s.proposal is not None:
                    n_acc = int(self.acceptance.accepted(law[id(s)][None, :], np.array([len(s.proposal.tokens)]))[0])
                    self.spec_stats.record(len(s.proposal.tokens), n_acc, s.proposal.confidences)
                if not s.samples:
                    continue
                if s.proposal is not None:
                    verified += len(s.proposal.tokens)
                    accepted += n_acc
                if s.draft_confidences is not None:  # as the engine: a row the budget cut to 0 is an outcome too
                    rounds.append((s.draft_confidences, len(s.proposal.tokens) if s.proposal is not None else 0, n_acc,
                                   s.seq.seq_id, s.draft_offset))
                    drafted += int(np.sum(~np.isnan(s.draft_confidences)))
                elif s.proposal is not None:
                    drafted += len(s.proposal.tokens)
                sampled[s.seq.seq_id] = [self._token] * (1 + n_acc)
            if self.opts.record_schedule:
                self.schedule_record.append((self.num_steps,
                                             [(s.seq.request_id, s.num_new_tokens) for s in sc.scheduled],
                                             [q.request_id for q in sc.preempted]))
            ended = []
            for seq, new in g.update(sc.scheduled, sampled):
                # the scheduler stamped these with the wall clock: the virtual one instead
                if len(new) == 1:
                    seq.token_times[-1] = t_end
                else:
                    seq.token_times[len(seq.token_times) - len(new):] = [t_end] * len(new)
                if seq.finished:
                    seq.finish_time = t_end
                    for rows in (self.held_rows, self.unread_rows):
                        rows.pop(seq.seq_id, None)
                    self.stale.discard(seq.seq_id)
                    ended.append(seq.seq_id)
                    self.finished.append(seq)
                self.tokens["output"] += len(new)
            if self.planner is not None and rounds:
                self.planner.observe(np.stack([r[0] for r in rounds]), [r[1] for r in rounds], [r[2] for r in rounds],
                                     [r[3] for r in rounds], [r[4] for r in rounds])
            self._forget(ended)  # after their last rounds are observed, as the engine frees after it learns
        self.tokens["drafted"] += drafted
        self.tokens["accepted"] += accepted
        used = sum(g.blocks.num_used for g in self.schedulers)
        self.kv_peak_blocks = max(self.kv_peak_blocks, max(g.blocks.num_used for g in self.schedulers))
        if self.opts.record_steps:
            rec = {"time": t_end, "step_time_s": terms["total"], "execute_s": terms["total"] - terms["host"],
                   "forward_s": terms["total"] - terms["host"] - terms["drafter"],
                   "num_seqs": int(shape.num_seqs.sum()), "num_tokens": int(sum(sc.num_tokens for sc in scheds)),
                   "kv_blocks_used": used, "num_preempted": sum(len(sc.preempted) for sc in scheds),
                   "overlapped": self.async_host, "num_drafted": drafted, "num_verified": verified,
                   "draft_len": max((s.num_lookahead for sc in scheds for s in sc.scheduled), default=0),
                   # tokens the verify rounds produced: the drafts accepted and one of the target's per round
                   "spec_tokens": accepted + sum(1 for sc in scheds for s in sc.scheduled if s.proposal is not None),
                   "simulated": True, "terms": {k: round(v, 9) for k, v in terms.items()}}
            rec["verify_budget"] = rec["num_tokens"] + verified
            self.step_record.append(rec)
        self.now = t_end
        self.num_steps += 1
        self._maybe_rebalance()
        return True

    def _count_comm(self, s: StepShape) -> None:
        """Bytes the step's collectives sent, summed over ranks (the ledger's comm_bytes)."""
        m, tp, p = self.shapes, self.topo.tensor, self.prec
        tok = float(np.sum(s.tokens))
        if tp > 1:
            self.comm_bytes["all_reduce"] += 2 * m.num_layers * tok * m.hidden * p.act_bytes * 2 * (tp - 1) / tp
            self.comm_bytes["all_gather"] += float(np.sum(s.sample_rows)) * m.vocab * 4.0 * (tp - 1) / tp
        if self.moe:
            w = self.topo.world
            self.comm_bytes["all_to_all"] += (m.num_moe_layers * tok * m.top_k * m.hidden
                                              * (p.dispatch_bytes + p.combine_bytes) * (w - 1) / w)
        if not self.on_target:
            self.comm_bytes["hidden_state_export"] += s.export_tokens * self.drafter.export_layers * m.hidden * p.act_bytes

    def run(self, requests, make_seq) -> list[Sequence]:
        """Replay requests (sorted by arrival_s) on the virtual clock; make_seq(request) -> Sequence.
        Returns every sequence, finished."""
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        seqs = []
        while pending or self.has_unfinished():
            while pending and pending[0].arrival_s <= self.now:
                r = pending.popleft()
                seq = make_seq(r)
                seq.arrival_time = r.arrival_s
                seqs.append(seq)
                self.enqueue(seq)
            if self.num_steps >= self.opts.max_steps:
                break
            if not self.step():
                if pending:
                    self.now = max(self.now, pending[0].arrival_s)  # idle until the next arrival
                    continue
                if self.has_unfinished():  # nothing schedulable and nothing arriving: cannot happen
                    raise RuntimeError("simulation: requests wait but none can be scheduled")
        return seqs

    def expert_summary(self) -> Optional[dict]:
        if self.expert_total is None:
            return None
        out = {"expert_load_total": self.expert_total.astype(np.int64).tolist(), "rebalances": self.rebalances,
               "num_ranks": self.topo.world, "num_slots": self.num_slots}
        if self.balancedness:
            out["balancedness_mean"] = float(np.mean(self.balancedness))
            n = max(1, len(self.balancedness) // 10)
            out["balancedness_first_tenth"] = float(np.mean(self.balancedness[:n]))
            out["balancedness_last_tenth"] = float(np.mean(self.balancedness[-n:]))
        return out

