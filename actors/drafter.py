"""Drafter: a Ray actor on its own device, with its own paged KV, proposing draft tokens for the
sequences assigned to its group. A thin shell over the core's proposers.

All drafters of a run form one torch.distributed world of their own (separate from the target's
ShardWorkers), cut into tensor-parallel groups of `speculative.draft_tensor` consecutive ranks.
A group runs SPMD: each rank gets the same calls and holds one shard of the draft model; TP rank 0
decides the draft tokens and its proposals are the group's.

Requests carry only the tokens a drafter was not sent before; each rank keeps the sequences
(`SequenceHistory`, the same calls on every rank keep the same copies). A restarted drafter holds
none, and the engine sends it every sequence whole.
"""

from __future__ import annotations

import os
import threading
import time

import torch

# how long a DSpark proposal waits for context rows still on their way from the target's workers
CONTEXT_WAIT_S = 0.05


class Drafter:
    def __init__(self, cfg, device: str = "cpu", threads: int = 1, rank: int = 0, world_size: int = 1,
                 calibrator: str = None):
        """`cfg`: a speculative.drafter_config.DrafterConfig (validated in the Router's process)."""
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        torch.set_num_threads(threads)
        self.cfg = cfg
        self.device_kind = device
        self.rank, self.world_size = rank, world_size
        from dspark_cluster.speculative.proposers import SequenceHistory

        self.state = self.proposer = None
        self.history = SequenceHistory()  # each sequence's tokens (requests carry only the new ones)
        self._lock = threading.Condition()  # a DSpark drafter serves two callers (Router, target worker)
        self.calibrator_name = calibrator  # online calibration: where finished sequences' rounds go
        self._calibrator = None
        self._outbox, self._sent_t = [], time.monotonic()
        self._shipping = None  # a thread pickles and sends the batches, off the calls that serve
        self._rendezvous = None  # drafter rank 0: its world's rendezvous server, from open_rendezvous until setup

    def open_rendezvous(self) -> tuple[str, int]:
        """This drafter's node IP and the port of the drafter world's rendezvous, opened here (asked of
        drafter rank 0)."""
        import ray

        from parallel.state import open_rendezvous

        self._rendezvous = open_rendezvous()
        return ray.util.get_node_ip_address(), self._rendezvous.port

    def setup(self, master_addr: str, master_port: int) -> dict:
        """Join the drafter world and load this rank's shard of the draft model. Returns report()."""
        from dspark_cluster.heap import freeze_heap
        from dspark_cluster.speculative.proposers import make_proposer
        from parallel.comm import TensorParallelComm
        from parallel.state import init_parallel

        cfg = self.cfg
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        self.device = torch.device("cuda", 0) if self.device_kind == "cuda" else torch.device("cpu")
        # drafters that fell back to CPU (too few GPUs) talk over gloo whatever the target uses
        backend = cfg.backend if self.device.type == "cuda" else "gloo"
        self.state = init_parallel(self.rank, self.world_size, cfg.speculative.draft_tensor, master_addr, master_port,
                                   backend, self.device, store=self._rendezvous)
        self._rendezvous = None  # the process group holds it now
        self.comm = TensorParallelComm(self.state)
        self.proposer = make_proposer(cfg, cfg.target_spec, self.device, self.comm)
        freeze_heap()  # start-up's objects: no full collection walks them during serving
        return self.report()

    def report(self) -> dict:
        """The process-group facts of this rank and the parameter bytes it holds."""
        import ray
        import torch.distributed as dist

        out = {
            "rank": self.rank,
            "world_size": dist.get_world_size(),
            "tp_rank": self.state.tp_rank,
            "tp_size": self.state.tp_size,
            "tp_ranks": list(self.state.tp_ranks),
            "backend": dist.get_backend(),
            "device": str(self.device),
            "node_id": ray.get_runtime_context().get_node_id(),
            "param_bytes": 0,
            # why the rounds run eager under model.compile auto (their compile failed): into the run's compile summary
            "compile_error": getattr(self.proposer, "compile_error", None),
        }
        if hasattr(self.proposer, "memory_report"):  # a draft model (n-gram lookup holds none)
            out.update(self.proposer.memory_report())
        return out

    def ready(self) -> bool:
        return True

    def propose(self, requests, version: int = 0):
        """Every rank of the group runs the same proposal; only TP rank 0's is returned (the
        others' carry no draft law, and sending them back would only cost time). A DSpark drafter
        first waits, briefly, for context rows the target's workers sent but that have not arrived
        (Ray orders calls per caller only); a sequence still without them gets no drafts."""
        with self._lock:
            requests = self.history.resolve(requests)
            if hasattr(self.proposer, "waiting_for"):
                deadline = time.monotonic() + CONTEXT_WAIT_S
                while self.proposer.waiting_for(requests) and time.monotonic() < deadline:
                    self._lock.wait(timeout=max(deadline - time.monotonic(), 0))
            if version != getattr(self.proposer, "version", 0):  # a publish or rollback: every rank at this call
                self.proposer.use(version)
            proposals = self.proposer.propose(requests)
        return proposals if self.state.tp_rank == 0 else None

    def ingest(self, rows) -> None:
        """DSpark: context rows from a target worker (fire and forget)."""
        with self._lock:
            self.proposer.ingest(rows)
            self._lock.notify_all()

    def prefill(self, requests) -> None:
        with self._lock:
            self.proposer.prefill(self.history.resolve(requests))

    def free(self, seq_ids, reasons=None) -> None:
        with self._lock:
            self.history.free(seq_ids)
            if reasons is None:
                self.proposer.free(seq_ids)
                return
            self.proposer.free(seq_ids, reasons)
            if self.state.tp_rank == 0 and self.calibrator_name:
                self._outbox += self.proposer.take_samples()
                if self._shipping is None:
                    threading.Thread(target=self._ship_loop, name="dspark-calibration-ship", daemon=True).start()
                    self._shipping = True

    def _ship_loop(self) -> None:
        """Finished sequences' rounds to the calibrator, in batches of 8 or every 2 s, pickled on this
        thread (fire and forget: a calibrator that is gone costs the samples, never the serving)."""
        import ray

        while True:
            time.sleep(0.2)
            with self._lock:
                if not self._outbox or (len(self._outbox) < 8 and time.monotonic() - self._sent_t < 2.0):
                    continue
                batch, self._outbox, self._sent_t = self._outbox, [], time.monotonic()
            try:
                if self._calibrator is None:
                    self._calibrator = ray.get_actor(self.calibrator_name)
                self._calibrator.add.remote(batch)
            except Exception:  # noqa: BLE001
                self._calibrator = None

    def stage(self, version: int, state, keep) -> int:
        """Hold a calibrated version (`state`: its weights, from the object store) to switch to."""
        state = {k: v.to(self.proposer.device) for k, v in state.items()}  # the copy outside the lock
        with self._lock:
            self.proposer.stage(version, state, keep)
        return version

    def version_report(self) -> dict:
        """The serving version and a fingerprint of the weights in use (tests: every rank the same)."""
        with self._lock:
            m = self.proposer.model
            return {"version": self.proposer.version, "staged": sorted(self.proposer.staged),
                    "weights_sum": float(sum(p.double().sum() for p in m.parameters()))}

    def context_stats(self) -> dict:
        with self._lock:
            return {"ingested_rows": getattr(self.proposer, "ingested_rows", 0),
                    "misses": getattr(self.proposer, "misses", 0), "resyncs": getattr(self.proposer, "resyncs", 0),
                    "sequences": len(getattr(self.proposer, "ctx", ())),
                    "draft_passes": getattr(getattr(self.proposer, "c", None), "draft_passes", 1)}

    def comm_stats(self) -> dict:
        return self.state.stats.snapshot()
