"""The executor interface: how the engine runs a step on the target model's devices.

Two implementations, chosen by name (`parallel.executor`): `local`, the whole model on one device in
this process (`LocalExecutor`, here), and `ray`, the model sharded over Ray actors (`actors.cluster.
Cluster`). The Ray side imports the core and is never imported by it: `backend("ray")` finds it by
the module name registered in `backends.BACKENDS`, as vLLM resolves an executor class by its qualified name.

An executor has:
    submit(step) -> handle          start one step (a StepInput, or one per data-parallel group)
    wait(handle) -> StepOutput      its output (a list of them for a list of inputs); raises
                                    WorkerError for a lost worker, the step's own error otherwise
    execute(step) -> StepOutput     submit + wait
    num_blocks: int                 KV blocks per data-parallel group (the same on every worker)
    device                          "cpu" / "cuda" or a torch.device: where the target runs
    transport: str                  how a step reaches the model: in_process, compiled_graph, actor_calls
    last_wire_s: float              seconds the last step spent pickling here (0 in process)
    reports: list[dict]             what each worker holds (the workers' setup reports)
    comm_stats() -> list[dict]      bytes each rank sent per collective kind
    device_reports() -> list[dict]  each device's memory, for the cost ledger
    shutdown()
"""

from __future__ import annotations

import torch

from .backends import backend
from .config import Config
from .cost import device_kind
from .model.spec import ModelSpec
from .step import StepInput, StepOutput
from .worker import Worker, WorkerConfig

def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LocalExecutor:
    """`executor: local`: the whole model on one device in this process, one `worker.Worker`."""

    transport = "in_process"  # how a step reaches the model (Cluster: compiled_graph or actor_calls)
    last_wire_s = 0.0  # nothing is pickled in process
    reports: list = []  # no workers

    def __init__(self, cfg: Config, spec: ModelSpec):
        if cfg.parallel.threads_per_worker:
            torch.set_num_threads(cfg.parallel.threads_per_worker)
        self.device = resolve_device(cfg.parallel.device)
        self.worker = Worker(WorkerConfig.of(cfg), spec, self.device)
        self.num_blocks = self.worker.kv_blocks_that_fit()
        self.kv_bytes_per_block = self.worker.allocate_kv(self.num_blocks)

    @property
    def model(self):
        return self.worker.model if self.worker is not None else None

    def submit(self, step: StepInput) -> StepOutput:
        """Run the step now (in process there is nothing to overlap); `wait` hands back its output."""
        return self.worker.execute(step)

    def wait(self, handle: StepOutput) -> StepOutput:
        return handle

    def device_reports(self) -> list[dict]:
        """This process's device, as Cluster.device_reports gives each worker's (one device never
        migrates experts: no staging)."""
        return [target_device_report(self.worker.memory_report(), device_kind(self.device.type), 0,
                                     self.kv_bytes_per_block, self.num_blocks)]

    def comm_stats(self) -> list[dict]:
        return []  # one device: no collectives

    def execute(self, step: StepInput) -> StepOutput:
        return self.wait(self.submit(step))

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.worker = None


def target_device_report(report: dict, kind: str, group: int, kv_bytes_per_block: int, num_blocks: int) -> dict:
    """The cost ledger's device (cost.CostMeter.devices) of a target worker's memory report."""
    return {"role": "target", "rank": report["rank"], "kind": kind, "group": group,
            "kv_bytes_per_block": kv_bytes_per_block, "expert_bytes": report["expert_param_bytes"],
            "expert_staging_bytes": report["expert_staging_bytes"],
            "memory": {"weights": report["param_bytes"], "weights_reordered": report.get("reordered_weight_bytes", 0),
                       "kv_pool": kv_bytes_per_block * num_blocks,
                       "context_stash": report.get("context_stash_peak_bytes", 0),
                       # speculative.placement target: the drafter beside the driver rank's shard
                       "drafter_weights": report.get("drafter_param_bytes", 0),
                       "drafter_weights_reordered": report.get("drafter_reordered_bytes", 0),
                       "drafter_kv": report.get("drafter_kv_bytes", 0)},
            # that drafter's start-up profile: rows -> seconds of a drafting call (the verify planner's prior)
            "drafter_profile": report.get("drafter_profile"),
            "compile": report.get("compile"),  # model.compile's stats on this rank (None: off)
            # why its steps / a drafter's rounds on it run eager under auto (None: they did not fail)
            "compile_error": report.get("compile_error"), "draft_compile_error": report.get("draft_compile_error")}


def resolve_for_executor(cfg: Config) -> Config:
    """`cfg` with its `auto` settings resolved for where the executor runs the work: in process as it is (they
    resolve for this process's devices); on a backend, by its `resolve_config` (Ray: for the devices the cluster
    gives the target's workers and the drafters, which a Router on a head node without a GPU does not have)."""
    if cfg.parallel.executor == "local":
        return cfg
    return backend(cfg.parallel.executor).resolve_config(cfg)


def make_executor(cfg: Config, spec: ModelSpec):
    """The executor `parallel.executor` names."""
    if cfg.parallel.executor == "local":
        return LocalExecutor(cfg, spec)
    return backend(cfg.parallel.executor).Executor(cfg, spec)
