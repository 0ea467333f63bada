"""The target's worker: one shard of the model on one device, and what it does with each step.

One class for both executors: `executor.LocalExecutor` hosts one `Worker` in process (rank 0 of a
world of one), and on Ray each `actors.shard_worker.ShardWorker` hosts one (the actor owns the
device and the process group, and sends the DSpark context rows to the drafters). A worker is set
up from a `WorkerConfig` (the model, parallel and scheduler sections, the redundant expert slots
and the hot-spot study's router bias: not the workload section or the prices) and the `ModelSpec`
the engine already read, so no worker re-reads or re-validates the whole config.

    Worker(cfg, spec, device, rank, world_size, state, phy2log)  load the shard and its expert slots
    kv_blocks_that_fit(sharing) -> int   KV blocks this device can hold (after the weights)
    allocate_kv(num_blocks) -> int       allocate the pool; the bytes of one block here
    execute(step) -> StepOutput          one step (this rank's group's, for a list), with the expert
                                         migration's advance / commit and the previous step's tokens
    memory_report() -> dict              what this rank holds
    comm_stats() -> dict                 bytes sent per collective kind
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .config import Config, ModelConfig, ParallelConfig, SchedulerConfig
from .heap import freeze_heap, unfreeze_heap
from .kv_cache import allocate_kv_cache, kv_bytes_per_block, peak_bytes_during, plan_num_blocks
from .model.compiled import CompiledSteps, compile_buckets, compiled_or_eager, resolve_compile
from .model.loader import load_model
from .model.spec import ModelSpec
from .step import StepOutput
from .step_builder import memory_profile_steps
from .step_exec import execute_step


@dataclass(frozen=True)
class WorkerConfig:
    """What a target worker needs of the config (validated once, in the engine's process)."""

    model: ModelConfig
    parallel: ParallelConfig
    scheduler: SchedulerConfig
    num_redundant_experts: int = 0  # eplb.num_redundant_experts
    hot_experts: tuple = field(default_factory=tuple)  # workload.hot_experts (a hot-spot study's router bias)
    hot_bias: float = 0.0  # workload.hot_bias
    # the run's speculative constants, sent once here rather than with every step: the decoder layers
    # a DSpark drafter reads, and the target's top-k log-probabilities kept per recorded verify round
    export_layers: tuple = ()
    record_top_logprobs: int = 20
    context_window: int = 0  # DSpark: the rows per sequence kept while its drafter is idle (ContextStash)
    # speculative.placement target: the DSpark drafter the driver rank hosts ("" : none), and its most tokens
    draft_model: str = ""
    num_draft_tokens: int = 0
    draft_passes: int = 1
    compile_buckets: tuple = ()  # the token counts a compiled step pads to (model.compile; `compile_buckets`)
    verify_row_tokens: int = 1  # the most tokens a verify row takes: 1 + speculative.num_tokens (1: no speculation)
    verify_laws: bool = False  # sampled verify rows carry their drafts' laws (a drafter with one: not ngram)

    @classmethod
    def of(cls, cfg: Config) -> "WorkerConfig":
        sp = cfg.speculative
        export, window, passes = (), 0, 1
        if sp.enabled and sp.method == "dspark":
            from .speculative.dspark_model import DSparkConfig, context_window_of, resolve_draft_passes

            c = DSparkConfig.load(Path(sp.draft_model) / "config.json")
            export, window = tuple(c.target_layer_ids), context_window_of(sp.context_window, c)
            passes = resolve_draft_passes(sp.draft_passes, c, sp.draft_model, cfg.parallel.device)
        return cls(model=cfg.model, parallel=cfg.parallel, scheduler=cfg.scheduler,
                   num_redundant_experts=cfg.eplb.num_redundant_experts,
                   hot_experts=tuple(cfg.workload.hot_experts), hot_bias=cfg.workload.hot_bias,
                   export_layers=export, record_top_logprobs=sp.calibration.top_logprobs, context_window=window,
                   draft_model=str(sp.draft_model) if sp.on_target else "",
                   num_draft_tokens=sp.num_tokens if sp.on_target else 0,
                   draft_passes=passes, compile_buckets=tuple(compile_buckets(cfg)),
                   verify_row_tokens=1 + (sp.num_tokens if sp.enabled else 0),
                   verify_laws=sp.enabled and sp.method != "ngram")


def _param_bytes(model) -> tuple[int, int]:
    """(every parameter and persistent buffer, the expert weights) in bytes."""
    expert = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.endswith((".w13", ".w2")))
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return total, expert


class Worker:
    """One shard of the target model. `state`: this rank's process groups (parallel.state), None
    in process (a world of one); `phy2log`: the expert placement to load (None: the default one)."""

    def __init__(self, cfg: WorkerConfig, spec: ModelSpec, device, rank: int = 0, world_size: int = 1,
                 state=None, phy2log=None):
        self.cfg, self.spec, self.device = cfg, spec, torch.device(device)
        self.rank, self.world_size, self.state = rank, world_size, state
        self.tp_rank = state.tp_rank if state is not None else 0
        self.dp_rank = state.dp_rank if state is not None else 0
        comm = None
        if state is not None:
            from parallel.comm import TensorParallelComm

            comm = TensorParallelComm(state)
        self.placement, expert_ids = None, None
        if spec.is_moe and world_size > 1:
            from .placement import default_placement, placement_from_phy2log

            num_moe = sum(spec.moe_layers)
            if phy2log is not None:
                self.placement = placement_from_phy2log(torch.as_tensor(phy2log), spec.num_experts, world_size)
            else:
                self.placement = default_placement(num_moe, spec.num_experts, world_size, cfg.num_redundant_experts)
            expert_ids = [self.placement.rank_experts(layer, rank) for layer in range(num_moe)]
        self.model = load_model(cfg.model.path, spec, comm, expert_ids, device=self.device)
        self.dispatchers = []
        if expert_ids is not None:
            from parallel.expert_parallel import ExpertParallelDispatch

            for layer, moe in enumerate(self.model.moe_layers):
                moe.dispatch = ExpertParallelDispatch(state, self.placement, layer, moe)
                self.dispatchers.append(moe.dispatch)
        if cfg.hot_experts:
            self.model.set_study_router_bias(cfg.hot_experts, cfg.hot_bias)
        self.num_blocks = 0
        self.reserved_bytes = 0  # what the KV plan left its largest steps (`activation_reserve`)
        self.compiled = None  # model.compile's step runner, made with the KV pool
        self.compile_error = None  # why the steps run eager under model.compile auto, where their compile failed
        self.migration, self.migration_version = None, None
        self.peak_staging_bytes = 0  # the most expert-migration staging this rank has held
        self._prev_sampled: Optional[torch.Tensor] = None
        self.stash = None  # DSpark: the driver rank keeps the context rows a step does not export
        if cfg.export_layers and self.tp_rank == 0:
            from .speculative.context import ContextStash

            self.stash = ContextStash(cfg.context_window)
        self.drafter = None  # placement target: the DSpark drafter beside this driver rank's shard
        if cfg.draft_model and self.tp_rank == 0:
            from .speculative.compiled_draft import draft_buckets
            from .speculative.on_target import TargetDrafter

            self.drafter = TargetDrafter(cfg.draft_model, cfg.model.path, spec, self.device, cfg.num_draft_tokens,
                                         cfg.context_window, cfg.draft_passes,
                                         (self.model.model.embed_tokens.weight, self.model.lm_head.weight),
                                         draft_buckets(cfg.scheduler.max_num_seqs)
                                         if resolve_compile(cfg.model.compile, self.device) else None,
                                         eager_if_compile_fails=cfg.model.compile == "auto")

    # -- KV --------------------------------------------------------------------------------------

    def kv_blocks_that_fit(self, sharing: int = 1) -> int:
        """After the weights are loaded: a share of kv_cache_memory is of what they left free on this
        worker's device, less what its largest steps hold on top (`activation_reserve`; split `sharing`
        ways between the CPU workers of one host). Collective where a share is measured: every rank."""
        sc = self.cfg.scheduler

        def reserve():
            self.reserved_bytes = self.activation_reserve()
            return self.reserved_bytes

        return plan_num_blocks(self.model, sc.block_size, sc.kv_cache_memory, sc.num_kv_blocks, self.device, sharing,
                               reserve)

    def activation_reserve(self) -> int:
        """Bytes the largest steps the scheduler can build hold beyond the weights and the KV pool (activations,
        logits, the captured layers a DSpark drafter reads, draft laws, the sampler's sorts), measured before the
        pool is sized so that it leaves them room (vLLM's profile run): `memory_profile_steps` on a pool just large
        enough for them, dropped after, and where the drafter is on this rank its largest round beside them
        (`TargetDrafter.memory_profile`: max_num_seqs sequences' contexts, as much as a store keeps, and their draft
        laws). Every rank runs them (their collectives). 0 off CUDA, where nothing counts a step's memory
        (`peak_bytes_during`): nothing runs."""
        sc, cfg = self.cfg.scheduler, self.cfg
        law = self.model.lm_head.weight.dtype if cfg.verify_laws else None
        steps, blocks = memory_profile_steps(sc.max_num_batched_tokens, sc.max_num_seqs, cfg.verify_row_tokens,
                                             self.spec.max_position_embeddings, sc.block_size, self.spec.vocab_size,
                                             law)

        def run():
            allocate_kv_cache(self.model, blocks, sc.block_size, self.device)
            for d in self.dispatchers:
                d.capacity = 0  # exact splits (a step's own capacity comes with it)
            # (the drafter's stores and laws alive while the steps run, as in serving)
            with self.drafter.memory_profile(sc.max_num_seqs) if self.drafter else contextlib.nullcontext():
                for step in steps:
                    execute_step(self.model, step, self.device, sample_tokens=self.tp_rank == 0,
                                 export_layers=cfg.export_layers)

        try:  # (the peak holds the pool: taken off)
            peak = peak_bytes_during(run, self.device)
        finally:
            for attn in self.model.attention_layers:
                attn.kv_cache = None
            self.model.captured = None
        return max(0, peak - blocks * kv_bytes_per_block(self.model, sc.block_size))

    def allocate_kv(self, num_blocks: int) -> int:
        """Allocate the KV pool; returns the bytes one block takes on this rank."""
        block_size = self.cfg.scheduler.block_size
        allocate_kv_cache(self.model, num_blocks, block_size, self.device)
        self.num_blocks = num_blocks
        # the graphs read the cache: compiled after it. With expert parallelism the engine sizes the padded
        # all-to-all from the bucket a step is padded to (LLMEngine.compile_buckets)
        if resolve_compile(self.cfg.model.compile, self.device):
            captures = ((), tuple(self.cfg.export_layers)) if self.cfg.export_layers else ((),)

            def make():
                runner = CompiledSteps(self.model, self.cfg.compile_buckets, self.device, captures)
                runner.warm_up()
                return runner
            # eager on a failed compile under auto, on one rank only: the warm-up's steps run the collectives, so a
            # rank that stopped compiling would leave its peers waiting in one, or serve other shapes than theirs
            self.compiled, self.compile_error = compiled_or_eager(
                make, self.cfg.model.compile == "auto" and self.world_size == 1, f"the steps on {self.device}")
        freeze_heap()  # this rank's start-up done: no full collection walks it again (heap.py)
        return kv_bytes_per_block(self.model, block_size)

    # -- the step --------------------------------------------------------------------------------

    def execute(self, step) -> StepOutput:
        """One step: a StepInput, or one per data-parallel group (this rank runs its group's).
        The driver rank (TP rank 0) samples; every rank returns its expert load. A placement the
        step commits is swapped in before it runs; a new one starts migrating, its transfers run
        after this and the next steps until the engine commits it."""
        if isinstance(step, list):
            step = step[self.dp_rank]
        if step.commit_placement is not None and self.migration is not None:
            if step.commit_placement == self.migration_version:
                self.migration.commit(self.dispatchers)
                self.placement = self.migration.new
                self.peak_staging_bytes = max(self.peak_staging_bytes, self.migration.peak_staged_bytes)
            self.migration = self.migration_version = None
        if step.placement_update is not None and self.migration is None and self.placement is not None:
            self._start_migration(*step.placement_update)
        for d in self.dispatchers:  # the padded expert all-to-all's size for this step (0: exact splits)
            d.capacity = step.expert_capacity
        try:
            out = execute_step(self.model, step, self.device, sample_tokens=self.tp_rank == 0,
                               prev_sampled=self._prev_sampled, export_layers=self.cfg.export_layers,
                               record_top_logprobs=self.cfg.record_top_logprobs, compiled=self.compiled,
                               stash=self.stash, drafter=self.drafter)
        finally:
            # this step's share of the expert transfers, here between two steps on the step thread: every rank
            # runs the same steps, so all issue them at the same point among the step's collectives (also after
            # a step that failed past its collectives on this rank only: the other ranks' transfers wait for it)
            if self.migration is not None:
                self.migration.advance()
        self._prev_sampled = out.sampled  # the next step's inputs may be these tokens (async scheduling)
        if self.migration is not None:
            out.migration_ready = self.migration.done()
            out.migration_bytes = self.migration.bytes_sent
        return out

    def _start_migration(self, version: int, phy2log) -> None:
        from parallel.migration import Migration

        from .placement import placement_from_phy2log

        new = placement_from_phy2log(torch.as_tensor(phy2log), self.spec.num_experts, self.world_size)
        self.migration = Migration(self.state, self.model.moe_layers, self.placement, new)
        self.migration_version = version

    # -- reports ---------------------------------------------------------------------------------

    def memory_report(self) -> dict:
        total, expert = _param_bytes(self.model)
        return {
            "rank": self.rank,
            "tp_rank": self.tp_rank,
            "param_bytes": total,  # params + persistent buffers
            "expert_param_bytes": expert,
            "expert_staging_bytes": self.peak_staging_bytes,  # peak; 0 until a rebalance stages experts here
            "activation_reserve_bytes": self.reserved_bytes,  # left out of the KV pool for the largest steps (CUDA)
            "bytes_read": self.model.bytes_read,
            "reordered_weight_bytes": getattr(self.model, "reordered_bytes", 0),  # the CPU's oneDNN copies (gemm.py)
            "experts": [m.expert_ids for m in self.model.moe_layers],
            "device": str(self.device),
            "compile": self.compile_stats(),
            "compile_error": self.compile_error,
            "draft_compile_error": self.drafter.compile_error() if self.drafter is not None else None,
            **(self.stash.report() if self.stash is not None else {}),
            **(self.drafter.memory_report() if self.drafter is not None else {}),
        }

    def compile_stats(self) -> dict | None:
        """model.compile's stats: the target's steps' and, with the drafter on the target, its rounds' (None: compile
        off)."""
        drafter = self.drafter.compile_stats() if self.drafter is not None else {}
        if self.compiled is None:  # (eager steps beside compiled rounds: the steps' compile failed under auto)
            return drafter or None
        return {**self.compiled.stats(), **drafter}

    def comm_stats(self) -> dict:
        return self.state.stats.snapshot() if self.state is not None else {}

    def shutdown(self) -> None:
        unfreeze_heap()
        self.model = None
        self.migration = None
        self.drafter = None
