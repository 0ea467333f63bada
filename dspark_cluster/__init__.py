"""DSpark Cluster: serve Mixture-of-Experts models with tensor / expert parallelism, continuous
batching and speculative decoding. The core runs without Ray; `actors/` wraps it for a cluster.

The public names load on first use (PEP 562), so a process that needs one module (a worker
unpickling a `step.StepInput`) imports that module's dependencies only, not the whole engine."""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_PUBLIC = {
    "LLM": ".llm",
    "SamplingParams": ".sampling",
    "RequestOutput": ".outputs",
    "StreamPiece": ".outputs",
    "Config": ".config",
    "load_config": ".config",
    "ConfigError": ".errors",
    "CheckpointError": ".errors",
    "RequestError": ".errors",
    "DSparkError": ".errors",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'dspark_cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
