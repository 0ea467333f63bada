"""What the target's workers export to a DSpark drafter: the chosen layers' hidden states of the
tokens a step committed (never rejected drafts, never the token just sampled: the target has not
run it yet; it is the next block's anchor), and what they keep of them while the drafter is idle
(`ContextStash`)."""

from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np
import torch

from .records import ContextRows


def committed_rows(captured, seq_ids, query_lens, context_lens, sample_rows, num_draft, num_tokens,
                   to_host: bool = True) -> ContextRows:
    """Select the committed rows of a step's captured states.

    captured [T, F] (one row per input token, sequences in order); seq_ids, query_lens,
    context_lens [B]; sample_rows [S] (indices into B); num_draft [S] or None; num_tokens [S] (tokens
    each sample row produced: accepted drafts + 1). A sequence commits all its input tokens but the
    drafts; a verify row also commits its accepted drafts (num_tokens - 1 of them). A sequence id of
    -1 (a request that does not speculate) exports nothing. to_host=False leaves the rows on the
    captured states' device (the worker keeps some of them there: ContextStash). The index arithmetic
    runs in numpy on the host arrays (as attention.build_metadata's: a numpy op costs ~1 us, a torch
    op ~5-10 us, and this runs every step); one gather runs on the device."""
    sid, q, ctx = (_host(t) for t in (seq_ids, query_lens, context_lens))
    committed = q.copy()
    if num_draft is not None and sample_rows.numel():
        rows = _host(sample_rows)
        committed[rows] -= _host(num_draft) - (_host(num_tokens) - 1)
    committed[sid < 0] = 0
    first = np.cumsum(q) - q
    ends = np.cumsum(committed)
    idx = np.repeat(first - (ends - committed), committed) + np.arange(int(ends[-1]) if len(ends) else 0)
    keep = committed > 0
    hidden = captured[torch.from_numpy(idx).to(captured.device)]
    return ContextRows(torch.from_numpy(sid[keep]), torch.from_numpy((ctx - q)[keep]), torch.from_numpy(committed[keep]),
                       hidden.cpu() if to_host else hidden)


def _host(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array (host tensors without a copy)."""
    return (t if t.device.type == "cpu" else t.cpu()).numpy()


class _Held:
    """One sequence's kept rows: contiguous chunks (start, rows), oldest first, ending at `end`."""

    __slots__ = ("chunks", "rows", "end")

    def __init__(self):
        self.chunks: deque = deque()
        self.rows = 0
        self.end = 0

    def cut(self, start: int) -> None:
        """Drop the rows from `start` on (a recompute rewrites them)."""
        while self.chunks and self.chunks[-1][0] >= start:
            self.rows -= self.chunks.pop()[1].shape[0]
        if self.chunks and self.end > start:
            s0, c = self.chunks.pop()
            self.chunks.append((s0, c[: start - s0]))
            self.rows -= self.end - start
        self.end = min(self.end, start)


class ContextStash:
    """The target worker's side of an idle DSpark drafter: per sequence, its committed rows the
    drafter was not sent (steps that asked for no export, `StepInput.export_rows`), the latest
    `window` of them at most (a block reads no more: `speculative.context_window`). When a step
    exports a sequence again, its held rows go first, in the same chunk (one contiguous run ending
    where the step's own rows begin), and the sequence's entry is freed; the drafter then has every
    row its next block reads (a run of at least `window` rows past a gap tells it the rows before
    the gap are never read again).

    Rows are held where the step computed them (on the device) as views of that step's selected
    rows: keeping a step's rows is one index copy however many sequences it holds. Memory: at most
    `window` rows a sequence (`nbytes`, `peak_bytes`; a step's selected rows stay allocated while
    any sequence holds one of them)."""

    def __init__(self, window: int):
        self.window = max(1, int(window))
        self.held: dict[int, _Held] = {}
        self.rows_held = 0
        self.row_bytes = 0
        self.peak_bytes = 0
        self.rows_kept = self.rows_flushed = self.flushes = 0  # since start: rows kept, rows sent later, flushes

    @property
    def nbytes(self) -> int:
        return self.rows_held * self.row_bytes

    def keep(self, rows: ContextRows) -> None:
        """Hold these rows (each sequence's continue its held run; a recompute rewinds it)."""
        if rows.hidden.numel():
            self.row_bytes = rows.hidden.shape[1] * rows.hidden.element_size()
        W = self.window
        for sid, start, h in rows:
            e = self.held.get(sid)
            if e is None:
                e = self.held[sid] = _Held()
            before = e.rows
            if e.chunks and start != e.end:
                if start < e.end:  # a recompute (after a preemption) rewrites from `start`
                    e.cut(start)
                else:  # rows missing in between (never expected): only the new ones are of use
                    e.chunks.clear()
                    e.rows = 0
            n = h.shape[0]
            if n > W:
                start, h, n = start + n - W, h[n - W :], W
            e.chunks.append((start, h))
            e.rows += n
            e.end = start + n
            while e.rows - e.chunks[0][1].shape[0] >= W:  # chunks wholly out of the window
                e.rows -= e.chunks.popleft()[1].shape[0]
            if e.rows > W:  # the oldest chunk straddles the window's start
                s0, c = e.chunks.popleft()
                cut = e.rows - W
                e.chunks.appendleft((s0 + cut, c[cut:]))
                e.rows = W
            self.rows_held += e.rows - before
            self.rows_kept += n
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def take(self, rows: ContextRows) -> ContextRows:
        """These rows to export, each sequence's held rows (if any) put before its own and freed."""
        if not any(sid in self.held for sid in rows.seq_ids.tolist()):
            return rows
        pieces, starts, counts = [], [], []
        for sid, start, h in rows:
            e = self.free_one(sid)
            if e is not None and e.end >= start:  # contiguous (cut back to `start` on a recompute)
                e.cut(start)
            elif e is not None:
                e = None
            n = e.rows if e is not None else 0
            if n:
                self.rows_flushed += n
                self.flushes += 1
                pieces += [c for _, c in e.chunks]
            pieces.append(h)
            starts.append(e.chunks[0][0] if n else start)
            counts.append(n + h.shape[0])
        long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        return ContextRows(rows.seq_ids.clone(), long(starts), long(counts), torch.cat(pieces), rows.rounds)

    def free_one(self, sid: int) -> Optional[_Held]:
        e = self.held.pop(sid, None)
        if e is not None:
            self.rows_held -= e.rows
        return e

    def free(self, seq_ids) -> None:
        for sid in seq_ids:
            self.free_one(int(sid))

    def clear(self) -> None:
        self.held.clear()
        self.rows_held = 0

    def route(self, rows: ContextRows, export: Optional[torch.Tensor], seq_ids: torch.Tensor,
              to_host: bool = True) -> Optional[ContextRows]:
        """A step's committed rows (on the device): those of the sequences whose rows `export` marks
        ([B] bool over the step's rows; None: all) go out with their held rows, on the host (to_host;
        else left on the device, for a drafter there); the others are kept. Returns the rows to export,
        or None when there are none (nor rounds)."""
        if export is not None:
            if not bool(export.any()):  # a step that drafts nothing: every row stays here
                self.keep(rows)
                if rows.rounds is None:
                    return None
                rows = ContextRows(rows.seq_ids[:0], rows.starts[:0], rows.counts[:0], rows.hidden[:0], rows.rounds)
            else:
                out_ids = set(seq_ids[export].tolist())
                mask = torch.tensor([sid in out_ids for sid in rows.seq_ids.tolist()], dtype=torch.bool)
                if not bool(mask.all()):
                    self.keep(rows.select(~mask))
                    rounds, rows = rows.rounds, rows.select(mask)
                    rows.rounds = rounds
        if rows.counts.numel():
            rows = self.take(rows)
        elif rows.rounds is None:
            return None
        if to_host:
            rows.hidden = rows.hidden.cpu()
        return rows

    def report(self) -> dict:
        return {"context_stash_bytes": self.nbytes, "context_stash_peak_bytes": self.peak_bytes,
                "context_stash_sequences": len(self.held), "context_rows_kept": self.rows_kept,
                "context_rows_flushed": self.rows_flushed, "context_flushes": self.flushes}
