"""DSparkProposer: serves a DSpark drafter behind the proposer interface (`propose`, `free`,
`prefill`), plus `ingest`, which takes the target's exported context rows.

Per sequence it keeps each drafter layer's context keys/values, computed once per committed token, for the
latest `window` rows a block reads (and a few behind them): a store of about twice that many rows, whose oldest
rows are dropped as it fills, so a sequence's drafter context holds O(window) rows on the device, whatever its
length.
Ingest only stores the rows; their keys/values are computed when a proposal first needs them, in one
batched forward over every sequence it drafts for (so steps that draft nothing, at high load under
the confidence schedule, cost the drafter no compute, and a sequence that ends without drafting
never costs any). A proposal is one backbone forward over a block per sequence (batched, context
padded), then k cheap Markov steps left to right, each giving the draft law q_i, the token and a
confidence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError
from ..model.compiled import compiled_or_eager
from ..model.gemm import detached, reorder_tensors
from ..sampling import DRAFT, filter_logits, race_sample
from .records import Proposal
from .calibration import MAX_CONTEXT, SequenceSample
from .compiled_draft import CompiledDraft
from .records import ContextRows, RoundRecords
from .dspark_model import (DSparkConfig, context_window_of, load_drafter, resolve_draft_passes, target_tables,
                           tensor_fingerprint)

# rows that arrive past a gap (a later chunk before an earlier one: the drafter actor serves two
# callers) wait for the gap to fill; a sequence with more pending than this has lost rows for good
MAX_PENDING = 8
RECENTLY_FREED = 65536
# rows a sequence's store keeps behind its window: a proposal may continue a length a little behind the rows
# already taken (a drafter actor takes a step's rows before the Router asks for the step before's proposals)
KEEP_BEHIND = 64
# online calibration keeps each sequence's latest rows (16-bit) for its training samples and a version switch's
# recompute: at most this many and MAX_CONTEXT more (trimmed every MAX_CONTEXT rows); a longer sequence's older rows
# go, and with them the rounds whose MAX_CONTEXT rows of context reached them (at DeepSeek-V3's 3 x 7,168-wide export,
# ~88 MB a sequence where a 32k-token one kept 1.4 GB)
CALIBRATION_KEPT_ROWS = 4 * MAX_CONTEXT


@dataclass
class _Context:
    k: list = field(default_factory=list)  # per layer [capacity, heads, head_dim]: row i holds position base + i
    v: list = field(default_factory=list)
    base: int = 0  # the position of the store's row 0: positions below it were dropped (never read again)
    kv_length: int = 0  # positions base .. kv_length-1 are in k / v
    raw: list = field(default_factory=list)  # (start, rows) received, keys/values not computed yet
    length: int = 0  # positions 0 .. length-1 are in k / v or raw
    pending: dict = field(default_factory=dict)  # start -> rows, past a gap
    lost: bool = False  # rows went missing (e.g. the drafter restarted mid-sequence): no drafts
    # online calibration: every row received (fp16; a new drafter version recomputes keys/values
    # from them) and the sequence's recorded verify rounds
    kept: list = field(default_factory=list)  # (start, rows)
    rounds: list = field(default_factory=list)  # RoundRecords
    # the first position with a row: a block reads none before it (a cached prefix, a resync), and online
    # calibration's kept rows start there
    first_row: int = 0


def check_against_target(c: DSparkConfig, spec, embed, lm_head, path) -> None:
    """Refuse a drafter trained against another target (ConfigError naming the key and the fix)."""
    problems = []
    if c.vocab_size != spec.vocab_size or c.target_hidden_size != spec.hidden_size:
        problems.append(f"vocab/hidden {c.vocab_size}/{c.target_hidden_size} != the target's "
                        f"{spec.vocab_size}/{spec.hidden_size}")
    if max(c.target_layer_ids) >= spec.num_layers:
        problems.append(f"target_layer_ids {c.target_layer_ids} beyond the target's {spec.num_layers} layers")
    fp = c.target.get("embed_sha256")
    if fp and fp != tensor_fingerprint(embed):
        problems.append("its target's embedding differs from this target's")
    fp = c.target.get("lm_head_sha256")
    if fp and fp != tensor_fingerprint(lm_head):
        problems.append("its target's LM head differs from this target's")
    if problems:
        raise ConfigError(f"speculative.draft_model: {path} was not trained for model.path's target: "
                          f"{'; '.join(problems)}; train one with launch/train_dspark.py --target <model.path>")


class DSparkProposer:
    def __init__(self, path, target_path, target_spec, device="cpu", num_tokens: int = 4, calibrate: bool = False,
                 context_window="auto", draft_passes="auto", target_tables_held=None, compile_buckets=None,
                 eager_if_compile_fails: bool = False):
        """compile_buckets: batch sizes greedy rounds are compiled for (model.compile on: `compiled_draft`), or
        None (eager). eager_if_compile_fails (model.compile auto): a compile that fails leaves the rounds eager, with
        a warning and the reason in `compile_error`, instead of raising."""
        path = Path(path)
        c = DSparkConfig.load(path / "config.json")
        # a block reads the latest `window` context rows before its anchor (speculative.context_window)
        self.window = context_window_of(context_window, c)
        embed, lm_head = target_tables(target_path, target_spec)
        check_against_target(c, target_spec, embed, lm_head, path)
        if c.draft_passes not in (1, 2):
            raise ConfigError(f"speculative.draft_model: {path}/config.json has draft_passes {c.draft_passes}; "
                              "a DSpark drafter drafts in 1 or 2 block forwards")
        c.draft_passes = resolve_draft_passes(draft_passes, c, path, torch.device(device))  # what it serves
        if num_tokens > c.block_size:
            raise ConfigError(f"speculative.num_tokens: got {num_tokens}; the DSpark drafter {path.name} drafts at most "
                              f"{c.block_size} tokens per block; use num_tokens <= {c.block_size}")
        self.device = torch.device(device)
        # the target's serving dtype (model.dtype): its hidden states come in it, and a drafter in fp32 beside a
        # bf16 target would read twice the bytes (and hold its tables twice over)
        self.dtype = target_spec.dtype
        # target_tables_held: the target's own embedding and LM head where this drafter runs beside it (placement
        # target) unsharded; read rather than a second copy (at a 151k x 2048 vocabulary, 1.2 GB in bf16)
        held = target_tables_held
        self.tables_shared = held is not None and all(
            t.shape == embed.shape and t.dtype == self.dtype and t.device == self.device for t in held)
        if self.tables_shared:
            embed, lm_head = (detached(t) for t in held)  # (the LM head's CPU oneDNN copy shared too: gemm.py)
        self.model = load_drafter(path, embed, lm_head, self.device, self.dtype)
        self.model.pack()
        # the CPU's oneDNN copies made now, before the target's KV plan reads the memory left (gemm.py), and counted
        self.reordered_bytes = reorder_tensors(self.model.serving_weights(tables=not self.tables_shared))
        self.model.c.draft_passes = c.draft_passes
        self.c = self.model.c  # one config: what drafting and calibration's forward both read
        self.layer_ids = tuple(c.target_layer_ids)
        self.ctx: dict[int, _Context] = {}
        # recently freed sequences: with executor ray a step's rows (from a worker) may arrive after
        # the free (from the Router) of a sequence that step finished; they must not hold memory
        self._freed_order: deque = deque(maxlen=RECENTLY_FREED)
        self._freed: set = set()
        self.ingested_rows = 0
        self._proposals, self.peak_context_bytes = 0, 0
        self.misses = 0  # proposals skipped because the context was not there (yet)
        self.resyncs = 0  # runs of rows taken past a gap (the target's workers kept them while it drafted nothing)
        self.narrowed = 0  # blocks that read fewer rows than their window: rows the store no longer kept
        # online calibration: keep each sequence's rows and rounds, hand finished ones on as samples
        self.calibrate = calibrate
        self.samples: list[SequenceSample] = []
        self.version = 0
        self.staged: dict[int, dict] = {0: {k: v.detach().clone() for k, v in self.model.state_dict().items()}} \
            if calibrate else {}
        self.compiled = self.compile_error = None
        if compile_buckets:  # (a round runs no collective: eager alone is safe)
            def make():
                runner = CompiledDraft(self, compile_buckets, num_tokens)
                runner.warm_up()
                return runner
            self.compiled, self.compile_error = compiled_or_eager(make, eager_if_compile_fails, "the drafter's rounds")

    # ---- context ----------------------------------------------------------------------------
    @torch.inference_mode()
    def ingest(self, rows: ContextRows) -> None:
        for sid, start, hidden in rows:
            if sid in self._freed:  # a finished sequence's last rows, arriving after its free()
                continue
            st = self.ctx.get(sid)
            if st is None:  # a sequence's first rows: past a cached prefix they start after 0 (the target
                # computed only its prompt's latest rows: Scheduler.speculative_recompute); its blocks read none before
                st = self.ctx[sid] = _Context()
                if start > 0:
                    self._resync(st, start, count=hidden.shape[0] >= self.window)
            elif start < st.first_row and st.kv_length == st.first_row and not st.lost:
                # rows before the first ones taken, arriving after them (a drafter actor takes rows on two
                # threads), before any block read them: the context starts here, the rows taken wait behind
                st.pending.update(st.raw)
                self._resync(st, start, count=False)
            elif start > st.length and hidden.shape[0] >= self.window:
                # a gap, then at least a window of rows (a worker's kept rows, sent once drafting resumes):
                # no block past them reads a row before the gap again
                self._resync(st, start)
            if st.lost:
                continue
            if start > st.length:
                st.pending[start] = hidden
                if len(st.pending) > MAX_PENDING:
                    st.lost, st.pending = True, {}
                continue
            self._append(st, start, hidden)
            while st.length in st.pending:
                self._append(st, st.length, st.pending.pop(st.length))
            self.ingested_rows += hidden.shape[0]
        if self.calibrate and rows.rounds is not None:
            for sid, r in rows.rounds.by_sequence().items():
                st = self.ctx.get(sid)
                if st is not None and not st.lost:
                    st.rounds.append(r)

    def _resync(self, st: _Context, start: int, count: bool = True) -> None:
        """Continue at `start` past missing rows: no later block reads a row before it (keys/values of
        positions below `start` stay where they are, never read again)."""
        st.raw, st.pending = [], {k: v for k, v in st.pending.items() if k > start}
        st.kv_length = st.length = st.first_row = start
        if start < st.base:  # (before the rows the store kept: it starts again at the rows sent)
            st.k, st.v, st.base = [], [], start
        st.lost = False
        if self.calibrate:  # calibration reads the rows from here on, and rounds anchored past them
            st.kept, st.rounds = [], []
        self.resyncs += count

    def _append(self, st: _Context, start: int, hidden) -> None:
        """Take rows at positions start.. (dropping anything after: a recompute rewrites history)."""
        if start < st.length:
            st.raw = [(s0, h[: start - s0]) for s0, h in st.raw if s0 < start]
            st.kv_length, st.first_row = min(st.kv_length, start), min(st.first_row, start)
            if start < st.base:  # rewritten below the rows the store kept: it starts again from the rows sent
                st.k, st.v, st.base = [], [], start
            st.kept = [(s0, h[: start - s0]) for s0, h in st.kept if s0 < start]
        if self.calibrate:  # 16-bit copies (a view would pin the whole step's export tensor)
            st.kept.append((start, hidden.clone() if hidden.dtype in (torch.float16, torch.bfloat16)
                            else hidden.clamp(-65504, 65504).to(torch.float16)))
            if start + hidden.shape[0] - st.first_row > CALIBRATION_KEPT_ROWS + MAX_CONTEXT:
                self._trim_kept(st, start + hidden.shape[0] - CALIBRATION_KEPT_ROWS)
        # a view of the step's rows (no copy per sequence per step): it keeps that step's tensor alive
        # until every sequence in it has drafted or ended, at most the rows the live sequences own
        st.raw.append((start, hidden))
        st.length = start + hidden.shape[0]

    def _trim_kept(self, st: _Context, lo: int) -> None:
        """Online calibration's rows of a long sequence from position lo on only (copies: a view of a long prompt's
        rows would keep them all), and the rounds whose context lies there; no block reads a row before lo (its
        window is far past it) and the sequence's sample starts there (`first_row`)."""
        st.kept = [(max(s0, lo), h if s0 >= lo else h[lo - s0:].clone()) for s0, h in st.kept if s0 + h.shape[0] > lo]
        st.rounds = [r.select(torch.nonzero(r.anchor_pos - MAX_CONTEXT >= lo).flatten()) for r in st.rounds]
        st.rounds = [r for r in st.rounds if len(r)]
        st.first_row = max(st.first_row, lo)

    def _materialize(self, seq_ids) -> None:
        """Compute the keys/values of these sequences' stored rows, in one batched forward."""
        chunks = [(st, s0, h) for st in (self.ctx[sid] for sid in seq_ids) for s0, h in st.raw if h.shape[0]]
        if not chunks:
            return
        for st in {id(c[0]): c[0] for c in chunks}.values():
            self._make_room(st)
        hidden = chunks[0][2] if len(chunks) == 1 else torch.cat([h for _, _, h in chunks])
        if hidden.device != self.device or hidden.dtype != self.dtype:
            hidden = hidden.to(self.device, self.dtype)
        if len(chunks) == 1:
            pos = torch.arange(chunks[0][1], chunks[0][1] + hidden.shape[0], device=self.device)
        else:
            pos = torch.cat([torch.arange(s0, s0 + h.shape[0]) for _, s0, h in chunks]).to(self.device)
        upto = max(s0 + h.shape[0] for _, s0, h in chunks)
        fused, rope = self.model.fuse(hidden), self.model.rope(pos, upto)
        for li, layer in enumerate(self.model.layers):
            k, v = layer.context_kv(fused, rope)
            off = 0
            for st, s0, h in chunks:
                n = h.shape[0]
                if li >= len(st.k):  # (capacity for a block's rows past the context: a block writes them there)
                    st.k.append(k.new_empty((self._capacity(st),) + k.shape[1:]))
                    st.v.append(v.new_empty((self._capacity(st),) + v.shape[1:]))
                a = max(s0, st.base)  # (rows below the store's base: never read again)
                if a < s0 + n:
                    whole = off == 0 and n == k.shape[0] and a == s0  # (one chunk: no view to take)
                    st.k[li][a - st.base:s0 + n - st.base] = k if whole else k[off + a - s0:off + n]
                    st.v[li][a - st.base:s0 + n - st.base] = v if whole else v[off + a - s0:off + n]
                off += n
        for st in {id(c[0]): c[0] for c in chunks}.values():
            st.kv_length, st.raw = st.length, []

    def _capacity(self, st: _Context) -> int:
        """Rows a store is made with from its base: twice what it must hold (its length and a block's rows past it),
        so that it fills, and drops its oldest rows, every ~window rows."""
        return max(64, 2 * (st.length + self.c.block_size - st.base))

    def _make_room(self, st: _Context) -> None:
        """Room in st's store for its rows up to its length and a block's rows past it. A full store keeps the rows
        later blocks can read (the latest `window` before its length and KEEP_BEHIND more, none before its first
        row) from its row 0 on, in a store of `_capacity`; an empty one starts at the first row sent."""
        if not st.k:
            st.base = max(min(s0 for s0, _ in st.raw), st.first_row, st.length - self.window - KEEP_BEHIND)
            return
        if st.length + self.c.block_size - st.base <= st.k[0].shape[0]:
            return
        old, st.base = st.base, max(st.base, st.first_row, st.length - self.window - KEEP_BEHIND)
        keep = max(0, st.kv_length - st.base)  # rows computed before, carried over (the rest comes from `raw`)
        for kv in (st.k, st.v):
            for li, t in enumerate(kv):
                kv[li] = t.new_empty((self._capacity(st),) + t.shape[1:])
                kv[li][:keep] = t[st.base - old:st.base - old + keep]

    def ready(self, r) -> bool:
        """Whether the context for this request's block is in (every token but the anchor), at or past the rows its
        store keeps, and a store there or rows to make one from."""
        st = self.ctx.get(r.seq_id)
        return (st is not None and not st.lost and st.length >= r.length - 1 >= st.base
                and bool(st.k or any(h.shape[0] for _, h in st.raw)))

    def waiting_for(self, requests) -> list:
        """Requests whose context may still arrive (not lost, not there yet)."""
        return [r for r in requests if r.k > 0 and not self.ready(r) and not self.ctx.get(r.seq_id, _Context()).lost]

    # ---- proposer interface -----------------------------------------------------------------
    def prefill(self, requests) -> None:
        pass  # the context comes from the target's prefill

    def free(self, seq_ids, reasons=None, drop_late_rows: bool = True) -> None:
        """reasons: seq_id -> how the request ended (online calibration filters on it). drop_late_rows: rows of
        these sequences that arrive later are dropped (a drafter actor may take a finished sequence's last rows
        after its free); False where rows arrive in order with the frees (the drafter on the target), so that a
        preempted sequence's recompute, under the same id, is taken again."""
        for sid in seq_ids:
            st = self.ctx.pop(sid, None)
            if self.calibrate and st is not None and st.rounds and not st.lost:
                rows = torch.cat([h for _, h in st.kept]) if st.kept else torch.zeros(0, 1, dtype=torch.float16)
                self.samples.append(SequenceSample(sid, rows, RoundRecords.cat(st.rounds),
                                                   (reasons or {}).get(sid), row_offset=st.first_row))
            if not drop_late_rows:
                continue
            if len(self._freed_order) == self._freed_order.maxlen:
                self._freed.discard(self._freed_order[0])
            self._freed_order.append(sid)
            self._freed.add(sid)

    def take_samples(self) -> list[SequenceSample]:
        out, self.samples = self.samples, []
        return out

    # ---- versions (online calibration) ---------------------------------------------------------
    def stage(self, version: int, state: dict, keep) -> None:
        """Hold a calibrated version's weights, ready to switch to; keep only the versions in `keep`
        (and this one, and the serving one)."""
        self.staged[version] = {k: v.to(self.device, self.dtype if v.is_floating_point() else v.dtype)
                                for k, v in state.items()}
        for v in [v for v in self.staged if v not in set(keep) | {version, self.version}]:
            self.staged.pop(v)

    def use(self, version: int) -> None:
        """Serve with another staged version from now on: every sequence's context keys/values are
        recomputed from its kept rows, with the new weights, at its next proposal."""
        if version == self.version:
            return
        if version not in self.staged:
            raise KeyError(f"drafter version {version} is not staged here (staged: {sorted(self.staged)})")
        self.model.load_trained(self.staged[version])
        reorder_tensors(self.model.serving_weights(tables=False))  # the CPU's oneDNN copies made again now, not mid-round
        self.version = version
        for st in self.ctx.values():
            st.k, st.v, st.kv_length = [], [], 0
            st.raw = list(st.kept)

    def _context_bytes(self) -> int:
        """Bytes of every live sequence's context: keys/values, rows not yet turned into them, and
        the rows kept for a version switch (or online calibration)."""
        ctx = sum(t.numel() * t.element_size() for st in self.ctx.values() for t in st.k + st.v)
        ctx += sum(h.numel() * h.element_size() for st in self.ctx.values() for _, h in st.raw)
        ctx += sum(h.numel() * h.element_size() for st in self.ctx.values() for _, h in st.kept)
        return ctx

    def memory_report(self) -> dict:
        """param_bytes (with the target's tables, unless they are the target's own tensors: tables_shared),
        shared_table_bytes (the tables it reads), context_kv_bytes now, and kv_bytes: the context's peak, sampled
        every 8th proposal (the cost ledger's drafter KV); rope_table_bytes, the rope's table of positions (a
        cache of what it computes, apart from the weights as the target's rope table is); reordered_bytes, the CPU's
        oneDNN copies of its serving weights (gemm.py; a shared LM head's is the target's)."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        rope = sum(t.numel() * t.element_size() for cs in self.model._rope_table.values() for t in cs)
        tables = sum(b.numel() * b.element_size() for b in self.model.buffers())
        ctx = self._context_bytes()
        self.peak_context_bytes = max(self.peak_context_bytes, ctx)
        return {"param_bytes": params + (0 if self.tables_shared else tables), "shared_table_bytes": tables,
                "rope_table_bytes": rope, "reordered_bytes": self.reordered_bytes,
                "tables_shared_with_target": self.tables_shared, "context_kv_bytes": ctx,
                "kv_bytes": self.peak_context_bytes, "bytes_read": params}

    @torch.inference_mode()  # it writes into the store, made in inference mode
    def block_context(self, requests) -> tuple:
        """What a block forward of these requests reads, made once per proposal (a second pass reads it
        again): (positions of the block's slots [B, S], mask [B, S, C + S] or None, layer index -> that
        drafter layer's keys and values [B, C + S, heads, hd]: the latest `window` context rows before each
        anchor, then S rows the layer writes the block's own into). At batch 1 views of the sequence's
        store, whose capacity keeps S rows past its length for that (no copy), where it holds no row past
        the anchor; else a padded copy (made once for two passes, else as each layer runs)."""
        dev, S = self.device, self.c.block_size
        self._materialize([r.seq_id for r in requests])
        B = len(requests)
        lens = [r.length - 1 for r in requests]  # context length = the anchor's position
        states = [self.ctx[r.seq_id] for r in requests]
        # the window: context rows lo .. len - 1, none before the sequence's first row (nor the store's base: a
        # proposal far behind the rows taken, or a history rewritten below them, reads the rows kept)
        los = [max(st.first_row, st.base, n - self.window) for st, n in zip(states, lens)]
        self.narrowed += sum(lo > max(st.first_row, n - self.window) for st, lo, n in zip(states, los, lens))
        widths = [n - lo for n, lo in zip(lens, los)]
        C = max(widths)
        if B == 1:
            qpos = torch.arange(lens[0], lens[0] + S, device=dev)[None]
        else:
            qpos = torch.tensor(lens, device=dev)[:, None] + torch.arange(S, device=dev)
        layers = range(len(self.model.layers))
        first, lo0, n0 = states[0], los[0] - states[0].base, lens[0] - states[0].base  # (rows of the store)
        # (rows past the anchor, where held, stay unwritten; _materialize keeps the S rows' capacity)
        if B == 1 and first.kv_length == lens[0] and first.k[0].shape[0] >= n0 + S:
            views = [(first.k[li][None, lo0:n0 + S], first.v[li][None, lo0:n0 + S]) for li in layers]
            return qpos, None, views.__getitem__
        mask = None
        if min(widths) != C:  # padded context: hide the padding
            see = torch.arange(C, device=dev)[None, :] < torch.tensor(widths, device=dev)[:, None]
            mask = torch.cat([see, see.new_ones(B, S)], dim=1)[:, None, :].expand(B, S, C + S)

        def padded(li):
            ck = states[0].k[li].new_zeros(B, C + S, *states[0].k[li].shape[1:])
            cv = torch.zeros_like(ck)
            for b, (st, lo, n) in enumerate(zip(states, los, lens)):
                ck[b, : n - lo] = st.k[li][lo - st.base:n - st.base]
                cv[b, : n - lo] = st.v[li][lo - st.base:n - st.base]
            return ck, cv

        if self.c.draft_passes == 2:  # both passes read them: made once
            return qpos, mask, [padded(li) for li in layers].__getitem__
        return qpos, mask, padded  # made as each layer runs: one layer's copies alive at a time

    @torch.inference_mode()
    def block_forward(self, requests, second=None, context=None, anchors=None):
        """One backbone forward over a block per request (context ready): returns the final normed
        rows [B, block_size, d] and base logits [B, block_size, V]. Always the whole trained block:
        fewer mask slots would change what the trained slots see. second [B]: slot 1's tokens (a
        second pass: the drafts at slot 0), or None (a mask). context: `block_context(requests)`, and
        anchors: the requests' anchor tokens [B] on the device, when the caller has them already."""
        if anchors is None:
            anchors = torch.tensor([r.anchor for r in requests], device=self.device)
        return self._block(requests, context if context is not None else self.block_context(requests), anchors)(second)

    def _block(self, requests, context, anchors):
        """block(second) -> `block_forward` of these requests over their context (the block's rope looked up once
        for both passes)."""
        qpos, mask, kv = context
        m = self.model
        rope = m.rope(qpos, max(r.length for r in requests) - 1 + self.c.block_size)
        return lambda second=None: m.block_pass(anchors, rope, lambda i: (*kv(i), mask, True), second)

    @torch.inference_mode()
    def propose(self, requests) -> list[Proposal]:
        out = [Proposal([]) for _ in requests]
        active, drafted = self.draft(requests)
        if not active:
            return out
        tokens, confs, laws = drafted
        tokens, confs = tokens.cpu(), confs.float().cpu()
        # the law of the sampled rows only (a greedy row's verification reads its tokens alone), one
        # tensor per proposal: a view of the batch's would take the whole batch's law onto the wire
        sampled = [b for b, i in enumerate(active) if requests[i].temperature > 0]
        law_of = {}
        if sampled and laws is not None:
            kept = laws[torch.tensor(sampled, device=laws.device)].cpu()
            law_of = {b: kept[j, : requests[active[b]].k].clone() for j, b in enumerate(sampled)}
        for b, i in enumerate(active):
            k = requests[i].k
            out[i] = Proposal(tokens[b, :k].tolist(), law_of.get(b), confs[b, :k].clone())
        return out

    @torch.inference_mode()
    def draft(self, requests) -> tuple[list[int], tuple]:
        """The drafting itself, left on the device: (indices of the requests drafted for (k > 0, context
        in), (tokens [B, K] long, raw confidences [B, K], draft laws [B, K, V] or None when every row is
        greedy and a confidence head gives the confidences; sampled rows' laws in the drafter's dtype)); K = the most
        any request asks for."""
        self._proposals += 1
        if self._proposals % 8 == 1:  # the context's peak, for the cost ledger (a sum over every sequence)
            self.peak_context_bytes = max(self.peak_context_bytes, self._context_bytes())
        active = [i for i, r in enumerate(requests) if r.k > 0 and self.ready(r)]
        self.misses += sum(1 for r in requests if r.k > 0 and not self.ready(r))
        if not active:
            return [], ()
        reqs = [requests[i] for i in active]
        m, dev = self.model, self.device
        context = self.block_context(reqs)
        anchors = torch.tensor([r.anchor for r in reqs], device=dev)
        if self.compiled is not None and self.compiled.applies(reqs):  # in graphs
            return active, self.compiled(reqs, context, anchors)
        w1, w2 = m.markov_factors()
        K = max(r.k for r in reqs)
        greedy = all(r.temperature == 0 for r in reqs)
        law_args = None
        if not greedy or not self.c.confidence_head:  # (a greedy step with a confidence head reads none of them)
            law_args = [torch.tensor([getattr(r, a) for r in reqs], device=dev)
                        for a in ("temperature", "top_k", "top_p")]
        seeds = [r.seed for r in reqs]  # seeded rows draw slot i's token by its position

        def choose(i, z):
            if greedy:
                return z.argmax(-1), None
            temp, top_k, top_p = law_args
            # in the drafter's dtype: the law it ships (or hands the verify step) is the law it draws from
            # (a 16-bit law is renormalised where it is verified; the race is scale-free)
            law = filter_logits(z, temp, top_k, top_p).softmax(-1).to(self.dtype)
            raced = race_sample(law.float(), seeds, [r.position + i for r in reqs], DRAFT)
            return torch.where(temp == 0, z.argmax(-1), raced), law

        tokens, zs, laws, conf = m.draft_slots(self._block(reqs, context, anchors), anchors, w1, w2, K, choose)
        B, V = zs[0].shape
        if greedy:  # no law to ship; without a confidence head its top probability is the confidence
            if conf is None:
                temp, top_k, top_p = law_args
                rep = lambda t: t.repeat_interleave(K)  # noqa: E731
                laws = filter_logits(torch.stack(zs, 1).reshape(B * K, V), rep(temp), rep(top_k),
                                     rep(top_p)).softmax(-1).view(B, K, V)
            else:
                laws = None
        else:
            laws = torch.stack(laws, 1)
        # without a confidence head: the draft law's top probability (never the drafted token's own)
        confs = torch.sigmoid(conf) if conf is not None else laws.max(-1).values
        return active, (tokens, confs, laws)
