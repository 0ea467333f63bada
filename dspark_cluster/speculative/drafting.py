"""The engine's view of the drafter: propose for the rows that speculate, and never let a drafter
failure cost a request. In process (executor local) or a Ray actor group (executor ray), whose
actors form their own process group, tensor-parallel by `speculative.draft_tensor`."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from typing import Optional

from ..cost import device_kind
from ..errors import ConfigError, DSparkError
from .calibration import CalibrationLoop, Calibrator, DrafterVersions
from .proposers import DraftRequest, make_proposer
from .spec_decode import Proposal

log = logging.getLogger(__name__)


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


def check_drafter_resources(cfg, ray) -> str:
    """Refuse a drafter group the Ray cluster cannot host beside the target's world (ConfigError,
    raised before any drafter starts). Returns the drafters' device kind ("cuda" or "cpu")."""
    sp, world = cfg.speculative, cfg.parallel.world_size
    tp = sp.draft_tensor
    n = sp.draft_workers + int(sp.calibration.enabled)  # online calibration: the calibrator's own device
    total = ray.cluster_resources()
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    gpus = total.get("GPU", 0)
    # drafters get GPUs only when there are enough for the target's world and all of them
    device = "cuda" if cfg.parallel.device in ("auto", "cuda") and gpus >= world + n else "cpu"
    target_device = cfg.parallel.device if cfg.parallel.device != "auto" else ("cuda" if gpus >= world else "cpu")
    key = "GPU" if device == "cuda" else "CPU"
    # the target's workers hold these already (each also takes a CPU when it has a GPU)
    beside = world if target_device == device or key == "CPU" else 0
    have = int(total.get(key, 0))
    if have < n + beside:
        raise ConfigError(
            f"speculative.draft_workers: got {sp.draft_workers}; the drafters (and a calibrator with "
            f"speculative.calibration.enabled) need {n} {key} devices beside the target's {beside}, but the Ray "
            f"cluster has {have}; lower speculative.draft_workers, turn calibration off or add nodes"
        )
    if max((int(node.get(key, 0)) for node in nodes), default=0) < tp:
        raise ConfigError(
            f"speculative.draft_tensor: got {tp}; no node has {tp} {key} devices to keep a drafter TP group "
            "on one node; lower speculative.draft_tensor or add larger nodes"
        )
    return device


class RayDrafterGroup:
    """`draft_workers` Drafter actors, each on its own device with its own KV, in a torch.distributed
    world of their own: `draft_workers / draft_tensor` tensor-parallel groups of `draft_tensor`
    consecutive ranks, each group kept on one node by a STRICT_PACK placement group. Sequences are
    split among the groups by id; every rank of a group gets the same calls (SPMD) and the group's
    proposals are its TP rank 0's."""

    def __init__(self, cfg, timeout_s: float = 30.0, startup_timeout_s: float = 300.0, first_version: int = 1):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from actors.drafter import Drafter

        self._ray, self._remove_pg = ray, remove_placement_group
        self.timeout_s = timeout_s
        n, tp = cfg.speculative.draft_workers, cfg.speculative.draft_tensor
        self.actors, self.placement_groups, self.groups, self.reports, self.names = [], [], [], [], []
        self.calibrator = None
        device = check_drafter_resources(cfg, ray)
        bundle = {"GPU": 1} if device == "cuda" else {"CPU": 1}
        threads = cfg.parallel.threads_per_worker or 1
        cls = ray.remote(Drafter)
        tag = uuid.uuid4().hex[:8]
        try:
            for _ in range(n // tp):  # one at a time, so that shutdown() removes every one made
                self.placement_groups.append(placement_group([dict(bundle)] * tp, strategy="STRICT_PACK"))
            placed, _ = ray.wait([pg.ready() for pg in self.placement_groups], num_returns=n // tp, timeout=120)
            if len(placed) < n // tp:
                key = "speculative.draft_tensor" if tp > 1 else "speculative.draft_workers"
                raise ConfigError(
                    f"{key}: got {tp if tp > 1 else n}; Ray could not place {n // tp} group(s) of {tp} {device} "
                    "drafter(s), each group on one node, beside the target's workers within 120 s (too few free "
                    "devices, or other jobs hold them); lower speculative.draft_workers / speculative.draft_tensor "
                    "or add nodes"
                )
            self.names = [f"dspark-drafter-{tag}-{rank}" for rank in range(n)]
            calibrator_name = None
            if cfg.speculative.calibration.enabled:  # the drafter group's trainer, on a device of its own
                from actors.calibrator import Calibrator

                calibrator_name = f"dspark-calibrator-{tag}"
                gpus = ray.cluster_resources().get("GPU", 0)
                cal_device = "cuda" if device == "cuda" and gpus >= cfg.parallel.world_size + n + 1 else "cpu"
                self.calibrator_device = cal_device
                self.calibrator = ray.remote(Calibrator).options(
                    name=calibrator_name, max_concurrency=4, num_cpus=1 if cal_device == "cpu" else 0,
                    num_gpus=1 if cal_device == "cuda" else 0).remote(cfg.to_dict(), cal_device, threads, first_version)
            # a DSpark drafter also takes context rows from the target's workers while a proposal waits for them
            concurrency = 2 if cfg.speculative.method == "dspark" else 1
            for rank in range(n):
                self.actors.append(cls.options(
                    name=self.names[rank], max_concurrency=concurrency,
                    num_cpus=1 if device == "cpu" else 0,
                    num_gpus=1 if device == "cuda" else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_groups[rank // tp], placement_group_bundle_index=rank % tp),
                ).remote(cfg.to_dict(), device, threads, rank, n, calibrator_name))
            self.groups = [self.actors[g * tp : (g + 1) * tp] for g in range(n // tp)]
            self._versions = [0] * len(self.groups)  # the drafter version each group serves
            # the drafters' own rendezvous, on drafter rank 0's node (the target's world has another)
            addr, port = self._gather([self.actors[0].node_address.remote()], startup_timeout_s)[0]
            self.reports = self._gather([a.setup.remote(addr, port) for a in self.actors], startup_timeout_s)
            if self.calibrator is not None:
                try:
                    self._gather([self.calibrator.ready.remote()], startup_timeout_s)
                except Exception as e:  # noqa: BLE001 -- the drafters serve without it (the original weights)
                    log.warning("drafter calibration off: the calibrator did not start (%s: %s)", type(e).__name__, e)
                    with contextlib.suppress(Exception):
                        ray.kill(self.calibrator, no_restart=True)
                    self.calibrator = None
        except BaseException:
            self.shutdown()
            raise

    def _gather(self, refs, timeout_s: float) -> list:
        """ray.get of every ref, but raising as soon as any one fails: a dead rank would otherwise
        leave its group's other ranks waiting in a collective until the timeout. A drafter's own
        error (ConfigError, CheckpointError, ...) is raised as itself."""
        from ray.exceptions import RayTaskError

        ray = self._ray
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the drafter group did not answer within {timeout_s:.0f} s")
                ready, pending = ray.wait(pending, num_returns=1, timeout=left)
                ray.get(ready)
            return ray.get(refs)
        except RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, DSparkError):
                raise cause from None
            raise

    def _split(self, items, key):
        """items of each TP group, by sequence id (every rank of a group gets the same ones)."""
        parts = [[] for _ in self.groups]
        for item in items:
            parts[key(item) % len(self.groups)].append(item)
        return parts

    def propose(self, requests: list[DraftRequest], version: int = 0) -> list[Proposal]:
        """version: the drafter version every rank serves with from this call on (a publish or a
        rollback takes effect for the whole group at the same step)."""
        ray = self._ray
        refs, leaders = [], []
        for g, (group, part) in enumerate(zip(self.groups, self._split(requests, lambda r: r.seq_id))):
            if part:
                arg = ray.put(part)  # serialised once for the whole group
                group_refs = [a.propose.remote(arg, version) for a in group]
                leaders.append((part, group_refs[0]))
                refs += group_refs
            elif self._versions[g] != version:  # a new version reaches every group at the same step
                refs += [a.propose.remote([], version) for a in group]
            self._versions[g] = version
        # every rank's answer is awaited, not only rank 0's, so that a failed rank is seen at once
        self._gather(refs, self.timeout_s)
        by_id = {}
        for part, ref in leaders:
            for r, prop in zip(part, ray.get(ref)):
                by_id[r.seq_id] = prop
        return [by_id[r.seq_id] for r in requests]

    def prefill_async(self, requests: list[DraftRequest]) -> None:
        """Fire and forget: each actor handles its calls in order, so the next propose() sees it."""
        for group, part in zip(self.groups, self._split(requests, lambda r: r.seq_id)):
            if part:
                arg = self._ray.put(part)
                for a in group:
                    a.prefill.remote(arg)

    def free(self, seq_ids, reasons=None) -> None:
        for group, part in zip(self.groups, self._split(seq_ids, lambda s: s)):
            if part:
                why = None if reasons is None else {sid: reasons.get(sid) for sid in part}
                for a in group:
                    a.free.remote(part, why)

    def stage(self, version: int, state_ref, keep) -> list:
        """Send a version's weights (one object, fetched by every drafter) to be held; the refs
        are ready when every drafter holds it."""
        return [a.stage.remote(version, state_ref, tuple(keep)) for a in self.actors]

    def comm_stats(self) -> list[dict]:
        return self._gather([a.comm_stats.remote() for a in self.actors], self.timeout_s)

    def device_reports(self) -> list[dict]:
        """The cost ledger's devices: each drafter actor (its weights and KV now, the DSpark context's
        peak) and the calibrator (its drafter copies, optimiser state, versions and replay buffer)."""
        out = [{"role": "drafter", "rank": r["rank"], "kind": device_kind(r["device"]),
                "memory": {"drafter_weights": r.get("param_bytes", 0), "drafter_kv": r.get("kv_bytes", 0)}}
               for r in self._gather([a.report.remote() for a in self.actors], self.timeout_s)]
        if self.calibrator is not None:
            m = self._gather([self.calibrator.memory_report.remote()], self.timeout_s)[0]
            out.append({"role": "calibrator", "rank": 0, "kind": device_kind(self.calibrator_device),
                        "memory": {"calibrator_state": m["total"]}})
        return out

    def shutdown(self) -> None:
        if self.calibrator is not None:
            with contextlib.suppress(Exception):
                self._ray.kill(self.calibrator, no_restart=True)
            self.calibrator = None
        for a in self.actors:
            with contextlib.suppress(Exception):  # already dead
                self._ray.kill(a, no_restart=True)
        for pg in self.placement_groups:
            with contextlib.suppress(Exception):
                self._remove_pg(pg)
        self.actors, self.groups, self.placement_groups = [], [], []


class Drafter:
    def __init__(self, cfg, target_spec, device="cpu"):
        self.cfg = cfg
        self.k = cfg.speculative.num_tokens
        self.stats = SpecStats(self.k)
        self.num_restarts = 0
        self._restarted = None  # a drafter group started in the background, not yet serving
        self._restarting: Optional[threading.Thread] = None
        self._closed = False
        self._export_layers = None
        if cfg.speculative.method == "dspark":
            from pathlib import Path

            from .dspark_model import DSparkConfig

            self._export_layers = tuple(DSparkConfig.load(Path(cfg.speculative.draft_model) / "config.json").target_layer_ids)
        # online calibration: versions (engine side); in process also the calibrator and its thread
        cc = cfg.speculative.calibration
        self.versions = DrafterVersions(cc.window_rounds, cc.rollback_margin) if cc.enabled else None
        self.available = {0}  # versions every drafter holds (rollback targets)
        self.calibrator = self._loop = None
        self._cand_ref, self._cand_t, self._staging = None, 0.0, None
        if cfg.parallel.executor == "ray":
            self.backend = RayDrafterGroup(cfg)
        else:
            self.backend = make_proposer(cfg, target_spec, device)
            if cc.enabled:
                self.calibrator = Calibrator(cfg, target_spec, device)
                self._loop = CalibrationLoop(self.calibrator, cc.interval_s)

    @property
    def alive(self) -> bool:
        return self.backend is not None

    def export(self) -> Optional[tuple]:
        """(target layers to export, drafter actor names or None in process) while a DSpark drafter
        serves; None otherwise (no export)."""
        if self.cfg.speculative.method != "dspark" or self.backend is None:
            return None
        names = tuple(self.backend.names) if isinstance(self.backend, RayDrafterGroup) else None
        return self._export_layers, names

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
            log.warning("drafter group restarted (%d); speculation resumes", self.num_restarts)
            restarted = True
            if self.versions is not None:  # the new group holds the original weights only
                self._cand_ref = self._staging = None
                self.available = {0}
                if self.versions.serving != 0:
                    self.versions.switch(0, "drafter restart", step)
        if self.versions is not None and self.backend is not None:
            try:
                self._calibration_poll(step)
            except Exception as e:  # noqa: BLE001 -- a calibration failure leaves the serving version as it is
                log.warning("drafter calibration: a candidate could not be published (%s: %s); asking again in 30 s",
                            type(e).__name__, e)
                self._staging = self._cand_ref = None
                self._cand_t = time.monotonic() + 30.0  # a calibrator that keeps failing is not asked every second
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
            if self.calibrator is not None:
                self.calibrator.set_serving(version, self.available)
            elif isinstance(self.backend, RayDrafterGroup) and self.backend.calibrator is not None:
                self.backend.calibrator.set_serving.remote(version, tuple(self.available))
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

    def _calibration_poll(self, step: int) -> None:
        if self.versions.pinned:  # a manual rollback holds its version (the calibrator keeps learning)
            return
        if self.calibrator is not None:  # in process
            cand = self.calibrator.take_candidate()
            if cand is not None:
                self.backend.stage(cand.version, cand.state, self._keep(cand.version))
                self._publish(cand.version, cand.meta, step)
            return
        group = self.backend
        if not isinstance(group, RayDrafterGroup) or group.calibrator is None:
            return
        ray = group._ray
        if self._staging is not None:  # every drafter fetching the weights, off the step's path
            version, meta, refs, t0 = self._staging
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) == len(refs):
                ray.get(refs)  # raises if a drafter could not stage it
                self._staging = None
                self._publish(version, meta, step)
            elif time.monotonic() - t0 > group.timeout_s:
                raise TimeoutError(f"drafters did not stage version {version} within {group.timeout_s:.0f} s")
            return
        if self._cand_ref is None:
            if time.monotonic() - self._cand_t >= 1.0:  # ask the calibrator at most once a second
                self._cand_t = time.monotonic()
                self._cand_ref = group.calibrator.take_candidate.remote()
            return
        ready, _ = ray.wait([self._cand_ref], timeout=0)
        if not ready:
            return
        ref, self._cand_ref = self._cand_ref, None
        got = ray.get(ref)
        if got is not None:
            version, meta, state_ref = got
            self._staging = (version, meta, group.stage(version, state_ref, self._keep(version)), time.monotonic())

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
        from ..errors import RequestError

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
        if self._staging is not None:  # a version on its way out to the drafters is not published
            self._staging = None
        return self.status()

    def resume(self) -> dict:
        """Let calibrated versions publish again after a manual rollback."""
        from ..errors import RequestError

        if self.versions is None:
            raise RequestError("the drafter has no versions; set speculative.calibration.enabled to calibrate it online")
        self.versions.pinned = False
        return self.status()

    def device_reports(self) -> list[dict]:
        """The cost ledger's view of the drafter: the Ray group's devices, or in process one entry
        with `shares_device` (its memory is on the target's device). [] when it cannot say (a group
        restarting): the ledger then misses the drafter's memory, never the run."""
        try:
            if isinstance(self.backend, RayDrafterGroup):
                return self.backend.device_reports()
            report = self.backend.memory_report() if hasattr(self.backend, "memory_report") else {}
            memory = {"drafter_weights": report.get("param_bytes", 0), "drafter_kv": report.get("kv_bytes", 0)}
            if self.calibrator is not None:
                memory["calibrator_state"] = self.calibrator.memory_report()["total"]
            return [{"role": "drafter", "shares_device": True, "memory": memory}]
        except Exception as e:  # noqa: BLE001
            log.warning("the drafter's memory could not be read for the cost ledger (%s: %s)", type(e).__name__, e)
            return []

    def status(self) -> dict:
        """The serving version, the history (version, time, rounds trained on, shadow score, live
        tau), the versions held, and the calibrator's buffer and updates."""
        if self.versions is None:
            return {"calibration": False, "serving_version": 0}
        out = {"calibration": True, **self.versions.status(), "available_versions": sorted(self.available)}
        try:
            if self.calibrator is not None:
                out["calibrator"] = self.calibrator.status()
            elif isinstance(self.backend, RayDrafterGroup) and self.backend.calibrator is not None:
                out["calibrator"] = self.backend._ray.get(self.backend.calibrator.status.remote(), timeout=10)
        except Exception as e:  # noqa: BLE001 -- the status says so rather than failing
            out["calibrator"] = {"error": f"{type(e).__name__}: {e}"}
        return out

    def _restart_in_background(self) -> None:
        """A lost Ray drafter group is replaced off the step's path, up to parallel.max_restarts
        times; meanwhile requests decode without drafts."""
        if self._closed or self.num_restarts >= self.cfg.parallel.max_restarts or (
                self._restarting is not None and self._restarting.is_alive()):
            return
        self.num_restarts += 1

        def start():
            try:
                group = RayDrafterGroup(self.cfg, first_version=self._next_version())
            except Exception as e:  # noqa: BLE001 -- stays on plain decoding
                log.warning("drafter group restart failed (%s: %s); continuing without speculation",
                            type(e).__name__, e)
                return
            if self._closed:
                group.shutdown()
            else:
                self._restarted = group

        self._restarting = threading.Thread(target=start, name="dspark-drafter-restart", daemon=True)
        self._restarting.start()

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """Proposals for every request; on any drafter failure speculation is switched off and
        the rows go on without drafts (the outputs do not change, only the speed)."""
        if self.backend is None or not requests:
            return [Proposal([]) for _ in requests]
        t0 = time.perf_counter()
        try:
            if self.versions is None:
                return self.backend.propose(requests)
            if isinstance(self.backend, RayDrafterGroup):
                return self.backend.propose(requests, self.versions.serving)
            self.backend.use(self.versions.serving)  # in process: switch here, at the step boundary
            return self.backend.propose(requests)
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
        if isinstance(self.backend, RayDrafterGroup) and requests:
            try:
                self.backend.prefill_async(requests)
            except Exception:  # noqa: BLE001
                self._drop()

    def free(self, seq_ids, reasons: Optional[dict] = None) -> None:
        """reasons: seq_id -> finish reason (online calibration keeps no rounds of failed or aborted requests)."""
        if self.backend is not None and seq_ids:
            try:
                if self.versions is None:
                    self.backend.free(seq_ids)
                    return
                self.backend.free(seq_ids, reasons or {})
                if self.calibrator is not None:  # in process (drafter actors send theirs to the calibrator actor)
                    self.calibrator.add(self.backend.take_samples())
            except Exception:  # noqa: BLE001
                self._drop()

    def _drop(self) -> None:
        backend, self.backend = self.backend, None
        if hasattr(backend, "shutdown"):
            try:
                backend.shutdown()
            except Exception:  # noqa: BLE001
                pass
        if isinstance(backend, RayDrafterGroup):
            self._restart_in_background()

    def shutdown(self) -> None:
        self._closed = True
        if self._loop is not None:
            self._loop.stop()
        self._drop()
        if self._restarting is not None:
            self._restarting.join(timeout=60)
        restarted, self._restarted = self._restarted, None
        if restarted is not None:
            restarted.shutdown()
