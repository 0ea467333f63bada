"""ShardWorker: one Ray actor per device, holding one shard of the target model.

A thin shell: it joins the process groups, loads only its own slices, allocates its KV blocks and
runs `execute_step` on each StepInput (SPMD: every rank gets the same one). The driver rank
returns sampled token ids; every rank returns its expert load.
"""

from __future__ import annotations

import os

import torch


class ShardWorker:
    def __init__(self, cfg: dict, rank: int, world_size: int, threads: int = 1):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        torch.set_num_threads(threads)
        from dspark_cluster.config import load_config

        self.cfg = load_config(cfg)
        self.rank = rank
        self.world_size = world_size
        self.model = None
        self._drafters = {}  # DSpark drafter actor handles by name

    def node_address(self) -> tuple[str, int]:
        """This worker's node IP and a free port there (asked of rank 0 for the rendezvous)."""
        import ray

        from parallel.state import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int, device: str, phy2log=None) -> dict:
        """Join the groups and load this rank's shard. Returns what this rank holds."""
        from dspark_cluster.executor import resolve_device
        from dspark_cluster.model.loader import load_model
        from dspark_cluster.model.spec import load_spec
        from dspark_cluster.placement import default_placement, placement_from_phy2log
        from parallel.comm import TensorParallelComm
        from parallel.expert_parallel import ExpertParallelDispatch
        from parallel.state import init_parallel

        cfg = self.cfg
        if device == "cuda":
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
            self.device = torch.device("cuda", 0)
        else:
            self.device = resolve_device(device)
        self.state = init_parallel(self.rank, self.world_size, cfg.parallel.tensor, master_addr, master_port,
                                   cfg.parallel.backend, self.device)
        self.spec = spec = load_spec(cfg.model.path, cfg.model.dtype)
        comm = TensorParallelComm(self.state)
        num_moe = sum(spec.moe_layers)
        expert_ids = None
        if spec.is_moe and self.world_size > 1:
            if phy2log is not None:
                self.placement = placement_from_phy2log(torch.as_tensor(phy2log), spec.num_experts, self.world_size)
            else:
                self.placement = default_placement(num_moe, spec.num_experts, self.world_size,
                                                   cfg.eplb.num_redundant_experts)
            expert_ids = [self.placement.rank_experts(layer, self.rank) for layer in range(num_moe)]
        self.model = load_model(cfg.model.path, spec, comm, expert_ids, device=self.device)
        self.dispatchers = []
        if expert_ids is not None:
            for layer, moe in enumerate(self.model.moe_layers):
                moe.dispatch = ExpertParallelDispatch(self.state, self.placement, layer)
                self.dispatchers.append(moe.dispatch)
        if cfg.workload.hot_experts:
            self.model.set_study_router_bias(cfg.workload.hot_experts, cfg.workload.hot_bias)
        self.migration, self.migration_version = None, None
        self.peak_staging_bytes = 0  # the most expert-migration staging this rank has held
        self._prev_sampled = None
        self._last_return = None
        return self.memory_report()

    def memory_report(self) -> dict:
        expert = sum(p.numel() * p.element_size() for n, p in self.model.named_parameters() if n.endswith((".w13", ".w2")))
        total = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())  # params + persistent buffers
        return {
            "rank": self.rank,
            "tp_rank": self.state.tp_rank,
            "param_bytes": total,
            "expert_param_bytes": expert,
            "expert_staging_bytes": self.peak_staging_bytes,  # peak; 0 until a rebalance stages experts here
            "bytes_read": self.model.bytes_read,
            "experts": [m.expert_ids for m in self.model.moe_layers],
            "device": str(self.device),
            "node": self.node_address()[0],
            "node_id": __import__("ray").get_runtime_context().get_node_id(),
        }

    def kv_blocks_that_fit(self, block_size: int, kv_cache_memory, num_kv_blocks, sharing: int = 1) -> int:
        """After the weights are loaded: a share of kv_cache_memory is of what they left free on this
        worker's device (split `sharing` ways between the CPU workers of one host)."""
        from dspark_cluster.kv_cache import plan_num_blocks

        return plan_num_blocks(self.model, block_size, kv_cache_memory, num_kv_blocks, self.device, sharing)

    def allocate_kv(self, num_blocks: int, block_size: int) -> int:
        """Allocate the KV pool; returns the bytes one block takes on this rank."""
        from dspark_cluster.kv_cache import allocate_kv_cache, kv_bytes_per_block

        allocate_kv_cache(self.model, num_blocks, block_size, self.device)
        return kv_bytes_per_block(self.model, block_size)

    def step(self, data: bytes) -> bytes:
        """One round: a pickled StepInput (or one per data-parallel group) in, a pickled StepOutput out."""
        import time

        from dspark_cluster.step import from_wire, to_wire

        t0 = time.perf_counter()
        out = self._step(from_wire(data))
        # the worker's time between rounds: Ray's channel write of the last output and read of this input
        out.between_s = t0 - self._last_return if self._last_return else 0.0
        out.worker_s = time.perf_counter() - t0  # unpickling + the step; pickling follows
        data = to_wire(out)
        self._last_return = time.perf_counter()
        return data

    def _step(self, step_input):
        from dspark_cluster.step_exec import execute_step

        if isinstance(step_input, list):  # one StepInput per data-parallel group
            step_input = step_input[self.state.dp_rank]
        if step_input.commit_placement is not None and self.migration is not None:
            if step_input.commit_placement == self.migration_version:
                self.migration.commit(self.dispatchers)
                self.placement = self.migration.new
                self.peak_staging_bytes = max(self.peak_staging_bytes, self.migration.peak_staged_bytes)
            self.migration = self.migration_version = None
        if step_input.placement_update is not None and self.migration is None:
            self._start_migration(*step_input.placement_update)
        try:
            out = execute_step(self.model, step_input, self.device, sample_tokens=self.state.tp_rank == 0,
                               prev_sampled=self._prev_sampled)
        finally:
            # this step's share of the expert transfers, here between two steps on the step thread: every rank
            # runs the same steps, so all issue them at the same point among the step's collectives (also after
            # a step that failed past its collectives on this rank only: the other ranks' transfers wait for it)
            if self.migration is not None:
                self.migration.advance()
        self._prev_sampled = out.sampled  # the next step's inputs may be these tokens (async scheduling)
        if out.context is not None:
            self._send_context(out.context, step_input.export_to)
            out.context = None
        if self.migration is not None:
            out.migration_ready = self.migration.done()
            out.migration_bytes = self.migration.bytes_sent
        return out

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

    def _start_migration(self, version: int, phy2log) -> None:
        """Plan a new expert placement; its transfers run after this and the next steps (which keep
        using the old one) until the commit."""
        from dspark_cluster.placement import placement_from_phy2log
        from parallel.migration import Migration

        new = placement_from_phy2log(torch.as_tensor(phy2log), self.spec.num_experts, self.world_size)
        self.migration = Migration(self.state, self.model.moe_layers, self.placement, new)
        self.migration_version = version

    def comm_stats(self) -> dict:
        return self.state.stats.snapshot()

    def shutdown(self) -> None:
        from parallel.state import shutdown_parallel

        self.model = None
        shutdown_parallel()
