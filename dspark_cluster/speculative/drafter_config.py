"""What a drafter actor and the calibrator need of the config, validated once in the engine's
process (as `worker.WorkerConfig` is for the target's workers): the target model's section, the
scheduler's (the draft model's KV block size), the speculative section and the backend the
drafters' world talks over, with the target's `ModelSpec` the engine already read. Not the
workload, the prices or the report; no actor re-validates the config or re-reads config.json."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config, ModelConfig, SchedulerConfig, SpeculativeConfig
from ..model.spec import ModelSpec


@dataclass(frozen=True)
class DrafterConfig:
    model: ModelConfig
    scheduler: SchedulerConfig
    speculative: SpeculativeConfig
    backend: str  # parallel.backend: the drafters' own world uses it on GPUs (gloo on CPU)
    target_spec: ModelSpec
    draft_passes: int = 1  # speculative.draft_passes resolved here (dspark_model.draft_passes_of)

    @classmethod
    def of(cls, cfg: Config, target_spec: ModelSpec) -> "DrafterConfig":
        from .dspark_model import draft_passes_of

        return cls(model=cfg.model, scheduler=cfg.scheduler, speculative=cfg.speculative,
                   backend=cfg.parallel.backend, target_spec=target_spec, draft_passes=draft_passes_of(cfg))
