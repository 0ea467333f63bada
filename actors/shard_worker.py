"""ShardWorker: one Ray actor per device, hosting the core's target worker (dspark_cluster.worker).

A thin shell: it owns the device and the process groups (joined at rank 0's node), hosts one
`Worker` (the shard, its expert slots, its KV, the step with its expert migration), moves the step
across the wire, and sends the DSpark context rows straight to the drafter actors. SPMD: every rank
gets the same StepInput; the driver rank returns sampled token ids, every rank its expert load.
"""

from __future__ import annotations

import os
import time

import torch


class ShardWorker:
    def __init__(self, cfg, spec, rank: int, world_size: int, threads: int = 1):
        """cfg: a dspark_cluster.worker.WorkerConfig; spec: the engine's ModelSpec."""
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        torch.set_num_threads(threads)
        self.cfg, self.spec = cfg, spec
        self.rank = rank
        self.world_size = world_size
        self.worker = None
        self._drafters = {}  # DSpark drafter actor handles by name
        self._last_return = None
        self._rendezvous = None  # rank 0: the world's rendezvous server, from open_rendezvous until setup

    def __repr__(self) -> str:  # Ray's actor repr (state API, error tracebacks): which rank this is
        return f"ShardWorker(rank={self.rank}/{self.world_size})"

    @property
    def model(self):
        return self.worker.model if self.worker is not None else None

    def open_rendezvous(self) -> tuple[str, int]:
        """This worker's node IP and the port of the world's rendezvous, opened here (asked of rank 0)."""
        import ray

        from parallel.state import open_rendezvous

        self._rendezvous = open_rendezvous()
        return ray.util.get_node_ip_address(), self._rendezvous.port

    def setup(self, master_addr: str, master_port: int, device: str, phy2log=None) -> dict:
        """Join the groups and load this rank's shard. Returns what this rank holds."""
        from dspark_cluster.executor import resolve_device
        from dspark_cluster.worker import Worker
        from parallel.state import init_parallel

        par = self.cfg.parallel
        if device == "cuda":
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
            self.device = torch.device("cuda", 0)
        else:
            self.device = resolve_device(device)
        self.state = init_parallel(self.rank, self.world_size, par.tensor, master_addr, master_port, par.backend,
                                   self.device, store=self._rendezvous)
        self._rendezvous = None  # the process group holds it now
        self.worker = Worker(self.cfg, self.spec, self.device, self.rank, self.world_size, self.state, phy2log)
        return self.memory_report()

    def memory_report(self) -> dict:
        import ray

        return {**self.worker.memory_report(), "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def kv_blocks_that_fit(self, sharing: int = 1) -> int:
        return self.worker.kv_blocks_that_fit(sharing)

    def allocate_kv(self, num_blocks: int) -> int:
        """Allocate the KV pool; returns the bytes one block takes on this rank."""
        return self.worker.allocate_kv(num_blocks)

    def step(self, data: bytes) -> bytes:
        """One round: a pickled StepInput (or one per data-parallel group) in, a pickled StepOutput out."""
        from dspark_cluster.step import from_wire, to_wire

        t0 = time.perf_counter()
        step_input = from_wire(data)
        out = self.worker.execute(step_input)
        if out.context is not None:
            if isinstance(step_input, list):
                step_input = step_input[self.state.dp_rank]
            self._send_context(out.context, step_input.export_to)
            out.context = None
        # the worker's time between rounds: Ray's channel write of the last output and read of this input
        out.between_s = t0 - self._last_return if self._last_return else 0.0
        out.worker_s = time.perf_counter() - t0  # unpickling + the step; pickling follows
        data = to_wire(out)
        self._last_return = time.perf_counter()
        return data

    def _send_context(self, rows, names) -> None:
        """DSpark: the committed tokens' states go straight to the drafter actors that own their
        sequences (seq_id % groups), fire and forget: a dead or slow drafter never holds up the
        target (its proposals then go without drafts)."""
        import ray

        if not names:
            return
        for name, part in zip(names, rows.split(len(names))):
            if not part.counts.numel():
                continue
            try:
                handle = self._drafters.get(name)
                if handle is None:
                    handle = self._drafters[name] = ray.get_actor(name)
                handle.ingest.remote(part)
            except Exception:  # noqa: BLE001 -- a drafter that is gone (restarting): its rows are lost
                self._drafters.pop(name, None)

    def comm_stats(self) -> dict:
        return self.worker.comm_stats()

    def shutdown(self) -> None:
        from parallel.state import shutdown_parallel

        if self.worker is not None:
            self.worker.shutdown()
        self.worker = None
        shutdown_parallel()
