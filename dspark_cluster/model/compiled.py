"""`model.compile`: decode steps through `torch.compile`, one graph per batch bucket.

A decode-only step (every sequence one new token) of B sequences is padded to the smallest bucket
>= B (vLLM's capture sizes: 1, 2, 4, 8, ... up to `scheduler.max_num_seqs`); the padding rows are
token 0 at position 0, their KV written to the cache's scratch block (no sequence owns it), their
outputs dropped and their routing kept out of the expert-load statistics (`real`). Attention and
the grouped expert matmul are opaque ops to the compiler (`dspark::decode_attention`,
`dspark::grouped_experts`), so a step's key length is a dynamic dimension that never recompiles;
everything between them (projections, norms, rope, routing, the residual stream) is one graph per
bucket. On CUDA the graphs are captured as CUDA graphs (`mode="reduce-overhead"`). Prefill chunks,
verify rows and mixed steps run eager (their token counts vary every step).

    runner = CompiledDecode(model, max_num_seqs, device, captures)
    runner.warm_up()                    compile every bucket now, for each capture (progress lines, seconds)
    runner.applies(step) -> bool        a decode-only step within the buckets
    runner(step, capture) -> hidden [T, H]
    runner.stats() -> dict              buckets, warm-up seconds, graphs compiled, recompiles since
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from .attention import build_metadata

log = logging.getLogger(__name__)

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def decode_buckets(max_num_seqs: int) -> list[int]:
    return sorted({b for b in DECODE_BUCKETS if b < max_num_seqs} | {max_num_seqs})


def bucket_of(n: int, buckets: list[int]) -> int:
    """The bucket a decode step of n rows is padded to (0 rows: none; the step runs eager)."""
    return buckets[bisect.bisect_left(buckets, n)] if 0 < n <= buckets[-1] else n


def resolve_compile(setting: str, device) -> bool:
    """model.compile -> on or off. auto: on for CUDA (graphs replay a decode step's thousands of
    launches); off on CPU, where a compiled decode forward measured ~1.3x faster at batch 1 but each
    bucket costs seconds of warm-up (BENCHMARKS.md, issue 27): `on` pays for long runs."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return setting == "on"


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledDecode:
    def __init__(self, model, max_num_seqs: int, device, captures: tuple = ((),)):
        """captures: the layer tuples steps will capture (`model.forward`'s capture: a guard, so a graph each):
        () alone, or also the exported layers where a drafter reads them."""
        self.model, self.device = model, torch.device(device)
        self.buckets = decode_buckets(max_num_seqs)
        self.captures = tuple(dict.fromkeys(tuple(c) for c in captures))
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        # one graph a bucket and capture, all of the same frame: past dynamo's limit of graphs a frame (8) the
        # larger buckets would run eager, silently (max_num_seqs 256 has 9 buckets)
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, len(self.buckets) * len(self.captures) + 1)
        self.fn = torch.compile(model.forward, dynamic=False, mode=mode)
        self.warm_up_s = 0.0
        self.graphs_at_warm_up = self.warm_up_graphs = None
        self.steps = 0

    def applies(self, step) -> bool:
        B = step.query_lens.numel()
        return 0 < B <= self.buckets[-1] and bool((step.query_lens == 1).all())

    def _padded(self, input_ids, context_lens, block_tables, block_size, Bp=None):
        """The step padded to its bucket (or to Bp rows): inputs, metadata and the real-row mask."""
        B = input_ids.numel()
        Bp = Bp or bucket_of(B, self.buckets)
        ids = torch.zeros(Bp, dtype=torch.long)
        ids[:B] = input_ids
        ctx = torch.ones(Bp, dtype=torch.long)
        ctx[:B] = context_lens
        # at least two blocks a row: a dynamic length of 1 would be specialised (and recompiled)
        tables = torch.full((Bp, max(2, block_tables.shape[1])), self.model.scratch_block, dtype=torch.long)
        tables[:B, : block_tables.shape[1]] = block_tables
        positions, meta = build_metadata(torch.ones(Bp, dtype=torch.long), ctx, tables, block_size, min_blocks=2,
                                         group_decodes=False)
        meta = meta.to(self.device, self.model.lm_head.weight.dtype)
        b = meta.batches[0]
        torch._dynamo.mark_dynamic(b.blocks, 0)  # the key length changes every block_size tokens
        torch._dynamo.mark_dynamic(b.attn_mask, 3)
        real = torch.arange(Bp, device=self.device) < B
        return ids.to(self.device), positions.to(self.device), meta, real

    @torch.inference_mode()
    def __call__(self, step, capture: tuple = ()):
        """The step's hidden states [T, hidden], the padding rows cut off (and off the captured rows)."""
        B = step.input_ids.numel()
        ids, positions, meta, real = self._padded(step.input_ids, step.context_lens, step.block_tables,
                                                  step.block_size)
        hidden = self.fn(ids, positions, meta, capture, real)
        self.steps += 1
        if self.model.captured is not None:
            self.model.captured = self.model.captured[:B]
        return hidden[:B]

    @torch.inference_mode()  # as the steps run: inference tensors (the guards check their dispatch keys)
    def warm_up(self) -> None:
        """Compile every bucket with a step of padding rows only (the scratch block's KV)."""
        t0, graphs = time.perf_counter(), _graphs()
        block_size = self.model.attention_layers[0].kv_cache[0].shape[1]
        none = torch.zeros(0, dtype=torch.long)
        for i, Bp in enumerate(self.buckets):
            t = time.perf_counter()
            ids, positions, meta, real = self._padded(none, none, torch.zeros(0, 1, dtype=torch.long), block_size, Bp)
            for capture in self.captures:
                self.fn(ids, positions, meta, capture, real)
            self.model.captured = None  # (the padding rows' states: nobody reads them)
            log.info("model.compile: decode bucket %d (%d/%d) in %.1f s", Bp, i + 1, len(self.buckets),
                     time.perf_counter() - t)
        self.warm_up_s = time.perf_counter() - t0
        self.graphs_at_warm_up = _graphs()
        self.warm_up_graphs = self.graphs_at_warm_up - graphs
        log.info("model.compile: %d decode buckets compiled in %.1f s", len(self.buckets), self.warm_up_s)
        # a graph break cuts a step into several graphs, a limit leaves it eager (with tensor or expert parallelism
        # the collectives are graph breaks by design)
        whole = len(self.buckets) * len(self.captures)
        if self.one_graph_a_step() and self.warm_up_graphs != whole:
            log.warning("model.compile: %d graphs for %d decode buckets x %d captures (graph breaks or dynamo's "
                        "limits: the steps run partly eager)", self.warm_up_graphs, len(self.buckets), len(self.captures))

    def one_graph_a_step(self) -> bool:
        """Whether a step compiles to one graph: no collective in it (one rank, no expert dispatch)."""
        return self.model.comm.tp_size == 1 and not any(m.dispatch is not None for m in self.model.moe_layers)

    def stats(self) -> dict:
        graphs = _graphs()
        return {"compile_buckets": list(self.buckets), "compile_warm_up_s": self.warm_up_s,
                "compile_graphs": graphs, "compile_steps": self.steps,
                # one a bucket when each decode step is one whole graph
                "compile_warm_up_graphs": self.warm_up_graphs,
                "compile_recompiles_after_warm_up": None if self.graphs_at_warm_up is None
                else graphs - self.graphs_at_warm_up}
