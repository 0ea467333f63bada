"""The `ray` drafter group: Drafter actors with their own torch.distributed world, and the
calibrator actor beside them (online calibration)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid

import ray
from ray.exceptions import RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dspark_cluster.cost import device_kind
from dspark_cluster.errors import ConfigError
from dspark_cluster.heartbeat import snapshot
from dspark_cluster.speculative.drafter_config import DrafterConfig
from dspark_cluster.speculative.proposers import DraftRequest
from dspark_cluster.speculative.records import Proposal

from .calibrator import Calibrator
from .calls import unwrap
from .drafter import Drafter
from .placement_groups import placement_group_name

log = logging.getLogger(__name__)


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
    """The `ray` drafter group (the interface is in dspark_cluster.speculative.drafting).
    `draft_workers` Drafter actors, each on its own device with its own KV, in a torch.distributed
    world of their own: `draft_workers / draft_tensor` tensor-parallel groups of `draft_tensor`
    consecutive ranks, each group kept on one node by a STRICT_PACK placement group. Sequences are
    split among the groups by id; every rank of a group gets the same calls (SPMD) and the group's
    proposals are its TP rank 0's."""

    restartable = True

    def __init__(self, cfg, target_spec, timeout_s: float = 30.0, startup_timeout_s: float = 300.0,
                 first_version: int = 1, progress=None):
        """progress(activity): called as the start-up moves on (a restart's heartbeat), or None."""
        self._ray, self._remove_pg = ray, remove_placement_group
        self.timeout_s = timeout_s
        self.stall_after_s = cfg.parallel.stall_after_s
        progress = progress or (lambda activity: None)
        # the calibrator's heartbeat as last answered (asked at most once a second, never waited for)
        self._beat_lock = threading.Lock()
        self._beat, self._beat_t, self._beat_ref, self._beat_asked = None, 0.0, None, 0.0
        self._cand_ref, self._cand_t, self._staging = None, 0.0, None  # online calibration: a candidate on its way
        n, tp = cfg.speculative.draft_workers, cfg.speculative.draft_tensor
        self.actors, self.placement_groups, self.groups, self.reports, self.names = [], [], [], [], []
        self.calibrator = None
        device = check_drafter_resources(cfg, ray)
        narrow = DrafterConfig.of(cfg, target_spec)  # what the actors need, validated here once
        bundle = {"GPU": 1} if device == "cuda" else {"CPU": 1}
        threads = cfg.parallel.threads_per_worker or 1
        cls = ray.remote(Drafter)
        tag = uuid.uuid4().hex[:8]
        try:
            progress(f"placing {n // tp} drafter group(s) of {tp} {device} device(s)")
            for _ in range(n // tp):  # one at a time, so that shutdown() removes every one made
                self.placement_groups.append(placement_group([dict(bundle)] * tp, strategy="STRICT_PACK",
                                                             name=placement_group_name("drafter")))
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
                calibrator_name = f"dspark-calibrator-{tag}"
                gpus = ray.cluster_resources().get("GPU", 0)
                cal_device = "cuda" if device == "cuda" and gpus >= cfg.parallel.world_size + n + 1 else "cpu"
                self.calibrator_device = cal_device
                self.calibrator = ray.remote(Calibrator).options(
                    name=calibrator_name, max_concurrency=4, num_cpus=1 if cal_device == "cpu" else 0,
                    num_gpus=1 if cal_device == "cuda" else 0).remote(narrow, cal_device, threads, first_version,
                                                                      self.stall_after_s)
            # a DSpark drafter also takes context rows from the target's workers while a proposal waits for them
            concurrency = 2 if cfg.speculative.method == "dspark" else 1
            for rank in range(n):
                self.actors.append(cls.options(
                    name=self.names[rank], max_concurrency=concurrency,
                    num_cpus=1 if device == "cpu" else 0,
                    num_gpus=1 if device == "cuda" else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_groups[rank // tp], placement_group_bundle_index=rank % tp),
                ).remote(narrow, device, threads, rank, n, calibrator_name))
            self.groups = [self.actors[g * tp : (g + 1) * tp] for g in range(n // tp)]
            self._versions = [0] * len(self.groups)  # the drafter version each group serves
            # the drafters' own rendezvous, on drafter rank 0's node (the target's world has another)
            progress(f"starting {n} drafter actor(s)")
            addr, port = self._gather([self.actors[0].open_rendezvous.remote()], startup_timeout_s)[0]
            progress("joining the drafters' process group and loading the draft model")
            self.reports = self._gather([a.setup.remote(addr, port) for a in self.actors], startup_timeout_s)
            if self.calibrator is not None:
                progress("starting the calibrator")
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
        except RayError as e:
            err = unwrap(e)
            if err is e:
                raise
            raise err from None

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

    def ingest(self, rows) -> None:
        raise TypeError("a Ray drafter group takes context rows from the target's workers, not from the engine")

    def poll_candidate(self, keep):
        """A calibrated version through the object store to every drafter, off the step's path:
        ask the calibrator at most once a second; once it offers one, stage it on every drafter;
        return (version, meta) when all hold it."""
        if self.calibrator is None:
            return None
        if self._staging is not None:
            version, meta, refs, t0 = self._staging
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) == len(refs):
                self._staging = None
                ray.get(refs)  # raises if a drafter could not stage it
                return version, meta
            if time.monotonic() - t0 > self.timeout_s:
                raise TimeoutError(f"drafters did not stage version {version} within {self.timeout_s:.0f} s")
            return None
        if self._cand_ref is None:
            if time.monotonic() - self._cand_t >= 1.0:
                self._cand_t = time.monotonic()
                self._cand_ref = self.calibrator.take_candidate.remote()
            return None
        ready, _ = ray.wait([self._cand_ref], timeout=0)
        if not ready:
            return None
        ref, self._cand_ref = self._cand_ref, None
        got = ray.get(ref)
        if got is not None:
            version, meta, state_ref = got
            self._staging = (version, meta, self.stage(version, state_ref, keep(version)), time.monotonic())
        return None

    def drop_candidate(self, retry_after_s: float) -> None:
        self._staging = self._cand_ref = None
        self._cand_t = time.monotonic() + retry_after_s

    def set_serving(self, version: int, available) -> None:
        if self.calibrator is not None:
            self.calibrator.set_serving.remote(version, tuple(available))

    def calibrator_status(self):
        return None if self.calibrator is None else ray.get(self.calibrator.status.remote(), timeout=10)

    def calibrator_heartbeat(self):
        """The calibrator's heartbeat without waiting (the engine's stats() reads it at every /health
        probe): asked at most once a second, the last answer returned meanwhile. An actor that has
        not answered for stall_after_s, or that failed, is itself reported as a stall."""
        if self.calibrator is None:
            return None
        with self._beat_lock:
            now, bound = time.monotonic(), self.stall_after_s
            if self._beat_ref is not None:
                ready, _ = ray.wait([self._beat_ref], timeout=0)
                if ready:
                    ref, self._beat_ref = self._beat_ref, None
                    try:
                        self._beat, self._beat_t = ray.get(ref), now
                    except Exception as e:  # noqa: BLE001 -- a calibrator lost costs calibration, never serving
                        self._beat, self._beat_t = snapshot(
                            "calibrator", "lost", True, now - self._beat_asked, True, bound,
                            f"calibrator: its actor failed ({type(e).__name__}); the drafters serve on without "
                            "calibration"), now
                elif now - self._beat_asked > bound:
                    return snapshot("calibrator", "answering its heartbeat", True, now - self._beat_asked, True, bound,
                                    f"calibrator: its actor has not answered for {now - self._beat_asked:.0f} s "
                                    f"(bound: parallel.stall_after_s = {bound:g})")
            if self._beat_ref is None and now - self._beat_asked >= 1.0:
                self._beat_asked, self._beat_ref = now, self.calibrator.heartbeat.remote()
            if self._beat is None:
                return snapshot("calibrator", "starting", False, 0.0, False, bound)
            return {**self._beat, "seconds_since_progress": round(self._beat["seconds_since_progress"]
                                                                  + now - self._beat_t, 1)}

    def comm_stats(self) -> list[dict]:
        return self._gather([a.comm_stats.remote() for a in self.actors], self.timeout_s)

    def device_reports(self) -> list[dict]:
        """The cost ledger's devices: each drafter actor (its weights and KV now, the DSpark context's
        peak) and the calibrator (its drafter copies, optimiser state, versions and replay buffer)."""
        out = [{"role": "drafter", "rank": r["rank"], "kind": device_kind(r["device"]),
                "memory": {"drafter_weights": r.get("param_bytes", 0), "drafter_kv": r.get("kv_bytes", 0),
                           "drafter_weights_reordered": r.get("reordered_bytes", 0)},
                "compile_error": r.get("compile_error")}
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
