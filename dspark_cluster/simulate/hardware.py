"""The hardware catalog: one validated entry per device kind (`assets/hardware.yaml`, or a file of
the user's), each figure with its source. Units: FLOP/s, bytes/s, seconds, bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import ASSETS_DIR
from ..errors import ConfigError

CATALOG_PATH = ASSETS_DIR / "hardware.yaml"


class Device(BaseModel):
    """One device kind. Achievable = peak x efficiency (what a good kernel reaches)."""

    model_config = ConfigDict(extra="allow")  # source_* strings ride along

    name: str = ""
    memory_bytes: float = Field(gt=0)
    flops: dict[str, float]  # dtype -> peak dense FLOP/s
    flops_efficiency: dict[str, float] = Field(default_factory=dict)
    hbm_bandwidth: float = Field(gt=0)  # bytes/s
    hbm_efficiency: float = Field(1.0, gt=0, le=1)
    gpus_per_node: int = Field(8, ge=1)
    nvlink_bandwidth: float = Field(gt=0)  # bytes/s per GPU per direction, within a node
    network_bandwidth: float = Field(gt=0)  # bytes/s per GPU per direction, between nodes
    collective_latency_s: float = Field(0.0, ge=0)  # one collective within a node
    network_latency_s: float = Field(0.0, ge=0)  # one collective that crosses nodes
    # per layer per step on the device: the framework's dispatch and kernel launches of one layer's ops,
    # what no roofline sees (CUDA graphs make it small on GPUs; eager PyTorch on a CPU pays it)
    layer_overhead_s: float = Field(0.0, ge=0)
    # per scheduled row per layer on the device: work a row costs beyond its FLOPs and bytes (eager
    # per-row attention and sampling on a CPU; fitted there, 0 where nothing measured it)
    row_overhead_s: float = Field(0.0, ge=0)
    host_overhead_s: float = Field(0.0, ge=0)  # per step: scheduling, building the step, launching it
    per_seq_overhead_s: float = Field(0.0, ge=0)  # per scheduled sequence (the scheduler's Python per row)
    per_token_overhead_s: float = Field(0.0, ge=0)  # per token of the step (building its tensors)
    # how an operation's compute and memory time combine: "max" (a GPU kernel streams its operands
    # while it computes: the roofline) or "sum" (neither hides the other: eager GEMMs on a CPU at a
    # few rows, where the weights' read and the arithmetic follow each other; the cpu entry's fit)
    roofline: Literal["max", "sum"] = "max"
    # how the attention kernel runs a step's rows: varlen (FlashAttention / FlashMLA: each row its own
    # causal pairs, MLA prompt chunks unabsorbed) or padded (this engine's eager path, what runs on a CPU
    # here: decode rows one batch and the rest another, each padded to its longest query and context)
    attention_kernel: Literal["varlen", "padded"] = "varlen"
    # device <-> host or the drafter's device (the hidden-state export): PCIe 5 x16 ~50 GB/s a direction
    host_link_bandwidth: float = Field(50e9, gt=0)
    # devices that are a host's cores (this CPU): the cores the ranks of a multi-process run share with
    # the run's other busy processes (the Router, the driver, Ray's own, the machine's other work),
    # host_procs of them as an effective count (fitted). 0 cores: each rank has its device to itself
    host_cores: float = Field(0.0, ge=0)
    host_procs: float = Field(0.0, ge=0)

    def achievable_flops(self, dtype: str) -> float:
        """FLOP/s a GEMM in `dtype` reaches (falls back to bf16's figure for a dtype not listed)."""
        key = dtype if dtype in self.flops else "bf16"
        return self.flops[key] * self.flops_efficiency.get(key, 1.0)

    @property
    def achievable_hbm(self) -> float:
        return self.hbm_bandwidth * self.hbm_efficiency

    def rank_share(self, ranks: int) -> float:
        """The share of its own speed a rank's device work gets when `ranks` ranks of one run are on a
        host of host_cores cores with host_procs other busy processes: host_cores / (ranks +
        host_procs), at most 1. One rank: 1 (one process, the engine's own: the figures are fitted to
        it as it runs, whatever shares its host); host_cores 0: 1 (a GPU is its rank's alone)."""
        if self.host_cores <= 0 or ranks <= 1:
            return 1.0
        return min(1.0, self.host_cores / (ranks + self.host_procs))

    def op_time(self, compute_s, memory_s):
        """One operation's seconds from its compute time and its memory time (arrays alike)."""
        return compute_s + memory_s if self.roofline == "sum" else np.maximum(compute_s, memory_s)


def load_catalog(path: Optional[Path] = None) -> dict[str, Device]:
    """name -> Device from the catalog YAML (default: the bundled one)."""
    path = Path(path or CATALOG_PATH)
    if not path.is_file():
        raise ConfigError(f"hardware catalog {str(path)!r}: no such file")
    raw = yaml.safe_load(path.read_text()) or {}
    out = {}
    for name, entry in (raw.get("devices") or {}).items():
        try:
            out[name] = Device.model_validate({**entry, "name": name})
        except ValidationError as e:
            raise ConfigError([f"{path}: devices.{name}.{'.'.join(map(str, x['loc']))}: {x['msg']}"
                               for x in e.errors()]) from None
    return out


def get_device(name: str, path: Optional[Path] = None) -> Device:
    catalog = load_catalog(path)
    if name not in catalog:
        raise ConfigError(f"--hardware: got {name!r}; the catalog has {', '.join(catalog)}")
    return catalog[name]
