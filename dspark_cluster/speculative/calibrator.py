"""Online calibration of the DSpark drafter, the trainer and serving side (the data side, from the
recorded rounds to the losses and shadow scores, is `calibration.py`):
- `Calibrator` (on its own device: a Ray actor, or a thread in process) distils a copy of the
  drafter on the `ReplayBuffer` (`Trainer`: AdamW with gradient clipping, in a world of one),
  scores the candidate against the serving version on held-back sequences (`shadow_scores`) and
  offers it (`Candidate`) when it wins by a margin; base-version switches (`set_serving`) happen
  between its updates only;
- `CalibrationLoop` runs its updates on a low-priority thread, at most one per interval; the
  calibrator's `heartbeat` says what it is doing and when it last progressed (heartbeat.py);
- the engine's `DrafterVersions` switches every drafter to it at a step boundary, watches live tau
  by version and rolls back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from ..heartbeat import Heartbeat
from .calibration import (ROUNDS_PER_SEQUENCE, ReplayBuffer, SequenceSample, collate, forward, group_rounds,
                          round_losses, shadow_scores)
from .dspark_model import DSparkConfig, DSparkDrafter, draft_passes_of, load_drafter, target_tables

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------- calibrator

@dataclass
class Candidate:
    """A calibrated version offered for publishing: its trained weights (not the target's tables)."""

    version: int
    state: dict
    meta: dict  # rounds_trained, steps, shadow (candidate's scores), serving_shadow, time


class Trainer:
    """The optimiser of a world of one: AdamW (betas 0.9 / 0.95, no weight decay) with the gradients
    clipped to norm 1.0 -- what DeepSpeed's engine ran here at ZeRO stage 0 with torch's AdamW, which
    is all a single rank gets from it. Not DeepSpeed itself: its comm backend, which a world of one
    does not need, JIT-compiles `deepspeed_shm_comm` at its first use on CPU (30 s at best, minutes
    on a loaded machine), and a build stopped midway leaves a lock in the torch extensions cache that
    every later calibrator on the machine waited on for ever (issue 29)."""

    def __init__(self, model: torch.nn.Module, learning_rate: float, clip: float = 1.0):
        self.module, self.clip = model, clip
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def backward(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()


class Calibrator:
    """Distils a copy of the drafter on the replay buffer, one update of `steps_per_update`
    optimiser steps at a time, and keeps a candidate that wins the shadow evaluation for the
    engine to publish. Thread-safe: `add`, `set_serving` and `status` may come from other threads
    than `update`; a switch of the serving version asked for during an update waits for its end
    (the model it would load into is the one training) and that update's candidate is dropped."""

    def __init__(self, cfg, target_spec, device="cpu", seed: int = 0, first_version: int = 1,
                 stall_after_s: float = 120.0):
        sp = cfg.speculative
        self.cc = sp.calibration
        self.device = torch.device(device)
        embed, lm_head = target_tables(cfg.model.path, target_spec)
        served = load_drafter(sp.draft_model, embed, lm_head, self.device)
        served.c.draft_passes = draft_passes_of(cfg)  # the function the drafters serve
        self.c: DSparkConfig = served.c
        self.vocab_size = self.c.vocab_size
        self.model = DSparkDrafter(self.c).to(self.device)
        self.model.set_target_tables(embed.float().to(self.device), lm_head.float().to(self.device))
        self.model.load_trained(served.state_dict())
        self.model.train()
        # the original and the versions made; pruned to what the engine keeps (set_serving's `keep`)
        self.versions: dict[int, dict] = {0: _cpu_state(served)}
        self.serving = 0
        self.next_version = first_version  # after a drafter group restart the engine's numbering goes on
        self.buffer = ReplayBuffer(self.cc.buffer_rounds, self.cc.holdout, seed, self.cc.max_entropy_share,
                                   int(self.cc.buffer_bytes))
        self._lock = threading.Lock()
        self._inbox: list[SequenceSample] = []
        self._inbox_bytes = 0
        self._inbox_lock = threading.Lock()
        self._take_lock = threading.Lock()  # one take_inbox at a time (see there)
        self.inbox_dropped = 0  # sequences refused while the inbox held buffer_bytes (training kept it from draining)
        self.nonfinite_steps = 0  # optimiser steps skipped for a loss that was not finite
        self._rng = random.Random(seed)
        self._engine: Optional[Trainer] = None  # made at the first update
        self.heartbeat = Heartbeat("calibrator", stall_after_s)
        self._training = False  # an update is running: set_serving defers its switch to the update's end
        self._switch: Optional[int] = None  # the serving version asked for meanwhile
        self._scratch: Optional[DSparkDrafter] = None  # scores the serving version in the shadow evaluation
        self.pending: Optional[Candidate] = None
        self.updates = self.steps = 0
        self.rounds_trained = 0  # rounds the serving line of versions was trained on
        self.history: list[dict] = []  # every update's outcome
        self.last_error: Optional[str] = None
        self._rounds_at_update = 0
        self._offered, self._offered_t = None, 0.0  # a candidate taken, until the engine says what serves

    # ---- data ---------------------------------------------------------------------------------
    def add(self, samples: list[SequenceSample]) -> None:
        """Take finished sequences (cheap: filtering and storing happen in take_inbox, on the
        calibrator's own, low-priority thread)."""
        with self._inbox_lock:
            for s in samples:
                if self._inbox_bytes + s.nbytes > self.buffer.max_bytes:
                    self.inbox_dropped += 1
                    continue
                self._inbox.append(s)
                self._inbox_bytes += s.nbytes

    def take_inbox(self) -> None:
        """Every sample added so far is in the buffer when this returns: the background thread's take
        and a caller's are serialised (else a caller could find the inbox emptied by the thread while
        the thread still inserts, and read a partial buffer)."""
        with self._take_lock:
            with self._inbox_lock:
                samples, self._inbox, self._inbox_bytes = self._inbox, [], 0
            for s in samples:
                prepared = self.buffer.prepare(s, self.vocab_size)  # the filtering, outside the training lock
                with self._lock:
                    self.buffer.insert(*prepared)

    def ready(self) -> bool:
        """Enough rounds for an update, and new ones since the last."""
        self.take_inbox()
        with self._lock:
            n, kept = self.buffer.num_rounds, self.buffer.total_kept
        waiting = self.pending is not None or (self._offered is not None and time.monotonic() - self._offered_t < 120)
        return n >= self.cc.min_rounds and kept > self._rounds_at_update and not waiting

    # ---- versions -----------------------------------------------------------------------------
    def set_serving(self, version: int, keep=None) -> None:
        """The engine published or rolled back to `version`: train on from its weights. `keep`: the
        versions the engine may still roll back to (the others are dropped here too). During an
        update the switch waits for its end (never a weight load into the model in training)."""
        with self._lock:
            self._offered = None
            if version not in self.versions:
                raise KeyError(f"drafter version {version} is not held by the calibrator ({sorted(self.versions)})")
            if self._training:
                if version != self.serving or self._switch is not None:
                    # the latest ask wins (a publish then a rollback: the rollback), at the update's end
                    self._switch = version
                    self.pending = None  # made from another base
            elif version != self.serving:
                self._use(version)
            if keep is not None:
                keep = set(keep) | {0, version, self.serving} | ({self._switch} - {None})
                for v in [v for v in self.versions if v not in keep]:
                    self.versions.pop(v)

    def _use(self, version: int) -> None:
        """Train on from `version`'s weights (under _lock, never during an update)."""
        self.serving = version
        self.model.load_trained(self.versions[version])
        self.model.train()
        self.pending = None  # made from another base

    def waiting(self, activity: str) -> None:
        """The heartbeat rests (not expected to progress) unless an update runs (one called
        directly, beside the loop, keeps its own heartbeat)."""
        with self._lock:
            if not self._training:
                self.heartbeat.rest(activity)

    def take_candidate(self) -> Optional[Candidate]:
        with self._lock:
            c, self.pending = self.pending, None
            if c is not None:
                self._offered, self._offered_t = c.version, time.monotonic()
            return c

    # ---- training -----------------------------------------------------------------------------
    def _trainer(self) -> Trainer:
        if self._engine is None:
            self.heartbeat.beat("setting up the optimiser")
            self._engine = Trainer(self.model, self.cc.learning_rate)
        return self._engine

    def update(self) -> dict:
        """One update: train, score against the serving version on the held-back rounds, and keep
        the result as the pending candidate if it wins by `margin` (else go back to the serving
        weights when it lost). A switch of the serving version asked for meanwhile (set_serving)
        takes effect at its end and drops its result. Returns the update's record."""
        t0, start = time.perf_counter(), time.monotonic()
        self.heartbeat.beat("taking new rounds")
        self.take_inbox()
        with self._lock:
            train = self.buffer.rounds(held_out=False)
            hold = self.buffer.rounds(held_out=True)
            self._rounds_at_update = self.buffer.total_kept
            serving_state = self.versions[self.serving]
            base_version = self.serving
            self._training = bool(train and hold)
        if not self._training:
            self.heartbeat.rest("waiting for training and held-back rounds")
            return {"skipped": "no training or held-back rounds yet"}
        done = False
        try:
            record, cand, serve, wins = self._train_and_score(train, hold, serving_state, base_version)
            record.update(seconds=round(time.perf_counter() - t0, 2), t_start=start, t_end=time.monotonic())
            with self._lock:
                self._training = False
                if self._switch is not None:  # published or rolled back meanwhile: this update no longer applies
                    record["outcome"] = (f"discarded (the serving version changed to {self._switch} during the "
                                         "update)")
                    self._use(self._switch)
                    self._switch = None
                else:
                    record["outcome"] = self._offer(record, train, serving_state, base_version, cand, serve, wins)
                self.model.train()
                self.history.append(record)
                del self.history[:-500]
            done = True
        finally:
            with self._lock:  # a failed update: a switch asked for meanwhile still happens
                self._training = False
                if self._switch is not None:
                    self._use(self._switch)
                    self._switch = None
            self.heartbeat.rest("idle after an update" if done else "idle after a failed update")
        log.info("drafter calibration update %d: %s (shadow tau %.3f vs serving %.3f)", self.updates,
                 record["outcome"], cand["tau"], serve["tau"])
        return record

    def _train_and_score(self, train, hold, serving_state, base_version) -> tuple:
        """steps_per_update optimiser steps on the training rounds, then the shadow scores of the
        result and of the serving version (outside _lock: set_serving waits for the update's end)."""
        engine = self._trainer()
        S = self.c.block_size
        by_seq = group_rounds(train, 10**9)  # every sequence with all its training rounds
        n_seq = max(1, self.cc.batch_rounds // ROUNDS_PER_SEQUENCE)
        metrics, loss = {}, torch.tensor(float("nan"))
        n = self.cc.steps_per_update
        for i in range(n):
            self.heartbeat.beat(f"training update {self.updates + 1}: optimiser step {i + 1} of {n}")
            # batch_rounds rounds: ROUNDS_PER_SEQUENCE consecutive rounds of each of a few sequences,
            # one context forward each (consecutive: their context windows overlap most)
            groups = []
            for s, idx in self._rng.sample(by_seq, min(n_seq, len(by_seq))):
                a = self._rng.randrange(max(1, len(idx) - ROUNDS_PER_SEQUENCE + 1))
                groups.append((s, idx[a : a + ROUNDS_PER_SEQUENCE]))
            batch = collate(groups, S, self.device)
            z, conf = forward(engine.module, batch)
            loss, metrics = round_losses(z, conf, batch, self.cc.reject_weight)
            if not bool(torch.isfinite(loss)):  # never let one bad batch into the optimiser's moments
                self.nonfinite_steps += 1
                continue
            engine.backward(loss)
            engine.step()
            self.steps += 1
        self.updates += 1
        self.heartbeat.beat(f"update {self.updates}: shadow evaluation against the serving version")
        self.model.load_trained(self.model.state_dict())  # drop the cached Markov factors
        try:
            cand = shadow_scores(self.model, hold, S, self.device)
            serve = shadow_scores(_scratch_model(self, serving_state), hold, S, self.device)
        finally:
            self.model.train()
        wins = cand["tau"] >= serve["tau"] * (1 + self.cc.margin) and cand["match"] >= serve["match"] * (1 - self.cc.margin)
        record = {"update": self.updates, "time": time.time(), "base_version": base_version,
                  "train_rounds": len(train), "holdout_rounds": len(hold), "steps": n,
                  "loss": round(float(loss.detach()), 4), "nonfinite_steps": self.nonfinite_steps, **{k: round(v, 4) for k, v in metrics.items()},
                  "shadow": _round(cand), "serving_shadow": _round(serve)}
        # (seconds, and the monotonic clock's t_start / t_end, one per machine: which serving steps ran
        # while this update trained, are added by update())
        return record, cand, serve, wins

    def _offer(self, record, train, serving_state, base_version, cand, serve, wins) -> str:
        """The update's outcome (under _lock, no switch asked for meanwhile): a candidate, a
        rejection (back to the serving weights), or training goes on."""
        if wins:
            v = self.next_version
            self.next_version += 1
            self.rounds_trained += len(train)
            state = _cpu_state(self.model)
            self.versions[v] = state
            self.pending = Candidate(v, state, {"version": v, "rounds_trained": self.rounds_trained,
                                                "shadow": record["shadow"], "serving_shadow": record["serving_shadow"],
                                                "time": time.time(), "base_version": base_version})
            return f"candidate version {v}"
        if cand["tau"] < serve["tau"] or cand["match"] < serve["match"] * (1 - self.cc.margin):
            self.model.load_trained(serving_state)
            return "rejected: worse than the serving version; back to its weights"
        return "not yet better by the margin; training goes on"

    def updates_log(self) -> list[dict]:
        """Every update's record (the latest 500)."""
        with self._lock:
            return list(self.history)

    def memory_report(self) -> dict:
        """Bytes the calibrator holds on its device and beside it: the drafter it trains (and its scratch copy for
        shadow scoring), the optimiser's state, the versions kept for rollback, the replay buffer."""

        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))

        with self._lock:
            models = [m for m in (self.model, self._scratch) if m is not None]
            weights = sum(nbytes(m.parameters()) + nbytes(m.buffers()) for m in models)
            optimizer = 0
            if self._engine is not None:
                states = list(getattr(self._engine.optimizer, "state", {}).values())  # a copy: training may add to it
                optimizer = sum(nbytes(st.values()) for st in states)
            versions = sum(nbytes(v.values()) for v in self.versions.values())
            return {"weights": weights, "optimizer": optimizer, "versions": versions, "buffer": self.buffer.num_bytes,
                    "total": weights + optimizer + versions + self.buffer.num_bytes}

    def status(self) -> dict:
        self.take_inbox()
        with self._lock:
            return {"buffer": self.buffer.state(), "inbox_dropped_sequences": self.inbox_dropped, "updates": self.updates, "optimizer_steps": self.steps,
                    "serving": self.serving, "versions_kept": sorted(self.versions),
                    "pending_candidate": None if self.pending is None else self.pending.version,
                    "last_updates": self.history[-5:], "last_error": self.last_error,
                    "switch_after_update": self._switch, "heartbeat": self.heartbeat.snapshot()}


def _cpu_state(model) -> dict:
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def _round(d: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def _scratch_model(cal: Calibrator, state: dict) -> DSparkDrafter:
    """The calibrator's second drafter (made once), holding `state`, for scoring the serving version."""
    if cal._scratch is None:
        cal._scratch = DSparkDrafter(cal.c).to(cal.device)
        cal._scratch.set_target_tables(cal.model.embed, cal.model.lm_head)
    cal._scratch.load_trained(state)
    return cal._scratch.eval()


class CalibrationLoop:
    """In process: the calibrator's updates on a thread of their own, at most one per interval_s.
    (With executor ray the calibrator is an actor, on its own device, running the same loop.)"""

    def __init__(self, calibrator: Calibrator, interval_s: float):
        self.calibrator, self.interval_s = calibrator, interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dspark-calibrator", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # background work: where the calibrator shares CPU cores with serving (a thread in process,
        # or an actor on a CPU node), the serving threads come first
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        last = time.monotonic()  # the first update one interval after the start, like every other
        while not self._stop.is_set():
            self._wake.wait(max(0.05, min(1.0, self.interval_s - (time.monotonic() - last))))
            self._wake.clear()
            if self._stop.is_set():
                continue
            cal = self.calibrator
            try:
                cal.take_inbox()  # filtering and storing at this thread's low priority
                if time.monotonic() - last < self.interval_s:
                    cal.waiting("waiting for the next interval (calibration.interval_s)")
                    continue
                if not cal.ready():
                    cal.waiting("waiting for new rounds (calibration.min_rounds) or for the engine to take a candidate")
                    continue
                cal.update()
            except Exception as e:  # noqa: BLE001 -- a calibration failure leaves the serving drafter as it is
                self.calibrator.last_error = f"{type(e).__name__}: {e}"
                log.warning("drafter calibration update failed (%s); the serving drafter is unchanged", e, exc_info=e)
            last = time.monotonic()  # the interval runs from the end of an update: it is idle time

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout=60)


# ---------------------------------------------------------------------------------------- versions

class DrafterVersions:
    """The engine's side: which version serves, the history of versions (time, rounds trained on,
    shadow score, live tau), and automatic rollback. A published version is on trial for
    TRIAL_WINDOWS x window_rounds verify rounds: at the end of each window its tau over all its
    rounds so far is compared with its predecessor's over that one's last TRIAL_WINDOWS windows, and
    a shortfall of more than rollback_margin rolls it back. (Judging each rolling window instead
    rolled back versions that were better overall: one window in a long stream falls 10% short by
    chance alone; BENCHMARKS.md.)"""

    TRIAL_WINDOWS = 4

    def __init__(self, window_rounds: int, rollback_margin: float):
        self.window_rounds, self.rollback_margin = window_rounds, rollback_margin
        self.serving = 0
        self.history: list[dict] = [{"version": 0, "time": time.time(), "event": "original", "rounds_trained": 0,
                                     "shadow": None}]
        self.live: dict[int, deque] = {0: self._deque()}  # each version's latest rounds (tokens per round)
        self.totals: dict[int, list] = {0: [0, 0, 0]}  # version -> [rounds, tokens, drafts verified]
        self.predecessor: Optional[int] = None
        self.baseline: Optional[float] = None  # the predecessor's live tau when this version was published
        self.trial: Optional[list] = None  # [rounds, tokens, windows judged] of the version on trial
        self.events: list[dict] = []  # publishes and rollbacks: {time, step, event, from, to}
        self.pinned = False  # a manual rollback holds its version: nothing publishes until resumed

    def _deque(self) -> deque:
        return deque(maxlen=self.TRIAL_WINDOWS * self.window_rounds)

    def pin(self) -> None:
        """Hold the serving version (a manual rollback): nothing publishes, and it is not on trial."""
        self.pinned, self.trial = True, None

    def live_tau(self, version: int) -> Optional[float]:
        w = self.live.get(version)
        return sum(w) / len(w) if w else None

    def observe(self, tokens_per_round, drafts_per_round=None) -> Optional[int]:
        """Verify rounds of the serving version (tokens each produced, drafts each verified). Returns
        the version to roll back to when the version on trial falls short of its predecessor."""
        v = self.serving
        self.live[v].extend(tokens_per_round)
        self.totals[v][0] += len(tokens_per_round)
        self.totals[v][1] += sum(tokens_per_round)
        self.totals[v][2] += sum(drafts_per_round) if drafts_per_round is not None else 0
        if self.trial is None:
            return None
        self.trial[0] += len(tokens_per_round)
        self.trial[1] += sum(tokens_per_round)
        windows = self.trial[0] // self.window_rounds
        if windows <= self.trial[2]:
            return None
        self.trial[2] = windows
        if self.trial[1] / self.trial[0] < self.baseline * (1 - self.rollback_margin):
            return self.predecessor
        if windows >= self.TRIAL_WINDOWS:  # passed: it serves on as any version does
            self.trial = None
            for h in self.history:
                if h["version"] == v and h.get("event") == "published":
                    h["trial"] = "passed"
        return None

    def switch(self, version: int, event: str, step: int, meta: Optional[dict] = None) -> None:
        old = self.serving
        if event == "publish":
            self.predecessor = old
            enough = len(self.live[old]) >= self.window_rounds
            self.baseline = self.live_tau(old) if enough else None
            self.trial = [0, 0, 0] if enough else None  # without a baseline there is nothing to judge against
            self.history.append({"version": version, "time": time.time(), "event": "published",
                                 "predecessor_live_tau": None if self.baseline is None else round(self.baseline, 4),
                                 **(meta or {})})
        else:  # a rollback: the version rolled back to is not on trial
            self.predecessor, self.baseline, self.trial = None, None, None
            for h in self.history:
                if h["version"] == old and h.get("event") == "published":
                    h["rolled_back"] = event
        self.serving = version
        self.live.setdefault(version, self._deque())
        self.totals.setdefault(version, [0, 0, 0])
        self.events.append({"time": time.time(), "monotonic": time.monotonic(), "step": step, "event": event,
                            "from": old, "to": version})

    def status(self) -> dict:
        hist = []
        for h in self.history:
            v = h["version"]
            rounds, tokens, drafts = self.totals.get(v, [0, 0, 0])
            hist.append({**h, "live_rounds": rounds, "live_tau": round(tokens / rounds, 4) if rounds else None,
                         "live_acceptance": round((tokens - rounds) / drafts, 4) if drafts else None})
        tau = self.live_tau(self.serving)
        return {"serving_version": self.serving, "pinned": self.pinned, "predecessor": self.predecessor,
                "predecessor_live_tau": None if self.baseline is None else round(self.baseline, 4),
                "on_trial_rounds": None if self.trial is None else self.trial[0],
                "live_tau": None if tau is None else round(tau, 4), "history": hist, "events": self.events[-50:]}
