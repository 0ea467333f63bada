"""The step contract: one step of continuous batching as data, `StepInput` in, `StepOutput` out
(plain CPU tensors, small enough to send to every worker in one round), and their wire format.
`step_builder.build_step_input` makes a StepInput from the scheduler's output; a worker runs it
with `step_exec.execute_step` on its model shard. Only token ids, expert load counts and (when
asked) log-probabilities come back, never logits.

A leaf: it imports torch, numpy and the speculative records only, so a worker that unpickles a
step imports nothing of the scheduler, the engine or the drafter's trainer.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, fields
from typing import Optional

import torch

from .speculative.records import ContextRows


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
    # the draft law, only of the sampled rows whose drafter has one (a greedy row's verification reads
    # the draft tokens alone; every row not in draft_law_rows is one-hot at its drafts), in the drafter's
    # dtype; only the driver rank verifies, so on Ray only it receives them (actors/cluster.py)
    draft_probs: Optional[torch.Tensor] = None  # [R, K, V] (None: every row one-hot)
    draft_law_rows: Optional[torch.Tensor] = None  # [R] long, the sample rows (into S) draft_probs belongs to
    placement_update: Optional[tuple] = None  # (version, phy2log [L, S]): start migrating experts
    commit_placement: Optional[int] = None  # version: switch to it before this step's forward
    # expert parallelism: rows per rank pair of the padded all-to-all (the same in every group's input;
    # 0: exact splits, the counts read on the host per layer). See parallel/expert_parallel.py
    expert_capacity: int = 0
    return_logits: bool = False  # diagnostics (parity tests): also return the sampled rows' logits
    # async scheduling: input_ids[prev_token_pos[i]] is the token the previous step sampled in its
    # sample row prev_token_row[i]; the worker fills it in from its own output before the forward
    prev_token_pos: Optional[torch.Tensor] = None  # [P] long
    prev_token_row: Optional[torch.Tensor] = None  # [P] long
    share_sampled: bool = False  # TP rank 0 broadcasts its sampled tokens (the next step may need them)
    # DSpark: the driver rank exports the committed tokens' states of the layers the drafter reads (a
    # run's constant, given at worker setup) for the rows' owners (-1: export nothing for that row)
    seq_ids: Optional[torch.Tensor] = None  # [B] long
    # executor ray: the drafter actors (by name) that take the rows, split by seq_id % len;
    # None in process: the rows come back in StepOutput.context
    export_to: Optional[tuple] = None
    # which rows export now ([B] bool; None: every row with an owner): the others' states are kept by the
    # worker (speculative/context.py ContextStash, the latest context_window rows per sequence) and go
    # out, before its own, with the next step that exports that sequence (a drafter idle meanwhile)
    export_rows: Optional[torch.Tensor] = None
    free_context: Optional[torch.Tensor] = None  # [F] long: sequences whose kept rows the worker drops
    # speculative.placement target: after verifying, the driver rank drafts up to propose_k[s] tokens for
    # sample row s for the next step (0: none), from the states this step computed; the proposals come back
    # in StepOutput.draft_* and the draft laws of sampled rows stay on that rank for the next verification
    propose_k: Optional[torch.Tensor] = None  # [S] long
    # online calibration: sample rows whose verify rounds are recorded (with the target's top-k law)
    record_rounds: Optional[torch.Tensor] = None  # [S] bool (the top-k kept: a run's constant, at worker setup)
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
    # StepInput.propose_k (placement target), per sample row: the tokens drafted for the next step (-1
    # past each row's own), their raw confidences, and the sequence length each proposal continues
    # (0: no proposal for the row); the drafting's seconds; a drafter failure (drafting then stops)
    draft_tokens: Optional[torch.Tensor] = None  # [S, K] long
    draft_confidences: Optional[torch.Tensor] = None  # [S, K] float32
    draft_lengths: Optional[torch.Tensor] = None  # [S] long
    draft_s: float = 0.0
    drafter_error: Optional[str] = None
