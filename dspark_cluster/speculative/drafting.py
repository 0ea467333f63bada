"""The engine's view of the drafter: propose for the rows that speculate, and never let a drafter
failure cost a request.

The drafter runs in a drafter group chosen by name like the executor: `local`, in this process
(`LocalDrafterGroup`, here), or `ray`, actors with their own process group, tensor-parallel by
`speculative.draft_tensor` (`actors.drafter_group.RayDrafterGroup`). A group has:

    names: tuple | None             actors the target's workers send DSpark context rows to (None: in
                                    process, the engine hands them to ingest())
    restartable: bool               a lost group is replaced in the background
    calibrator                      online calibration's trainer (or None)
    propose(requests, version)      proposals, with the drafter version every rank serves from this call on
    prefill_async(requests)         start prompt prefill beside the target's step (in process: lazily)
    ingest(rows)                    in process: the target's exported context rows
    free(seq_ids, reasons)          reasons: seq_id -> finish reason (online calibration), or None
    poll_candidate(keep)            online calibration, never blocking: (version, meta) once a calibrated
                                    version is staged on every drafter, else None
    drop_candidate(retry_after_s)   forget a candidate that failed to stage
    set_serving(version, available) tell the calibrator which version serves and which are held
    calibrator_status() -> dict | None
    calibrator_heartbeat() -> dict | None   the calibrator's heartbeat (heartbeat.py), never waiting
    device_reports(), comm_stats(), shutdown()

Draft requests are incremental: `Drafter` (the engine's side) remembers how many of each sequence's
tokens the serving group has been sent and sends only the rest (`DraftRequest.start`); the group
keeps the sequences (`proposers.SequenceHistory`). A group that takes over (a restart) holds none,
so each sequence goes to it whole once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Optional

from ..errors import RequestError
from ..backends import backend
from ..heartbeat import Heartbeat, snapshot, stalled_reasons
from .calibrator import CalibrationLoop, Calibrator, DrafterVersions
from .dspark_model import DSparkConfig
from .proposers import DraftRequest, SequenceHistory, make_proposer
from .records import Proposal

log = logging.getLogger(__name__)

FREE_BATCH = 64  # finished sequences the drafter group is told of at once, at most, while it is not called


class SpecStats:
    """Acceptance by position, verify rounds, accepted length, draft vs verify time."""

    def __init__(self, k: int):
        self.proposed = [0] * max(k, 1)
        self.accepted = [0] * max(k, 1)
        self.confidence = [0.0] * max(k, 1)  # sums of the proposals' raw confidences, by position
        self.rounds = 0
        self.tokens_out = 0  # tokens produced by verify rounds (accepted drafts + 1 each)
        self.draft_time_s = 0.0
        self.verify_time_s = 0.0
        self.failures = 0

    def record(self, num_draft: int, num_accepted: int, confidences=None) -> None:
        self.rounds += 1
        self.tokens_out += num_accepted + 1
        for i in range(num_draft):
            self.proposed[i] += 1
            self.accepted[i] += int(i < num_accepted)
        if confidences is not None:
            for i, c in enumerate(confidences[:num_draft].tolist()):
                self.confidence[i] += c

    def summary(self) -> dict:
        return {
            "verify_rounds": self.rounds,
            "mean_accepted_length": self.tokens_out / self.rounds if self.rounds else float("nan"),
            "acceptance_by_position": [a / p if p else float("nan") for a, p in zip(self.accepted, self.proposed)],
            "mean_confidence_by_position": [c / p if p else float("nan") for c, p in zip(self.confidence, self.proposed)],
            "num_draft_tokens": sum(self.proposed),
            "num_accepted_tokens": sum(self.accepted),
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "drafter_failures": self.failures,
        }


class LocalDrafterGroup:
    """`executor: local`: the proposer in this process (on the target's device), and with online
    calibration the calibrator and its training thread."""

    names = None
    restartable = False

    def __init__(self, cfg, target_spec, device="cpu"):
        self.proposer = make_proposer(cfg, target_spec, device)
        self.history = SequenceHistory()  # each sequence's tokens (requests carry only the new ones)
        self.calibrator = self._loop = None
        cc = cfg.speculative.calibration
        if cc.enabled:
            self.calibrator = Calibrator(cfg, target_spec, device, stall_after_s=cfg.parallel.stall_after_s)
            self._loop = CalibrationLoop(self.calibrator, cc.interval_s)

    def propose(self, requests: list[DraftRequest], version: int = 0) -> list[Proposal]:
        if self.calibrator is not None:
            self.proposer.use(version)  # a publish or rollback takes effect here, at the step boundary
        return self.proposer.propose(self.history.resolve(requests))

    def prefill_async(self, requests: list[DraftRequest]) -> None:
        self.history.resolve(requests)  # nothing to overlap with in process: the prefill happens at the first proposal

    def ingest(self, rows) -> None:
        self.proposer.ingest(rows)

    def free(self, seq_ids, reasons: Optional[dict] = None) -> None:
        self.history.free(seq_ids)
        if self.calibrator is None:
            self.proposer.free(seq_ids)
            return
        self.proposer.free(seq_ids, reasons or {})
        self.calibrator.add(self.proposer.take_samples())

    def poll_candidate(self, keep) -> Optional[tuple]:
        cand = self.calibrator.take_candidate() if self.calibrator is not None else None
        if cand is None:
            return None
        self.proposer.stage(cand.version, cand.state, keep(cand.version))
        return cand.version, cand.meta

    def drop_candidate(self, retry_after_s: float) -> None:
        pass  # staging in process is immediate: nothing is left half-done

    def set_serving(self, version: int, available) -> None:
        if self.calibrator is not None:
            self.calibrator.set_serving(version, available)

    def calibrator_status(self) -> Optional[dict]:
        return None if self.calibrator is None else self.calibrator.status()

    def calibrator_heartbeat(self) -> Optional[dict]:
        return None if self.calibrator is None else self.calibrator.heartbeat.snapshot()

    def device_reports(self) -> list[dict]:
        """One entry with `shares_device`: the drafter's memory is on the target's device."""
        report = self.proposer.memory_report() if hasattr(self.proposer, "memory_report") else {}  # n-gram holds none
        memory = {"drafter_weights": report.get("param_bytes", 0), "drafter_kv": report.get("kv_bytes", 0),
                  "drafter_weights_reordered": report.get("reordered_bytes", 0)}
        if self.calibrator is not None:
            memory["calibrator_state"] = self.calibrator.memory_report()["total"]
        # why the rounds run eager under model.compile auto (their compile failed; the run's compile summary says so)
        return [{"role": "drafter", "shares_device": True, "memory": memory,
                 "compile_error": getattr(self.proposer, "compile_error", None)}]

    def comm_stats(self) -> list[dict]:
        return []

    def shutdown(self) -> None:
        if self._loop is not None:
            self._loop.stop()
        self.proposer = None


class TargetDrafterGroup:
    """`speculative.placement: target`: the drafter runs on the target's driver ranks, inside their
    step (speculative/on_target.py), and drafts for the next step there; the engine reads its proposals
    from the step's output (`Speculation.collect`). This side holds nothing: the workers free a finished
    sequence's state with the step's `free_context`, their memory reports carry the drafter's memory
    (on the target's device), and a lost worker takes its drafter with it (recovery re-runs every
    request, and with it the context)."""

    names = None
    restartable = False
    calibrator = None

    def propose(self, requests, version: int = 0):
        raise RuntimeError("a drafter on the target drafts inside the step (StepInput.propose_k), not on request")

    def prefill_async(self, requests) -> None:
        pass  # the context comes from the target's own prefill, on its device

    def ingest(self, rows) -> None:
        pass  # never exported: the rows stay with the drafter on the target's device

    def free(self, seq_ids, reasons=None) -> None:
        pass  # the workers drop their state with the next step's free_context

    def poll_candidate(self, keep):
        return None

    def drop_candidate(self, retry_after_s: float) -> None:
        pass

    def set_serving(self, version: int, available) -> None:
        pass

    def calibrator_status(self):
        return None

    def calibrator_heartbeat(self):
        return None

    def device_reports(self) -> list[dict]:
        return []  # in the target workers' reports (drafter_weights, drafter_kv)

    def comm_stats(self) -> list[dict]:
        return []

    def shutdown(self) -> None:
        pass


def make_drafter_group(cfg, target_spec, device="cpu", first_version: int = 1, progress=None):
    """The drafter group `parallel.executor` names (a restarted Ray group numbers its calibrated
    versions on from `first_version`; `progress(activity)` follows its start-up), or the target's
    own driver ranks (speculative.placement target)."""
    if cfg.speculative.on_target:
        return TargetDrafterGroup()
    if cfg.parallel.executor == "local":
        return LocalDrafterGroup(cfg, target_spec, device)
    return backend(cfg.parallel.executor).DrafterGroup(cfg, target_spec, first_version=first_version,
                                                       progress=progress)


class Drafter:
    def __init__(self, cfg, target_spec, device="cpu"):
        self.cfg = cfg
        self.target_spec, self.device = target_spec, device
        self.k = cfg.speculative.num_tokens
        self.stats = SpecStats(self.k)
        self.num_restarts = 0
        self._restarted = None  # a drafter group started in the background, not yet serving
        self._restarting: Optional[threading.Thread] = None
        self.restart_beat = Heartbeat("drafter_restart", cfg.parallel.stall_after_s)
        self._closed = False
        self._export_layers = None
        if cfg.speculative.method == "dspark":
            self._export_layers = tuple(DSparkConfig.load(Path(cfg.speculative.draft_model) / "config.json").target_layer_ids)
        # online calibration: versions (engine side); the calibrator is the group's
        cc = cfg.speculative.calibration
        self.versions = DrafterVersions(cc.window_rounds, cc.rollback_margin) if cc.enabled else None
        self.available = {0}  # versions every drafter holds (rollback targets)
        self.backend = make_drafter_group(cfg, target_spec, device)
        # seq_id -> how many of its tokens the serving group was sent: requests carry only the rest
        # (a group that takes over was sent nothing, so each sequence goes to it whole once)
        self.sent: dict[int, int] = {}
        # finished sequences the group is told of with its next call (a step that drafts nothing makes none),
        # or once FREE_BATCH of them wait, or when the engine has nothing left to run
        self._to_free: list[int] = []
        self._free_reasons: dict = {}

    @property
    def alive(self) -> bool:
        return self.backend is not None

    @property
    def calibrator(self):
        """The group's calibrator (in process: the core Calibrator; on Ray: its actor), or None."""
        return None if self.backend is None else self.backend.calibrator

    def export(self) -> Optional[tuple]:
        """(target layers to export, drafter actor names or None in process) while a DSpark drafter
        serves; None otherwise (no export)."""
        if self.cfg.speculative.method != "dspark" or self.backend is None:
            return None
        return self._export_layers, self.backend.names

    def ingest(self, rows) -> None:
        """In process: the target's exported context rows (a Ray drafter group gets them from the
        workers directly)."""
        if self.backend is None:
            return
        try:
            self.backend.ingest(rows)
        except Exception as e:  # noqa: BLE001 - any drafter failure degrades to plain decoding
            self.stats.failures += 1
            log.warning("drafter failed to take context (%s: %s); continuing without speculation",
                        type(e).__name__, e)
            self._drop()

    def poll(self, step: int = 0) -> bool:
        """Between steps: True when a drafter group restarted in the background has just taken over
        (its KV is empty: each sequence's tokens are fed again at its next proposal). With online
        calibration, also moves a calibrated candidate on: staged on every drafter, then published
        (the next proposals use it)."""
        restarted = False
        if self._restarted is not None:
            self.backend, self._restarted = self._restarted, None
            self.sent = {}  # the new group holds no sequence
            self._to_free, self._free_reasons = [], {}
            self.restart_beat.rest("idle")
            log.warning("drafter group restarted (%d); speculation resumes", self.num_restarts)
            restarted = True
            if self.versions is not None:  # the new group holds the original weights only
                self.available = {0}
                if self.versions.serving != 0:
                    self.versions.switch(0, "drafter restart", step)
        if self.versions is not None and self.backend is not None and not self.versions.pinned:
            # (a manual rollback holds its version: the calibrator keeps learning, nothing publishes)
            try:
                got = self.backend.poll_candidate(self._keep)
                if got is not None:
                    self._publish(*got, step)
            except Exception as e:  # noqa: BLE001 -- a calibration failure leaves the serving version as it is
                log.warning("drafter calibration: a candidate could not be published (%s: %s); asking again in 30 s",
                            type(e).__name__, e)
                self.backend.drop_candidate(30.0)  # a calibrator that keeps failing is not asked every second
                self._tell_calibrator(self.versions.serving)
        return restarted

    # ---- online calibration ----------------------------------------------------------------------
    def _keep(self, version: int) -> set:
        """Versions the drafters hold: the original, the serving one, its predecessor (an automatic
        rollback's target) and the newest keep_versions."""
        newest = sorted(v for v in self.available | {version} if v)[-self.cfg.speculative.calibration.keep_versions:]
        return {0, self.versions.serving, *newest} | ({self.versions.predecessor} - {None})

    def _tell_calibrator(self, version: int) -> None:
        """Which version serves now, and which the calibrator must keep (never raises: a calibrator
        failure costs calibration, not serving)."""
        try:
            if self.backend is not None:
                self.backend.set_serving(version, self.available)
        except Exception as e:  # noqa: BLE001
            log.warning("drafter calibration: the calibrator did not take version %d (%s: %s)", version,
                        type(e).__name__, e)

    def _next_version(self) -> int:
        """The first version number a new calibrator may use (a restarted group goes on numbering)."""
        return 1 + max(h["version"] for h in self.versions.history) if self.versions is not None else 1

    def _publish(self, version: int, meta: dict, step: int) -> None:
        self.versions.switch(version, "publish", step, meta)
        self.available = self._keep(version)  # with the new predecessor (the version it replaced)
        self._tell_calibrator(version)
        log.info("drafter version %d published (shadow tau %s)", version, (meta.get("shadow") or {}).get("tau"))

    def observe_rounds(self, tokens_per_round: list, drafts_per_round: list, step: int = 0) -> None:
        """Verify rounds' tokens (accepted + 1) and drafts verified under the serving version: live
        tau and acceptance, and the automatic rollback when a new version does worse than its
        predecessor by the margin."""
        if self.versions is None or not tokens_per_round:
            return
        back = self.versions.observe(tokens_per_round, drafts_per_round)
        if back is not None:
            bad = self.versions.serving
            self.versions.switch(back, "auto rollback", step)
            self._tell_calibrator(back)
            log.warning("drafter version %d rolled back to %d: live tau fell below its predecessor's by more than "
                        "%.0f%%", bad, back, 100 * self.cfg.speculative.calibration.rollback_margin)

    def rollback(self, version: Optional[int] = None, step: int = 0) -> dict:
        """Serve `version` (None: the original weights) from the next step, and hold it: no
        calibrated version publishes until resume(). Raises RequestError when no drafter holds it."""
        if self.versions is None:
            raise RequestError("version: the drafter has no versions; set speculative.calibration.enabled to calibrate it online")
        target = 0 if version is None else version
        if target not in self.available:
            raise RequestError(f"version: got {version}; the drafters hold versions {sorted(self.available)} "
                               "(None: the original weights)")
        if target != self.versions.serving:
            self.versions.switch(target, "manual rollback", step)
            self._tell_calibrator(target)
        self.versions.pin()
        if self.backend is not None:  # a version on its way out to the drafters is not published
            self.backend.drop_candidate(0.0)
        return self.status()

    def resume(self) -> dict:
        """Let calibrated versions publish again after a manual rollback."""
        if self.versions is None:
            raise RequestError("the drafter has no versions; set speculative.calibration.enabled to calibrate it online")
        self.versions.pinned = False
        return self.status()

    def device_reports(self) -> list[dict]:
        """The cost ledger's view of the drafter: the Ray group's devices, or in process one entry
        with `shares_device` (its memory is on the target's device). [] when it cannot say (a group
        restarting): the ledger then misses the drafter's memory, never the run."""
        try:
            return self.backend.device_reports() if self.backend is not None else []
        except Exception as e:  # noqa: BLE001
            log.warning("the drafter's memory could not be read for the cost ledger (%s: %s)", type(e).__name__, e)
            return []

    def heartbeats(self) -> list[dict]:
        """The background parts' heartbeats (heartbeat.py): the restart's, the calibrator's. Constant
        time: the engine's stats() (every /health probe) reads them."""
        beats, group = [self.restart_beat.snapshot()], self.backend  # (the step thread may swap the group)
        try:
            beat = group.calibrator_heartbeat() if group is not None else None
        except Exception as e:  # noqa: BLE001 -- a calibrator that cannot be asked is reported, never raised
            beat = snapshot("calibrator", "unknown", True, 0.0, True, self.cfg.parallel.stall_after_s,
                            f"calibrator: its heartbeat could not be read ({type(e).__name__}: {e})")
        return beats + ([beat] if beat is not None else [])

    def status(self) -> dict:
        """The serving version, the history (version, time, rounds trained on, shadow score, live
        tau), the versions held, the calibrator's buffer and updates, and the background parts'
        heartbeats (`background`; `stalled`: the reasons of those that stopped progressing)."""
        beats = self.heartbeats()
        background = {"background": beats, "stalled": stalled_reasons(beats)}
        if self.versions is None:
            return {"calibration": False, "serving_version": 0, **background}
        out = {"calibration": True, **self.versions.status(), "available_versions": sorted(self.available),
               **background}
        try:
            status = self.backend.calibrator_status() if self.backend is not None else None
            if status is not None:
                out["calibrator"] = status
        except Exception as e:  # noqa: BLE001 -- the status says so rather than failing
            out["calibrator"] = {"error": f"{type(e).__name__}: {e}"}
        return out

    def _restart_in_background(self) -> None:
        """A lost (restartable: Ray) drafter group is replaced off the step's path, up to parallel.max_restarts
        times; meanwhile requests decode without drafts."""
        if self._closed or self.num_restarts >= self.cfg.parallel.max_restarts or (
                self._restarting is not None and self._restarting.is_alive()):
            return
        self.num_restarts += 1
        beat, attempt = self.restart_beat, f"restart {self.num_restarts} of {self.cfg.parallel.max_restarts}"
        beat.beat(f"drafter group {attempt}: starting")

        def start():
            try:
                group = make_drafter_group(self.cfg, self.target_spec, self.device, self._next_version(),
                                           progress=lambda activity: beat.beat(f"drafter group {attempt}: {activity}"))
            except Exception as e:  # noqa: BLE001 -- stays on plain decoding
                beat.rest(f"drafter group {attempt} failed ({type(e).__name__}); decoding without speculation")
                log.warning("drafter group restart failed (%s: %s); continuing without speculation",
                            type(e).__name__, e)
                return
            if self._closed:
                group.shutdown()
            else:
                self._restarted = group
            beat.rest(f"drafter group {attempt}: ready, takes over at the next step")

        self._restarting = threading.Thread(target=start, name="dspark-drafter-restart", daemon=True)
        self._restarting.start()

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """Proposals for every request; on any drafter failure speculation is switched off and
        the rows go on without drafts (the outputs do not change, only the speed)."""
        if self.backend is None or not requests:
            return [Proposal([]) for _ in requests]
        self._flush_free()
        if self.backend is None:
            return [Proposal([]) for _ in requests]
        t0 = time.perf_counter()
        try:
            return self.backend.propose(self._incremental(requests),
                                        self.versions.serving if self.versions is not None else 0)
        except Exception as e:  # noqa: BLE001 - any drafter failure degrades to plain decoding
            self.stats.failures += 1
            log.warning("drafter failed (%s: %s); continuing without speculation", type(e).__name__, e)
            self._drop()
            return [Proposal([]) for _ in requests]
        finally:
            self.stats.draft_time_s += time.perf_counter() - t0

    def prefill_async(self, requests: list[DraftRequest]) -> None:
        """Start the drafter's prompt prefill for sequences the target is prefilling in this step:
        with a drafter actor group it runs concurrently with the target's step. In process there
        is nothing to overlap with, so the prefill happens lazily at the first proposal."""
        if self.backend is not None and requests:
            self._flush_free()
        if self.backend is not None and requests:
            try:
                self.backend.prefill_async(self._incremental(requests))
            except Exception:  # noqa: BLE001
                self._drop()

    def free(self, seq_ids, reasons: Optional[dict] = None, flush: bool = True) -> None:
        """reasons: seq_id -> finish reason (online calibration keeps no rounds of failed or aborted requests).
        flush=False: told to the group with its next call (or once FREE_BATCH wait), not now."""
        for sid in seq_ids:
            self.sent.pop(sid, None)
        if self.backend is None:
            return
        self._to_free += list(seq_ids)
        self._free_reasons.update(reasons or {})
        if flush or len(self._to_free) >= FREE_BATCH:
            self._flush_free()

    def _flush_free(self) -> None:
        ids, reasons = self._to_free, self._free_reasons
        self._to_free, self._free_reasons = [], {}
        if self.backend is not None and ids:
            try:
                self.backend.free(ids, None if self.versions is None else reasons)
            except Exception:  # noqa: BLE001
                self._drop()

    def _incremental(self, requests: list[DraftRequest]) -> list[DraftRequest]:
        """The requests (each with its whole sequence) as the group is sent them: only the tokens
        past those it was sent before (`start` on); a sequence it was not sent, whole (start 0).
        A sequence's tokens only grow (committed tokens never change); one shorter than what was
        sent goes whole again."""
        out = []
        for r in requests:
            n = self.sent.get(r.seq_id, 0) if r.start == 0 else 0
            if n > len(r.token_ids):
                n = 0
            out.append(dataclasses.replace(r, token_ids=r.token_ids[n:], start=n) if n else r)
            self.sent[r.seq_id] = r.start + len(r.token_ids)
        return out

    def fail(self, message: str) -> None:
        """A drafter failure reported from elsewhere (the drafter on the target, in a step's output): drop
        the group, as a failed call does; requests go on without drafts."""
        self.stats.failures += 1
        log.warning("%s; continuing without speculation", message)
        self._drop()

    def _drop(self) -> None:
        self.sent = {}
        self._to_free, self._free_reasons = [], {}
        backend, self.backend = self.backend, None
        if backend is None:
            return
        with contextlib.suppress(Exception):
            backend.shutdown()
        if backend.restartable:
            self._restart_in_background()

    def shutdown(self) -> None:
        self._closed = True
        self._drop()
        if self._restarting is not None:
            self._restarting.join(timeout=60)
        restarted, self._restarted = self._restarted, None
        if restarted is not None:
            restarted.shutdown()
