"""Iteration-level scheduler: which sequences run in the next step, and with how many tokens.

Each step mixes decodes and prefill chunks under `max_num_seqs` and `max_num_batched_tokens`.
Running sequences go first (oldest first); when KV blocks run out the newest running sequence is
preempted by recompute (its blocks are freed, its tokens kept, and it rejoins the front of the
queue). Waiting requests are admitted in arrival order, their prompts chunked to fit the budget.

Scheduling a chunk advances the sequence at once (`num_computed_tokens`, and a pending token when it
samples), so the next step can be scheduled while this one is still running (async scheduling);
`update` fills in the sampled tokens when the step's output arrives.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from .kv_cache import BlockManager
from .sequence import Sequence, SeqStatus
from .speculative.records import Proposal


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens to compute (prefill chunk, or 1 for a decode)
    start: int  # the sequence's num_computed_tokens when scheduled: where this chunk begins
    samples: bool  # the chunk reaches the end of the tokens, so the next token is sampled
    num_lookahead: int = 0  # KV slots reserved for drafts (speculative decode rows)
    proposal: Optional[Proposal] = None  # drafts to verify, filled in before the step
    # schedule confidence: the raw confidences [K] of every drafted position, verified or not, and the sequence's
    # calibration offset the verify budget chose with (VerifyPlanner.sequence_offsets)
    draft_confidences: Optional[object] = None
    draft_offset: float = 0.0

    @property
    def num_draft(self) -> int:
        return len(self.proposal.tokens) if self.proposal is not None else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler (KV capacity)
    lookahead: int = 0  # the draft slots a decode row could reserve in this step (0: no row drafts)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 lookahead: int = 0):
        self.blocks = block_manager
        # drafts per speculative decode row (0: no speculation); the confidence schedule sets it per step
        self.lookahead = lookahead
        self.speculation_enabled = lookahead > 0  # global run-time switch
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        # prefix caching: prompt tokens looked up at admission, and those found cached
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        # DSpark drafts from the target's states of its context tokens, which a cached prefix does not
        # produce: while this step drafts (lookahead > 0), a request that speculates takes cached blocks only up
        # to `speculative_recompute` tokens before its prompt's end, so its drafter has that many rows from its
        # first block (the engine sets it; None: no limit). At a load that drafts nothing it takes every cached
        # block, as plain decoding: if drafting resumes for it, its drafter's context starts at its prompt's end
        self.speculative_recompute: Optional[int] = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str, reason: str = "abort") -> list[Sequence]:
        """Remove a request wherever it is and free its blocks; returns the removed sequences."""
        removed = [s for s in list(self.waiting) + self.running if s.request_id == request_id]
        for s in removed:
            self._finish(s, reason)
        return removed

    def requeue_all(self, block_manager: BlockManager) -> None:
        """The workers were replaced (their KV is gone): every running sequence goes back to the
        front of the queue, oldest first, to recompute its prompt and output so far into the new
        pool. Not counted as preemptions."""
        for seq in reversed(self.running):
            seq.status = SeqStatus.WAITING
            seq.num_computed_tokens, seq.num_pending = 0, 0
            self.waiting.appendleft(seq)
        for seq in self.waiting:
            seq.num_computed_tokens = 0
        self.running = []
        self.blocks = block_manager

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        seq.finish_time = time.monotonic()
        self.blocks.free(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        self.num_recomputed_tokens += seq.num_computed_tokens  # their KV is computed again (the cost ledger)
        seq.num_computed_tokens = 0  # recompute: the tokens are kept, their KV is rebuilt later
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(lookahead=self.lookahead if self.speculation_enabled else 0)
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.done_when_pending_arrive(self.max_model_len):
                i += 1  # its last token is in flight
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            la = self._lookahead(seq, budget - n) if n == seq.num_tokens - seq.num_computed_tokens == 1 else 0
            n_alloc = n + la
            if la and not self.blocks.can_allocate(seq.seq_id, seq.num_computed_tokens + n_alloc):
                la, n_alloc = 0, n  # out of room: this row decodes without drafts
            while not self.blocks.can_allocate(seq.seq_id, seq.num_computed_tokens + n) and self.running[-1] is not seq:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
            if not self.blocks.can_allocate(seq.seq_id, seq.num_computed_tokens + n):
                if i == 0 and seq.num_pending:
                    break  # its token in flight may end it anyway: decide once that token is known
                if i == 0:  # alone and still out of blocks: the pool cannot hold this sequence
                    self._finish(seq, "kv_cache_full")
                    out.finished.append(seq)
                else:
                    self._preempt(seq)
                    out.preempted.append(seq)
                break
            self.blocks.allocate(seq.seq_id, seq.num_computed_tokens + n_alloc)
            out.scheduled.append(self._advance(seq, n, la))
            budget -= n_alloc
            i += 1
        if out.preempted:
            return out  # admitting new work in a step that had to preempt would only thrash
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self._match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.can_allocate(seq.seq_id, seq.num_computed_tokens + n):
                if self.running:
                    if cached:  # it waits: the blocks it would share go back (still cached)
                        self.blocks.free(seq.seq_id)
                        seq.num_computed_tokens = 0
                    break
                # nothing else runs: take the chunk that fits (add() guarantees the prompt fits)
                have = len(self.blocks.block_tables.get(seq.seq_id, ()))
                n = (have + self.blocks.num_free) * self.blocks.block_size - seq.num_computed_tokens
            if seq.num_computed_tokens == cached:  # admitted from the start (not a chunk already computed)
                self.prefix_cache_queries += seq.num_tokens - 1
                self.prefix_cache_hits += cached
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = cached
            self.waiting.popleft()
            self.blocks.allocate(seq.seq_id, seq.num_computed_tokens + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(self._advance(seq, n))
            budget -= n
        return out

    def _match_prefix(self, seq: Sequence) -> int:
        """A sequence starting from nothing takes the cached blocks its tokens begin with (never its
        last token: that one is computed, to sample from). Returns the tokens they hold."""
        if seq.num_computed_tokens or not self.blocks.prefix_caching or seq.params.prompt_logprobs is not None:
            return 0  # (prompt log-probabilities need every position's law)
        limit = seq.num_tokens - 1
        if (self.speculative_recompute is not None and seq.params.speculative and self.speculation_enabled
                and self.lookahead > 0):
            limit = max(0, limit - self.speculative_recompute)  # (its drafter's context starts past the cached blocks)
        cached = self.blocks.match_prefix(seq.seq_id, seq.token_ids, limit)
        seq.num_computed_tokens = cached
        return cached

    @staticmethod
    def _advance(seq: Sequence, n: int, lookahead: int = 0) -> ScheduledSeq:
        """Count the chunk as computed now; a sampling chunk leaves one token pending."""
        s = ScheduledSeq(seq, n, seq.num_computed_tokens, seq.num_computed_tokens + n == seq.num_tokens, lookahead)
        seq.num_computed_tokens += n
        seq.num_pending += s.samples
        return s

    def _lookahead(self, seq: Sequence, budget_left: int) -> int:
        """Draft slots for a decode row: none when speculation is off (globally or for the
        request), and never past max_tokens, max_model_len or the step's token budget."""
        if not (self.lookahead and self.speculation_enabled and seq.params.speculative):
            return 0  # (the lookahead first: a step the plan drafts nothing in reads no row's params)
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        k = self.lookahead if seq.params.num_speculative_tokens is None else min(self.lookahead, seq.params.num_speculative_tokens)
        return max(0, min(k, room, budget_left))

    def update(self, scheduled: list[ScheduledSeq], sampled: dict[int, list[int]]) -> list[tuple[Sequence, list[int]]]:
        """Fill in a step's tokens. sampled: seq_id -> new tokens (sampling rows only: the accepted
        drafts and one token of the target's). Returns (sequence, new tokens) for every sequence that
        produced tokens; finished ones are removed and their blocks freed. Rows of sequences that
        ended while the step ran (aborted, or finished by the step before) are dropped."""
        now = time.monotonic()
        events = []
        for s in scheduled:
            seq = s.seq
            if not s.samples:  # a prompt chunk: its KV is written (prefix caching may register its blocks)
                self.blocks.commit(seq.seq_id, seq.token_ids, s.start + s.num_new_tokens)
                continue
            seq.num_pending -= 1
            if seq.finished or seq.seq_id not in sampled:
                continue
            accepted = 0
            if s.proposal is not None:
                accepted = len(sampled[seq.seq_id]) - 1
                seq.num_draft_tokens += s.num_draft
                seq.num_accepted_tokens += accepted
                seq.num_computed_tokens += accepted  # the KV of rejected drafts is dropped
            new, done = [], False
            for tok in sampled[seq.seq_id]:
                new.append(tok)
                if seq.append(tok, self.max_model_len, now):
                    done = True
                    break
            # the KV written by this step: its tokens and the accepted drafts (before the blocks are freed)
            self.blocks.commit(seq.seq_id, seq.token_ids, min(s.start + s.num_new_tokens + accepted, len(seq.token_ids)))
            if done:
                self._finish(seq, seq.finish_reason)
            events.append((seq, new))
        return events
