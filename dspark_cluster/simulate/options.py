"""What a simulation needs beyond the run's YAML: the hardware, the precision the deployment runs
at, how the experts are loaded, how drafts survive, which host model. Validated by pydantic;
`dspark simulate CONFIG --hardware H200 --sim expert_load.skew=1.2 --sim overlap=true` sets them
(nested keys as `--set` takes them)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import parse_overrides
from ..errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExpertLoadOptions(_Section):
    kind: Literal["zipf", "report"] = "zipf"
    skew: float = Field(0.0, ge=0)  # Zipf exponent per layer; 0 = every expert equally likely
    drift_every_steps: int = Field(0, ge=0)  # re-draw part of each layer's hot set this often (0: never)
    drift_share: float = Field(0.25, gt=0, le=1)
    report: Optional[str] = None  # kind report: a run's report.json (experts.expert_load_total)


class AcceptanceOptions(_Section):
    # survival[j] = P(drafts 1..j+1 all accepted); None: from `report`, else 0.8 per position (an
    # assumption: say yours)
    survival: Optional[list[float]] = None
    report: Optional[str] = None  # a real run's report.json: its summary.speculative.acceptance_by_position
    spread: float = Field(0.5, ge=0)  # per-row logit noise: rows differ in how predictable they are
    # per-sequence logit offset the drafter's confidence does not see: a sequence easier or harder throughout than
    # its drafts look (what the verify planner's sequence offsets learn); 0: every sequence as its drafts look.
    # (Both spreads move the mean survival off the curve: an average in logit space is not one in probability)
    sequence_spread: float = Field(0.0, ge=0)


class SimOptions(_Section):
    hardware: str = "auto"  # a catalog name; auto: cpu for a CPU config, else H200
    hardware_file: Optional[str] = None  # another catalog YAML
    drafter_hardware: Optional[str] = None  # default: the target's
    # precision: auto = what this engine runs (the config's dtype; fp8 checkpoints dequantized to it);
    # fp8 = DeepSeek's deployment (fp8 weights and GEMMs, fp8 dispatch, bf16 combine and KV)
    precision: Literal["auto", "fp8"] = "auto"
    # DeepSeek's dual micro-batch: communication of one half under the other's compute
    overlap: bool = False
    # decode: decode-only nodes of a disaggregated deployment (prompts' KV arrives from prefill
    # nodes: it takes blocks here, no compute); colocated: prefill and decode on the same ranks
    role: Literal["colocated", "decode"] = "colocated"
    # the experts' all-to-all: per_expert = a copy per routed expert (DeepEP's low-latency decode
    # kernels, and this engine's parallel/expert_parallel.py); per_node = a copy per remote node, fanned
    # out over NVLink there (DeepEP's normal kernels, prefill)
    dispatch: Literal["per_expert", "per_node"] = "per_expert"
    # the host's scheduling work: router = one process for every group (this engine: the Router
    # actor); per_group = one per data-parallel group, in parallel (DeepSeek's deployment)
    host: Literal["router", "per_group"] = "router"
    # async scheduling overlaps the host with the device: auto = as the engine (on for executor ray)
    async_scheduling: Literal["auto", "on", "off"] = "auto"
    # the expert placement at the start: default = the engine's (slot s holds expert s mod E, as a
    # fresh engine starts); balanced = the EPLB policy over the expected load, as a deployment that
    # rebalanced on earlier traffic (DeepSeek computes its placements from historical statistics)
    eplb_initial: Literal["default", "balanced"] = "default"
    # the policy's refinement (swaps, replica-count search); false = the plain greedy replication and
    # packing, close to DeepSeek's open-source EPLB (eplb.py's docstring says what differs)
    eplb_refine: bool = True
    expert_load: ExpertLoadOptions = Field(default_factory=ExpertLoadOptions)
    acceptance: AcceptanceOptions = Field(default_factory=AcceptanceOptions)
    trace: Optional[str] = None  # JSONL of arrivals and lengths (traffic.read_trace), instead of the workload
    drafter_params: Optional[float] = None  # parameters of one drafter forward; default: from its config.json
    export_layers: Optional[int] = None  # DSpark hidden-state layers exported; default: the drafter's config
    max_steps: int = Field(10_000_000, ge=1)
    seed: int = 0
    record_steps: bool = True  # every step's stats in the report (off for the largest runs)
    record_schedule: bool = False  # each step's scheduled (request, tokens) and preempted ids (tests)
    record_shapes: bool = False  # each step's StepShape (fitting a device to a real run's step times)


def load_options(values=None, overrides=None) -> SimOptions:
    """SimOptions from a dict and `key.path=value` overrides; one ConfigError naming every problem."""
    from ..config import _merge

    data = _merge(dict(values or {}), parse_overrides(overrides))
    try:
        return SimOptions.model_validate(data)
    except ValidationError as e:
        raise ConfigError([f"--sim {'.'.join(map(str, x['loc']))}: got {x.get('input')!r}; {x['msg']}"
                           for x in e.errors()]) from None
