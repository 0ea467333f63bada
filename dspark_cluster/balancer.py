"""Expert-load telemetry and live rebalancing on the router side.

Every step's StepOutput carries tokens per (MoE layer, logical expert). The balancer keeps a
sliding window of them, reports balancedness (mean / max tokens per rank, per layer) under the
current placement, and every `interval_steps` (or on demand) asks the EPLB policy for a better
placement. A change is then staged on the workers between steps (on their step threads, after
the step that brought it and the next ones while steps keep running on the old placement; see
parallel/migration.py) and committed at a step boundary once every rank holds its new experts:
outputs never change, only where experts live. The staging has a heartbeat (heartbeat.py): a
placement staged for parallel.stall_after_s of stepping without moving a byte further or becoming
ready (a worker that lost its migration, say) is reported as a stall.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

import torch

from . import eplb
from .heartbeat import Heartbeat
from .placement import ExpertPlacement, default_placement, placement_from_phy2log

RANK_HISTORY_KEPT = 4096  # steps of per-rank load a long-running server keeps


class ExpertBalancer:
    def __init__(self, cfg, num_moe_layers: int, num_experts: int, num_ranks: int, n_group: int = 1):
        e = cfg.eplb
        self.enabled = e.enabled
        self.window_steps, self.interval_steps, self.min_gain = e.window_steps, e.interval_steps, e.min_gain
        self.num_ranks, self.num_nodes = num_ranks, e.num_nodes
        self.num_groups = e.num_groups or n_group
        self.policy = e.policy
        self.placement: ExpertPlacement = default_placement(num_moe_layers, num_experts, num_ranks, e.num_redundant_experts)
        self.window: deque = deque(maxlen=self.window_steps)
        self.total = torch.zeros(num_moe_layers, num_experts, dtype=torch.long)
        # per step: [layer][rank] tokens, under the placement of that step; bounded in a server,
        # whole for a run's report (keep_history)
        self.rank_history = deque(maxlen=RANK_HISTORY_KEPT)
        self.steps = 0
        self.version = 0
        self.pending: Optional[dict] = None  # a staged placement: version, phy2log, started, state
        self.requested = False
        self.events = deque(maxlen=RANK_HISTORY_KEPT)  # committed rebalances
        self.num_moe_layers, self.num_experts, self.num_redundant = num_moe_layers, num_experts, e.num_redundant_experts
        # the handshake: the version the next StepInput commits, and the bytes its migration moved
        self._commit_version: Optional[int] = None
        self._migration_bytes = 0
        # staging advances only when the engine steps: an idle engine is no stall (step_driven)
        self.heartbeat = Heartbeat("expert_staging", cfg.parallel.stall_after_s, step_driven=True)
        self._bytes_seen = 0  # the migration's bytes sent, as last read (progress)

    def keep_history(self) -> None:
        """Keep every step's per-rank load from now on (a run's report), not only the latest."""
        self.rank_history, self.events = list(self.rank_history), list(self.events)

    def reset_placement(self) -> None:
        """The workers were restarted with the default placement: forget the current one and any
        migration under way."""
        self.placement = default_placement(self.num_moe_layers, self.num_experts, self.num_ranks, self.num_redundant)
        self.pending = None
        self._commit_version, self._migration_bytes = None, 0
        self.window.clear()
        self.heartbeat.rest("idle")

    # ---- the handshake with the workers, on the step's own data ----------------------------
    def step_fields(self) -> dict:
        """Before a step is built (world > 1): the commit the last output made ready and a new
        placement to start staging, the same on every group's StepInput (all ranks switch together)."""
        if self.num_ranks <= 1:
            return {}
        commit, self._commit_version = self._commit_version, None
        return {"commit_placement": commit, "placement_update": self.placement_update()}

    def read(self, inputs: list, outs: list) -> None:
        """After the step: the load it routed; the commit it ran; a migration every rank has staged
        (the next step commits it)."""
        self.observe(sum(o.expert_load for o in outs))
        if inputs[0].commit_placement is not None:
            self.committed(self._migration_bytes)
        elif outs[0].migration_ready:
            version = self.commit_version(True)
            if version is not None:  # None: already committing (its commit may not have been sent yet)
                self._migration_bytes = outs[0].migration_bytes
                self._commit_version = version
                self.heartbeat.beat(f"committing placement {version} at the next step")
        if self.pending is not None:
            self._staging_progress(outs)

    def _staging_progress(self, outs: list) -> None:
        """A step ran while a placement is staged: progress when its transfers moved on."""
        sent = sum(o.migration_bytes for o in outs)
        if sent > self._bytes_seen:
            self._bytes_seen = sent
            self.heartbeat.beat(f"staging placement {self.pending['version']}: {sent / 2**20:.1f} MiB sent")
        self.heartbeat.ran()

    # ---- telemetry ------------------------------------------------------------------------
    def observe(self, expert_load: Optional[torch.Tensor]) -> None:
        if expert_load is None or not expert_load.numel():
            return
        self.steps += 1
        self.window.append(expert_load)
        self.total += expert_load
        if self.num_ranks > 1:  # one rank holds every expert: nothing to record per rank
            self.rank_history.append(eplb.rank_load(expert_load.float(), self.placement.phy2log, self.num_ranks).tolist())

    def window_load(self) -> torch.Tensor:
        return torch.stack(list(self.window)).sum(0) if self.window else self.total.clone()

    def balancedness(self, load: Optional[torch.Tensor] = None, phy2log: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[L] mean / max tokens per rank over the window (1.0 = perfectly even)."""
        load = self.window_load() if load is None else load
        return eplb.balancedness(load.float(), self.placement.phy2log if phy2log is None else phy2log, self.num_ranks)

    def served_balancedness(self, start: int = 0, end: int = None) -> list[float]:
        """[L] mean / max of the tokens each rank actually computed over steps [start, end), each
        step under the placement it ran with: the before / after measure of a study."""
        return served_balancedness(self.rank_history, start, end)

    def imbalance(self) -> torch.Tensor:
        return eplb.imbalance(self.window_load().float(), self.placement.phy2log, self.num_ranks)

    def save_load(self, path) -> None:
        torch.save({"window": self.window_load(), "total": self.total, "phy2log": self.placement.phy2log}, str(path))

    @staticmethod
    def load_load(path) -> dict:
        return torch.load(str(path))

    # ---- rebalancing ----------------------------------------------------------------------
    def request(self) -> None:
        """Rebalance at the next step, whatever the interval."""
        self.requested = True

    def placement_update(self) -> Optional[tuple]:
        """What to attach to the next StepInput: (version, phy2log) to start a migration, or None."""
        if self.pending is not None or not self.window:
            return None
        due = self.enabled and self.steps and self.steps % self.interval_steps == 0
        if not (due or self.requested):
            return None
        self.requested = False
        load = self.window_load().float()
        phy2log, _, _ = eplb.rebalance(load, self.placement.num_slots, self.num_groups, self.num_nodes, self.num_ranks,
                                       policy="hierarchical" if self.policy == "hierarchical" else "global")
        before, after = self.balancedness(load), self.balancedness(load, phy2log)
        if torch.equal(phy2log, self.placement.phy2log) or float(after.mean() - before.mean()) < self.min_gain:
            return None
        self.version += 1
        self.pending = {"version": self.version, "phy2log": phy2log, "started": time.perf_counter(),
                        "step": self.steps, "before": before.tolist(), "predicted_after": after.tolist(),
                        "committing": False}
        self._bytes_seen = 0
        self.heartbeat.beat(f"staging placement {self.version} on the workers")
        return self.version, phy2log

    def commit_version(self, migration_ready: Optional[bool]) -> Optional[int]:
        """After a step: once every rank has staged the new experts, the next StepInput commits."""
        p = self.pending
        if p is None or p["committing"] or not migration_ready:
            return None
        p["committing"] = True
        return p["version"]

    def committed(self, migration_bytes: int) -> None:
        """The commit step ran: the new placement is live."""
        p = self.pending
        self.placement = placement_from_phy2log(p["phy2log"], self.placement.log2phy.shape[1], self.num_ranks)
        self.events.append({"version": p["version"], "at_step": p["step"], "committed_at_step": self.steps,
                            "duration_s": time.perf_counter() - p["started"], "bytes_moved": migration_bytes,
                            "balancedness_before": p["before"], "balancedness_predicted": p["predicted_after"]})
        self.pending = None
        self.window.clear()  # the new placement starts a fresh window
        self.heartbeat.rest("idle")

    def summary(self) -> dict:
        b = self.balancedness()
        return {"balancedness_per_layer": b.tolist(), "balancedness_mean": float(b.mean()),
                "imbalance_per_layer": self.imbalance().tolist(), "rebalances": list(self.events),
                "phy2log": self.placement.phy2log.tolist(), "expert_load_total": self.total.tolist(),
                "rank_history": list(self.rank_history)}


def served_balancedness(rank_history, start: int = 0, end=None) -> list[float]:
    """rank_history: per step [layer][rank] tokens -> [L] mean / max over ranks of the summed loads."""
    steps = list(rank_history)[start:end]
    if not steps:
        return []
    total = torch.tensor(steps).sum(0)  # [L, R]
    return (total.mean(1) / total.max(1).values.clamp(min=1e-9)).tolist()
