"""The worker side of a step: run the model on a StepInput and sample (or verify drafts for) the rows
that need tokens, with the log-probabilities a request asked for. The same function runs in process
(`executor.LocalExecutor`) and on every Ray shard worker (SPMD)."""

from __future__ import annotations

import time
from typing import Optional

import torch

from .model.attention import build_metadata
from .sampling import sample
from .speculative.calibration import record_rounds
from .speculative.context import committed_rows
from .speculative.spec_decode import verify
from .step import StepInput, StepOutput


@torch.inference_mode()
def execute_step(model, step: StepInput, device="cpu", sample_tokens: bool = True,
                 prev_sampled: Optional[torch.Tensor] = None, export_layers: tuple = (),
                 record_top_logprobs: int = 20, compiled=None, stash=None, drafter=None) -> StepOutput:
    """Run the model on one StepInput; sample (or verify drafts for) the rows that need tokens.
    `sample_tokens=False` (non-driver ranks) skips sampling; the forward still runs (SPMD).
    `prev_sampled`: this rank's `sampled` of the previous step, for the inputs the scheduler did not
    know yet (`prev_token_pos`). The run's constants, given once at worker setup: `export_layers`,
    the decoder layers a DSpark drafter reads (exported in steps that name the rows' owners,
    `step.seq_ids`), and `record_top_logprobs`, the target's top-k kept per recorded verify round.
    `compiled`: the worker's model.compile runner (model/compiled.py), for the steps it applies to.
    `stash`: the driver rank's speculative.context.ContextStash, which keeps the rows a step does not
    export (`step.export_rows`) until one does; None: every row is exported. `drafter`: the driver rank's
    speculative.on_target.TargetDrafter (placement target): it takes the exported rows instead of the
    output, holds the draft laws this step verifies, and drafts for the next step (`step.propose_k`)."""
    t0 = time.perf_counter()
    if step.prev_token_pos is not None:
        if prev_sampled is None:
            raise RuntimeError("a step refers to the previous step's tokens, but this rank has none")
        step.input_ids[step.prev_token_pos] = prev_sampled[step.prev_token_row, 0]
    capture = tuple(export_layers) if step.seq_ids is not None else ()
    if stash is not None:
        if step.free_context is not None:
            stash.free(step.free_context.tolist())
            if drafter is not None:
                drafter.free(step.free_context.tolist())
        if not capture and step.query_lens.numel():  # no drafter takes rows (none serves now): keep none
            stash.clear()
    out = _execute_step(model, step, device, sample_tokens, capture, record_top_logprobs, compiled, stash, drafter)
    if drafter is not None:
        out.drafter_error = drafter.take_error()
    out.forward_s = time.perf_counter() - t0
    return out


def _execute_step(model, step: StepInput, device, sample_tokens: bool, capture: tuple,
                  record_top_logprobs: int, compiled=None, stash=None, drafter=None) -> StepOutput:
    if step.query_lens.numel() == 0:
        return _idle_step(model, device)
    if compiled is not None and compiled.applies(step):
        hidden = compiled(step, capture)
    else:
        positions, meta = build_metadata(step.query_lens, step.context_lens, step.block_tables, step.block_size)
        ids = step.input_ids.to(device)
        hidden = model(ids, positions.to(device), meta.to(device, model.lm_head.weight.dtype), capture=capture)
    ends = torch.cumsum(step.query_lens, 0)[step.sample_rows]  # one past each sample row's last token
    S = step.sample_rows.numel()
    nd = step.num_draft if step.num_draft is not None else torch.zeros(S, dtype=torch.long)
    # rows to score: each sample row's last num_draft + 1 positions
    counts = nd + 1
    offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    rows_idx = torch.repeat_interleave(ends - counts, counts) + offsets
    sampled, num_tokens, logits = torch.empty(S, 1, dtype=torch.long), torch.ones(S, dtype=torch.long), None
    rounds, scored = None, None
    if S and (sample_tokens or model.comm.tp_size > 1):
        logits = model.compute_logits(hidden[rows_idx.to(device)])  # non-drivers join the vocab all-gather
    if sample_tokens and S:
        args = [t.to(device) for t in (step.temperature, step.top_k, step.top_p, step.seeds, step.positions_out)]
        if step.num_draft is None:
            sampled = sample(logits, *args).cpu()[:, None]
            scored = logits[:, None]
        else:
            K = step.draft_tokens.shape[1]
            padded = logits.new_zeros(S, K + 1, logits.shape[-1])
            padded[torch.repeat_interleave(torch.arange(S), counts), offsets] = logits
            probs = law_rows = None  # the sampled rows' draft laws (the others are one-hot)
            if step.draft_probs is not None:
                probs, law_rows = step.draft_probs.to(device), step.draft_law_rows.to(device)
            elif drafter is not None and bool(((nd > 0) & (step.temperature > 0)).any()):
                # placement target: the sampled rows' laws stayed here, with the drafter
                lengths = step.context_lens[step.sample_rows] - nd  # the length each row's drafts continue
                probs, law_rows = drafter.verify_laws(step.seq_ids[step.sample_rows], step.draft_tokens, nd, lengths,
                                                      torch.nonzero((nd > 0) & (step.temperature > 0)).flatten())
                probs, law_rows = probs.to(device), law_rows.to(device)
            tokens, num_tokens = verify(padded, step.draft_tokens.to(device), nd.to(device), probs, *args, law_rows)
            sampled, num_tokens, scored = tokens.cpu(), num_tokens.cpu(), padded
            if step.record_rounds is not None and capture:
                rounds = _record(step, padded, nd, sampled, num_tokens, ends, record_top_logprobs)
    token_lp = prompt_lp = None
    if scored is not None and step.logprobs is not None:
        token_lp = _token_logprobs(scored, sampled, step.temperature, step.logprobs)
    if step.prompt_lp_pos is not None and (sample_tokens or model.comm.tp_size > 1):  # TP: all join the gather
        prompt_lp = _prompt_logprobs(model, hidden, step, device, sample_tokens)
    if step.share_sampled and S and model.comm.tp_size > 1:  # every rank needs them for the next input
        sampled = model.comm.broadcast(sampled).cpu()
    context = None
    idle = stash is not None and rounds is None and step.export_rows is not None and not bool(step.export_rows.any())
    if capture and sample_tokens and idle:  # nothing goes out: the stash logs the step's states as they are
        stash.keep_step(model.captured, step.seq_ids, step.query_lens, step.context_lens, step.sample_rows,
                        step.num_draft, num_tokens)
    elif capture and sample_tokens:  # the driver rank exports (TP ranks hold the same states)
        context = committed_rows(model.captured, step.seq_ids, step.query_lens, step.context_lens, step.sample_rows,
                                 step.num_draft, num_tokens, to_host=stash is None and drafter is None)
        context.rounds = rounds
        if stash is not None:  # the rows not exported now stay here; None when nothing goes out
            context = stash.route(context, step.export_rows, step.seq_ids, to_host=drafter is None)
        if drafter is not None:  # they stay on the device, with the drafter
            drafter.ingest(context)
            context = None
    model.captured = None
    # read before the drafter's round: on CUDA with model.compile the loads are outputs of the step's graphs, which
    # the round's graphs (another compiled function on this thread's graph tree) may free or overwrite
    slot = [m.last_slot_load for m in model.moe_layers if m.last_slot_load is not None]
    expert_load, slot_load = model.expert_load().cpu(), torch.stack(slot).cpu() if slot else None
    drafted = {}
    if drafter is not None and step.propose_k is not None and sample_tokens and S:
        # the next step's drafts, from each row's sequence as this step left it
        rows = step.sample_rows
        lengths = step.context_lens[rows] - nd + num_tokens
        anchors = sampled.gather(1, (num_tokens - 1)[:, None]).squeeze(1)
        drafted = drafter.propose(step.propose_k, step.seq_ids[rows], lengths, anchors, step.temperature, step.top_k,
                                  step.top_p, step.seeds, step.positions_out + num_tokens)
    return StepOutput(sampled=sampled, num_tokens=num_tokens, expert_load=expert_load, slot_load=slot_load,
                      logits=logits.cpu() if step.return_logits and logits is not None else None,
                      context=context, export_bytes=context.nbytes if context is not None else 0, **drafted,
                      **(dict(zip(("token_logprobs", "top_ids", "top_logprobs"), token_lp)) if token_lp else {}),
                      **(dict(zip(("prompt_token_logprobs", "prompt_top_ids", "prompt_top_logprobs"), prompt_lp))
                         if prompt_lp else {}))


def _law(logits: torch.Tensor, temperature: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Log-probabilities of the law after temperature (greedy rows: temperature 1), before top-k/top-p.
    logits [N, W, V]; temperature [N] or None (temperature 1)."""
    x = logits.float()
    if temperature is not None:
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(x.device)
        x = x / t[:, None, None]
    return x.log_softmax(-1)


def _top(lp: torch.Tensor, k: int) -> tuple:
    if k == 0:
        return torch.zeros(*lp.shape[:-1], 0, dtype=torch.long), torch.zeros(*lp.shape[:-1], 0)
    vals, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return ids.cpu(), vals.cpu()


def _token_logprobs(scored, tokens, temperature, want) -> tuple:
    """Each produced token's log-probability and the top alternatives, for the rows that asked.
    scored [S, W, V] the target's logits at the produced positions; tokens [S, W]; want [S] (-1: not)."""
    S, W = tokens.shape
    k = int(want.max())
    token_lp, top_ids, top_lp = torch.zeros(S, W), torch.zeros(S, W, k, dtype=torch.long), torch.zeros(S, W, k)
    rows = torch.nonzero(want >= 0).flatten()
    lp = _law(scored[rows.to(scored.device)], temperature[rows])
    token_lp[rows] = lp.gather(-1, tokens[rows].clamp(min=0).to(lp.device)[..., None]).squeeze(-1).cpu()
    top_ids[rows], top_lp[rows] = _top(lp, k)
    return token_lp, top_ids, top_lp


def _prompt_logprobs(model, hidden, step: StepInput, device, sample_tokens: bool, chunk: int = 256):
    """The scored prompt tokens' log-probabilities (the model's own law, temperature 1, as vLLM's
    prompt_logprobs) and the top alternatives, 256 positions at a time (a [P, V] law at once could
    be large). Non-driver TP ranks only join the logits' gather."""
    pos, k = step.prompt_lp_pos, step.prompt_lp_top
    out_lp, out_ids, out_top = [], [], []
    for a in range(0, pos.numel(), chunk):
        logits = model.compute_logits(hidden[pos[a : a + chunk].to(device)])
        if not sample_tokens:
            continue
        lp = _law(logits[:, None])[:, 0]
        target = step.prompt_lp_target[a : a + chunk].to(lp.device)
        out_lp.append(lp.gather(-1, target[:, None]).squeeze(-1).cpu())
        ids, vals = _top(lp, k)
        out_ids.append(ids)
        out_top.append(vals)
    if not sample_tokens:
        return None
    return torch.cat(out_lp), torch.cat(out_ids), torch.cat(out_top)


def _record(step: StepInput, padded, nd, sampled, num_tokens, ends, top_logprobs: int):
    """The verify rounds of the rows that record them (online calibration), or None."""
    rows = torch.nonzero(step.record_rounds & (nd > 0)).flatten()
    if rows.numel() == 0:
        return None
    anchor_idx = ends[rows] - nd[rows] - 1  # the last committed token before a row's drafts
    return record_rounds(padded[rows.to(padded.device)], step.draft_tokens[rows], nd[rows], sampled[rows],
                         num_tokens[rows], step.temperature[rows], step.input_ids[anchor_idx],
                         step.context_lens[step.sample_rows[rows]] - nd[rows] - 1, step.seq_ids[step.sample_rows[rows]],
                         top_logprobs)


def _idle_step(model, device) -> StepOutput:
    """A data-parallel group with nothing scheduled: no attention, no sampling, but every MoE
    layer's expert all-to-all still runs (with no tokens) so the busy groups' collectives match."""
    H = model.spec.hidden_size
    dtype = model.lm_head.weight.dtype
    for moe in model.moe_layers:
        moe.last_load = torch.zeros(model.spec.num_experts, dtype=torch.long, device=device)
        if moe.dispatch is None:  # (with expert parallelism the dispatch below counts what the others send)
            moe.last_slot_load = torch.zeros(len(moe.expert_ids), dtype=torch.long, device=device)
        else:
            x = torch.empty(0, H, dtype=dtype, device=device)
            moe.dispatch(moe, x, torch.empty(0, model.spec.top_k, dtype=torch.long, device=device),
                         torch.empty(0, model.spec.top_k, device=device))
    slot = [m.last_slot_load for m in model.moe_layers if m.last_slot_load is not None]
    return StepOutput(sampled=torch.empty(0, 1, dtype=torch.long), num_tokens=torch.empty(0, dtype=torch.long),
                      expert_load=model.expert_load().cpu(), slot_load=torch.stack(slot).cpu() if slot else None)
