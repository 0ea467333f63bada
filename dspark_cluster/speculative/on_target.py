"""A DSpark drafter on the target's driver rank (`speculative.placement: target`).

The drafter lives beside the target's shard on its device, in the worker's process (each data-parallel
group's TP rank 0, the rank that verifies). In one step call the worker runs the target's forward,
verifies the drafts proposed for this step, hands the committed tokens' states to the drafter (no
export: they never leave the device) and drafts for the next step, so a speculative step costs the
engine one round to the workers, as plain decoding does, and a drafter round trip never waits between
two steps (vLLM drafts in its model runner the same way). What crosses back is small: per sample row
the draft tokens, their raw confidences and the sequence length each proposal continues. The draft law
of a sampled row stays here until the next step verifies it (`laws`); a greedy row needs none.

A drafter failure never fails the target's step: the drafter is dropped, the step's output says so
once (`StepOutput.drafter_error`) and the engine goes on without speculation.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Optional

import torch

from .dspark_proposer import KEEP_BEHIND, DSparkProposer
from .proposers import DraftRequest
from .records import ContextRows

PROFILE_ROWS = (1, 4, 16)  # rows drafted for in the start-up profile (the exploration drafts for 4)
PROFILE_ID = -(1 << 40)  # the profile's synthetic sequences count down from here (never an engine's id)
MEMORY_PROFILE_ID = PROFILE_ID - (1 << 30)  # and the memory profile's (a freed id's late rows are dropped)

log = logging.getLogger(__name__)


def profile_calls(prepare, call, free, rows=PROFILE_ROWS, repeats: int = 3) -> dict[int, float]:
    """A drafter's start-up profile: for each count r in `rows`, r synthetic sequences (ids [r] counting
    down from PROFILE_ID, each pass its own: a freed id's late rows are dropped by a proposer); for
    i = 0 .. repeats, prepare(ids, i) untimed (the context rows a step would have delivered), then
    call(ids, i) timed; free(ids). Returns r -> the fastest call after the first (the first computes the
    whole context; a busy machine only adds time)."""
    out, first = {}, PROFILE_ID
    for r in rows:
        ids, first = torch.arange(first, first - r, -1), first - r
        times = []
        for i in range(repeats + 1):
            prepare(ids, i)
            t = time.perf_counter()
            call(ids, i)
            times.append(time.perf_counter() - t)
        free(ids)
        out[r] = min(times[1:])
    return out


class TargetDrafter:
    def __init__(self, draft_model: str, target_path: str, target_spec, device, num_tokens: int, context_window,
                 draft_passes=1, target_tables_held=None, compile_buckets=None, eager_if_compile_fails=False):
        """target_tables_held: this rank's embedding and LM head weights, which the drafter reads in place where
        they are the whole vocabulary (no tensor parallelism); compile_buckets: the batch sizes its greedy rounds
        are compiled for (model.compile on), or None."""
        self.proposer: Optional[DSparkProposer] = DSparkProposer(draft_model, target_path, target_spec, device,
                                                                 num_tokens, context_window=context_window,
                                                                 draft_passes=draft_passes,
                                                                 target_tables_held=target_tables_held,
                                                                 compile_buckets=compile_buckets,
                                                                 eager_if_compile_fails=eager_if_compile_fails)
        self._compile_error = self.proposer.compile_error
        # seq_id -> (sequence length the proposal continues, its tokens [k] (host), its draft law [k, V] (a
        # view of its batch's on the device)), for the sampled rows' latest proposals
        self.laws: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self.error: Optional[str] = None  # a failure not yet reported
        self.num_proposed = 0  # rows drafted for, since start
        self.num_tokens = num_tokens
        # rows -> seconds of a drafting call, measured at start-up: the verify planner's first decisions
        # use it instead of learning the drafter's cost on live rows (VerifyPlanner.prior_acceptance)
        self.profile: dict[int, float] = {}
        try:
            self.profile = self.measure()
        except Exception as e:  # noqa: BLE001 -- a drafter that cannot draft serves no one
            self._fail("draft (start-up profile)", e)

    @property
    def alive(self) -> bool:
        return self.proposer is not None

    def _fail(self, what: str, e: Exception) -> None:
        log.warning("the drafter on the target failed to %s (%s: %s); the engine goes on without speculation",
                    what, type(e).__name__, e)
        self.error = f"the drafter on the target failed to {what}: {type(e).__name__}: {e}"
        self.proposer, self.laws = None, {}

    def verify_laws(self, seq_ids: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor,
                    lengths: torch.Tensor, sampled_rows: torch.Tensor) -> tuple:
        """The draft laws of this step's sampled rows that verify drafts: (probs [R, K, V], rows [R]) for
        `verify`, or (None, None) when there are none. seq_ids, lengths (the sequence length each row's
        drafts continue) [S], draft_tokens [S, K], num_draft [S]; sampled_rows [R] (into S). A law this
        rank does not hold for the tokens the engine sent is an engine fault: raised, never guessed."""
        if sampled_rows.numel() == 0:
            return None, None
        K = draft_tokens.shape[1]
        laws = []
        for r in sampled_rows.tolist():
            sid, n, want = int(seq_ids[r]), int(num_draft[r]), int(lengths[r])
            held = self.laws.get(sid)
            if held is None or held[0] != want or not torch.equal(held[1][:n], draft_tokens[r, :n]):
                raise RuntimeError(f"sequence {sid}: the step verifies drafts at length {want} whose draft law this "
                                   f"rank does not hold (held: {None if held is None else held[0]})")
            law = held[2][:K]
            if law.shape[0] < K:  # (rows past num_draft are never read)
                law = torch.cat([law, law.new_zeros(K - law.shape[0], law.shape[1])])
            laws.append(law)
        return torch.stack(laws), sampled_rows

    def ingest(self, rows) -> None:
        if self.proposer is None or rows is None or not rows.counts.numel():
            return
        try:
            self.proposer.ingest(rows)
        except Exception as e:  # noqa: BLE001 -- the target's step goes on
            self._fail("take context rows", e)

    def free(self, seq_ids) -> None:
        """Sequences that finished or were preempted (a step's `free_context`, applied before its forward: no row
        of theirs comes after in that step; a preempted one's recompute sends its rows again)."""
        for sid in seq_ids:
            self.laws.pop(sid, None)
        if self.proposer is not None:
            try:
                self.proposer.free(seq_ids, drop_late_rows=False)
            except Exception as e:  # noqa: BLE001
                self._fail("free sequences", e)

    def propose(self, propose_k, seq_ids, lengths, anchors, temperature, top_k, top_p, seeds, positions) -> dict:
        """Draft for the next step: every argument is [S] over this step's sample rows (propose_k: the most
        tokens to draft, 0 for none; lengths: each sequence's tokens now, anchors: its last). Returns the
        StepOutput fields (draft_tokens [S, K] with -1 past each row's, draft_confidences [S, K],
        draft_lengths [S] with 0 where nothing was drafted, draft_s), or {} when nothing was asked."""
        rows = torch.nonzero(propose_k > 0).flatten().tolist()
        if self.proposer is None or not rows:
            return {}
        t0 = time.perf_counter()
        cols = [t.tolist() for t in (seq_ids, anchors, propose_k, temperature, top_k, top_p, seeds, positions, lengths)]
        reqs = [DraftRequest(sid, [a], k, t, tk, tp, seed, pos, n - 1)
                for sid, a, k, t, tk, tp, seed, pos, n in (tuple(c[r] for c in cols) for r in rows)]
        try:
            active, drafted = self.proposer.draft(reqs)
        except Exception as e:  # noqa: BLE001
            self._fail("draft", e)
            return {}
        S, K = propose_k.shape[0], int(propose_k.max())
        out_tokens = torch.full((S, K), -1, dtype=torch.long)
        out_conf = torch.full((S, K), float("nan"))
        out_len = torch.zeros(S, dtype=torch.long)
        if active:
            tokens, confs, laws = drafted
            tokens, confs = tokens.cpu(), confs.float().cpu()
            for b, i in enumerate(active):
                r, req = rows[i], reqs[i]
                out_tokens[r, : req.k] = tokens[b, : req.k]
                out_conf[r, : req.k] = confs[b, : req.k]
                out_len[r] = req.length
                if req.temperature > 0:  # (its own copy: a view would keep the whole batch's law alive)
                    self.laws[req.seq_id] = (req.length, tokens[b, : req.k], laws[b, : req.k].clone())
                else:
                    self.laws.pop(req.seq_id, None)
            self.num_proposed += len(active)
        return {"draft_tokens": out_tokens, "draft_confidences": out_conf, "draft_lengths": out_len,
                "draft_s": time.perf_counter() - t0}

    def measure(self, rows=PROFILE_ROWS, context: int = 32, repeats: int = 3) -> dict[int, float]:
        """Seconds of a drafting call (`propose`, what a step reports as draft_s) for `rows` sequences
        of `context` tokens drafting num_tokens each, once their context is in (`profile_calls`):
        random context rows, then one committed row before each call."""
        p = self.proposer
        width = p.c.target_hidden_size * len(p.layer_ids)

        def prepare(ids, i):  # the prompt's rows, then the row the last step committed
            r, n = len(ids), context if i == 0 else 1
            p.ingest(ContextRows(ids, torch.full((r,), 0 if i == 0 else context + i - 1), torch.full((r,), n),
                                 torch.randn(r * n, width, device=p.device)))

        def call(ids, i):
            full = lambda v, dtype=torch.long: torch.full((len(ids),), v, dtype=dtype)  # noqa: E731
            self.propose(full(self.num_tokens), ids, full(context + 1 + i), full(2), full(0.0, torch.float32),
                         full(0), full(1.0, torch.float32), full(-1), full(i))

        with self._start_up_rounds():
            out = profile_calls(prepare, call, lambda ids: p.free(ids.tolist()), rows, repeats)
        log.info("drafter on the target, ms a drafting call by rows: %s",
                 ", ".join(f"{r}: {1e3 * s:.2f}" for r, s in out.items()))
        return out

    @contextlib.contextmanager
    def memory_profile(self, rows: int):
        """The most device memory drafting holds beside the target, held while the block runs, for
        `Worker.activation_reserve` to measure with the target's largest steps inside it (in serving both are alive
        at once): `rows` sequences (the most a step drafts for), each with as much context as a sequence's store
        keeps (its window and KEEP_BEHIND rows: `DSparkProposer._make_room`), taken in one batch as a catch-up after
        idle steps sends them, and one round drafting num_tokens for every row at temperature 1, its laws held;
        all freed after. A failure (the device's memory, most likely) is logged and leaves the drafter out of the
        measure: it does not end the drafter, which serves or fails on its own later."""
        p, held = self.proposer, None
        ids = torch.arange(MEMORY_PROFILE_ID, MEMORY_PROFILE_ID - rows, -1)
        try:
            if p is not None:
                with self._start_up_rounds():
                    try:
                        n = p.window + KEEP_BEHIND
                        width = p.c.target_hidden_size * len(p.layer_ids)
                        p.ingest(ContextRows(ids, torch.zeros(rows, dtype=torch.long), torch.full((rows,), n),
                                             torch.randn(rows * n, width, device=p.device, dtype=p.dtype)))
                        held = p.draft([DraftRequest(int(s), [2], self.num_tokens, 1.0, position=n, start=n)
                                        for s in ids])
                    except Exception as e:  # noqa: BLE001 -- the reserve leaves it out; serving decides
                        log.warning("the drafter's memory profile failed (%s: %s): the KV pool leaves it no room",
                                    type(e).__name__, e)
            yield
        finally:
            del held
            if p is not None:
                p.free(ids.tolist())

    @contextlib.contextmanager
    def _start_up_rounds(self):
        """Rounds at start-up: a compiled drafter's run as they serve, but without its recording pass (every
        bucket's CUDA graphs: this thread, the worker's start-up thread, may never draft; only the profile's sizes
        record here); what they count is reset after."""
        p = self.proposer
        runner = p.compiled
        recording = runner is not None and runner.records_cuda_graphs
        if recording:
            runner.records_cuda_graphs = False
        try:
            yield
        finally:
            if recording:
                runner.records_cuda_graphs = True
            p.peak_context_bytes = p.ingested_rows = p.misses = p.narrowed = 0
            self.num_proposed = 0

    def compile_stats(self) -> dict:
        """The drafter's compiled rounds (`CompiledDraft.stats`; {} where they run eager)."""
        p = self.proposer
        return p.compiled.stats() if p is not None and p.compiled is not None else {}

    def compile_error(self) -> Optional[str]:
        """Why the rounds run eager under model.compile auto (their compile failed), or None (kept past a later
        failure that drops the proposer)."""
        return self._compile_error

    def take_error(self) -> Optional[str]:
        err, self.error = self.error, None
        return err

    def memory_report(self) -> dict:
        if self.proposer is None:
            return {}
        r = self.proposer.memory_report()
        laws = sum(law.numel() * law.element_size() for _, _, law in self.laws.values())
        return {"drafter_param_bytes": r["param_bytes"], "drafter_reordered_bytes": r.get("reordered_bytes", 0),
                "drafter_kv_bytes": r["kv_bytes"] + laws,
                "drafter_rows_proposed": self.num_proposed, "drafter_misses": self.proposer.misses,
                "drafter_resyncs": self.proposer.resyncs, "drafter_narrowed_windows": self.proposer.narrowed,
                "drafter_profile": self.profile}
