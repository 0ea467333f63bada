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


def committed_runs(seq_ids, query_lens, context_lens, sample_rows, num_draft, num_tokens):
    """Where each sequence's committed rows lie in a step's captured states, in numpy (host arrays):
    (seq ids, first position, rows committed, first row in the captured states), each [B]. A
    sequence commits all its input tokens but the drafts; a verify row also commits its accepted
    drafts (num_tokens - 1 of them); either way a prefix of its input rows. A sequence id of -1 (a
    request that does not speculate) commits none. (numpy as attention.build_metadata's: a numpy op
    costs ~1 us, a torch op ~5-10 us, and this runs every step.)"""
    sid, q, ctx = (_host(t) for t in (seq_ids, query_lens, context_lens))
    committed = q.copy()
    if num_draft is not None and sample_rows.numel():
        rows = _host(sample_rows)
        committed[rows] -= _host(num_draft) - (_host(num_tokens) - 1)
    committed[sid < 0] = 0
    return sid, ctx - q, committed, np.cumsum(q) - q


def committed_rows(captured, seq_ids, query_lens, context_lens, sample_rows, num_draft, num_tokens,
                   to_host: bool = True) -> ContextRows:
    """Select the committed rows of a step's captured states (`committed_runs`): captured [T, F] (one
    row per input token, sequences in order); seq_ids, query_lens, context_lens [B]; sample_rows [S]
    (indices into B); num_draft [S] or None; num_tokens [S] (tokens each sample row produced: accepted
    drafts + 1). to_host=False leaves the rows on the captured states' device (the worker keeps some
    of them there: ContextStash). One gather runs on the device."""
    sid, starts, committed, first = committed_runs(seq_ids, query_lens, context_lens, sample_rows, num_draft,
                                                   num_tokens)
    ends = np.cumsum(committed)
    idx = np.repeat(first - (ends - committed), committed) + np.arange(int(ends[-1]) if len(ends) else 0)
    keep = committed > 0
    hidden = captured[torch.from_numpy(idx).to(captured.device)]
    return ContextRows(torch.from_numpy(sid[keep]), torch.from_numpy(starts[keep]), torch.from_numpy(committed[keep]),
                       hidden.cpu() if to_host else hidden)


def _host(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array (host tensors without a copy)."""
    return (t if t.device.type == "cpu" else t.cpu()).numpy()


class _Step:
    """One step's kept rows, from its captured states `hidden` as they are (`args`: committed_runs'
    arguments) or from rows selected already (`runs` given). Where each sequence's rows lie is worked
    out at the first catch-up that reads this step, not while it is logged."""

    __slots__ = ("index", "hidden", "args", "window", "_runs", "_pos", "nbytes")

    def __init__(self, index, hidden, window, args=None, runs=None):
        self.index, self.hidden, self.window, self.args, self._runs, self._pos = index, hidden, window, args, runs, None
        self.nbytes = hidden.numel() * hidden.element_size()

    def runs(self):
        """(seq ids, starts, counts, first rows) [n], numpy; a run longer than the window cut to its last
        `window` rows (a prompt chunk)."""
        if self._runs is None:
            self._runs = committed_runs(*self.args)
            self.args = None
        sids, starts, counts, offs = self._runs
        over = np.maximum(counts - self.window, 0)
        return sids, starts + over, counts - over, offs + over

    @property
    def rows(self) -> int:
        return int(self.runs()[2].sum())

    def find(self, sid: int):
        """(start, count, first row) of a sequence's rows here, or None."""
        if self._pos is None:
            sids, starts, counts, offs = (a.tolist() for a in self.runs())
            self._pos = {sid: run for sid, *run in zip(sids, starts, counts, offs) if run[1] > 0}
        return self._pos.get(sid)


class ContextStash:
    """The target worker's side of an idle DSpark drafter: per sequence, its committed rows the
    drafter was not sent (steps that asked for no export, `StepInput.export_rows`). When a step
    exports a sequence again, its held rows go first, the latest `window` of them (a block reads no
    more: `speculative.context_window`), in the same chunk (one contiguous run ending where the
    step's own rows begin), and the sequence is forgotten; the drafter then has every row its next
    block reads (a run of at least `window` rows past a gap tells it the rows before the gap are
    never read again).

    A step that keeps rows is logged as one entry: its captured states as they are (no copy, no
    gather: each sequence's committed rows are a prefix of its input rows) and where each sequence's
    rows lie; per sequence only the first entry that holds its rows is noted. Its rows are cut out,
    ordered (a recompute after a preemption rewrites from its start) and windowed only when it
    exports again. So an idle step costs a few microseconds whatever its batch; the work per
    sequence is paid at a catch-up. Memory: the latest `window` steps at most (a sequence commits
    at least a row a step, so older ones are out of every window; a prompt chunk counts its last
    `window` rows), fewer once no sequence held needs the oldest (`nbytes`, `peak_bytes`: the
    logged steps' states)."""

    def __init__(self, window: int):
        self.window = max(1, int(window))
        self.log: deque = deque()  # _Step, oldest first
        self.since: dict[int, int] = {}  # seq_id -> index of the first logged step holding rows of it
        self.num_logged = 0
        self.nbytes = 0
        self.peak_bytes = 0
        self.row_bytes = 0
        self.rows_flushed = self.flushes = 0  # since start: kept rows sent later, catch-ups that sent some

    @property
    def rows_held(self) -> int:
        return sum(st.rows for st in self.log)

    def keep(self, rows: ContextRows) -> None:
        """Hold these rows (selected rows of a step: each sequence's run follows the one before)."""
        counts = rows.counts.numpy()
        self._keep_runs(rows.hidden, (rows.seq_ids.numpy(), rows.starts.numpy(), counts, np.cumsum(counts) - counts))

    def keep_step(self, captured, seq_ids, query_lens, context_lens, sample_rows, num_draft, num_tokens) -> None:
        """Hold the committed rows of a step that exports nothing, from its captured states as they are
        (arguments as committed_rows'). A step of more rows than the window (prompt chunks) is selected
        at once instead: only each sequence's last `window` rows are kept of it."""
        args = (seq_ids, query_lens, context_lens, sample_rows, num_draft, num_tokens)
        if captured.shape[0] > self.window:
            self._keep_runs(captured, committed_runs(*args))
            return
        self._log(_Step(self.num_logged, captured, self.window, args=args), seq_ids)

    def _keep_runs(self, hidden, runs) -> None:
        """Log rows whose runs are known: a run longer than the window keeps its last `window` rows (copied
        out, so the rest of the step's states can go) and is a whole window, so its sequence's earlier
        steps are never read again (they go once no other sequence needs them)."""
        sids, starts, counts, offs = runs
        long = counts > self.window
        if long.any():
            over = np.where(long, counts - self.window, 0)
            starts, counts, offs = starts + over, counts - over, offs + over
            ends = np.cumsum(counts)
            idx = np.repeat(offs - (ends - counts), counts) + np.arange(int(ends[-1]) if len(ends) else 0)
            hidden = hidden[torch.from_numpy(idx).to(hidden.device)]
            offs = ends - counts
            for sid in sids[long & (sids >= 0)].tolist():
                self.since.pop(sid, None)  # (set to this step below)
        self._log(_Step(self.num_logged, hidden, self.window, runs=(sids, starts, counts, offs)), torch.from_numpy(sids))
        if long.any():
            self._trim()

    def _log(self, step: _Step, seq_ids: torch.Tensor) -> None:
        if not step.nbytes:
            return
        # set operations in C: this runs every idle step, with caches cold from the forward
        ids = set(seq_ids.tolist())
        ids.discard(-1)
        new = ids.difference(self.since)
        if new:
            self.since.update(dict.fromkeys(new, step.index))
        self.row_bytes = step.hidden.shape[1] * step.hidden.element_size()
        self.num_logged += 1
        self.log.append(step)
        self.nbytes += step.nbytes
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        if len(self.log) > self.window:  # out of every window
            self.nbytes -= self.log.popleft().nbytes

    def _trim(self) -> None:
        """Drop the steps no sequence held needs (after a catch-up or a free)."""
        log = self.log
        oldest = min(self.since.values(), default=self.num_logged)
        while log and log[0].index < oldest:
            self.nbytes -= log.popleft().nbytes

    def _run(self, first: int, sid: int, upto: int) -> tuple[int, list]:
        """A held sequence's rows (logged from step `first` on) as one contiguous run ending at `upto`
        (its next row): (start, pieces), at most `window` rows. Later rows rewrite earlier ones from
        their start (a recompute); rows before a gap, and from `upto` on, are never read again."""
        run: list = []  # [start, rows] chunks, contiguous
        end = None
        log = self.log
        for i in range(max(first - log[0].index, 0) if log else 0, len(log)):
            step = log[i]
            found = step.find(sid)
            if found is None:
                continue
            s0, n, off = found
            if end is not None and s0 < end:  # rewrite from s0
                while run and run[-1][0] >= s0:
                    run.pop()
                if run and run[-1][0] + run[-1][1].shape[0] > s0:
                    run[-1][1] = run[-1][1][: s0 - run[-1][0]]
            elif end is not None and s0 > end:  # a gap: only what follows it is of use
                run = []
            run.append([s0, step.hidden[off : off + n]])
            end = s0 + n
        while run and run[-1][0] >= upto:
            run.pop()
        if run and run[-1][0] + run[-1][1].shape[0] > upto:
            run[-1][1] = run[-1][1][: upto - run[-1][0]]
        if not run or run[-1][0] + run[-1][1].shape[0] != upto:
            return upto, []  # not contiguous with the step's own rows
        cut = sum(h.shape[0] for _, h in run) - self.window  # the latest `window` rows
        while cut > 0 and run[0][1].shape[0] <= cut:
            cut -= run.pop(0)[1].shape[0]
        if cut > 0:
            run[0] = [run[0][0] + cut, run[0][1][cut:]]
        return run[0][0], [h for _, h in run]

    def take(self, rows: ContextRows) -> ContextRows:
        """These rows to export, each sequence's held rows (if any) put before its own and forgotten."""
        if not any(sid in self.since for sid in rows.seq_ids.tolist()):
            return rows
        pieces, starts, counts = [], [], []
        for sid, start, h in rows:
            first = self.since.pop(sid, None)
            first, held = self._run(first, sid, start) if first is not None else (start, [])
            n = sum(x.shape[0] for x in held)
            if n:
                self.rows_flushed += n
                self.flushes += 1
                pieces += held
            pieces.append(h)
            starts.append(first)
            counts.append(n + h.shape[0])
        self._trim()
        long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        return ContextRows(rows.seq_ids.clone(), long(starts), long(counts), torch.cat(pieces), rows.rounds)

    def free(self, seq_ids) -> None:
        for sid in seq_ids:
            self.since.pop(int(sid), None)
        self._trim()

    def clear(self) -> None:
        self.since.clear()
        self.log.clear()
        self.nbytes = 0

    def route(self, rows: ContextRows, export: Optional[torch.Tensor], seq_ids: torch.Tensor,
              to_host: bool = True) -> Optional[ContextRows]:
        """A step's committed rows (on the device): those of the sequences whose rows `export` marks
        ([B] bool over the step's rows; None: all) go out with their held rows, on the host (to_host;
        else left on the device, for a drafter there); the others are kept. Returns the rows to export,
        or None when there are none (nor rounds). (A step that exports nothing and records no rounds
        goes to keep_step instead, without selecting its rows.)"""
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
                "context_stash_sequences": len(self.since), "context_stash_steps": len(self.log),
                "context_rows_flushed": self.rows_flushed, "context_flushes": self.flushes}
