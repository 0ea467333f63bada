"""The engine's view of the drafter: propose for the rows that speculate, and never let a drafter
failure cost a request. In process (executor local) or a Ray actor group (executor ray)."""

from __future__ import annotations

import logging
import time
import uuid

from .proposers import DraftRequest, make_proposer
from .spec_decode import Proposal

log = logging.getLogger(__name__)


class SpecStats:
    """Acceptance by position, verify rounds, accepted length, draft vs verify time."""

    def __init__(self, k: int):
        self.proposed = [0] * max(k, 1)
        self.accepted = [0] * max(k, 1)
        self.rounds = 0
        self.tokens_out = 0  # tokens produced by verify rounds (accepted drafts + 1 each)
        self.draft_time_s = 0.0
        self.verify_time_s = 0.0
        self.failures = 0

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.rounds += 1
        self.tokens_out += num_accepted + 1
        for i in range(num_draft):
            self.proposed[i] += 1
            self.accepted[i] += int(i < num_accepted)

    def summary(self) -> dict:
        return {
            "verify_rounds": self.rounds,
            "mean_accepted_length": self.tokens_out / self.rounds if self.rounds else float("nan"),
            "acceptance_by_position": [a / p if p else float("nan") for a, p in zip(self.accepted, self.proposed)],
            "num_draft_tokens": sum(self.proposed),
            "num_accepted_tokens": sum(self.accepted),
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "drafter_failures": self.failures,
        }


class RayDrafterGroup:
    """`draft_workers` Drafter actors, each on its own device with its own KV; sequences are
    split among them by id."""

    def __init__(self, cfg, timeout_s: float = 30.0):
        import ray

        from actors.drafter import Drafter

        self.timeout_s = timeout_s
        n = cfg.speculative.draft_workers
        device = "cuda" if cfg.parallel.device in ("auto", "cuda") and ray.cluster_resources().get("GPU", 0) >= (
            cfg.parallel.world_size + n) else "cpu"
        cls = ray.remote(Drafter)
        tag = uuid.uuid4().hex[:8]
        self.actors = [
            cls.options(name=f"dspark-drafter-{tag}-{i}", num_cpus=1 if device == "cpu" else 0,
                        num_gpus=1 if device == "cuda" else 0).remote(cfg.to_dict(), device)
            for i in range(n)
        ]
        ray.get([a.ready.remote() for a in self.actors], timeout=300)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        import ray

        parts = [[r for r in requests if r.seq_id % len(self.actors) == i] for i in range(len(self.actors))]
        refs = [a.propose.remote(p) for a, p in zip(self.actors, parts) if p]
        results = iter(ray.get(refs, timeout=self.timeout_s))
        by_id = {}
        for p in parts:
            if p:
                for r, prop in zip(p, next(results)):
                    by_id[r.seq_id] = prop
        return [by_id[r.seq_id] for r in requests]

    def prefill_async(self, requests: list[DraftRequest]) -> None:
        """Fire and forget: each actor handles its calls in order, so the next propose() sees it."""
        for i, a in enumerate(self.actors):
            mine = [r for r in requests if r.seq_id % len(self.actors) == i]
            if mine:
                a.prefill.remote(mine)

    def free(self, seq_ids) -> None:
        for i, a in enumerate(self.actors):
            mine = [s for s in seq_ids if s % len(self.actors) == i]
            if mine:
                a.free.remote(mine)

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)


class Drafter:
    def __init__(self, cfg, target_spec, device="cpu"):
        self.k = cfg.speculative.num_tokens
        self.stats = SpecStats(self.k)
        if cfg.parallel.executor == "ray":
            self.backend = RayDrafterGroup(cfg)
        else:
            self.backend = make_proposer(cfg, target_spec, device)

    @property
    def alive(self) -> bool:
        return self.backend is not None

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """Proposals for every request; on any drafter failure speculation is switched off and
        the rows go on without drafts (the outputs do not change, only the speed)."""
        if self.backend is None or not requests:
            return [Proposal([]) for _ in requests]
        t0 = time.perf_counter()
        try:
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

    def free(self, seq_ids) -> None:
        if self.backend is not None and seq_ids:
            try:
                self.backend.free(seq_ids)
            except Exception:  # noqa: BLE001
                self._drop()

    def _drop(self) -> None:
        backend, self.backend = self.backend, None
        if hasattr(backend, "shutdown"):
            try:
                backend.shutdown()
            except Exception:  # noqa: BLE001
                pass

    def shutdown(self) -> None:
        self._drop()
