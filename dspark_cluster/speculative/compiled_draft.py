"""`model.compile` for the DSpark drafter's round: a greedy proposal through `torch.compile`, its rows padded to
batch buckets (CUDA graphs on CUDA).

Eager, a round at batch 1 issues ~160 operations at one block pass and ~250 at two (the fuse, each layer's
projections, norms and rope, the head over the vocabulary, then k Markov steps): on a GPU, beside a verify step
replayed as CUDA graphs (`model/compiled.py`), those launches would be most of a drafting step's time at low load.
Compiled, the round is the block forward(s), the Markov loop over `num_tokens` slots and the confidences in one
function of the anchors and the block's rope: everything but attention is one graph (a graph for one row and one
for every larger bucket, the batch a dynamic dimension) and, on CUDA, CUDA graphs cut around attention as the
target's are. Attention is one op (`dspark::block_attention`) that reads the round's context (each layer's
keys / values of the context rows and the padding mask, `DSparkProposer.block_context`) from `draft_context`, not
from the graph's inputs: the context length changes every token, the graphs never see it. Padding rows (anchor 0
at position 0) attend nothing, write no context row, and are dropped.

The round computes every slot up to `num_tokens` and each row keeps its own k (a slot's draft and confidence read
only the slots before it: the same as drafting k). Greedy rows, and sampled rows at a temperature alone (no top-k or
top-p, unseeded: the common API request), with a confidence head; a round with such sampled rows is a second
variant of the function (its graphs compiled at the warm-up too) that also returns the draft law [rows, K, V] in
the drafter's dtype and draws each slot by the exponential race inside the graph (the compiler's random stream:
the same law, not the eager draws), the law copied out of the graphs' memory (a sampled row's law is held until
the next step verifies it, and a CUDA graph's next replay overwrites its outputs). Seeded rows (per-row
generators), top-k / top-p rows and batches past the largest bucket draft eager. A round calls its graph's code
without dynamo's guards (`model.compiled.DirectCalls`: every module value the graphs read is fixed when the drafter
is loaded, `DRAFT_FIXED_VALUES`): compiled over eager 1.00 -> 0.91 at batch 1 on this CPU (BENCHMARKS.md,
session 33). The drafts are the
eager round's up to the compiler's rounding (sums in another order; in 16 bits, intermediates the compiler keeps in
fp32 across fused operations): near-ties may draft another token; speculation keeps the target's law whatever the
drafts are.

    runner = CompiledDraft(proposer, buckets, num_tokens)
    runner.warm_up()                       compile every bucket (a padding-only round each)
    runner.applies(requests) -> bool
    runner(requests, context, anchors) -> (tokens [B, K] long, confidences [B, K], laws [B, K, V] or None)
    runner.stats() -> dict
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..model.attention import on_real_rows
from ..model.compiled import (FIXED_VALUES, DirectCalls, _cuda_graph_manager, _cuda_graphs, _entries,
                              allow_cuda_graph_sizes, bucket_of, compile_own, functions_mark, note_functions,
                              step_buckets)
from ..sampling import greedy_rows
from .dspark_model import block_attention as _block_attention

log = logging.getLogger(__name__)


@dataclass
class DraftContext:
    """What a compiled round's attention reads: `rows` real rows (the first of the padded batch), each layer's
    context keys / values [rows, C + S, heads, hd] (`kv(layer)`, the block's S rows written in place) and the mask
    [rows, S, C + S] or None."""

    rows: int
    kv: Optional[Callable]
    mask: Optional[torch.Tensor]


_round = threading.local()


@contextlib.contextmanager
def draft_context(ctx: DraftContext):
    prev, _round.ctx = getattr(_round, "ctx", None), ctx
    try:
        yield
    finally:
        _round.ctx = prev


def _block_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """`block_attention` of the round in `draft_context` over its real rows: q, k, v [Bp, S, heads, hd] ->
    [Bp, S, heads, hd] (the padding rows zeros)."""
    ctx = getattr(_round, "ctx", None)
    if ctx is None:
        raise RuntimeError("dspark::block_attention ran outside compiled_draft.draft_context: a compiled round's "
                           "attention reads its context there (CompiledDraft sets it around each round)")
    return on_real_rows(ctx.rows, q.shape, lambda q, k, v: _block_attention(q, k, v, *ctx.kv(layer), ctx.mask), q, k, v)


# Declared pure, though it writes the block's rows into the context store (no input of the graph): the compiler may
# merge two calls with the same inputs, and none has them (each layer's q, k, v differ, and so do a second pass's,
# whose block holds slot 0's draft); every call's output is read, so none is dropped
torch.library.custom_op("dspark::block_attention", _block_attention_op, mutates_args=()).register_fake(
    lambda q, k, v, layer: q.new_empty(q.shape))


def _attend_by_op(layer: int) -> tuple:
    """A compiled round's layers attend through `dspark::block_attention` (`DSparkLayer.forward` with no context)."""
    return None, None, None


# The most rows a compiled round takes (larger rounds run eager, their launches shared by many rows): a round holds
# its block's base logits, [rows, block_size, V] in fp32 (two of them with two passes), in the graphs' memory, outside
# the KV plan: at DeepSeek-V3's 129k vocabulary and a block of 7, 64 rows are 230 MB a pass
MAX_DRAFT_ROWS = 64


def draft_buckets(max_rows: int) -> list[int]:
    """The batch sizes a compiled round pads to: the target's step buckets up to `max_rows` (the most sequences a
    step drafts for: scheduler.max_num_seqs), MAX_DRAFT_ROWS at most."""
    return step_buckets(max(1, min(int(max_rows), MAX_DRAFT_ROWS)))


# The module values a round's guards read, all fixed when the drafter is loaded (its config's sizes and flags, each
# layer's index and packed splits, the runner's slots and law dtype; a version switch copies weights in place): a
# round calls its graph's code directly (`DirectCalls`), keyed by the Markov factors marked static on CUDA only
DRAFT_FIXED_VALUES = FIXED_VALUES | {"block_size", "confidence_head", "draft_passes", "hidden_size", "index",
                                     "law_dtype", "markov_gate", "markov_rank", "mask_token_id", "num_tokens", "packed",
                                     "rms_norm_eps"}


class CompiledDraft:
    def __init__(self, proposer, buckets: list, num_tokens: int):
        """proposer: the DSparkProposer whose rounds run here (its model and device; it passes each round's context);
        buckets: batch sizes (`draft_buckets`); num_tokens: the slots a round drafts (speculative.num_tokens: the most
        a row asks)."""
        self.model, self.device, self.law_dtype = proposer.model, proposer.device, proposer.dtype
        self.buckets, self.num_tokens = list(buckets), int(num_tokens)
        options = None
        config = torch._inductor.config
        if self.device.type == "cuda" and not hasattr(config, "graph_partition"):
            log.warning("model.compile: this torch (%s) cannot cut CUDA graphs around attention: the drafter's rounds "
                        "compile without CUDA graphs", torch.__version__)
            options = {}
        elif self.device.type == "cuda":  # CUDA graphs cut where attention runs (its context grows every token)
            options = {"triton.cudagraphs": True, "graph_partition": True,
                       "custom_should_partition_ops": ["dspark::block_attention"]}
            allow_cuda_graph_sizes(len(self.buckets) + 1)
            # (the packed weights, attributes of inlined modules, dynamo already treats as static; the Markov factors,
            # arguments, are marked so in `_inputs`: the graphs read them in place, kept in place by `load_trained`)
        self._static = ()  # the Markov factors marked static (made again in place; new tensors are marked again)
        # a graph for one row and one for the larger buckets, greedy and sampled, in this runner's own frame: past
        # dynamo's limit of graphs a frame the rounds would run eager, silently
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 4 + 1)
        self.direct = DirectCalls(frozenset(), DRAFT_FIXED_VALUES)  # on or off after the warm-up
        self.fn, self.code = compile_own(self._round, options, self.direct.guard_filter)
        self.warm_up_s = self.record_s = 0.0
        self.graphs_at_warm_up = self.warm_up_graphs = None
        self.records_cuda_graphs = self.device.type == "cuda"
        self.cuda_graph_managers, self.cuda_graphs_at_warm_up = {}, None
        self.cuda_graph_functions: dict = {}  # thread id -> this runner's functions in its manager (`note_functions`)
        self.rounds = self.sampled_rounds = 0  # rounds run compiled, and of them those with sampled rows

    def applies(self, requests) -> bool:
        """With a confidence head, at most the largest bucket of rows, none asking more than num_tokens, each greedy
        or sampled at a temperature alone (unseeded, no top-k / top-p)."""
        return (0 < len(requests) <= self.buckets[-1] and self.model.c.confidence_head
                and all(r.k <= self.num_tokens and (r.temperature == 0 or (r.seed < 0 and r.top_k == 0
                                                                            and r.top_p >= 1.0)) for r in requests))

    def _round(self, anchors, cos, sin, w1, w2, temperature=None):
        """The compiled function: anchors [Bp] long, cos / sin [Bp, S, 1, hd], the Markov factors w1 [V, r], w2 [r, V]
        (or None), temperature [Bp] (None: every row greedy) -> (tokens [Bp, K], raw confidences [Bp, K], draft laws
        [Bp, K, V] in the drafter's dtype or None), K = num_tokens: the eager round's `draft_slots`, attention the
        op (a sampled row's law is softmax(z / t), its token the race of that law's fp32 values)."""
        m = self.model
        if temperature is not None:  # (filter_logits' temperature alone: greedy rows unscaled)
            t = torch.where(greedy_rows(temperature), torch.ones_like(temperature), temperature)[:, None]

        def choose(i, z):
            tok = z.argmax(-1)
            if temperature is None:
                return tok, None
            law = (z / t).softmax(-1).to(self.law_dtype)
            q = law.float()
            return torch.where(temperature == 0, tok, (q / torch.empty_like(q).exponential_()).argmax(-1)), law

        tokens, _, laws, conf = m.draft_slots(lambda second: m.block_pass(anchors, (cos, sin), _attend_by_op, second),
                                              anchors, w1, w2, self.num_tokens, choose)
        return tokens, conf, torch.stack(laws, 1) if laws else None

    def _inputs(self, anchors, qpos, upto: int, Bp: int, temperature=None):
        """The round's inputs padded to Bp rows: anchors, the rope of the block's positions qpos [B, S], the Markov
        factors (made again here, in place, after a version switch: outside the graph) and the rows' temperatures
        [B] (None: all greedy; padding rows greedy)."""
        B = anchors.shape[0]
        if Bp > B:
            anchors = torch.cat([anchors, anchors.new_zeros(Bp - B)])
            qpos = torch.cat([qpos, torch.arange(qpos.shape[1], device=qpos.device).expand(Bp - B, -1)])
            if temperature is not None:
                temperature = torch.cat([temperature, temperature.new_zeros(Bp - B)])
        cos, sin = self.model.rope(qpos, upto)
        if Bp > 1:  # one graph for every bucket past 1, the batch dynamic (as the target's steps)
            for t in (anchors, cos, sin) + (() if temperature is None else (temperature,)):
                torch._dynamo.mark_dynamic(t, 0)
        w1, w2 = self.model.markov_factors()
        if self.device.type == "cuda" and w1 is not None and tuple(map(id, (w1, w2))) != self._static:
            for t in (w1, w2):  # read in place by the CUDA graphs, not copied in at each replay
                torch._dynamo.mark_static_address(t)
            self._static = tuple(map(id, (w1, w2)))
        return anchors, cos, sin, w1, w2, temperature

    @torch.inference_mode()
    def __call__(self, requests, context, anchors):
        """A round of these requests (`applies`), context = `proposer.block_context(requests)`, anchors [B] on the
        device -> (tokens [B, K], confidences [B, K] (sigmoid of the head's logits), draft laws [B, K, V] (a copy of
        the graphs' output), or None where every row is greedy), K = the most they ask."""
        if self.records_cuda_graphs and threading.get_ident() not in self.cuda_graph_managers:
            self.record_cuda_graphs()
        qpos, mask, kv = context
        B = len(requests)
        upto = max(r.length for r in requests) - 1 + self.model.c.block_size
        temperature = None
        if any(r.temperature > 0 for r in requests):
            temperature = torch.tensor([r.temperature for r in requests], dtype=torch.float32, device=self.device)
        args = self._inputs(anchors, qpos, upto, bucket_of(B, self.buckets), temperature)
        mark = functions_mark(self.device)
        with draft_context(DraftContext(B, kv, mask)):
            tokens, conf, laws = self.padded_round(*args)
        note_functions(self.cuda_graph_functions, self.device, mark)  # (a graph recorded now is this runner's)
        self.rounds += 1
        self.sampled_rounds += laws is not None
        K = max(r.k for r in requests)
        return tokens[:B, :K], torch.sigmoid(conf[:B, :K]), None if laws is None else laws[:B, :K].clone()

    def padded_round(self, anchors, cos, sin, w1, w2, temperature):
        """The padded round's graphs (`_inputs`): their code called directly while the Markov factors are those they
        were checked under (`DirectCalls`: every other module value they read is fixed at load), through dynamo's
        guards otherwise."""
        return self.direct(self.fn, self, (anchors.shape[0] == 1, temperature is not None), anchors, cos, sin, w1, w2,
                           temperature)

    def _padding_inputs(self, Bp: int, sampled: bool) -> tuple:
        """The inputs of a round of Bp padding rows, greedy or sampled."""
        S, none = self.model.c.block_size, torch.zeros(0, dtype=torch.long, device=self.device)
        return self._inputs(none, torch.zeros(0, S, dtype=torch.long, device=self.device), S, Bp,
                            torch.zeros(0, device=self.device) if sampled else None)

    def _probes(self) -> dict:
        """The locals of a round of each kind (one row or more, sampled or not) and size, as the graphs' guards read
        them."""
        names = self.code.co_varnames[:self.code.co_argcount]
        sizes = {True: [1], False: [b for b in self.buckets if b > 1]}
        return {(one, sampled): [dict(zip(names, (self,) + self._padding_inputs(Bp, sampled))) for Bp in rows]
                for (one, rows), sampled in itertools.product(sizes.items(), (False, True)) if rows}

    def _run_buckets(self, runs: int, on_bucket=None) -> None:
        """Every bucket `runs` times with padding rows only, greedy and sampled."""
        with draft_context(DraftContext(0, None, None)):
            for i, Bp in enumerate(self.buckets):
                t = time.perf_counter()
                for sampled in (False, True):
                    args = self._padding_inputs(Bp, sampled)
                    for _ in range(runs):
                        self.fn(*args)
                if on_bucket is not None:
                    on_bucket(i, Bp, time.perf_counter() - t)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile every bucket now (a graph for one row and one for the rest); on CUDA the thread that drafts
        records its CUDA graphs before its first round (`record_cuda_graphs`), as the target's steps do."""
        t0, before, mark = time.perf_counter(), len(_entries(self.code)), functions_mark(self.device)
        self._run_buckets(1, lambda i, Bp, s: log.info("model.compile: the drafter's round of %d rows (%d/%d) in "
                                                       "%.1f s", Bp, i + 1, len(self.buckets), s))
        note_functions(self.cuda_graph_functions, self.device, mark)
        self.warm_up_s = time.perf_counter() - t0
        self.graphs_at_warm_up = len(_entries(self.code))
        self.warm_up_graphs = self.graphs_at_warm_up - before
        # the direct dispatch where a round is one graph of each kind (one row or more, greedy or sampled)
        self.direct.start(self.code, self._round.__func__.__globals__, lambda: self._static, self._probes,
                          self.warm_up_graphs == 2 * (1 + (self.buckets[-1] > 1)))
        log.info("model.compile: the drafter's rounds, %d buckets compiled in %.1f s (%d graphs)", len(self.buckets),
                 self.warm_up_s, self.warm_up_graphs)

    @torch.inference_mode()
    def record_cuda_graphs(self) -> None:
        """This thread's CUDA graphs of every bucket (two runs each: a graph tree warms a size up, then records)."""
        t0, mark = time.perf_counter(), functions_mark(self.device)
        self._run_buckets(2)
        note_functions(self.cuda_graph_functions, self.device, mark)
        self.cuda_graph_managers[threading.get_ident()] = _cuda_graph_manager(self.device)
        self.cuda_graphs_at_warm_up = _cuda_graphs(self.cuda_graph_managers, self.cuda_graph_functions)
        self.record_s += time.perf_counter() - t0

    def stats(self) -> dict:
        graphs = len(_entries(self.code))
        return {"draft_compile_buckets": list(self.buckets), "draft_compile_warm_up_s": self.warm_up_s,
                "draft_compile_rounds": self.rounds, "draft_compile_sampled_rounds": self.sampled_rounds,
                "draft_compile_direct_rounds": self.direct.calls,  # (without dynamo's guards)
                "draft_compile_warm_up_graphs": self.warm_up_graphs,
                # (the graphs of this runner's own frame)
                "draft_compile_graphs": graphs, "draft_compile_recompiles_after_warm_up": None if self.graphs_at_warm_up is None
                else graphs - self.graphs_at_warm_up,
                "draft_compile_cuda_graph_record_s": self.record_s,
                "draft_compile_cuda_graphs_after_warm_up": None if self.cuda_graphs_at_warm_up is None
                else _cuda_graphs(self.cuda_graph_managers, self.cuda_graph_functions) - self.cuda_graphs_at_warm_up}
