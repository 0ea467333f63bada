"""One YAML schema for every run: typed sections with defaults, validated by pydantic.

`load_config(source, overrides)` accepts a YAML path, a nested dict, or a `Config`, plus
`key.path=value` overrides (as `--set` gives them). Every problem found is reported at once in
one `ConfigError`, each naming the key path, the bad value and what is accepted. What needs the
checkpoint (the topology must divide the model and the drafter) is checked in `config_checks.py`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import (BaseModel, BeforeValidator, ByteSize, ConfigDict, Field, TypeAdapter, ValidationError,
                      field_validator, model_validator)

from .config_checks import check_against_model
from .errors import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parent
ASSETS_DIR = PACKAGE_DIR / "assets"
# The bundled default config lives in the repository's configs/ (the package is installed editable
# or run from the checkout, as under `ray job submit --working-dir .`).
DEFAULT_CONFIG_PATH = PACKAGE_DIR.parent / "configs" / "tiny.yaml"


_BYTES = TypeAdapter(ByteSize)


def parse_bytes(value, what: str) -> int:
    """'141GB', '80GiB', 1234 -> bytes; ConfigError naming `what` otherwise."""
    try:
        return int(_BYTES.validate_python(value))
    except ValidationError:
        raise ConfigError(f"{what}: got {value!r}; expected a size such as 141GB or 80GiB") from None


# auto / on / off: YAML 1.1 (PyYAML, and so `--set k=v`) reads a bare on / off as true / false, which mean the same
Switch = Annotated[Literal["auto", "on", "off"],
                   BeforeValidator(lambda v: {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v)]


class _Section(BaseModel):
    # Unknown keys are errors, and ints are not silently turned into strings or bools.
    model_config = ConfigDict(extra="forbid", strict=False, validate_assignment=True)


class ModelConfig(_Section):
    # a local checkpoint folder, a bundled asset name, or a Hugging Face name (org/name) found in the
    # local Hugging Face cache (HF_HOME / HF_HUB_CACHE; nothing is downloaded)
    path: str = "tiny-moe"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    tokenizer: Optional[str] = None  # defaults to `path`
    # fp8 checkpoints: auto = dequantize (each shard's slices, at load, to `dtype`) until a GPU run
    # shows that fp8 matmuls pay; fp8 (keep the weights in fp8) is refused until it exists
    weights: Literal["auto", "dequantize", "fp8"] = "auto"
    # steps through torch.compile, padded to token buckets (CUDA graphs on CUDA); auto: on for CUDA (one rank
    # whose steps, or a drafter whose rounds, fail to compile runs eager), off on CPU (model/compiled.py says why)
    compile: Switch = "auto"

    @model_validator(mode="after")
    def _check(self):
        if self.weights == "fp8":
            raise ValueError("weights: got 'fp8'; keeping weights in fp8 for fp8 matmuls is not implemented yet "
                             "(no GPU run has measured it); use auto or dequantize (fp8 checkpoints are "
                             "dequantized per shard at load)")
        return self


class ParallelConfig(_Section):
    tensor: int = Field(1, ge=1)
    data: int = Field(1, ge=1)
    executor: Literal["ray", "local"] = "local"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads_per_worker: Optional[int] = Field(None, ge=1)
    # a step (one compiled-graph round) longer than this fails its requests: a hung or lost worker
    step_timeout_s: float = Field(600.0, gt=0)
    # executor ray: a dead worker (or node) restarts the target's workers and re-runs the requests
    # in flight this many times over the engine's life; past that, requests fail and /health says so
    max_restarts: int = Field(3, ge=0)
    # a background part (the calibrator, expert staging, a drafter group restart) that makes no progress
    # for this long while it should be working is reported (/health "degraded", drafter_status(),
    # dspark_background_stalled); one unit of its work (an optimiser step, a staging step) takes far less
    stall_after_s: float = Field(120.0, gt=0)
    # which Ray to use when this process has none yet: auto = RAY_ADDRESS, else the instance a
    # `ray start` left on this machine, else a private one; local = always a private one; or an address
    ray_address: str = "auto"
    # the step's transport to the target workers. auto: a Ray compiled graph (shared-memory
    # channels) when every worker is on the calling process's node, plain actor calls otherwise:
    # Ray 2.60's raylet aborts, taking its node down, when a cross-node compiled-graph channel is
    # closed under a writer (a worker lost, a teardown; ray#63229). on/off force one or the other.
    compiled_graph: Switch = "auto"

    @property
    def world_size(self) -> int:
        return self.tensor * self.data


class SchedulerConfig(_Section):
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    block_size: int = Field(16, ge=1, le=1024)
    num_kv_blocks: Union[Literal["auto"], int] = "auto"
    # the KV pool (with num_kv_blocks: auto): bytes per worker ("8GiB"), or a share in (0, 1] of the
    # device memory left after the weights (vLLM's gpu_memory_utilization); auto = 0.9 of it on
    # CUDA, 256 MiB on CPU (where the "device" is the host's memory, shared by every process)
    kv_cache_memory: Union[Literal["auto"], int, float] = "auto"
    max_model_len: Optional[int] = Field(None, ge=1)  # None: the model's max_position_embeddings
    # reuse the KV blocks of prompt prefixes computed before (hashed full blocks, shared, LRU-evicted)
    prefix_caching: bool = True
    # schedule step n+1 while the workers run step n (vLLM's async scheduling). auto: on with
    # executor ray (the workers are other processes), off in process (nothing runs meanwhile)
    async_scheduling: Union[Literal["auto"], bool] = "auto"

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _kv_memory(cls, v):
        if isinstance(v, float) and not isinstance(v, bool):
            if not 0 < v <= 1:
                raise ValueError(f"got {v}; a share of device memory must be in (0, 1] (e.g. 0.9), or give bytes "
                                 "(e.g. 8GiB)")
            return v
        if v == "auto":
            return v
        size = int(_BYTES.validate_python(v)) if isinstance(v, (str, int)) else v
        if isinstance(size, int) and size <= 0:
            raise ValueError(f"got {v!r}; bytes must be > 0 (e.g. 256MiB), or a share such as 0.9")
        return size

    @model_validator(mode="after")
    def _check(self):
        if isinstance(self.num_kv_blocks, int) and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks: got {self.num_kv_blocks}; use 'auto' or an integer >= 1")
        return self


class CalibrationConfig(_Section):
    """Online calibration of the DSpark drafter on live verification rounds (off until measured on a
    workload: see BENCHMARKS.md "Online drafter calibration")."""

    enabled: bool = False
    interval_s: float = Field(30.0, gt=0)  # idle time between training updates (never in a serving step)
    buffer_rounds: int = Field(4096, ge=16)  # verify rounds the replay buffer keeps (oldest sequences go first)
    buffer_bytes: ByteSize = Field(ByteSize(2**30), gt=0)  # and the bytes it keeps (its context rows, mostly)
    min_rounds: int = Field(256, ge=1)  # rounds in the buffer before the first update
    learning_rate: float = Field(1e-4, gt=0)  # 1e-3 wrecked the bundled drafter in 40 steps (BENCHMARKS.md)
    steps_per_update: int = Field(40, ge=1)  # optimiser steps per update
    batch_rounds: int = Field(64, ge=1)  # rounds per optimiser step (8 of each sequence, sharing its context)
    top_logprobs: int = Field(20, ge=1, le=256)  # the target's top-k log-probabilities kept per position
    reject_weight: float = Field(2.0, ge=0)  # extra loss weight at the first rejected position (OSD)
    # rounds where the target's mean entropy exceeds this share of ln(vocab) are dropped (it does not know)
    max_entropy_share: float = Field(0.85, gt=0, le=1)
    holdout: float = Field(0.2, gt=0, lt=1)  # share of sequences held back for the shadow evaluation
    margin: float = Field(0.02, ge=0)  # a candidate publishes when its shadow tau beats the serving one by this share
    rollback_margin: float = Field(0.1, ge=0, lt=1)  # live tau below the predecessor's by this share: roll back
    window_rounds: int = Field(200, ge=10)  # verify rounds a live tau is measured over
    keep_versions: int = Field(3, ge=1)  # published versions kept for rollback (the original is always kept)


class SpeculativeConfig(_Section):
    method: Literal["none", "ngram", "draft_model", "dspark"] = "none"
    draft_model: Optional[str] = None
    num_tokens: int = Field(4, ge=0, le=64)
    draft_workers: int = Field(1, ge=1)
    # drafter actors per tensor-parallel group: the draft model is split over this many devices
    draft_tensor: int = Field(1, ge=1)
    # confidence (default, measured to win at every load but batch 1 in BENCHMARKS.md): verify per step only
    # the draft slots whose calibrated survival pays for their cost at the current load (num_tokens is
    # then the most drafted); static: always draft and verify num_tokens
    schedule: Literal["confidence", "static"] = "confidence"
    # the confidence schedule, before any verify outcome: the acceptance a position (given the one before) it
    # assumes to decide whether drafting could pay at the current load; where it could not, it learns only by
    # paced exploration. A good drafter reads 0.7-0.8 at its first positions; null: learn at any load
    prior_acceptance: Optional[float] = Field(0.8, gt=0, lt=1)
    # DSpark: the context rows before its anchor a block reads (the latest; positions stay absolute).
    # While the schedule drafts nothing for a sequence, the target's workers keep its last
    # context_window rows and send them once when drafting resumes. auto: the drafter's config.json
    # `context_window`, else 512 (the rows online calibration trains each round on)
    context_window: Union[Literal["auto"], int] = "auto"
    # DSpark: block forwards a proposal takes. 2: slots 1.. drafted from a second forward that holds slot 0's
    # draft (a drafter trained for it: draft_passes 2 in its config.json). auto: the drafter's own where it drafts
    # on CUDA (on Ray: the devices the cluster gives the drafting, whatever the Router's node has); 1 on the CPU
    # (there the second forward costs more than its tau gives: BENCHMARKS.md)
    draft_passes: Literal["auto", 1, 2] = "auto"
    # where the drafter runs. target: on the target's driver rank (of each data-parallel group), on its
    # device, drafting for the next step right after a step's verification, in the same call: no drafter
    # process, no drafter round trip per step, no context rows or draft law on the wire (DSpark, without
    # online calibration). group: the drafter group (in process, or on Ray actors with devices of their
    # own: draft_workers, draft_tensor, online calibration). auto: target where it applies, else group
    placement: Literal["auto", "target", "group"] = "auto"
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)

    @property
    def enabled(self) -> bool:
        """A drafter runs: a method is chosen and it may propose tokens."""
        return self.method != "none" and self.num_tokens > 0

    @property
    def on_target(self) -> bool:
        """The drafter runs on the target's driver ranks (placement target, or auto where it applies)."""
        if self.placement == "auto":
            return self.enabled and self.method == "dspark" and not self.calibration.enabled
        return self.enabled and self.placement == "target"

    @model_validator(mode="after")
    def _check(self):
        if self.method in ("draft_model", "dspark") and not self.draft_model:
            raise ValueError(f"draft_model: method {self.method!r} needs a draft_model path")
        if self.context_window != "auto" and self.context_window < 1:
            raise ValueError(f"context_window: got {self.context_window}; use 'auto' or an integer >= 1")
        if self.placement == "target" and self.method != "dspark":
            raise ValueError(f"placement: got 'target' with method {self.method!r}; a drafter on the target's "
                             "driver rank is a DSpark drafter: use method dspark, or placement group")
        if self.placement == "target" and self.calibration.enabled:
            raise ValueError("placement: got 'target' with calibration.enabled; online calibration trains the "
                             "drafter in the drafter group: use placement group (or auto), or switch calibration off")
        if self.calibration.enabled and self.method != "dspark":
            raise ValueError(f"calibration.enabled: got true with method {self.method!r}; online calibration trains "
                             "the DSpark drafter: use method dspark or set calibration.enabled false")
        return self


class EplbConfig(_Section):
    enabled: bool = False
    num_redundant_experts: int = Field(0, ge=0)
    window_steps: int = Field(100, ge=1)
    interval_steps: int = Field(200, ge=1)
    policy: Literal["global", "hierarchical"] = "global"
    num_nodes: int = Field(1, ge=1)  # for the hierarchical policy
    num_groups: Optional[int] = Field(None, ge=1)  # expert groups; default: the model's n_group
    min_gain: float = Field(0.02, ge=0)  # rebalance only when balancedness would rise by this much


DEFAULT_PROMPT_LEN = [8, 256]


class WorkloadConfig(_Section):
    kind: Literal["prompts", "synthetic", "jsonl"] = "prompts"
    path: Optional[str] = None  # jsonl file for kind=jsonl; default prompt set for kind=prompts
    num_requests: int = Field(32, ge=1)
    prompt_len: list[int] = Field(default_factory=lambda: list(DEFAULT_PROMPT_LEN), min_length=2, max_length=2)
    output_len: list[int] = Field(default_factory=lambda: [8, 128], min_length=2, max_length=2)
    request_rate: float = Field(0.0, ge=0)  # requests/s, Poisson; 0 = all at once
    temperature: float = Field(0.0, ge=0)
    ignore_eos: bool = True  # fixed output lengths make runs comparable
    seed: int = 0
    # hot-spot studies only: bias added to these experts' gate logits in every MoE layer (changes outputs)
    hot_experts: list[int] = Field(default_factory=list)
    hot_bias: float = 0.0

    @model_validator(mode="after")
    def _check(self):
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: got [{lo}, {hi}]; expected [min, max] with 1 <= min <= max")
        # (compared with the default, not "was it set": a config round-trips through to_dict to the Router)
        if self.kind != "synthetic" and self.prompt_len != DEFAULT_PROMPT_LEN:
            raise ValueError(f"prompt_len: got {self.prompt_len} with kind {self.kind!r}, whose prompts keep their own "
                             "lengths; remove prompt_len, or use kind synthetic for prompts of chosen lengths")
        return self


class DevicePrices(_Section):
    """Price per device-hour by device kind, in any currency (examples, not facts: set your own)."""

    gpu: float = Field(2.5, ge=0)
    cpu: float = Field(0.05, ge=0)


class CostConfig(_Section):
    price_per_device_hour: DevicePrices = Field(default_factory=DevicePrices)


class ReportConfig(_Section):
    out_dir: str = "runs"
    name: Optional[str] = None


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    eplb: EplbConfig = Field(default_factory=EplbConfig)
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    cost: CostConfig = Field(default_factory=CostConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


def resolve_path(path: str, base_dir: Optional[Path] = None) -> Path:
    """A relative path is looked up beside the config file (or the working folder), then among
    the bundled assets, so `path: tiny-moe` works from any folder."""
    p = Path(os.path.expanduser(path))
    if p.is_absolute():
        return p
    for root in (base_dir or Path.cwd(), ASSETS_DIR):
        if (root / p).exists():
            return (root / p).resolve()
    return ((base_dir or Path.cwd()) / p).resolve()


# a Hugging Face model name (org/name), as vLLM users write model paths
HF_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it (read now, so HF_HOME set after
    import counts): HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expanduser(os.environ["HF_HUB_CACHE"]))
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expanduser(home)) / "hub"


def resolve_model_path(path: str, key: str, base_dir: Optional[Path] = None) -> str:
    """A model path as `resolve_path` finds it; else a Hugging Face name found in the local cache
    (never downloaded). ConfigError naming `key` and where it looked when it is neither."""
    p = resolve_path(path, base_dir)
    if p.exists() or not HF_NAME.match(path):
        return str(p)
    from huggingface_hub import snapshot_download

    cache = hf_cache_dir()
    try:
        return str(snapshot_download(path, local_files_only=True, cache_dir=str(cache)))
    except Exception as e:  # LocalEntryNotFoundError, or a cache entry without a snapshot
        raise ConfigError(
            f"{key}: got {path!r}; not a local folder (looked in {base_dir or Path.cwd()} and {ASSETS_DIR}) and not "
            f"in the Hugging Face cache {cache} (set by HF_HOME / HF_HUB_CACHE; {type(e).__name__}). Download it "
            f"first (`hf download {path}`) or give the checkpoint's folder; nothing is downloaded at run time"
        ) from None


def parse_overrides(overrides) -> dict:
    """['a.b=1', 'c=x'] or {'a.b': 1} -> nested dict; values are parsed as YAML scalars."""
    if not overrides:
        return {}
    items = overrides.items() if isinstance(overrides, dict) else []
    problems = []
    if not isinstance(overrides, dict):
        parsed = []
        for item in overrides:
            key, sep, raw = str(item).partition("=")
            if not sep or not key.strip():
                problems.append(f"--set {item!r}: expected key.path=value, e.g. parallel.tensor=2")
                continue
            try:
                parsed.append((key.strip(), yaml.safe_load(raw) if raw.strip() else None))
            except yaml.YAMLError as e:
                problems.append(f"--set {item!r}: value is not valid YAML ({e.__class__.__name__})")
        items = parsed
    if problems:
        raise ConfigError(problems)
    nested: dict = {}
    for key, value in items:
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: cannot set below the scalar {part!r}")
        node[parts[-1]] = value
    return nested


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _format_pydantic(err: ValidationError) -> list[str]:
    problems = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"] if not str(x).startswith("function-after"))
        # Literal/union errors repeat the location with the branch name; keep the key path.
        loc = ".".join(p for p in loc.split(".") if not p.startswith(("literal[", "int", "lax-or-strict")))
        value = e.get("input")
        if e["type"] == "extra_forbidden":
            parent = loc.rsplit(".", 1)[0] if "." in loc else ""
            problems.append(f"{loc}: unknown key; accepted keys: {', '.join(_known_keys(parent))}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            problems.append(f"{loc}: got {value!r}; {msg}" if loc else msg)
    # unions report each branch; keep one line per distinct message
    return list(dict.fromkeys(problems))


def _known_keys(parent: str) -> list[str]:
    cls: Any = Config
    for part in filter(None, parent.split(".")):
        field = cls.model_fields.get(part)
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return []
        cls = field.annotation
    return list(cls.model_fields)


def load_config(source: Union[None, str, os.PathLike, dict, Config] = None, overrides=None) -> Config:
    """Build a validated Config.

    source: a YAML path, a nested dict of values (like the YAML), a Config, or None for the bundled
    default (configs/tiny.yaml). overrides: ['key.path=value', ...] or {'key.path': value}.
    Relative model paths are resolved against the YAML file's folder, then the bundled assets.
    """
    base_dir = None
    if source is None:
        source = DEFAULT_CONFIG_PATH
    if isinstance(source, Config):
        data = source.to_dict()
    elif isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass a YAML path such as configs/tiny.yaml")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
        base_dir = path.resolve().parent
    data = _merge(data, parse_overrides(overrides))
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_pydantic(e)) from None
    cfg.model.path = resolve_model_path(cfg.model.path, "model.path", base_dir)
    if cfg.model.tokenizer:
        cfg.model.tokenizer = resolve_model_path(cfg.model.tokenizer, "model.tokenizer", base_dir)
    if cfg.speculative.draft_model:
        cfg.speculative.draft_model = resolve_model_path(cfg.speculative.draft_model, "speculative.draft_model",
                                                         base_dir)
    problems = check_against_model(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg
