"""Online calibration of the DSpark drafter, the trainer and serving side (the data side, from the
recorded rounds to the losses and shadow scores, is `calibration.py`):
- `Calibrator` (on its own device: a Ray actor, or a thread in process) distils a copy of the
  drafter on the `ReplayBuffer` with DeepSpeed, scores the candidate against the serving version
  on held-back sequences (`shadow_scores`) and offers it (`Candidate`) when it wins by a margin;
- `CalibrationLoop` runs its updates on a low-priority thread, at most one per interval;
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

from parallel.state import init_world_of_one

from .calibration import (ROUNDS_PER_SEQUENCE, ReplayBuffer, SequenceSample, collate, forward, group_rounds,
                          round_losses, shadow_scores)
from .dspark_model import DSparkConfig, DSparkDrafter, load_drafter, target_tables

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------- calibrator

@dataclass
class Candidate:
    """A calibrated version offered for publishing: its trained weights (not the target's tables)."""

    version: int
    state: dict
    meta: dict  # rounds_trained, steps, shadow (candidate's scores), serving_shadow, time


class Calibrator:
    """Distils a copy of the drafter on the replay buffer (DeepSpeed: optimiser step and states),
    one update of `steps_per_update` steps at a time, and keeps a candidate that wins the shadow
    evaluation for the engine to publish. Thread-safe: `add` and `status` may come from other
    threads than `update`."""

    def __init__(self, cfg, target_spec, device="cpu", seed: int = 0, first_version: int = 1):
        sp = cfg.speculative
        self.cc = sp.calibration
        self.device = torch.device(device)
        embed, lm_head = target_tables(cfg.model.path, target_spec)
        served = load_drafter(sp.draft_model, embed, lm_head, self.device)
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
        self.inbox_dropped = 0  # sequences refused while the inbox held buffer_bytes (training kept it from draining)
        self.nonfinite_steps = 0  # optimiser steps skipped for a loss that was not finite
        self._rng = random.Random(seed)
        self._engine = None  # DeepSpeed's, made at the first update (importing DeepSpeed takes seconds)
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
        with self._inbox_lock:
            samples, self._inbox, self._inbox_bytes = self._inbox, [], 0
        for s in samples:
            prepared = self.buffer.prepare(s, self.vocab_size)  # the filtering, outside the lock
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
        versions the engine may still roll back to (the others are dropped here too)."""
        with self._lock:
            self._offered = None
            if version not in self.versions:
                raise KeyError(f"drafter version {version} is not held by the calibrator ({sorted(self.versions)})")
            if version != self.serving:
                self.serving = version
                self.model.load_trained(self.versions[version])
                self.model.train()
                self.pending = None  # made from another base
            if keep is not None:
                for v in [v for v in self.versions if v not in set(keep) | {0, version}]:
                    self.versions.pop(v)

    def take_candidate(self) -> Optional[Candidate]:
        with self._lock:
            c, self.pending = self.pending, None
            if c is not None:
                self._offered, self._offered_t = c.version, time.monotonic()
            return c

    # ---- training -----------------------------------------------------------------------------
    def _deepspeed(self):
        if self._engine is None:
            os.environ.setdefault("DS_ACCELERATOR", "cuda" if self.device.type == "cuda" else "cpu")
            os.environ.setdefault("LOCAL_RANK", "0")  # what a DeepSpeed launcher would set
            import deepspeed

            # DeepSpeed wants a process group: the calibrator is a world of one (no port: an in-memory store)
            init_world_of_one(self.device)
            deepspeed.init_distributed(auto_mpi_discovery=False)  # wraps the group that exists
            ds_cfg = {
                "train_micro_batch_size_per_gpu": self.cc.batch_rounds, "gradient_accumulation_steps": 1,
                "gradient_clipping": 1.0, "steps_per_print": 10**9,
                "optimizer": {"type": "AdamW", "params": {"lr": self.cc.learning_rate, "betas": [0.9, 0.95],
                                                          "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True}},
                "zero_optimization": {"stage": 0},
            }
            self._engine, _, _, _ = deepspeed.initialize(model=self.model, model_parameters=list(self.model.parameters()),
                                                         config=ds_cfg)
        return self._engine

    def update(self) -> dict:
        """One update: train, score against the serving version on the held-back rounds, and keep
        the result as the pending candidate if it wins by `margin` (else go back to the serving
        weights when it lost). Returns the update's record."""
        t0, start = time.perf_counter(), time.monotonic()
        self.take_inbox()
        with self._lock:
            train = self.buffer.rounds(held_out=False)
            hold = self.buffer.rounds(held_out=True)
            self._rounds_at_update = self.buffer.total_kept
            serving_state = self.versions[self.serving]
            base_version = self.serving
        if not train or not hold:
            return {"skipped": "no training or held-back rounds yet"}
        engine = self._deepspeed()
        S = self.c.block_size
        by_seq = group_rounds(train, 10**9)  # every sequence with all its training rounds
        n_seq = max(1, self.cc.batch_rounds // ROUNDS_PER_SEQUENCE)
        metrics = {}
        for _ in range(self.cc.steps_per_update):
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
        self.model.load_trained(self.model.state_dict())  # drop the cached Markov factors
        try:
            cand = shadow_scores(self.model, hold, S, self.device)
            serve = shadow_scores(_scratch_model(self, serving_state), hold, S, self.device)
        finally:
            self.model.train()
        wins = cand["tau"] >= serve["tau"] * (1 + self.cc.margin) and cand["match"] >= serve["match"] * (1 - self.cc.margin)
        record = {"update": self.updates, "time": time.time(), "base_version": base_version,
                  "train_rounds": len(train), "holdout_rounds": len(hold), "steps": self.cc.steps_per_update,
                  "loss": round(float(loss.detach()), 4), "nonfinite_steps": self.nonfinite_steps, **{k: round(v, 4) for k, v in metrics.items()},
                  "shadow": _round(cand), "serving_shadow": _round(serve), "seconds": round(time.perf_counter() - t0, 2),
                  # monotonic clock (one per machine): which serving steps ran while this update trained
                  "t_start": start, "t_end": time.monotonic()}
        with self._lock:
            if self.serving != base_version:  # rolled back meanwhile: this update no longer applies
                record["outcome"] = "discarded (the serving version changed)"
                self.model.load_trained(self.versions[self.serving])
            elif wins:
                v = self.next_version
                self.next_version += 1
                self.rounds_trained += len(train)
                state = _cpu_state(self.model)
                self.versions[v] = state
                self.pending = Candidate(v, state, {"version": v, "rounds_trained": self.rounds_trained,
                                                    "shadow": record["shadow"], "serving_shadow": record["serving_shadow"],
                                                    "time": time.time(), "base_version": base_version})
                record["outcome"] = f"candidate version {v}"
            elif cand["tau"] < serve["tau"] or cand["match"] < serve["match"] * (1 - self.cc.margin):
                record["outcome"] = "rejected: worse than the serving version; back to its weights"
                self.model.load_trained(serving_state)
            else:
                record["outcome"] = "not yet better by the margin; training goes on"
            self.model.train()
            self.history.append(record)
            del self.history[:-500]
        log.info("drafter calibration update %d: %s (shadow tau %.3f vs serving %.3f)", self.updates,
                 record["outcome"], cand["tau"], serve["tau"])
        return record

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
                    "last_updates": self.history[-5:], "last_error": self.last_error}


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
            try:
                self.calibrator.take_inbox()  # filtering and storing at this thread's low priority
                if time.monotonic() - last < self.interval_s or not self.calibrator.ready():
                    continue
                self.calibrator.update()
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
