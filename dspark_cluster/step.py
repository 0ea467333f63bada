"""One step of continuous batching as data: `StepInput` in, `StepOutput` out.

The scheduler side builds a StepInput (plain CPU tensors, small enough to send to every worker in
one round); a worker runs `execute_step` on its model shard. Only token ids and expert load counts
come back, never logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .model.attention import build_metadata
from .sampling import sample
from .scheduler import ScheduledSeq


@dataclass
class StepInput:
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
    return_logits: bool = False  # diagnostics (parity tests): also return the sampled rows' logits


@dataclass
class StepOutput:
    sampled: torch.Tensor  # [S] token ids, aligned with StepInput.sample_rows (driver rank only)
    expert_load: Optional[torch.Tensor] = None  # [num_moe_layers, num_experts] routed tokens
    slot_load: Optional[torch.Tensor] = None  # [num_moe_layers, slots] tokens this rank's slots computed
    logits: Optional[torch.Tensor] = None  # [S, vocab], only when StepInput.return_logits


def build_step_input(scheduled: list[ScheduledSeq], block_tables: dict[int, list[int]], block_size: int) -> StepInput:
    input_ids, query_lens, context_lens, tables = [], [], [], []
    rows, temps, ks, ps, seeds, pos_out = [], [], [], [], [], []
    for b, s in enumerate(scheduled):
        seq, start = s.seq, s.seq.num_computed_tokens
        input_ids.extend(seq.token_ids[start : start + s.num_new_tokens])
        query_lens.append(s.num_new_tokens)
        context_lens.append(start + s.num_new_tokens)
        tables.append(block_tables[seq.seq_id])
        if s.samples:
            p = seq.params
            rows.append(b)
            temps.append(p.temperature)
            ks.append(p.top_k)
            ps.append(p.top_p)
            seeds.append(-1 if p.seed is None else p.seed)
            pos_out.append(seq.num_output_tokens)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.long)
    for b, t in enumerate(tables):
        bt[b, : len(t)] = torch.tensor(t, dtype=torch.long)
    return StepInput(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        query_lens=torch.tensor(query_lens, dtype=torch.long),
        context_lens=torch.tensor(context_lens, dtype=torch.long),
        block_tables=bt,
        sample_rows=torch.tensor(rows, dtype=torch.long),
        temperature=torch.tensor(temps, dtype=torch.float32),
        top_k=torch.tensor(ks, dtype=torch.long),
        top_p=torch.tensor(ps, dtype=torch.float32),
        seeds=torch.tensor(seeds, dtype=torch.long),
        positions_out=torch.tensor(pos_out, dtype=torch.long),
        block_size=block_size,
    )


@torch.inference_mode()
def execute_step(model, step: StepInput, device="cpu", sample_tokens: bool = True) -> StepOutput:
    """Run the model on one StepInput and sample the rows that need a token.
    `sample_tokens=False` (non-driver ranks) skips sampling; the forward still runs (SPMD)."""
    positions, meta = build_metadata(step.query_lens, step.context_lens, step.block_tables, step.block_size)
    ids = step.input_ids.to(device)
    hidden = model(ids, positions.to(device), meta.to(device, model.lm_head.weight.dtype))
    last = torch.cumsum(step.query_lens, 0) - 1  # last new token of each sequence
    sampled = torch.empty(0, dtype=torch.long)
    logits = None
    if sample_tokens and step.sample_rows.numel():
        logits = model.compute_logits(hidden[last[step.sample_rows].to(device)])
        sampled = sample(
            logits,
            step.temperature.to(device),
            step.top_k.to(device),
            step.top_p.to(device),
            step.seeds.to(device),
            step.positions_out.to(device),
        ).cpu()
    elif step.sample_rows.numel() and model.comm.tp_size > 1:
        model.compute_logits(hidden[last[step.sample_rows].to(device)])  # joins the vocab all-gather
    slot = [m.last_slot_load for m in model.moe_layers if m.last_slot_load is not None]
    return StepOutput(sampled=sampled, expert_load=model.expert_load().cpu(),
                      slot_load=torch.stack(slot).cpu() if slot else None,
                      logits=logits.cpu() if step.return_logits and logits is not None else None)
