"""One step of continuous batching as data: `StepInput` in, `StepOutput` out, and the scheduler
side that builds a StepInput (plain CPU tensors, small enough to send to every worker in one round).
A worker runs it with `step_exec.execute_step` on its model shard. Only token ids, expert load
counts and (when asked) log-probabilities come back, never logits.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np
import torch

from .speculative.context import ContextRows
from .scheduler import ScheduledSeq


class _NumpyWire:
    """Pickles a step's tensors as numpy and restores them as tensors. Torch's own tensor pickling
    goes through its storage reducers, ~20x slower for these small arrays."""

    def __getstate__(self):
        return {f.name: _to_wire(getattr(self, f.name)) for f in fields(self)}

    def __setstate__(self, state):
        for k, v in state.items():
            setattr(self, k, _from_wire(v))


def to_wire(obj) -> bytes:
    """A StepInput / StepOutput (or a list of them) as one bytes object. Ray channels pass bytes
    on a fast path: a compiled-graph round trip of the pickled bytes takes ~0.05 ms on this CPU,
    of the object itself ~0.6 ms (measured in launch/bench_cluster.py)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def from_wire(data: bytes):
    return pickle.loads(data)


def _to_wire(v):
    if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dtype != torch.bfloat16:
        return ("t", v.detach().contiguous().numpy())  # bf16 has no numpy dtype: pickled as a tensor
    if isinstance(v, tuple):
        return ("tuple", tuple(_to_wire(x) for x in v))
    return ("v", v)


def _from_wire(v):
    kind, x = v
    if kind == "t":  # arrays unpickled from bytes own writable memory; a read-only one is copied
        return torch.from_numpy(x if x.flags.writeable else x.copy())
    if kind == "tuple":
        return tuple(_from_wire(y) for y in x)
    return x


@dataclass
class StepInput(_NumpyWire):
    input_ids: torch.Tensor  # [T] new tokens, sequence after sequence
    query_lens: torch.Tensor  # [B] new tokens per sequence
    context_lens: torch.Tensor  # [B] KV length after this step
    block_tables: torch.Tensor  # [B, max_blocks]
    sample_rows: torch.Tensor  # [S] indices into B of the sequences that sample a token
    temperature: torch.Tensor  # [S] float
    top_k: torch.Tensor  # [S] long
    top_p: torch.Tensor  # [S] float
    seeds: torch.Tensor  # [S] long, -1 = unseeded
    positions_out: torch.Tensor  # [S] long, index of the output token being sampled
    block_size: int
    # speculative rows: the last draft_count[s] query tokens of sample row s are drafts to verify
    draft_tokens: Optional[torch.Tensor] = None  # [S, K] long
    num_draft: Optional[torch.Tensor] = None  # [S] long
    draft_probs: Optional[torch.Tensor] = None  # [S, K, V] draft law (None: one-hot drafts)
    placement_update: Optional[tuple] = None  # (version, phy2log [L, S]): start migrating experts
    commit_placement: Optional[int] = None  # version: switch to it before this step's forward
    return_logits: bool = False  # diagnostics (parity tests): also return the sampled rows' logits
    # async scheduling: input_ids[prev_token_pos[i]] is the token the previous step sampled in its
    # sample row prev_token_row[i]; the worker fills it in from its own output before the forward
    prev_token_pos: Optional[torch.Tensor] = None  # [P] long
    prev_token_row: Optional[torch.Tensor] = None  # [P] long
    share_sampled: bool = False  # TP rank 0 broadcasts its sampled tokens (the next step may need them)
    # DSpark: the driver rank exports these decoder layers' outputs of the committed tokens
    export_layers: Optional[tuple] = None
    seq_ids: Optional[torch.Tensor] = None  # [B] long, with export_layers (-1: export nothing for that row)
    # executor ray: the drafter actors (by name) that take the rows, split by seq_id % len;
    # None in process: the rows come back in StepOutput.context
    export_to: Optional[tuple] = None
    # online calibration: sample rows whose verify rounds are recorded (with the target's top-k law)
    record_rounds: Optional[torch.Tensor] = None  # [S] bool
    record_top_logprobs: int = 20
    # log-probabilities: per sample row, how many top alternatives to return with each produced token's
    # (-1: none); per prompt position scored, the flat input index whose law scores `prompt_lp_target`,
    # and the scheduled row and token index it belongs to
    logprobs: Optional[torch.Tensor] = None  # [S] long
    prompt_lp_pos: Optional[torch.Tensor] = None  # [P] long
    prompt_lp_target: Optional[torch.Tensor] = None  # [P] long
    prompt_lp_row: Optional[torch.Tensor] = None  # [P] long, into the scheduled rows
    prompt_lp_index: Optional[torch.Tensor] = None  # [P] long, the target's index in its sequence
    prompt_lp_top: int = 0  # top alternatives per scored prompt position


@dataclass
class StepOutput(_NumpyWire):
    sampled: torch.Tensor  # [S, W] token ids per sample row (driver rank only)
    num_tokens: torch.Tensor  # [S] how many of each row's W tokens are real (1 without drafts)
    expert_load: Optional[torch.Tensor] = None  # [num_moe_layers, num_experts] routed tokens
    slot_load: Optional[torch.Tensor] = None  # [num_moe_layers, slots] tokens this rank's slots computed
    logits: Optional[torch.Tensor] = None  # [S, vocab], only when StepInput.return_logits
    migration_ready: Optional[bool] = None  # an expert migration is staged and complete on this rank
    migration_bytes: int = 0
    forward_s: float = 0.0  # this rank's time inside execute_step (the rest of a round is transport)
    worker_s: float = 0.0  # a ShardWorker's time in its step call but pickling the output (forward_s included)
    between_s: float = 0.0  # a ShardWorker's time from returning the previous step to starting this one
    context: Optional[ContextRows] = None  # the exported rows (in process only; a worker sends them on)
    export_bytes: int = 0  # bytes of context rows this step exported
    # StepInput.logprobs: [S, W] each produced token's log-probability, [S, W, k] the top k's ids and values
    token_logprobs: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None
    top_logprobs: Optional[torch.Tensor] = None
    # StepInput.prompt_lp_pos: [P] the prompt tokens' log-probabilities, [P, k] the top k's
    prompt_token_logprobs: Optional[torch.Tensor] = None
    prompt_top_ids: Optional[torch.Tensor] = None
    prompt_top_logprobs: Optional[torch.Tensor] = None


def build_step_input(scheduled: list[ScheduledSeq], block_tables: dict[int, list[int]], block_size: int,
                     prev_rows: Optional[dict[int, int]] = None) -> StepInput:
    """prev_rows (async scheduling): seq_id -> its sample row in the step still in flight, whose
    token is this step's input for that sequence."""
    input_ids, query_lens, context_lens, tables = [], [], [], []
    rows, temps, ks, ps, seeds, pos_out, lps = [], [], [], [], [], [], []
    drafts, draft_probs = [], []
    prev_pos, prev_row = [], []
    plp_pos, plp_target, plp_row, plp_index, plp_top = [], [], [], [], 0
    for b, s in enumerate(scheduled):
        seq, start = s.seq, s.start
        k = seq.params.prompt_logprobs
        if k is not None:  # position t's law scores prompt token t + 1
            last = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)
            if last > start:
                plp_pos.extend(range(len(input_ids), len(input_ids) + last - start))
                plp_target.extend(seq.token_ids[start + 1 : last + 1])
                plp_index.extend(range(start + 1, last + 1))
                plp_row.extend([b] * (last - start))
                plp_top = max(plp_top, k)
        known = seq.token_ids[start : start + s.num_new_tokens]
        input_ids.extend(known)
        if len(known) < s.num_new_tokens:  # the last token is still being sampled by the step in flight
            prev_pos.append(len(input_ids))
            prev_row.append(prev_rows[seq.seq_id])
            input_ids.append(0)
        if s.proposal is not None:  # the drafts follow the last known token
            input_ids.extend(s.proposal.tokens)
        query_lens.append(s.num_new_tokens + s.num_draft)
        context_lens.append(start + s.num_new_tokens + s.num_draft)
        tables.append(block_tables[seq.seq_id])
        if s.samples:
            p = seq.params
            rows.append(b)
            temps.append(p.temperature)
            ks.append(p.top_k)
            ps.append(p.top_p)
            seeds.append(-1 if p.seed is None else p.seed)
            pos_out.append(seq.num_output_tokens + seq.num_pending - 1)  # pending counts this row's own token
            lps.append(-1 if p.logprobs is None else p.logprobs)
            drafts.append(s.proposal.tokens if s.proposal is not None else [])
            draft_probs.append(s.proposal.probs if s.proposal is not None else None)
    width = max((len(t) for t in tables), default=1)
    bt = np.zeros((len(tables), width), dtype=np.int64)  # numpy: ~1 us per row against ~5 for torch.tensor
    for b, t in enumerate(tables):
        bt[b, : len(t)] = t
    long = lambda x: torch.from_numpy(np.array(x, dtype=np.int64))  # noqa: E731
    real = lambda x: torch.from_numpy(np.array(x, dtype=np.float32))  # noqa: E731
    return StepInput(
        input_ids=long(input_ids),
        query_lens=long(query_lens),
        context_lens=long(context_lens),
        block_tables=torch.from_numpy(bt),
        sample_rows=long(rows),
        temperature=real(temps),
        top_k=long(ks),
        top_p=real(ps),
        seeds=long(seeds),
        positions_out=long(pos_out),
        block_size=block_size,
        prev_token_pos=long(prev_pos) if prev_pos else None,
        prev_token_row=long(prev_row) if prev_pos else None,
        logprobs=long(lps) if any(k >= 0 for k in lps) else None,
        **({"prompt_lp_pos": long(plp_pos), "prompt_lp_target": long(plp_target), "prompt_lp_row": long(plp_row),
            "prompt_lp_index": long(plp_index), "prompt_lp_top": plp_top} if plp_pos else {}),
        **_draft_fields(drafts, draft_probs),
    )


def profile_input(num_rows: int, tokens_per_row: int, block_size: int, num_blocks: int) -> StepInput:
    """A step of num_rows greedy verify rows of tokens_per_row tokens each (the last tokens_per_row - 1
    of them drafts), for timing the step at start-up. Its KV goes to the pool's first blocks, which
    hold nothing yet (a sequence overwrites its slots before it reads them)."""
    q = tokens_per_row
    nb = -(-q // block_size)
    tables = torch.arange(num_rows * nb).view(num_rows, nb) % max(num_blocks, 1)
    S = num_rows
    out = StepInput(
        input_ids=torch.zeros(S * q, dtype=torch.long), query_lens=torch.full((S,), q), context_lens=torch.full((S,), q),
        block_tables=tables, sample_rows=torch.arange(S), temperature=torch.zeros(S), top_k=torch.zeros(S, dtype=torch.long),
        top_p=torch.ones(S), seeds=torch.full((S,), -1), positions_out=torch.zeros(S, dtype=torch.long),
        block_size=block_size)
    if q > 1:
        out.draft_tokens, out.num_draft = torch.zeros(S, q - 1, dtype=torch.long), torch.full((S,), q - 1)
    return out


def _draft_fields(drafts: list[list[int]], probs: list) -> dict:
    K = max((len(d) for d in drafts), default=0)
    if K == 0:
        return {}
    S = len(drafts)
    tokens = torch.zeros(S, K, dtype=torch.long)
    for i, d in enumerate(drafts):
        tokens[i, : len(d)] = torch.tensor(d, dtype=torch.long)
    out = {"draft_tokens": tokens, "num_draft": torch.tensor([len(d) for d in drafts], dtype=torch.long)}
    if any(p is not None for p in probs):
        V = next(p for p in probs if p is not None).shape[-1]
        law = torch.zeros(S, K, V)
        for i, (d, p) in enumerate(zip(drafts, probs)):
            if d:
                law[i, : len(d)] = p if p is not None else torch.nn.functional.one_hot(torch.tensor(d), V).float()
        out["draft_probs"] = law
    return out
